"""Argument rules and gathers shared by `EngramStore` and `ReleasedEngramStore`: the
binding's strict layer-id type, layer configs, store-client resolution, per-head gathers."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, LookupTypeError
from engramdb.integrations.mooncake import is_store_client
from engramdb.io.gather import run_split

_INT64_MAX = 2**63 - 1
_INT32_LIMIT = 2**31


def layer_key(layer_id: Any) -> int:
    """A layer id as the binding's ``int`` parameter takes it: a Python or numpy integer
    (``bool`` included, as pybind11 accepts it) in the C ``int`` range; ``"1"``, ``1.0`` or
    ``2**31`` raise `LookupTypeError` (a ``TypeError``), as the binding does."""
    if not isinstance(layer_id, (int, np.integer)):
        raise LookupTypeError(
            f"layer ids must be integers, got {type(layer_id).__name__} {layer_id!r}"
        )
    value = int(layer_id)
    if not -_INT32_LIMIT <= value < _INT32_LIMIT:
        raise LookupTypeError(f"layer id {value} does not fit a C int")
    return value


def check_config(layer_id: Any, cfg: Any) -> None:
    if layer_key(layer_id) < 0:
        raise InvalidArgument(f"layer ids must be non-negative integers, got {layer_id!r}")
    sizes = getattr(cfg, "table_vocab_sizes", None)
    row_bytes = getattr(cfg, "row_bytes", None)
    if not sizes:
        raise InvalidArgument(f"layer {layer_id}: table_vocab_sizes must be non-empty")
    for h, n in enumerate(sizes):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
            raise InvalidArgument(f"layer {layer_id}: table_vocab_sizes[{h}] = {n!r} must be > 0")
    if (
        isinstance(row_bytes, bool)
        or not isinstance(row_bytes, (int, np.integer))
        or row_bytes <= 0
    ):
        raise InvalidArgument(f"layer {layer_id}: row_bytes must be set > 0, got {row_bytes!r}")
    if sum(int(n) for n in sizes) * int(row_bytes) > _INT64_MAX:
        raise InvalidArgument(f"layer {layer_id}: table byte size overflows int64")


def resolve_client(store: Any) -> Any:
    """The ``MooncakeDistributedStore`` behind ``store``: the client itself, or a wrapper
    exposing ``_get_pyclient_capsule()`` (as the binding accepts) that delegates the client's
    methods or holds the client as ``store`` / ``client`` / ``_store`` / ``_client``. None
    when ``store`` is not a Mooncake client. A wrapper whose only handle is the capsule is
    refused: the capsule is a C++ pointer that Python code cannot read through."""
    if is_store_client(store):
        return store
    if not callable(getattr(store, "_get_pyclient_capsule", None)):
        return None
    for attr in ("store", "client", "_store", "_client", "store_client"):
        inner = getattr(store, attr, None)
        if inner is not None and is_store_client(inner):
            return inner
    raise InvalidArgument(
        f"{type(store).__name__} exposes only _get_pyclient_capsule(); EngramDB needs the "
        "client's Python methods (batch_put_from, get_into_ranges, register_buffer, "
        "unregister_buffer): pass the MooncakeDistributedStore itself"
    )


_scratch = threading.local()


def tensor_array(output: Any) -> np.ndarray:
    """A CPU uint8 tensor's memory as an ndarray (no copy); other objects are refused."""
    numpy = getattr(output, "numpy", None)
    if getattr(output, "is_cuda", False) or not callable(numpy):
        raise LookupTypeError(
            f"output must be a uint8 ndarray or CPU tensor, got {type(output).__name__}"
        )
    if str(getattr(output, "dtype", "")) != "torch.uint8" or not output.is_contiguous():
        raise LookupTypeError("output must be a contiguous uint8 tensor")
    arr: np.ndarray = numpy()
    return arr


def gather_concat(
    tables: list[np.ndarray], heads: np.ndarray, ids: np.ndarray, rows: np.ndarray
) -> None:
    """Rows of separate head tables by concatenated-head row id (one take per head hit)."""
    starts = np.concatenate(([0], np.cumsum(heads)[:-1]))
    head = np.searchsorted(starts, ids, side="right") - 1
    for h in np.unique(head):
        sel = np.flatnonzero(head == h)
        rows[sel] = np.take(tables[int(h)], ids[sel] - starts[h], axis=0)


def gather_heads(tables: list[np.ndarray], row_ids: np.ndarray, output: np.ndarray) -> None:
    """Per-head gather from separate head tables into the interleaved output.

    Each head is gathered into a contiguous scratch buffer with ``np.take`` (fast, no
    temporary) and then copied into its strided slot of the output; heads are split
    across cores."""
    h_count = row_ids.shape[-1]
    ids2 = row_ids.reshape(-1, h_count)
    n = ids2.shape[0]
    out3 = output.reshape(n, h_count, output.shape[-1])

    def run(lo: int, hi: int) -> None:
        buf = getattr(_scratch, "rows", None)
        need = n * output.shape[-1]
        if buf is None or buf.size < need:
            buf = np.empty(need, dtype=np.uint8)
            _scratch.rows = buf
        rows = buf[:need].reshape(n, output.shape[-1])
        for h in range(lo, hi):
            np.take(tables[h], ids2[:, h], axis=0, out=rows, mode="clip")
            out3[:, h, :] = rows

    run_split(run, h_count)


__all__ = [
    "check_config",
    "gather_concat",
    "gather_heads",
    "layer_key",
    "resolve_client",
    "tensor_array",
]
