"""`Store`: read access to one Store-I table of an open database.

The engine (shards, mapping, backend and read rule, RAM tier, prefetcher, the trusted read
API) is `engramdb.read.table.LocalTable`; the read surface (``fetch``, ``fetch_into``,
``lookup_into``, ``to_global``) is `engramdb.table_api.RowTable`. A `Store` adds what a user
of one table asks for: its Store-P views, prefetch submission, the hot set, and ``stats()``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.keygen import preset as keygen_preset
from engramdb.layouts.manifest import TableInfo
from engramdb.read.index import load_index
from engramdb.read.prefetch import Ticket
from engramdb.read.table import LocalTable
from engramdb.validate import as_rowids, check_bounds
from engramdb.view import View, open_view

__all__ = ["Store"]


class Store(LocalTable):
    """One table of an open database. Thread-safe for concurrent reads.

    Row ids are *global* (``head_offsets[h] + local``) for `fetch` / `fetch_into`, and
    per-head *local* for `lookup_into`. Every call validates first and writes the output
    only after validation passed, so a bad id never leaves a half-written buffer.
    """

    def __init__(
        self,
        db_path: str | os.PathLike[str],
        info: TableInfo,
        *,
        backend: str = "auto",
        ram_budget: int | str | None = None,
        **backend_options: Any,
    ):
        super().__init__(db_path, info, backend=backend, ram_budget=ram_budget, **backend_options)
        self._views: dict[str, View] = {}
        self._views_lock = threading.Lock()
        self._hashers: dict[str, Any] = {}

    # -- prefetch ----------------------------------------------------------------------------
    def prefetch(self, rowids: Any) -> Ticket:
        """Start reading global ``rowids`` in the background, into the RAM tier if the table
        has one, else into the page cache. Returns at once (a bounds check and a queue
        append, a few microseconds) with a `Ticket`. A later fetch of those rows waits only
        for what is still in flight; a failed read raises at the fetch that needs the rows."""
        return self.prefetcher.submit(rowids)

    def prefetch_tokens(self, token_ids: Any, *, preset: Any, layer: int | None = None) -> Ticket:
        """`prefetch` the rows that ``token_ids`` (``[..., T]``, each row a fresh sequence)
        select under ``preset`` (a preset name or a keygen `Hasher`) for ``layer``. Costs one
        keygen pass (~0.1 us per token) on the calling thread."""
        return self.prefetch(self._hasher(preset).row_ids(token_ids, layer=layer))

    def _hasher(self, preset: Any) -> Any:
        if not isinstance(preset, str):
            return preset
        h = self._hashers.get(preset)
        if h is None:
            h = self._hashers[preset] = keygen_preset(preset)
        return h

    # -- Store-P views -------------------------------------------------------------------------
    def view(self, name: str, **options: Any) -> View:
        """Store-P view ``name`` of this table, opened on first use and kept until `close`
        (reads the manifest and two header pages, no data). ``options`` (hasher, key_hash,
        backend, backend_options) apply at first open; misses are served by this store."""
        with self._views_lock:
            v = self._views.get(name)
            if v is None or v.closed:
                v = open_view(self.db_path, self, name, **options)
                self._views[name] = v
            return v

    # -- RAM tier ----------------------------------------------------------------------------
    def load_hot(self, rows: Any = None, *, limit: int | None = None) -> int:
        """Pin hot rows in the RAM tier, most frequent first: ``rows`` (global ids in priority
        order) or, by default, the hot set `engramdb index` wrote for this table. Reads them
        once through the normal read path. Returns how many rows were pinned."""
        cache = self.cache
        if cache is None:
            raise InvalidArgument(f"table {self.name!r} has no RAM tier: open with ram_budget=")
        if rows is None:
            rows = load_index(self.db_path, self.name).hot_rows
        ids = as_rowids(rows).reshape(-1)
        check_bounds(ids, self.n_rows)
        ids = ids[: min(ids.size, cache.max_hot if limit is None else limit)]
        data = np.empty((ids.size, self.row_bytes), dtype=np.uint8)
        if ids.size:
            self.read_below(ids, data)
        return cache.load_hot(ids, data)

    def stats(self) -> dict[str, Any]:
        """Counters: calls and rows served, the backend's requests, payload ``bytes``,
        ``device_bytes`` (asked of the kernel: aligned spans for O_DIRECT) and syscalls (for
        ``auto``: its buffered and O_DIRECT paths summed, ``io_paths`` per path including the
        mapping, ``choices`` which path served how many batches), and the RAM tier's
        hits/misses."""
        out: dict[str, Any] = {
            "table": self.name,
            "backend": self.backend_name,
            **self.counters(),
        }
        b = self.backend
        if b is not None:
            # auto: its syscall paths (buffered and O_DIRECT) together; "io_paths" adds the
            # gathers from the mapping, path by path.
            out["io"] = b.total_stats(mapped=False).as_dict()
            choices = getattr(b, "choices", None)
            if choices is not None:  # auto: which path served how many batches
                out["choices"] = dict(choices)
                paths: dict[str, Any] = {}
                for part in b.parts():
                    label = "io_uring_direct" if part.direct else part.name
                    paths[label] = part.total_stats().as_dict()
                out["io_paths"] = paths
        cache = self.cache
        if cache is not None:
            out["cache"] = cache.stats.as_dict()
        pf = self._prefetcher
        if pf is not None:
            out["prefetch"] = pf.stats.as_dict()
        return out

    def close(self) -> None:
        """Release the views, the mapping and file descriptors. Later calls raise
        `StoreClosed`."""
        if self.closed:
            return
        with self._views_lock:
            views = list(self._views.values())
            self._views.clear()
        for v in views:
            v.close()
        super().close()
