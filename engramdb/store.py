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

from engramdb.disk.publish import read_manifest
from engramdb.errors import InvalidArgument, TableNotFound
from engramdb.io.tiers import process_rss
from engramdb.keygen.presets import preset_for_table, table_record
from engramdb.layouts.manifest import TableInfo
from engramdb.read.index import load_index
from engramdb.read.prefetch import Ticket
from engramdb.read.raw import raw_layout
from engramdb.read.table import LocalTable
from engramdb.validate import as_rowids, check_bounds
from engramdb.view import View, open_view

__all__ = ["Store"]

_DESCRIBE = ("name", "dtype", "dim", "heads")


def _describe(kwargs: dict[str, Any], *, pop: bool = False) -> dict[str, Any]:
    """The raw-row form's row description (``name``, ``dtype``, ``dim``, ``heads``)."""
    get = kwargs.pop if pop else kwargs.get
    return {k: v for k in _DESCRIBE if (v := get(k, None)) is not None}


def _raw_form(
    db_path: Any, info: Any, rows_per_shard: Any, width: Any, shards: Any
) -> tuple[int, int, int] | None:
    """``(shards, rows_per_shard, width)`` when the call is the raw-row form, else None."""
    if info is not None and not isinstance(info, (int, np.integer)):
        if shards is not None or rows_per_shard is not None or width is not None:
            raise InvalidArgument("pass a TableInfo or shards/rows_per_shard/width, not both")
        return None
    if info is not None and shards is not None:
        raise InvalidArgument(f"shards given twice: {info!r} and shards={shards!r}")
    n = info if info is not None else shards
    if n is None and rows_per_shard is None and width is None:
        return None
    if n is None or rows_per_shard is None or width is None:
        raise InvalidArgument(
            "the raw-row form needs shards, rows_per_shard and width, got "
            f"shards={n!r}, rows_per_shard={rows_per_shard!r}, width={width!r}"
        )
    return int(n), int(rows_per_shard), int(width)


