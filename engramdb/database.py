"""`Database`: an open database directory, a `Store` per table.

Two forms of directory open as a `Database`:

* a built database (``manifest.json``): the manifest read at open, a `Store` per table;
* the published EngramDB Python API's directory of tables (no manifest): each sub-directory
  holding ``shard_000.bin`` is a table of raw row shards (see `engramdb.read.raw`). Raw
  shards carry no geometry, so a table opens on first `Database.fetch` /
  `Database.table` with ``shards=``, ``rows_per_shard=``, ``width=`` and is kept per
  ``(name, geometry)``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.disk.files import open_shards, open_view_files
from engramdb.disk.publish import read_manifest
from engramdb.errors import (
    CorruptFile,
    DatabaseNotFound,
    InvalidArgument,
    StoreClosed,
    TableNotFound,
)
from engramdb.io import BACKENDS
from engramdb.layouts.manifest import Manifest
from engramdb.read.raw import raw_shard_name
from engramdb.store import Store
from engramdb.stream import stream as _stream
from engramdb.table_api import Closing, RowTable

_Geometry = tuple[int, int, int]


def raw_table_dirs(root: Path) -> list[str]:
    """Names of the sub-directories of ``root`` that hold raw row shards (``shard_000.bin``),
    sorted; empty when ``root`` is not a directory."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    first = raw_shard_name(0)
    return sorted(
        e.name for e in entries if e.is_dir() and os.path.isfile(os.path.join(e.path, first))
    )


