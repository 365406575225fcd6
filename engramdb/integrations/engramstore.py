"""`EngramStore`: a drop-in for the Mooncake EngramStore Python surface, backed by EngramDB.

Semantics follow Mooncake's EngramStore contract (one table per head, ``[B, L, H]``
per-head row ids, caller-owned ``[B, L, H, row_bytes]`` output, create-only populate,
``engram:l{layer}:h{head}`` keys). Storage differs: a layer is one EngramDB table
(``engram_l{layer}``, heads concatenated), so a lookup is one vectorised gather.

Backings, chosen by the ``store`` argument:

* ``None`` — metadata only; layers can be bound to caller memory with `bind_local`;
* an EngramDB `Database` or a database path — `populate` builds tables there, lookups read
  them (any process that opens the same path sees populated layers without re-populating);
* a ``mooncake.store.MooncakeDistributedStore`` client (duck-typed) — the contract's own
  backing: one store object per head (``engram:l{layer}:h{head}``, or ``...:p{part}`` when
  ``object_bytes`` splits large heads), one ``get_into_ranges`` per lookup into the caller's
  registered output (`engramdb.integrations.mooncake`).

Exceptions keep the binding's types: ``ValueError`` for bad configuration and unknown
layers, ``TypeError`` for wrong argument types or layouts, a bounds error for bad row ids;
each also derives from `EngramDBError`, and lookup failures also from ``RuntimeError``
(which the binding raises for them). On a bounds error the output is zero-filled, as the
binding does, so rows of an earlier step are never mistaken for this one's; any other
rejected call leaves the output untouched.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.build import build, drop_table
from engramdb.database import Database
from engramdb.errors import (
    DatabaseNotFound,
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    LayerExists,
    LayerNotReady,
    LookupBoundsError,
    LookupShapeError,
    LookupTypeError,
    RowIdOutOfRange,
    ShapeMismatch,
    UnknownLayer,
)
from engramdb.integrations.mooncake import MooncakeLayers, is_store_client
from engramdb.io.gather import run_split
from engramdb.store import Store
from engramdb.validate import check_head_bounds, check_lookup_ids, check_output

_INT64_MAX = 2**63 - 1


class EngramStoreConfig:
    """Physical layout of one layer: per-head table sizes and the row width in bytes."""

    def __init__(self, table_vocab_sizes: Sequence[int] | None = None, row_bytes: int = 0):
        self.table_vocab_sizes: list[int] = list(table_vocab_sizes or [1024])
        self.row_bytes = row_bytes

    def __repr__(self) -> str:
        return (
            f"EngramStoreConfig(table_vocab_sizes={self.table_vocab_sizes!r}, "
            f"row_bytes={self.row_bytes!r})"
        )


class _Layer:
    __slots__ = (
        "layer_id",
        "sizes",
        "row_bytes",
        "heads",
        "bound",
        "store",
        "db",
        "objects",
    )

    def __init__(self, layer_id: int, cfg: EngramStoreConfig):
        self.layer_id = layer_id
        self.sizes = [int(n) for n in cfg.table_vocab_sizes]
        self.row_bytes = int(cfg.row_bytes)
        self.heads = np.asarray(self.sizes, dtype=np.int64)
        self.bound: list[np.ndarray] | None = None
        self.store: Store | None = None
        self.db: Database | None = None
        self.objects: Any = None  # ObjectLayout when backed by a Mooncake store

    @property
    def table(self) -> str:
        return f"engram_l{self.layer_id}"


def _check_config(layer_id: Any, cfg: Any) -> None:
    if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)) or layer_id < 0:
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


@contextmanager
def _binding_errors() -> Iterator[None]:
    """Re-raise the engine's validation errors as the binding-compatible classes."""
    try:
        yield
    except (LookupTypeError, LookupShapeError, LookupBoundsError):
        raise
    except (InvalidDtype, InvalidLayout) as e:
        raise LookupTypeError(str(e)) from None
    except ShapeMismatch as e:
        raise LookupShapeError(str(e)) from None
    except RowIdOutOfRange as e:
        raise LookupBoundsError(str(e)) from None


def _check_head_tables(layer: _Layer, buffers: Any, what: str) -> list[np.ndarray]:
    if not isinstance(buffers, (list, tuple)):
        raise LookupTypeError(f"{what}: expected a list of arrays, got {type(buffers).__name__}")
    if len(buffers) != len(layer.sizes):
        raise LookupShapeError(
            f"{what}: layer {layer.layer_id} has {len(layer.sizes)} heads, got {len(buffers)} tables"
        )
    for h, (buf, n) in enumerate(zip(buffers, layer.sizes)):
        if not isinstance(buf, np.ndarray):
            raise LookupTypeError(f"{what}: head {h} is {type(buf).__name__}, not a numpy array")
        if buf.dtype != np.uint8:
            raise LookupTypeError(
                f"{what}: head {h} has dtype {buf.dtype}, expected uint8 "
                "(expose other dtypes with .view(np.uint8))"
            )
        if not buf.flags.c_contiguous:
            raise LookupTypeError(f"{what}: head {h} is not C-contiguous")
        if buf.shape != (n, layer.row_bytes):
            raise LookupShapeError(
                f"{what}: head {h} has shape {buf.shape}, expected {(n, layer.row_bytes)}"
            )
    return list(buffers)