class Store(LocalTable):
    """One table of an open database. Thread-safe for concurrent reads.

    Three ways to open one:

    * ``Store(db_path, info)`` — a table of a built database, from its manifest entry (what
      `Database` does);
    * ``Store(db_path, table="name")`` — the same, reading the manifest itself;
    * ``Store(path, shards, rows_per_shard, width, threads=None)`` (positional or keywords) —
      the published EngramDB Python API's raw row shards: ``shard_{i:03d}.bin`` files with no
      header, row ``r`` in shard ``r // rows_per_shard`` at ``(r % rows_per_shard) * width``
      (see `engramdb.read.raw`). Read in place, no copy, with every read path of a built
      table whatever the geometry: shards that map back to back (one shard, or shard bytes
      a multiple of 4 KiB) open as a built table, any other geometry as an attached one
      (rows read from each shard file in place, its identity checked at open).
      ``threads`` is accepted for compatibility: large gathers size their own worker pool. ``heads=``, ``dtype=``, ``dim=`` and
      ``name=`` describe the rows (defaults: one head, raw bytes, the directory's name).

    Row ids are *global* (``head_offsets[h] + local``) for `fetch` / `fetch_into`, and
    per-head *local* for `lookup_into`. ``fetch`` accepts lists and arrays of ints and
    returns a uint8 ndarray (it supports the buffer protocol, so
    ``np.frombuffer(store.fetch(ids), dtype)`` works). Every call validates first and writes
    the output only after validation passed, so a bad id never leaves a half-written buffer.
    """

    def __init__(
        self,
        db_path: str | os.PathLike[str],
        info: TableInfo | int | None = None,
        rows_per_shard: int | None = None,
        width: int | None = None,
        *,
        table: str | None = None,
        shards: int | None = None,
        threads: int | None = None,
        backend: str = "auto",
        ram_budget: int | str | None = None,
        fds: list[int] | None = None,
        view_fds: dict[str, int] | None = None,
        **backend_options: Any,
    ):
        # Descriptors of the view files the manifest named when the database was opened
        # (path -> fd, owned by this store from here on): `view` opens those very files.
        self._view_fds: dict[str, int] = dict(view_fds or {})
        describe = _describe(backend_options, pop=True)
        raw = _raw_form(db_path, info, rows_per_shard, width, shards)
        if raw is not None:
            if table is not None:
                raise InvalidArgument("table= names a table of a built database, not raw shards")
            info = raw_layout(db_path, *raw, **describe)
        elif info is None:
            if table is None:
                raise InvalidArgument(
                    "Store needs a TableInfo, table=, or shards/rows_per_shard/width"
                )
            manifest = read_manifest(db_path)
            found = manifest.tables.get(table)
            if found is None:
                raise TableNotFound(
                    f"no table {table!r} in {str(db_path)!r} (tables: {sorted(manifest.tables)})"
                )
            info = found
        elif table is not None and table != getattr(info, "name", table):
            raise InvalidArgument(f"table={table!r} differs from the TableInfo {info!r}")
        assert isinstance(info, TableInfo)
        self.threads = threads
        try:
            super().__init__(
                db_path, info, backend=backend, ram_budget=ram_budget, fds=fds, **backend_options
            )
        except BaseException:
            self._close_view_fds()
            raise

    def _close_view_fds(self) -> None:
        fds, self._view_fds = self._view_fds, {}
        for fd in fds.values():
            os.close(fd)

    def _opened(self) -> None:
        self._views: dict[str, View] = {}
        self._views_lock = threading.Lock()
        self._hashers: dict[str, Any] = {}

    @property
    def width(self) -> int:
        """Bytes per row (the published API's name for ``row_bytes``)."""
        return self.row_bytes

    def fetch_one(self, rowid: int) -> np.ndarray:
        """Row ``rowid`` as a ``[width]`` uint8 array (`RowIdOutOfRange` when out of range)."""
        return self.fetch([rowid])[0]

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
            h = self._hashers[preset] = preset_for_table(preset, table_record(self))
        return h

    # -- Store-P views -------------------------------------------------------------------------
    def view(self, name: str, **options: Any) -> View:
        """Store-P view ``name`` of this table, opened on first use and kept until `close`
        (reads the manifest and two header pages, no data). ``options`` (hasher, key_hash,
        backend, backend_options) apply at first open; misses are served by this store."""
        with self._views_lock:
            v = self._views.get(name)
            if v is None or v.closed:
                v = open_view(self.db_path, self, name, held=self._view_fds, **options)
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

    def memory(self) -> dict[str, Any]:
        """Where this table's bytes live (see ``docs/workloads.md``, memory tiers):

        ``table_bytes``; ``page_cache_resident_bytes`` (``mincore``: shared by every process
        that maps the file); ``page_cache_budget`` and ``fits`` (whether the non-resident
        part fits it, the read rule's input); ``rss_file_bytes`` (this process's mapped
        resident pages of the table, ``/proc/self/smaps``: what its ``RssFile`` owes the
        table) and ``rss_file_huge_bytes`` (the part mapped with 2 MiB entries,
        ``FilePmdMapped``: warm gathers through it skip a TLB miss per 4 KiB page);
        ``rss_anon_bytes`` (the RAM tier and this thread's pooled result buffers:
        what its ``RssAnon`` owes the table); ``ram_tier_bytes``; ``rss_budget``;
        ``locked_bytes`` and ``lock`` (the ``lock`` option's state: ``"waiting"`` for a
        finished warm pass, ``"locked"``, ``"off"``, or why not); ``warm`` (the background
        warm's state, reason, bytes read, and the 1 MiB pieces it read in the gaps of a
        decode loop, paced ones beside prefetches) and
        ``process`` (this process's ``VmRSS`` / ``RssAnon`` / ``RssFile`` ...)."""
        tiers = self.tiers
        cache = self.cache
        tier = int(cache.nbytes) if cache is not None else 0
        w = tiers.warm
        rss_file, rss_huge = tiers.mapped_rss_split()
        return {
            "table": self.name,
            "table_bytes": int(self.nbytes),
            "page_cache_resident_bytes": tiers.resident_bytes(),
            "page_cache_budget": tiers.budget(),
            "fits": tiers.fits,
            "rss_file_bytes": rss_file,
            "rss_file_huge_bytes": rss_huge,
            "rss_anon_bytes": tier + self.pool_bytes(),
            "ram_tier_bytes": tier,
            "rss_budget": tiers.rss_budget,
            "locked_bytes": tiers.locked_bytes,
            "lock": tiers.resident_lock.state,
            "warm": {
                "state": w.state,
                "reason": w.reason,
                "bytes_read": w.bytes_read,
                "starts": tiers.warm_starts,
                "gap_pieces": w.gap_pieces,
                "paced_pieces": w.paced_pieces,
                "top_up": w.top_up,
                "seconds": w.seconds,
                # on ``time.monotonic()`` (0.0: no pass yet; ``ended_at`` 0.0 while one runs)
                "started_at": w.started_at,
                "ended_at": w.ended_at,
            },
            "process": process_rss(),
        }

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
        sp = self.split_decision
        out["gather_split"] = {
            "split": sp.split,
            "serial_ns_per_row": sp.ns[False],
            "split_ns_per_row": sp.ns[True],
            "tried": {"serial": sp.tried[False], "split": sp.tried[True]},
        }
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
        self._close_view_fds()
        super().close()
