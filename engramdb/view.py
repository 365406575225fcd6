"""Store-P: materialized views of a Store-I table, one fixed-size record per n-gram key.

A token's Engram / PLE lookup reads 16-24 rows scattered over a table. A view stores, for
every key of a corpus, the concatenation of those rows as one record (16 x 160 B = 2560 B),
so a lookup becomes one fixed-size read. Records are laid out in access order (first
occurrence in the corpus), so replaying that corpus reads the view sequentially. The format
is in ``docs/view.md`` and `engramdb.layouts.view`.

* `View` reads records (`read_record`, `read_records`: `engramdb.read.records.RecordFile`)
  and serves keys (`lookup`, `lookup_tokens`): hits from the view, misses from the table
  (any handle with ``fetch_into``) in the same call, same bytes.
* `build_view` (`engramdb.build.view`) gathers every key's rows from Store-I in batches and
  publishes the view atomically. A killed build leaves the previous state.
* `verify_views` (`engramdb.verify`) checks files against the manifest and slots
  against Store-I.
* `measure_throughput` / `measure_latency` (`engramdb.cli.bench`) are the library side of
  ``engramdb view bench|lat``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engramdb.disk.publish import read_manifest
from engramdb.errors import (
    CorruptFile,
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    ShapeMismatch,
    TableNotFound,
)
from engramdb.keygen import Hasher
from engramdb.keygen import preset as keygen_preset
from engramdb.layouts.keys import KeyHash, hash_keys, hasher_fingerprint, match_keys
from engramdb.layouts.manifest import TableInfo
from engramdb.layouts.view import VIEW_SUFFIX, check_view_name, source_hash
from engramdb.read.records import RecordFile, find_entry
from engramdb.read.slotfile import RawSlotFile, raw_view_manifest
from engramdb.read.table import LocalTable
from engramdb.validate import as_rowids, check_bounds, check_output

__all__ = ["MissTable", "View", "open_view"]


class MissTable(Protocol):
    """What serves a view's misses: any table handle with the public read API (`Store`,
    a `RowTable` such as `RemoteStore`)."""

    name: str
    n_rows: int
    row_bytes: int

    def fetch_into(self, rowids: Any, out: np.ndarray) -> Any: ...

    def close(self) -> None: ...


class View(RecordFile):
    """An open Store-P view: fixed-size records in access order, plus a key index.

    ``View(path)`` opens a ``.edv`` file of a database (``DB/<table>/views/...``);
    ``View(db, table=..., name=...)`` opens a view by name; `open_view` is the form used by
    ``Store.view(name)``. Opening reads the manifest and the header pages only (no data) and
    raises `StaleView` when the table was rebuilt with other contents since the build,
    `TruncatedFile` / `CorruptFile` for a file whose size or header disagrees.

    Reads: `read_record` (one record as ``bytes``, from the mapping), `read_records` (a
    batch, vectorised), `lookup` / `lookup_tokens` (keys or tokens -> records; misses come
    from Store-I). ``backend`` picks how batches travel: ``"mmap"`` (copy out of the mapping:
    the warm path), ``"preadv"`` / ``"io_uring"`` (syscall reads, runs of adjacent slots
    coalesced into large reads), or ``"auto"`` (the reader layer's rule: the mapping while
    the pages are resident, else the cold backend; `engramdb.io.records_rule`).
    ``backend_options`` go to the backend.

    ``store`` serves misses: any table handle with ``fetch_into`` (default: the view opens
    the table's own `Store` on the first miss). ``hasher`` turns keys into row ids for misses
    and tokens into keys (default: the preset recorded at build; a custom hasher must be
    passed). Thread-safe for concurrent reads.

    ``View(path)`` on a published raw slot view (a directory, slot file or manifest with a
    ``view.manifest.json``: ``grans`` / ``heads`` / ``slot_bytes`` and a keys file of row
    ids) returns a `RawSlotFile` instead: `read_record`, `read_records`, `slot_keys`,
    `find` over the slot file in place (`engramdb.read.slotfile`).
    """

    def __new__(cls, path: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        if (
            path is not None
            and kwargs.get("name") is None
            and Path(path).suffix != VIEW_SUFFIX
            and raw_view_manifest(path) is not None
        ):
            if any(v is not None for v in kwargs.values()) and set(kwargs) - {"backend"}:
                raise InvalidArgument(f"a raw slot view takes no options: {sorted(kwargs)}")
            return RawSlotFile(path)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str | None = None,
        name: str | None = None,
        store: MissTable | None = None,
        info: TableInfo | None = None,
        hasher: Hasher | None = None,
        key_hash: KeyHash | None = None,
        backend: str = "auto",
        backend_options: dict[str, Any] | None = None,
        held: Mapping[str, int] | None = None,
    ):
        p = Path(path)
        if name is None:
            if table is not None or p.suffix != VIEW_SUFFIX:
                raise InvalidArgument(
                    f"View({str(path)!r}) needs a {VIEW_SUFFIX} file, or a database with "
                    "table= and name="
                )
            db, table = p.parent.parent.parent, p.parent.parent.name
        else:
            if table is None:
                raise InvalidArgument("View(db, name=...) also needs table=")
            db = p
            check_view_name(name)
        self._store = store
        self._own_store = False
        self._closed = True
        store_info = getattr(store, "info", None)
        if isinstance(store_info, TableInfo):
            info = store_info
        snapshot = info if info is not None else read_manifest(db).tables.get(table)
        if snapshot is None:
            raise TableNotFound(f"no table {table!r} in {str(db)!r}")
        entry = find_entry(db, snapshot, name, p if name is None else None, held)
        self._hasher = hasher
        self._hasher_checked = False
        self._key_hash = key_hash
        super().__init__(
            db, snapshot, entry, backend=backend, backend_options=backend_options, held=held
        )
        self._counters.update(lookups=0, hits=0, misses=0, store_rows=0)

    def _check_options(self) -> None:
        entry, key_hash = self.entry, self._key_hash
        if entry.key_hash == "custom" and key_hash is None and entry.source == "keys":
            raise InvalidArgument(
                f"view {self.name!r} was built with a custom key hash: pass the same key_hash="
            )
        if key_hash is not None and entry.key_hash != "custom":
            raise InvalidArgument(
                f"view {self.name!r} uses the XXH64 key hash; key_hash= must not be given"
            )
        if self._hasher is not None:
            self._check_hasher(self._hasher)

    # -- properties ----------------------------------------------------------------------------
    @property
    def stale(self) -> bool:
        """Whether the database's current table differs from the one this view was built
        from (reads ``manifest.json``: ~0.1-1 ms). An open view keeps serving the old
        table's bytes consistently either way; reopen to see the rebuild."""
        try:
            now = read_manifest(self._db).tables.get(self.table)
        except EngramDBError:
            return True
        return now is None or source_hash(now) != self.entry.source_hash

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_records:,} records x {self.record_bytes} B"
        return f"<View {self.table!r}/{self.name!r} {state}, backend={self.backend}>"

    # -- keys ----------------------------------------------------------------------------------
    def key_hashes(self, keys: np.ndarray) -> np.ndarray:
        """uint64 key-index hash of every int64 ``[K, key_width]`` key: XXH64, or the
        ``key_hash`` given at open (what the key index was sorted by)."""
        return hash_keys(self._key_hash, keys)

    def _as_keys(self, keys: Any) -> np.ndarray:
        if self._hashes is None:
            raise InvalidArgument(
                f"view {self.name!r} was built from explicit row ids and has no key index; "
                "use read_records"
            )
        arr = np.asarray(keys)
        if arr.size == 0 and arr.dtype.kind == "f" and not isinstance(keys, np.ndarray):
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
            raise InvalidDtype(f"keys must hold integers, got dtype {arr.dtype}")
        if arr.ndim == 0 or arr.shape[-1] != self.key_width:
            raise ShapeMismatch(f"keys must be [..., {self.key_width}], got shape {arr.shape}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise InvalidArgument(f"key id {int(arr.max())} is beyond int64")
        return arr

    def find(self, keys: Any) -> np.ndarray:
        """Slot of every key (int64 ``keys.shape[:-1]``, -1 where the view lacks the key).
        Pure index work: hash, one ``searchsorted``, a key comparison (~0.1 us per key)."""
        self._check_open()
        arr = self._as_keys(keys)
        k2 = np.ascontiguousarray(arr.reshape(-1, self.key_width), dtype=np.int64)
        return self._find(k2).reshape(arr.shape[:-1])

    def _find(self, k2: np.ndarray) -> np.ndarray:
        assert self._hashes is not None and self._keys is not None and self._slot_of is not None
        slots = match_keys(
            self._hashes, self._keys, self._slot_of, k2, hash_keys(self._key_hash, k2)
        )
        if slots.size and int(slots.max()) >= self.n_records:
            bad = int(slots.max())
            raise CorruptFile(
                f"view {self.name!r}: key index {self.entry.index.path if self.entry.index else ''!r} "
                f"points at slot {bad}, beyond its {self.n_records} slots"
            )
        return slots

    def lookup(self, keys: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records of n-gram ``keys`` (int ``[..., key_width]``, `Hasher.keys` contexts) as
        uint8 ``[..., record_bytes]``. Keys in the view come from it; the others are gathered
        from Store-I in the same call (``hash_keys`` then ``fetch_into``): the bytes are the
        same either way. Every miss is validated before ``out`` is written.
        Counters: ``hits``, ``misses``, ``store_rows``."""
        self._check_open()
        arr = self._as_keys(keys)
        shape = arr.shape[:-1] + (self.record_bytes,)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        else:
            check_output(out, shape)
        k2 = np.ascontiguousarray(arr.reshape(-1, self.key_width), dtype=np.int64)
        self._serve(k2, out.reshape(-1, self.record_bytes))
        return out

    def lookup_tokens(
        self,
        token_ids: Any,
        out: np.ndarray | None = None,
        *,
        compressed: bool = False,
        mask: Any = None,
        strict: bool = True,
    ) -> np.ndarray:
        """Records of every position of ``token_ids`` (``[..., T]``, sequences starting
        fresh) as uint8 ``[..., T, record_bytes]``: ``Hasher.keys`` then `lookup`. Options
        as in ``Hasher.keys``."""
        self._check_open()
        h = self.hasher()
        keys = h.keys(token_ids, compressed=compressed, mask=mask, strict=strict)
        return self.lookup(keys, out)

    def _serve(self, k2: np.ndarray, out2d: np.ndarray) -> None:
        m = k2.shape[0]
        if m == 0:
            return
        slots = self._find(k2)
        miss = np.flatnonzero(slots < 0)
        c = self._counters
        c["lookups"] += 1
        c["hits"] += m - miss.shape[0]
        c["misses"] += miss.shape[0]
        if miss.shape[0] == 0:
            self._gather(slots, out2d)
            return
        rows = self.hasher().hash_keys(k2[miss], layer=self.layer)
        store = self._miss_store()
        check_bounds(rows.reshape(-1), store.n_rows, shape=rows.shape)
        if miss.shape[0] < m:
            # Point the misses at a hit's slot so one gather fills every position (a cold
            # backend deduplicates it: no extra I/O), then overwrite them from Store-I.
            slots[miss] = slots[np.argmax(slots >= 0)]
            self._gather(slots, out2d)
        tmp = self._scratch.get(miss.shape[0] * self.record_bytes)
        store.fetch_into(rows, tmp.reshape(rows.shape + (store.row_bytes,)))
        out2d[miss] = tmp.reshape(-1, self.record_bytes)
        c["store_rows"] += rows.size

    # -- the hasher ----------------------------------------------------------------------------
    def hasher(self) -> Hasher:
        """The keygen hasher of this view (given at open, or the recorded preset), checked
        against the build's fingerprint once."""
        self._check_open()
        h = self._hasher
        if h is None:
            doc = self.entry.hasher or {}
            name = doc.get("preset")
            if not name:
                raise InvalidArgument(
                    f"view {self.name!r} was built with the hasher {doc.get('name')!r}, which is "
                    "not a preset: open it with hasher= to serve misses and tokens"
                )
            h = keygen_preset(name)
            self._check_hasher(h)
            self._hasher = h
        elif not self._hasher_checked:
            self._check_hasher(h)
        return h

    def _check_hasher(self, h: Hasher) -> None:
        doc = self.entry.hasher
        if doc is None:
            raise InvalidArgument(f"view {self.name!r} has no keys; it takes no hasher")
        if h.max_ngram != self.key_width or h.n_heads != self.rows_per_record:
            raise InvalidArgument(
                f"hasher {h!r} makes {h.n_heads} rows from {h.max_ngram}-id keys; view "
                f"{self.name!r} holds {self.rows_per_record} rows per {self.key_width}-id key"
            )
        if hasher_fingerprint(h, self.layer, self.key_width) != doc.get("fingerprint"):
            raise InvalidArgument(
                f"hasher {h!r} (layer {self.layer}) does not reproduce the row ids view "
                f"{self.name!r} was built with"
            )
        self._hasher_checked = True

    def _miss_store(self) -> MissTable:
        store = self._store
        if store is None:
            store = LocalTable(self._db, self.info)
            self._store = store
            self._own_store = True
        return store

    def record_rows(self, ids: Any) -> np.ndarray:
        """Store-I global row ids of records ``ids``: int64 ``ids.shape + (rows_per_record,)``
        (the rows file, or ``hash_keys`` of the stored keys). Cost: O(n_records) once for a
        key view (the slot -> key inverse), then a gather."""
        self._check_open()
        arr = as_rowids(ids)
        flat = arr.reshape(-1)
        check_bounds(flat, self.n_records, shape=arr.shape, what="record id")
        if self._rows is not None:
            return np.take(self._rows, flat, axis=0).reshape(arr.shape + (self.rows_per_record,))
        keys = self.slot_keys()[flat]
        return (
            self.hasher()
            .hash_keys(keys, layer=self.layer)
            .reshape(arr.shape + (self.rows_per_record,))
        )

    # -- stats and lifetime ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since open (or `reset_stats`): records returned, batches per path,
        ``bytes_requested`` (what the view asked the mapping / backend for) and
        ``bytes_returned``, lookups with ``hits`` / ``misses`` (positions) and the
        ``store_rows`` misses cost."""
        doc: dict[str, Any] = {"table": self.table, "view": self.name, "backend": self.backend}
        doc.update(self._counters)
        return doc

    def reset_stats(self) -> None:
        self._reset_counters()

    def _release(self) -> None:
        super()._release()
        if self._own_store and self._store is not None:
            self._store.close()
        self._store = None

    def close(self) -> None:
        """Release mappings, descriptors, the backend and an owned miss `Store`. Later
        calls raise `StoreClosed`. Arrays returned earlier stay valid (they are copies)."""
        super().close()


def open_view(
    db_path: str | os.PathLike[str],
    table: TableInfo | MissTable,
    name: str,
    *,
    held: Mapping[str, int] | None = None,
    **options: Any,
) -> View:
    """Open view ``name`` of a table given as the handle that serves its misses (a `Store`,
    what ``Store.view`` passes, or any table handle with ``fetch_into``) or as the
    `TableInfo` of a manifest snapshot. ``options`` go to `View` (``hasher``, ``key_hash``,
    ``backend``, ``backend_options``); ``held``, the descriptors of view files taken at
    open (``Store.view`` passes its own), pins the snapshot's generation of the view."""
    if isinstance(table, TableInfo):
        return View(db_path, table=table.name, name=name, info=table, held=held, **options)
    if callable(getattr(table, "fetch_into", None)):
        return View(db_path, table=table.name, name=name, store=table, held=held, **options)
    raise InvalidArgument(f"table must be a Store or a TableInfo, got {type(table).__name__}")