class EngramStore:
    """Engram tables of several layers behind Mooncake's EngramStore surface.

    ``object_bytes`` (Mooncake backing only) splits heads larger than that many bytes into
    several store objects of whole rows; by default each head is one object, as the
    contract has it."""

    def __init__(
        self,
        layers: dict[int, EngramStoreConfig],
        store: Any = None,
        *,
        object_bytes: int | None = None,
    ):
        if not isinstance(layers, dict) or not layers:
            raise InvalidArgument("EngramStore requires at least one layer")
        for layer_id, cfg in layers.items():
            _check_config(layer_id, cfg)
        self._layers = {int(k): _Layer(int(k), v) for k, v in layers.items()}
        self._lock = threading.Lock()
        self._db_path: Path | None = None
        self._mooncake: MooncakeLayers | None = None
        if object_bytes is not None and not is_store_client(store):
            raise InvalidArgument("object_bytes applies only to a Mooncake store backing")
        if store is None:
            pass
        elif is_store_client(store):
            self._mooncake = MooncakeLayers(store, object_bytes)
            for layer in self._layers.values():
                layer.objects = self._mooncake.layout(layer.layer_id, layer.sizes, layer.row_bytes)
        elif isinstance(store, Database):
            self._db_path = store.path
        elif isinstance(store, (str, os.PathLike)):
            self._db_path = Path(store)
        else:
            raise InvalidArgument(
                f"store must be None, an EngramDB Database, a database path or a Mooncake "
                f"store client, got {type(store).__name__}"
            )

    # -- metadata ----------------------------------------------------------------------------
    def _layer(self, layer_id: int) -> _Layer:
        try:
            return self._layers[int(layer_id)]
        except (KeyError, TypeError, ValueError):
            raise UnknownLayer(f"Unknown Engram layer {layer_id!r}") from None

    def get_layer_ids(self) -> list[int]:
        return sorted(self._layers)

    def get_table_vocab_sizes(self, layer_id: int) -> list[int]:
        return list(self._layer(layer_id).sizes)

    def get_store_keys(self, layer_id: int) -> list[str]:
        layer = self._layer(layer_id)
        return [f"engram:l{layer.layer_id}:h{h}" for h in range(len(layer.sizes))]

    def get_num_heads(self, layer_id: int) -> int:
        return len(self._layer(layer_id).sizes)

    def get_row_bytes(self, layer_id: int) -> int:
        return self._layer(layer_id).row_bytes

    def table_name(self, layer_id: int) -> str:
        """The EngramDB table that holds ``layer_id`` (``engram_l{layer}``)."""
        return self._layer(layer_id).table

    @property
    def mooncake_layers(self) -> MooncakeLayers | None:
        """The Mooncake backing (its ``counters`` count the store calls, its ``layouts`` name
        each layer's store objects); None for the other backings."""
        return self._mooncake

    def layer_store(self, layer_id: int) -> Store:
        """The EngramDB table serving ``layer_id`` (database backing; opened on first use and
        kept, so its ``stats()`` count this EngramStore's lookups). `LayerNotReady` if the
        layer is not populated or the EngramStore has no database backing."""
        return self._open_store(self._layer(layer_id))

    # -- writes ------------------------------------------------------------------------------
    def _existing_table(self, layer: _Layer) -> bool:
        if self._db_path is None:
            return False
        try:
            with Database(self._db_path) as db:
                return layer.table in db
        except DatabaseNotFound:
            return False

    def populate(
        self, layer_id: int, embedding_buffers: Sequence[np.ndarray], config: Any = None
    ) -> None:
        """Write one uint8 ``[N_h, row_bytes]`` table per head as the layer's table.

        Create-only: fails with `LayerExists` if the layer already has a table (remove it
        first). ``config`` (a Mooncake ReplicateConfig) is accepted and ignored: an EngramDB
        table has one copy on local storage. Streams the arrays to disk at build speed; a
        failed populate leaves nothing behind (the build publishes atomically).

        Mooncake backing: checks that no head key exists, registers each table, uploads all
        heads with one ``batch_put_from`` (``config`` is passed on; default: hard-pinned so
        the store never evicts the table), unregisters, and removes what a failed populate
        wrote. Cost: one copy of the layer over the store's transport."""
        layer = self._layer(layer_id)
        if self._mooncake is not None:
            buffers = _check_head_tables(layer, embedding_buffers, "populate")
            with self._lock:
                self._mooncake.populate(layer.objects, buffers, config)
            return
        if self._db_path is None:
            raise LayerNotReady(
                "populate needs a backing store: construct EngramStore(layers, store=<EngramDB "
                "database or path>), or use bind_local for caller-owned memory"
            )
        buffers = _check_head_tables(layer, embedding_buffers, "populate")
        with self._lock:
            if layer.bound is not None or self._existing_table(layer):
                raise LayerExists(
                    f"layer {layer.layer_id} already has tables ({', '.join(self.get_store_keys(layer_id))}); "
                    "call remove_from_store first"
                )
            build(self._db_path, layer.table, layer.row_bytes, buffers, dtype="u8")

    def bind_local(self, layer_id: int, embedding_buffers: Sequence[np.ndarray]) -> None:
        """Serve ``layer_id`` from caller-owned uint8 ``[N_h, row_bytes]`` arrays (e.g.
        ``np.memmap`` of ``/dev/shm`` files). No copy; the list and arrays are kept alive
        while bound. Binding twice, or binding on a store-backed EngramStore, is rejected."""
        layer = self._layer(layer_id)
        if self._db_path is not None or self._mooncake is not None:
            raise LayerExists("bind_local is for EngramStore(layers) without a backing store")
        buffers = _check_head_tables(layer, embedding_buffers, "bind_local")
        with self._lock:
            if layer.bound is not None:
                raise LayerExists(f"layer {layer.layer_id} is already bound")
            layer.bound = list(buffers)

    def remove_from_store(self, layer_id: int, force: bool = False) -> int:
        """Remove the layer's tables; returns how many head tables were removed (0 if none).

        ``force`` is accepted for compatibility: readers that already opened the table keep
        their snapshot, so removal never has to wait for them. Mooncake backing: an object
        read within the master's lease TTL refuses removal unless ``force``."""
        layer = self._layer(layer_id)
        if self._mooncake is not None:
            with self._lock:
                return int(self._mooncake.remove(layer.objects, force))
        with self._lock:
            removed = 0
            if layer.bound is not None:
                layer.bound = None
                removed = len(layer.sizes)
            if layer.db is not None:
                layer.db.close()
                layer.db, layer.store = None, None
            if self._existing_table(layer):
                assert self._db_path is not None
                drop_table(self._db_path, layer.table)
                removed = len(layer.sizes)
            return removed

    # -- reads -------------------------------------------------------------------------------
    def _open_store(self, layer: _Layer) -> Store:
        store = layer.store
        if store is not None and not store.closed:
            return store
        with self._lock:
            if layer.store is not None and not layer.store.closed:
                return layer.store
            if self._db_path is None:
                raise LayerNotReady(f"layer {layer.layer_id} is not bound (bind_local first)")
            try:
                db = Database(self._db_path)
            except DatabaseNotFound:
                raise LayerNotReady(f"layer {layer.layer_id} is not populated") from None
            if layer.table not in db:
                db.close()
                raise LayerNotReady(f"layer {layer.layer_id} is not populated")
            store = db[layer.table]
            if store.heads.tolist() != layer.sizes or store.row_bytes != layer.row_bytes:
                db.close()
                raise LayerExists(
                    f"table {layer.table!r} has heads {store.heads.tolist()} x {store.row_bytes} B, "
                    f"the layer is configured as {layer.sizes} x {layer.row_bytes} B"
                )
            layer.db, layer.store = db, store
            return store

    def lookup_into(self, layer_id: int, row_ids: np.ndarray, output: np.ndarray) -> None:
        """Write ``output[b, l, h] = table_h[row_ids[b, l, h]]``.

        ``row_ids``: int64, C-contiguous, ``[B, L, H]`` per-head local ids; ``output``:
        writable C-contiguous uint8 ``[B, L, H, row_bytes]``. No implicit conversions; an
        empty batch is a no-op. Warm cost: one gather (EngramDB-backed) or one gather per
        head (bound memory), split across cores for large batches; no allocation.

        Mooncake backing: ``output`` must be registered with the store client (an empty
        batch needs no registration); one ``get_into_ranges`` per call, ~40 us per row on
        the TCP transport (the store client's per-range cost; docs/distributed.md). A failed read zero-fills ``output``."""
        layer = self._layer(layer_id)
        with _binding_errors():
            check_lookup_ids(row_ids, len(layer.sizes))
            check_output(output, row_ids.shape + (layer.row_bytes,), name="output")
            if row_ids.size == 0:
                return
            bound = layer.bound
            mooncake = self._mooncake
            store = None if bound is not None or mooncake is not None else self._open_store(layer)
            try:
                check_head_bounds(row_ids, layer.heads)
            except RowIdOutOfRange:
                output.fill(0)
                raise
            if mooncake is not None:
                mooncake.lookup_into(layer.objects, row_ids, output)
            elif bound is not None:
                _gather_heads(bound, row_ids, output)
            else:
                assert store is not None
                store.lookup_into(row_ids, output)

    def __repr__(self) -> str:
        if self._mooncake is not None:
            backing = "mooncake"
        else:
            backing = str(self._db_path) if self._db_path else "local"
        return f"<EngramStore layers={self.get_layer_ids()} backing={backing}>"


_scratch = threading.local()


def _gather_heads(tables: list[np.ndarray], row_ids: np.ndarray, output: np.ndarray) -> None:
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


__all__ = ["EngramDBError", "EngramStore", "EngramStoreConfig"]
