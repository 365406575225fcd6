"""Open a publication: `open_mooncake` → `MooncakeDatabase` → `MooncakeTable` (a `RowTable`).

A table reads in one of three ways: ranged (default: one ``get_into_ranges`` per batch into
the caller's registered buffer), through a published view (`MooncakeTable.use_view`: the
batch's records in a few runs, `views.ViewReader`), or from a host copy (``host_copy=``:
the host pulls the table once into a file every rank maps; reads are a local gather).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from engramdb.errors import InvalidArgument, StoreClosed, TableNotFound
from engramdb.integrations.mooncake._store import (
    PULL_BATCH_BYTES,
    Counters,
    bulk_read,
    connect,
    get_bytes,
    object_batches,
    read_ranges,
    registered,
)
from engramdb.integrations.mooncake.layout import ObjectLayout
from engramdb.integrations.mooncake.manifest import check_name, manifest_key, parse_manifest
from engramdb.integrations.mooncake.views import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MERGE_GAP_BYTES,
    ViewReader,
    parse_views,
)
from engramdb.io.gather import take_rows
from engramdb.table_api import Closing, RowTable, TableSchema
from engramdb.validate import as_rowids, check_bounds


class MooncakeTable(RowTable):
    """One published table: the read surface of `engramdb.Store` over the store.

    Ranged mode (default): every read validates, then issues one ``get_into_ranges`` into
    the destination, which must be registered with the database's client (``fetch``
    registers the array it allocates). Host-copy mode: reads gather from this host's copy.
    Validation and errors are those of `engramdb.Store`; a rejected call leaves the output
    untouched, a failed transfer zero-fills it."""

    def __init__(
        self,
        db: MooncakeDatabase,
        name: str,
        entry: dict[str, Any],
        *,
        host_copy: str | os.PathLike[str] | None = None,
    ):
        super().__init__(
            TableSchema(
                name=name,
                row_bytes=int(entry["row_bytes"]),
                n_rows=int(entry["n_rows"]),
                heads=tuple(int(h["rows"]) for h in entry["heads"]),
                dtype=entry.get("dtype", "u8"),
                dim=entry.get("dim"),
            )
        )
        self._db = db
        self.layout = ObjectLayout(
            self.heads.tolist(), self.row_bytes, int(entry["rows_per_object"]), entry["objects"]
        )
        self.counters = Counters()
        self._entry = entry
        self._local: np.ndarray | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.views = parse_views(entry, f"publication {db.name!r} table {name!r}")
        self._view: ViewReader | None = None
        if host_copy is not None:
            self._attach_host_copy(Path(host_copy))

    # -- the RowTable contract -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed or self._db.closed

    def _closed_message(self) -> str:
        if self._db.closed:
            return f"publication {self._db.name!r} is closed"
        return f"table {self.name!r} of publication {self._db.name!r} is closed"

    def close(self) -> None:
        """Drop the host copy's mapping and the view reader (its staging buffer is
        unregistered); later reads raise `StoreClosed`. The client stays open: it is the
        database's (`MooncakeDatabase.close`)."""
        with self._lock:
            if self._closed:
                return
            self._local = None
            view, self._view = self._view, None
            if view is not None:
                view.close()
            self._closed = True

    def live_client(self) -> Any:
        """The store client reads go through (the database's); `StoreClosed` once closed."""
        self.check_open()
        return self._db.live_client()

    def gather(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Validated global ids: a gather from the host copy, else one ``get_into_ranges``
        into ``out2d`` (registered with the client by the caller)."""
        local = self._local
        if local is not None:
            take_rows(local, flat, out2d)
            return
        read_ranges(self.live_client(), self.layout.plan_global(flat), out2d, self.counters)

    def _gather_local(self, row_ids: np.ndarray, out2d: np.ndarray) -> None:
        """Validated per-head local ids ``[B, L, H]``: the host copy, the view in use, or one
        ``get_into_ranges`` of per-head ranges into the registered output."""
        if self._local is not None:
            super()._gather_local(row_ids, out2d)
            return
        view = self._view
        if view is not None:
            view.lookup_into(row_ids, out2d, self.counters)
            return
        read_ranges(self.live_client(), self.layout.plan_local(row_ids), out2d, self.counters)

    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids``: ``rowids.shape + (row_bytes,)`` uint8, allocated and
        (ranged mode) registered for the call — a register/unregister pair per call."""
        if self._local is not None:
            return super().fetch(rowids)
        self.check_open()
        ids = as_rowids(rowids)
        check_bounds(ids.reshape(-1), self.n_rows, shape=ids.shape)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        with registered(self.live_client(), out):
            return self.fetch_into(ids, out)

    # -- modes ---------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        if self._local is not None:
            return "host_copy"
        return "ranged" if self._view is None else f"ranged+view:{self._view.view.name}"

    def use_view(
        self,
        name: str | None,
        *,
        merge_gap_bytes: int = DEFAULT_MERGE_GAP_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """Serve ``lookup_into`` through the published view ``name`` (None: stop): its row
        index is read once (one object), then every batch reads the records it needs in
        merged runs and the unmatched positions row by row, in one ``get_into_ranges``.
        ``merge_gap_bytes``: gaps between needed records read through rather than split;
        ``cache_bytes``: a direct-mapped cache of records read earlier (repeated n-grams of
        a stream are not read again; 0 turns it off)."""
        old, self._view = self._view, None
        if old is not None:
            old.close()
        if name is None:
            return
        pv = self.views.get(name)
        if pv is None:
            raise TableNotFound(
                f"table {self.name!r} has no published view {name!r} (views: {sorted(self.views)})"
            )
        self._view = ViewReader(self, pv, merge_gap_bytes=merge_gap_bytes, cache_bytes=cache_bytes)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_rows:,} rows x {self.row_bytes} B"
        return f"<MooncakeTable {self.name!r} {state}, {self.n_heads} heads, {self.mode}>"

    def stats(self) -> dict[str, Any]:
        doc = {
            "table": self.name,
            "backend": "mooncake",
            "mode": self.mode,
            **self.counters.as_dict(),
        }
        if self._view is not None:
            doc.update({f"view_{k}": v for k, v in self._view.counters.items()})
        return doc

    # -- host copy -----------------------------------------------------------------------------
    def _attach_host_copy(self, directory: Path) -> None:
        """Map this host's copy of the table, pulling it from the store first if no rank on
        the host has (``flock`` serialises the pull; a ``rename`` publishes it whole).
        Cost once per host: one bulk read of the table; afterwards reads are local."""
        # The name carries a digest of what was published (table entry, source database and
        # generation), so a republished table never maps an older host copy.
        ident = {
            "entry": self._entry,
            "source": self._db.manifest.get("source"),
            "generation": self._db.manifest.get("source_generation"),
        }
        digest = xxhash.xxh3_64_hexdigest(json.dumps(ident, sort_keys=True).encode())
        stem = f"{self._db.name}.{self.name}.{digest}"
        path = directory / f"{stem}.rows"
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{stem}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path.exists() and path.stat().st_size == self.nbytes):
                self._pull(path)
        self._local = np.memmap(path, dtype=np.uint8, mode="r", shape=(self.n_rows, self.row_bytes))

    def _pull(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        client = self.live_client()
        rb = self.row_bytes
        try:
            arr = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(self.nbytes,))
            with registered(client, arr):
                base = arr.ctypes.data
                pending = [
                    (key, base + (int(self.head_offsets[h]) + first) * rb, rows * rb)
                    for key, h, first, rows in self.layout.objects()
                ]
                for batch in object_batches(pending, PULL_BATCH_BYTES):
                    bulk_read(client, batch)
            arr.flush()
            del arr
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