class Database(Closing):
    """A snapshot of a database: the manifest read at open, its tables opened on first use.

    On a directory of raw-shard tables (no manifest; see the module docstring) the table
    names are read at open, ``db[name]`` is refused (raw shards carry no geometry) and
    tables open through `table` / `fetch` with their geometry. `list_tables` and
    ``fetch(name, ids)`` work on both forms, so the published API's calls run on either.

    Opening opens every shard of every table (descriptors only: nothing is mapped or read)
    and checks its size against the manifest (a truncated shard is an error here, not
    garbage later). The descriptors are kept: a table opened later maps the very files the
    manifest named at open, so a concurrent rebuild, whose garbage collection unlinks the
    replaced generation, does not disturb an open database: it serves the generation it
    opened until it is closed (an unlinked file lives on while a descriptor holds it).
    Eager descriptors were chosen over a reader lease (no cross-process protocol, nothing
    to clean up after a killed reader) and over re-reading the manifest on first use (that
    would mix generations within one `Database`). Cost: one descriptor per shard (~1 GiB).
    Views get the same treatment: the files of every view the manifest names are opened here
    too (one to three descriptors per view), so ``db[t].view(v)`` opened after a rebuild of
    the view (or of its table) and its garbage collection still serves the records of the
    generation this database opened. A view built after open (not in the snapshot) is found
    through the latest manifest while its table is unchanged.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        backend: str = "auto",
        populate: bool = False,
        ram_budget: int | str | None = None,
        **backend_options: Any,
    ):
        if backend not in BACKENDS:
            raise InvalidArgument(
                f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        self.path = Path(path)
        try:
            self.manifest = read_manifest(self.path)
            raw: list[str] | None = None
        except DatabaseNotFound:
            raw = raw_table_dirs(self.path)
            if not raw:
                raise DatabaseNotFound(
                    f"no EngramDB database at {str(self.path)!r} (no manifest.json and no "
                    f"table sub-directory holding {raw_shard_name(0)})"
                ) from None
            if populate:
                raise InvalidArgument(
                    f"populate=True needs a built database; {str(self.path)!r} holds raw row "
                    "shards, whose tables open on first fetch (call populate() on db.table(...))"
                ) from None
            self.manifest = Manifest(tables={})
        #: the raw-shard table names (the published directory of tables), else None
        self.raw_tables = raw
        self._raw_stores: dict[tuple[str, _Geometry], RowTable] = {}
        self.backend = backend
        self.ram_budget = ram_budget
        self._backend_options = backend_options
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._shard_fds: dict[str, list[int]] = {}
        self._view_fds: dict[str, dict[str, int]] = {}
        try:
            for name, info in self.manifest.tables.items():
                self._shard_fds[name] = open_shards(self.path, info)
                self._view_fds[name] = open_view_files(self.path, info)
        except BaseException:
            self._close_fds()
            raise
        if populate:
            for name in self.tables:
                self[name].populate()

    @property
    def tables(self) -> list[str]:
        if self.raw_tables is not None:
            return list(self.raw_tables)
        return sorted(self.manifest.tables)

    def list_tables(self) -> list[str]:
        """The table names, sorted (the published API's name for `tables`)."""
        return self.tables

    def __contains__(self, name: object) -> bool:
        if self.raw_tables is not None:
            return name in self.raw_tables
        return name in self.manifest.tables

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def _not_found(self, name: object) -> TableNotFound:
        return TableNotFound(f"no table {name!r} in {str(self.path)!r} (tables: {self.tables})")

    def __getitem__(self, name: str) -> Store:
        if self._closed:
            raise StoreClosed(f"database {str(self.path)!r} is closed")
        if self.raw_tables is not None:
            if name not in self.raw_tables:
                raise self._not_found(name)
            raise InvalidArgument(
                f"table {name!r} of {str(self.path)!r} is raw row shards with no geometry: use "
                "db.table(name, shards=, rows_per_shard=, width=) or db.fetch(name, ids, ...)"
            )
        with self._lock:
            store = self._stores.get(name)
            if store is None:
                info = self.manifest.tables.get(name)
                if info is None:
                    raise self._not_found(name)
                store = Store(
                    self.path,
                    info,
                    backend=self.backend,
                    ram_budget=self.ram_budget,
                    fds=self._shard_fds.pop(name, None),
                    view_fds=self._view_fds.pop(name, None),
                    **self._backend_options,
                )
                self._stores[name] = store
            return store

    def table(
        self,
        name: str,
        *,
        shards: int | None = None,
        rows_per_shard: int | None = None,
        width: int | None = None,
    ) -> RowTable:
        """Table ``name``, opened on first use and kept until `close`.

        A built database: ``db[name]``; the geometry keywords are optional there, and a
        ``width`` that differs from the table's row bytes is `InvalidArgument` (``shards`` /
        ``rows_per_shard`` describe raw files and are ignored: a built table knows its own).
        A directory of raw tables: all three are required, and the table is what
        ``Store(root / name, shards, rows_per_shard, width)`` opens (a `Store` with
        every read path, whatever the geometry), kept per
        ``(name, shards, rows_per_shard, width)``. Geometry that does not match the files
        is `InvalidArgument` naming the table, chained from the shard's size error."""
        if self.raw_tables is None:
            store = self[name]
            if width is not None and (isinstance(width, bool) or width != store.row_bytes):
                raise InvalidArgument(
                    f"width={width!r} does not match table {name!r}, whose rows are "
                    f"{store.row_bytes} bytes"
                )
            return store
        if self._closed:
            raise StoreClosed(f"database {str(self.path)!r} is closed")
        if name not in self.raw_tables:
            raise self._not_found(name)
        geometry = _geometry(name, shards, rows_per_shard, width)
        key = (name, geometry)
        with self._lock:
            found = self._raw_stores.get(key)
            if found is not None:
                return found
            try:
                opened: RowTable = Store(
                    self.path / name,
                    *geometry,
                    backend=self.backend,
                    ram_budget=self.ram_budget,
                    name=name,
                    **self._backend_options,
                )
            except CorruptFile as e:  # TruncatedFile too: the shard sizes disagree with it
                raise InvalidArgument(
                    f"table {name!r} of {str(self.path)!r} does not have the geometry "
                    f"shards={geometry[0]}, rows_per_shard={geometry[1]}, "
                    f"width={geometry[2]}: {e}"
                ) from e
            self._raw_stores[key] = opened
            return opened

    def fetch(
        self,
        name: str,
        ids: Any,
        *,
        shards: int | None = None,
        rows_per_shard: int | None = None,
        width: int | None = None,
    ) -> Any:
        """Rows ``ids`` (global row ids: a list or array of ints) of table ``name`` as a uint8
        ``[n, width]`` array, the bytes ``Store(root / name, shards, rows_per_shard,
        width).fetch(ids)`` returns (see `table` for the geometry keywords). Out-of-range
        ids raise `RowIdOutOfRange`, never a zero row."""
        t = self.table(name, shards=shards, rows_per_shard=rows_per_shard, width=width)
        return t.fetch(ids)

    def stream(
        self, corpus: Any, *, preset: Any, table: str | None = None, **options: Any
    ) -> Iterator[tuple[Any, Any]]:
        """Stream ``(token_ids, e_t)`` batches of ``corpus`` from ``table``, read ahead in a
        background thread: see `engramdb.stream.stream` for the options."""
        return _stream(self, corpus, preset=preset, table=table, **options)

    def info(self) -> dict[str, Any]:
        """The manifest as a plain dict plus per-table sizes (no I/O beyond open)."""
        doc: dict[str, Any] = {
            "path": str(self.path),
            "generation": self.manifest.generation,
            "tables": {},
        }
        if self.raw_tables is not None:
            doc["generation"] = None
            doc["kind"] = "raw-shards"
            for name in self.raw_tables:
                opened = sorted(g for (n, g) in self._raw_stores if n == name)
                doc["tables"][name] = {"kind": "raw-shards", "opened_geometries": opened}
            return doc
        for name, t in sorted(self.manifest.tables.items()):
            d = t.to_dict()
            d["bytes"] = t.n_rows * t.row_bytes
            doc["tables"][name] = d
        return doc

    def close(self) -> None:
        with self._lock:
            for s in self._stores.values():
                s.close()
            self._stores.clear()
            for t in self._raw_stores.values():
                t.close()
            self._raw_stores.clear()
            self._close_fds()
            self._closed = True

    def __del__(self) -> None:
        # a Database dropped without close(): release the descriptors no table took over
        if getattr(self, "_shard_fds", None) or getattr(self, "_view_fds", None):
            self._close_fds()

    def _close_fds(self, _close: Callable[[int], None] = os.close) -> None:
        """Close the descriptors of tables never opened. ``os.close`` is bound at definition:
        a `Database` still alive at interpreter exit is collected after the ``os`` module's
        globals are cleared."""
        for fds in self._shard_fds.values():
            for fd in fds:
                _close(fd)
        self._shard_fds.clear()
        for held in self._view_fds.values():
            for fd in held.values():
                _close(fd)
        self._view_fds.clear()

    def __repr__(self) -> str:
        return f"<Database {str(self.path)!r} tables={self.tables}>"


def _geometry(name: str, shards: Any, rows_per_shard: Any, width: Any) -> _Geometry:
    """The raw geometry as three positive ints (`InvalidArgument` naming a bad value)."""
    given = {"shards": shards, "rows_per_shard": rows_per_shard, "width": width}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise InvalidArgument(
            f"table {name!r} is raw row shards: pass shards=, rows_per_shard= and width= "
            f"(missing: {', '.join(missing)})"
        )
    out = []
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
            raise InvalidArgument(f"{k} must be a positive integer, got {v!r}")
        out.append(int(v))
    return out[0], out[1], out[2]


def open(  # noqa: A001
    path: str | os.PathLike[str],
    *,
    backend: str = "auto",
    populate: bool = False,
    ram_budget: int | str | None = None,
    **backend_options: Any,
) -> Database:
    """Open the database at ``path``.

    ``backend``: ``"auto"`` (mmap gathers for page-cache-resident data, io_uring — else
    preadv — for cold data, decided per batch), ``"mmap"``, ``"preadv"`` or ``"io_uring"``.
    ``populate=True`` faults every table into the page tables first (reads it from the device
    if cold). ``ram_budget`` (bytes or ``"8G"``) gives each table a RAM tier of that size.
    ``backend_options`` go to the backend (e.g. ``threads=`` for preadv, ``direct=`` for
    io_uring)."""
    return Database(
        path, backend=backend, populate=populate, ram_budget=ram_budget, **backend_options
    )
