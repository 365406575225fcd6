"""`Database`: an open database directory, a `Store` per table."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engramdb.disk.files import open_shards, open_view_files
from engramdb.disk.publish import read_manifest
from engramdb.errors import (
    InvalidArgument,
    StoreClosed,
    TableNotFound,
)
from engramdb.io import BACKENDS
from engramdb.store import Store
from engramdb.stream import stream as _stream
from engramdb.table_api import Closing


class Database(Closing):
    """A snapshot of a database: the manifest read at open, its tables opened on first use.

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
        self.manifest = read_manifest(self.path)
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
        return sorted(self.manifest.tables)

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tables

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.manifest.tables)

    def __getitem__(self, name: str) -> Store:
        if self._closed:
            raise StoreClosed(f"database {str(self.path)!r} is closed")
        with self._lock:
            store = self._stores.get(name)
            if store is None:
                info = self.manifest.tables.get(name)
                if info is None:
                    raise TableNotFound(
                        f"no table {name!r} in {str(self.path)!r} (tables: {self.tables})"
                    )
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
            self._close_fds()
            self._closed = True

    def __del__(self) -> None:
        # a Database dropped without close(): release the descriptors no table took over
        if getattr(self, "_shard_fds", None) or getattr(self, "_view_fds", None):
            self._close_fds()

    def _close_fds(self) -> None:
        """Close the descriptors of tables never opened."""
        for fds in self._shard_fds.values():
            for fd in fds:
                os.close(fd)
        self._shard_fds.clear()
        for held in self._view_fds.values():
            for fd in held.values():
                os.close(fd)
        self._view_fds.clear()

    def __repr__(self) -> str:
        return f"<Database {str(self.path)!r} tables={self.tables}>"


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
