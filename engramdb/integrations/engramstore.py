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
from engramdb.integrations.engramstore_parts import (
    check_config,
    gather_concat,
    gather_heads,
    layer_key,
    resolve_client,
    tensor_array,
)
from engramdb.integrations.mooncake import (
    MooncakeError,
    MooncakeLayers,
    read_many,
)
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
    if not isinstance(buffers, list):
        # the binding's parameter is a py::list: a tuple is refused there too
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

    Constructor forms (every Mooncake version users hold):

    * ``EngramStore(layers, store)`` — the merged contract (``store``: None, an EngramDB
      database or path, or a Mooncake client);
    * ``EngramStore(layers, store_client=client, local_dir=path)`` — the current upstream
      form: ``store_client`` a Mooncake client (or a wrapper with ``_get_pyclient_capsule``),
      ``local_dir`` a directory whose local tables ``populate`` writes atomically (an
      EngramDB database there);
    * ``EngramStore(layer_id, config, store)`` — the released wheel's (0.3.13.post1)
      single-layer API: returns a `ReleasedEngramStore` (float32 rows,
      ``config.embedding_dim``, ``lookup(row_ids) -> [B, L, H, D]``).

    ``object_bytes`` (Mooncake backing only) splits heads larger than that many bytes into
    several store objects of whole rows; by default each head is one object, as the
    contract has it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("layer_id", kwargs.get("layers"))
        if "layer_id" in kwargs or isinstance(first, (int, np.integer, str, float)):
            from engramdb.integrations.engramstore_released import ReleasedEngramStore

            return ReleasedEngramStore(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        layers: dict[int, EngramStoreConfig],
        store: Any = None,
        *,
        store_client: Any = None,
        local_dir: str | os.PathLike[str] | None = None,
        object_bytes: int | None = None,
    ):
        if not isinstance(layers, dict) or not layers:
            raise InvalidArgument("EngramStore requires at least one layer")
        for layer_id, cfg in layers.items():
            check_config(layer_id, cfg)
        self._layers = {int(k): _Layer(int(k), v) for k, v in layers.items()}
        self._lock = threading.Lock()
        self._db_path: Path | None = None
        self._mooncake: MooncakeLayers | None = None
        self._local_mode = store is None and store_client is None
        if store_client is not None:
            if store is not None:
                raise InvalidArgument("pass the Mooncake client as store or store_client, not both")
            store = store_client
            if resolve_client(store) is None:
                raise InvalidArgument(
                    f"store_client must be a Mooncake client, got {type(store).__name__}"
                )
        if local_dir is not None:
            if store is not None:
                raise InvalidArgument("local_dir is the local backing: pass no store with it")
            store = Path(local_dir)
        client = resolve_client(store)
        if object_bytes is not None and client is None:
            raise InvalidArgument("object_bytes applies only to a Mooncake store backing")
        if store is None:
            pass
        elif client is not None:
            self._mooncake = MooncakeLayers(client, object_bytes)
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
        key = layer_key(layer_id)
        try:
            return self._layers[key]
        except KeyError:
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
        read within the master's lease TTL refuses removal unless ``force``.

        Local mode (no store: bound or ``local_dir`` layers) refuses, as upstream does
        (`MooncakeError`, a ``RuntimeError``, code -600 INVALID_PARAMS): local tables live
        as long as the EngramStore."""
        layer = self._layer(layer_id)
        if self._local_mode:
            raise MooncakeError(
                f"remove_from_store failed for layer {layer.layer_id}: a local EngramStore "
                "(no store client) has no store to remove from (INVALID_PARAMS (-600))",
                -600,
            )
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
                gather_heads(bound, row_ids, output)
            else:
                assert store is not None
                store.lookup_into(row_ids, output)

    def lookup_many_into(
        self, layer_ids: Sequence[int], row_ids: Sequence[np.ndarray], outputs: Sequence[np.ndarray]
    ) -> None:
        """`lookup_into` for several layers at once: ``outputs[i][b, l, h] =
        table(layer_ids[i])_h[row_ids[i][b, l, h]]``.

        Every request is validated (types, shapes, bounds, outputs not overlapping) before
        any output is written; a bounds error zero-fills every output, as upstream does.
        Mooncake backing: one ``get_into_ranges`` submission for all layers (each output
        registered by the caller)."""
        if not all(isinstance(x, Sequence) for x in (layer_ids, row_ids, outputs)):
            raise LookupTypeError("layer_ids, row_ids and outputs must be sequences")
        if not len(layer_ids) == len(row_ids) == len(outputs):
            raise LookupShapeError("layer_ids, row_ids, and outputs must have equal lengths")
        layers = [self._layer(layer_id) for layer_id in layer_ids]
        with _binding_errors():
            for layer, ids, out in zip(layers, row_ids, outputs):
                check_lookup_ids(ids, len(layer.sizes))
                check_output(out, ids.shape + (layer.row_bytes,), name="output")
            live = [i for i, ids in enumerate(row_ids) if ids.size]
            for a, i in enumerate(live):
                for j in live[a + 1 :]:
                    if np.may_share_memory(outputs[i], outputs[j]):
                        raise LookupShapeError(f"outputs {i} and {j} overlap")
            stores = {
                i: self._open_store(layers[i])
                for i in live
                if layers[i].bound is None and self._mooncake is None
            }
            try:
                for i in live:
                    check_head_bounds(row_ids[i], layers[i].heads)
            except RowIdOutOfRange:
                for out in outputs:
                    out.fill(0)
                raise
            if self._mooncake is not None:
                parts = [(layers[i].objects.plan_local(row_ids[i]), outputs[i]) for i in live]
                read_many(self._mooncake.client, parts, self._mooncake.counters)
                return
            for i in live:
                bound = layers[i].bound
                if bound is not None:
                    gather_heads(bound, row_ids[i], outputs[i])
                else:
                    stores[i].lookup_into(row_ids[i], outputs[i])

    def lookup(self, table_ids: Sequence[int], row_ids: np.ndarray, output: Any) -> None:
        """Upstream's flat lookup: ``output[i, t] = table(table_ids[i])[row_ids[i, t]]``.

        ``row_ids``: C-contiguous int64 ``[len(table_ids), tokens]``, each id a row of that
        layer's table (heads concatenated: for the one-head layers upstream's callers make,
        the head's own row); ``-1`` leaves that output row untouched. ``output``: a writable
        C-contiguous uint8 ndarray (or CPU uint8 tensor) ``[len(table_ids), tokens,
        row_bytes]``, every table of one row width. Invalid input raises before any write.
        Database and local backings (the Mooncake backing serves `lookup_into`)."""
        if not isinstance(table_ids, Sequence) or not table_ids:
            raise LookupTypeError("table_ids must be a non-empty sequence of layer ids")
        layers = [self._layer(t) for t in table_ids]
        if not isinstance(row_ids, np.ndarray) or row_ids.dtype != np.int64:
            raise LookupTypeError("lookup requires contiguous int64 IDs [heads,tokens]")
        if not row_ids.flags.c_contiguous or row_ids.ndim != 2 or row_ids.shape[0] != len(layers):
            raise LookupTypeError("lookup requires contiguous int64 IDs [heads,tokens]")
        width = layers[0].row_bytes
        if any(layer.row_bytes != width for layer in layers):
            raise LookupShapeError("lookup: every table must have the same row_bytes")
        out = output if isinstance(output, np.ndarray) else tensor_array(output)
        with _binding_errors():
            check_output(out, row_ids.shape + (width,), name="output")
        if self._mooncake is not None:
            raise LayerNotReady(
                "lookup(table_ids, ...) is served by the database and local backings; use "
                "lookup_into / lookup_many_into on a Mooncake backing"
            )
        bounds = np.array([sum(layer.sizes) for layer in layers], dtype=np.int64)
        live = row_ids >= 0
        bad = (row_ids < -1) | (row_ids >= bounds[:, None])
        if bad.any():
            i, t = (int(v) for v in np.argwhere(bad)[0])
            raise LookupBoundsError(
                f"row id {int(row_ids[i, t])} at [{i}, {t}] is outside table "
                f"{layers[i].layer_id}'s [0, {int(bounds[i])}) (-1 leaves a row untouched)"
            )
        for i, layer in enumerate(layers):
            keep = np.flatnonzero(live[i])
            if keep.size == 0:
                continue
            ids = row_ids[i, keep]
            rows = np.empty((keep.size, width), dtype=np.uint8)
            if layer.bound is not None:
                gather_concat(layer.bound, layer.heads, ids, rows)
            else:
                self._open_store(layer).fetch_into(ids, rows)
            out[i, keep] = rows

    def __repr__(self) -> str:
        if self._mooncake is not None:
            backing = "mooncake"
        else:
            backing = str(self._db_path) if self._db_path else "local"
        return f"<EngramStore layers={self.get_layer_ids()} backing={backing}>"


__all__ = ["EngramDBError", "EngramStore", "EngramStoreConfig"]
