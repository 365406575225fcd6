"""Fetched table rows as torch values (the part of `engramdb.torch` below its multi-head
module): the modules' shared base `DiskTable` and `DiskEmbedding`.

`RowDecoder` turns raw rows ``uint8 [n, row_bytes]`` into values by the table's dtype hint
(`engramdb.rowcodec`): raw dtypes are reinterpreted without a copy, FP8 is widened, FP8 with
E8M0 block scales is dequantised; `ids_to_numpy` takes the ids a module is given.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from engramdb.errors import InvalidDtype, MissingDependency
from engramdb.read.step_plan import StepTicket
from engramdb.rowcodec import RowCodec, codec_for
from engramdb.table_api import RowTable

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise MissingDependency("engramdb.torch needs PyTorch: pip install 'engramdb[torch]'") from e

__all__ = [
    "DiskEmbedding",
    "DiskTable",
    "Hot",
    "RowDecoder",
    "hand_over",
    "ids_to_numpy",
    "torch_dtype",
]


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def ids_to_numpy(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise InvalidDtype(f"ids must be an integer tensor, got {ids.dtype}")
        if ids.device.type != "cpu":
            ids = ids.cpu()
        return ids.contiguous().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidDtype(f"ids must be integers, got dtype {arr.dtype}")
    return arr


class RowDecoder:
    """Turns fetched raw rows ``uint8 [n, row_bytes]`` (a torch view) into values."""

    def __init__(self, codec: RowCodec, out_dtype: torch.dtype | None, scale: float | None):
        self.codec = codec
        self.value_dtype = torch_dtype(codec.value_dtype)
        if codec.scaled or scale is not None:
            self.out_dtype = out_dtype or torch.float32
        else:
            self.out_dtype = out_dtype or self.value_dtype
        self.scale = scale
        #: True when decoding only reinterprets the fetched bytes (no new tensor).
        self.is_view = not codec.scaled and scale is None and self.out_dtype == self.value_dtype

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        c = self.codec
        if not c.scaled:
            vals = raw.view(self.value_dtype)
            if self.scale is not None:
                vals = vals.to(self.out_dtype) * self.scale
            elif self.out_dtype != self.value_dtype:
                vals = vals.to(self.out_dtype)
            return vals
        n = raw.shape[0]
        w = raw[:, : c.dim].view(self.value_dtype).to(torch.float32)
        s = raw[:, c.dim :].view(torch.float8_e8m0fnu).to(torch.float32)
        out = (w.view(n, c.n_scales, -1) * s.unsqueeze(-1)).view(n, c.dim)
        if self.scale is not None:
            out = out * self.scale
        return out.to(self.out_dtype)


class Hot:
    """A `DiskMultiHeadEmbedding`'s per-call state and counters (a plain object)."""

    __slots__ = (
        "mapped",
        "prefetched",
        "read",
        "prefetches",
        "from_prefetch",
        "resident_skips",
        "ticket",
        "ticket_ids",
        "ticket_src",
        "view_cache",
    )

    def __init__(self) -> None:
        self.mapped = self.prefetched = self.read = self.prefetches = self.from_prefetch = 0
        self.resident_skips = 0
        self.ticket: Any = None
        self.ticket_ids: np.ndarray | None = None
        #: the ids tensor the pending prefetch was given, its version and its rows' shape
        #: (None: not a CPU int64 ``[B, L, H]`` tensor): a forward of that very tensor,
        #: unchanged, needs no second check
        self.ticket_src: tuple[torch.Tensor, int, tuple[int, ...]] | None = None
        self.view_cache: tuple[Any, torch.Tensor, Any, torch.Tensor] | None = None


def hand_over(hot: Hot, local_ids: Any, proc: Any, slot: int, keys: tuple[Any, ...]) -> bool | None:
    """A `DiskMultiHeadEmbedding.prefetch` through its process's compiled hand-over
    (`PrefetchProcess.hand`): a contiguous CPU int64 ``[B, L, H]`` tensor of at most its
    ``max_rows`` ids, checked and made global straight into the table's slot in one call, its
    ticket kept in ``hot``. ``keys``: the module's heads, bounds and offsets as bytes, and row
    bytes. None: not such a tensor (the general path); False: an id out of range."""
    heads, bounds, offsets, rb = keys
    if not (
        type(local_ids) is torch.Tensor
        and local_ids.dtype is torch.int64
        and local_ids.is_cpu
        and local_ids.dim() == 3
        and local_ids.is_contiguous()
    ):
        return None
    n = local_ids.numel()
    shape = local_ids.shape
    if n > proc.max_rows or shape[2] != heads or n == 0:
        return None
    old = hot.ticket
    if old is not None and type(old) is StepTicket:
        old.cancel()
    hot.ticket = hot.ticket_ids = hot.ticket_src = None
    t = proc.hand(slot, local_ids.data_ptr(), n, bounds, offsets)
    if t is None:  # an id out of range: nothing started (the forward raises)
        return False
    hot.ticket, hot.ticket_ids = t, t.ids
    # with torch's counter of in-place changes to it (what autograd checks)
    hot.ticket_src = (local_ids, local_ids._version, (*shape, rb))  # noqa: SLF001
    hot.prefetches += 1
    return True


class DiskTable(nn.Module):
    """A read-only EngramDB table decoded by its dtype hint (the base of `DiskEmbedding` and
    `engramdb.torch.DiskMultiHeadEmbedding`)."""

    def __init__(
        self,
        store: RowTable,
        *,
        out_dtype: torch.dtype | None = None,
        scale: float | None = None,
        dim: int | None = None,
    ):
        super().__init__()
        self.store = store
        self.codec = codec_for(store.dtype, store.row_bytes, dim if dim is not None else store.dim)
        self._decode = RowDecoder(self.codec, out_dtype, scale)
        self._setup()

    def _setup(self) -> None:
        """What a module adds once the table and codec are set (the constructor is shared)."""


class DiskEmbedding(DiskTable):
    """``nn.Embedding`` whose weight is an EngramDB table (global row ids).

    ``forward(ids)`` returns ``[*ids.shape, dim]`` in the table's dtype (or ``out_dtype``).
    Cost: one batched gather into a fresh output tensor (raw dtypes: no further copy);
    scaled FP8 rows are staged in a reused per-thread buffer, then dequantised. Bad ids raise
    `RowIdOutOfRange` (an ``IndexError``, as ``nn.Embedding`` raises).
    """

    def _setup(self) -> None:
        self.num_embeddings = self.store.n_rows
        self.embedding_dim = self.codec.dim
        self._staging = threading.local()

    def _raw(self, n: int) -> torch.Tensor:
        if self._decode.is_view:  # the output aliases the fetched bytes: fresh each call
            return torch.empty((n, self.codec.row_bytes), dtype=torch.uint8)
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 256), self.codec.row_bytes), dtype=torch.uint8)
            self._staging.buf = buf
        return buf[:n]

    def forward(self, ids: Any) -> torch.Tensor:
        flat = ids_to_numpy(ids)
        shape = tuple(flat.shape)
        flat = flat.reshape(-1)
        raw = self._raw(flat.size)
        with torch.no_grad():
            self.store.fetch_into(flat, raw.numpy())
            out = self._decode(raw)
        return out.reshape(*shape, self.codec.dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, table={self.store.name!r}, "
            f"hint={self.codec.hint!r}"
        )