class MooncakeDatabase(Closing):
    """A publication opened from the store: ``db[table]`` is a `MooncakeTable`.

    ``client`` is the store client every ranged read goes through: register output
    buffers with ``db.register(array)`` or ``db.client.register_buffer``."""

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        own_client: bool = False,
        host_copy: str | os.PathLike[str] | None = None,
    ):
        self.client = client
        self.name = check_name(name)
        self._own_client = own_client
        self._closed = False
        self._lock = threading.Lock()
        raw = get_bytes(client, manifest_key(name))
        if raw is None:
            raise TableNotFound(f"nothing is published as {name!r} in this store")
        self.manifest = parse_manifest(raw, name)
        self._tables = {
            t: MooncakeTable(self, t, e, host_copy=host_copy)
            for t, e in self.manifest["tables"].items()
        }

    @property
    def closed(self) -> bool:
        """Whether `close` was called (reads then raise `StoreClosed`)."""
        return self._closed

    def live_client(self) -> Any:
        """The store client; `StoreClosed` once the publication is closed."""
        if self._closed:
            raise StoreClosed(f"publication {self.name!r} is closed")
        return self.client

    @property
    def tables(self) -> list[str]:
        return sorted(self._tables)

    def __contains__(self, name: object) -> bool:
        return name in self._tables

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, name: str) -> MooncakeTable:
        self.live_client()
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFound(
                f"no table {name!r} in publication {self.name!r} (tables: {self.tables})"
            ) from None

    def register(self, array: np.ndarray) -> Any:
        """Context manager: ``array`` registered with the client for the block."""
        return registered(self.live_client(), array)

    def info(self) -> dict[str, Any]:
        return dict(self.manifest)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for t in self._tables.values():
                t.close()
            self._closed = True
            if self._own_client:
                self.client.close()

    def __repr__(self) -> str:
        return f"<MooncakeDatabase {self.name!r} tables={self.tables}>"


def open_mooncake(
    *,
    master: str | None = None,
    metadata: str | None = None,
    name: str,
    client: Any = None,
    host_copy: str | os.PathLike[str] | None = None,
    local_hostname: str | None = None,
    protocol: str = "tcp",
    view: str | None = None,
) -> MooncakeDatabase:
    """Open the publication ``name`` (see `publish`) from the store at ``master`` /
    ``metadata``, or through an existing ``client`` (one client per rank can serve every
    table). ``host_copy`` (a tmpfs directory such as ``/dev/shm/engramdb``): pull each
    table once per host into a file that all ranks on the host map, and serve reads
    locally. Cost: client setup (~0.1-1 s) and one manifest read; ``host_copy`` adds one
    bulk read of every table the first time on a host. ``view``: every table that has a
    published view of that name serves ``lookup_into`` through it (`MooncakeTable.use_view`).
    """
    own = client is None
    if own:
        if not master or not metadata:
            raise InvalidArgument("open_mooncake needs master= and metadata= (or client=)")
        client = connect(master, metadata, local_hostname=local_hostname, protocol=protocol)
    try:
        db = MooncakeDatabase(client, name, own_client=own, host_copy=host_copy)
    except BaseException:
        if own:
            client.close()
        raise
    if view is not None:
        try:
            tables = [db[t] for t in db.manifest["tables"] if view in db[t].views]
            if not tables:
                raise TableNotFound(f"no table of {name!r} has a published view {view!r}")
            for t in tables:
                t.use_view(view)
        except BaseException:
            db.close()  # its tables first, then the client when this call opened it
            raise
    return db


__all__ = ["MooncakeDatabase", "MooncakeTable", "open_mooncake"]
