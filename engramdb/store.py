"""`Store`: read access to one Store-I table.

The warm path is one vectorised gather: the table's shards are mapped back to back, so
``fetch`` is ``np.take(table, ids, axis=0, out=..., mode="clip")`` after a one-pass bounds
check (``mode="clip"`` avoids numpy's temporary copy for ``mode="raise"``; the ids were
validated already, so clipping never changes a row).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engramdb.cache import RowCache
from engramdb.errors import CorruptFile, InvalidArgument, StoreClosed, TruncatedFile
from engramdb.io import Backend, make_backend
from engramdb.io.gather import take_rows
from engramdb.io.mapping import MADV_RANDOM, MADV_SEQUENTIAL, ShardMapping
from engramdb.io.select import AutoBackend
from engramdb.layouts.manifest import TableInfo
from engramdb.plan import assemble, locate, plan_reads
from engramdb.prefetch import Prefetcher, Ticket
from engramdb.units import parse_size
from engramdb.validate import (
    as_rowids,
    check_bounds,
    check_head_bounds,
    check_lookup_ids,
    check_output,
)

_NO_OFFSETS = np.zeros(1, dtype=np.int64)
# RAM tier with a resident table (see `Store._gather_tiered`): batches above this many rows
# bypass the tier; every `_TIER_ADMIT_EVERY`-th bypassed batch admits its first rows.
_TIER_SAMPLE = 128
_TIER_ADMIT_EVERY = 32  # one admission of <= 128 rows costs ~0.3 ms


if TYPE_CHECKING:
    from engramdb.view import View


def _take_serial(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    np.take(table, ids, axis=0, out=out, mode="clip")


def open_shards(db: Path, info: TableInfo) -> list[int]:
    """Open every shard read-only and check its size against the manifest."""
    fds: list[int] = []
    try:
        for s in info.shards:
            path = db / s.path
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise TruncatedFile(f"table {info.name!r}: shard {s.path!r} is missing") from None
            fds.append(fd)
            size = os.fstat(fd).st_size
            if size < s.bytes:
                raise TruncatedFile(
                    f"table {info.name!r}: shard {s.path!r} is truncated: {size} bytes, "
                    f"manifest says {s.bytes} (rows from {s.first_row + size // info.row_bytes} "
                    "are missing)"
                )
            if size > s.bytes:
                raise CorruptFile(
                    f"table {info.name!r}: shard {s.path!r} has {size} bytes, manifest says "
                    f"{s.bytes}"
                )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class Store:
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
        self._db = Path(db_path)
        self.info = info
        self.name = info.name
        self.row_bytes = info.row_bytes
        self.n_rows = info.n_rows
        self.heads = np.asarray(info.heads, dtype=np.int64)
        self.head_offsets = info.head_offsets
        self.dtype = info.dtype
        self.dim = info.dim
        self._fds = open_shards(self._db, info)
        try:
            self._mapping: ShardMapping | None = ShardMapping(
                self._fds, [s.bytes for s in info.shards]
            )
            self._table: np.ndarray | None = self._mapping.array(self.n_rows, self.row_bytes)
            for fd in self._fds:
                # The table is read at random: no read-ahead on the syscall paths either.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            flat = self._table.reshape(-1)
            regions = {}
            start = 0
            for fd, sh in zip(self._fds, info.shards):
                regions[fd] = flat[start : start + sh.bytes]
                start += sh.bytes
            self._backend: Backend | None = make_backend(
                backend, regions=regions, **backend_options
            )
        except BaseException:
            if getattr(self, "_mapping", None) is not None:
                self._mapping.close()
            for fd in self._fds:
                os.close(fd)
            raise
        self.backend_name = backend
        b = self._backend
        self._unsampled_rows = b.min_sampled if isinstance(b, AutoBackend) else 0
        self._fd_array = np.asarray(self._fds, dtype=np.int32)
        self._scratch = threading.local()
        self._counters = {"fetch_calls": 0, "rows_fetched": 0, "small_gathers": 0}
        self._cache: RowCache | None = None
        self._views: dict[str, View] = {}
        self._views_lock = threading.Lock()
        self._prefetcher: Prefetcher | None = None
        self._bypasses = 0
        self._prefetch_lock = threading.Lock()
        self._hashers: dict[str, Any] = {}
        if ram_budget is not None:
            self._cache = RowCache(self.row_bytes, parse_size(ram_budget), self.n_rows)

    # -- properties --------------------------------------------------------------------------
    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def closed(self) -> bool:
        return self._table is None

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    def _array(self) -> np.ndarray:
        t = self._table
        if t is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        return t

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_rows:,} rows x {self.row_bytes} B"
        return f"<Store {self.name!r} {state}, {self.n_heads} heads>"

    # -- reads -------------------------------------------------------------------------------
    def _scratch_bytes(self, name: str, nbytes: int) -> np.ndarray:
        """A reused per-thread buffer (fresh allocations fault pages in: expensive here)."""
        buf = getattr(self._scratch, name, None)
        if buf is None or buf.size < nbytes:
            buf = np.zeros(max(nbytes, 1 << 16), dtype=np.uint8)
            setattr(self._scratch, name, buf)
        return buf[:nbytes]

    def _choose(self, flat: np.ndarray) -> Backend:
        """The backend's pick for a batch of validated ids (it sees an evenly spread sample)."""
        backend = self._backend
        assert backend is not None
        sample = flat[:: max(1, flat.size // 16)]
        shard, off = locate(sample, self.info.geometry)
        return backend.choose(self._fd_array[shard], off, self.row_bytes, batch_rows=flat.size)

    def _read_below(
        self,
        flat: np.ndarray,
        out2d: np.ndarray,
        *,
        serial: bool = False,
        chosen: Backend | None = None,
    ) -> None:
        """Rows of validated ids from the page cache or the device, through the backend.

        The backend picks the path per batch (``auto``: mmap gather for resident data,
        io_uring/preadv for cold data); syscall paths dedupe and sort the reads. ``serial``
        keeps a large mapped gather on this thread (callers that run their own workers);
        ``chosen`` is the backend's pick when the caller already asked (`_choose`)."""
        take = _take_serial if serial else take_rows
        table = self._array()
        backend = self._backend
        assert backend is not None
        if not backend.wants_plan and backend.name == "mmap":
            take(table, flat, out2d)
            return
        n = flat.size
        if chosen is None and n < self._unsampled_rows and self._mapped_state():
            # The rule would not sample a batch this small in the mapped state (a stray fault
            # costs it less than the check): skip locating it, ~3 us of a 16-row decode step.
            chosen = backend.choose(self._fd_array[:1], _NO_OFFSETS, batch_rows=n)
            if not chosen.wants_plan:  # still mapped (another thread may have moved the state)
                t0 = time.perf_counter()
                take(table, flat, out2d)
                backend.feedback(chosen, n, time.perf_counter() - t0)
                return
        chosen = self._choose(flat) if chosen is None else chosen
        t0 = time.perf_counter()
        if not chosen.wants_plan:
            take(table, flat, out2d)
        else:
            plan = plan_reads(flat, self.info.geometry, validated=True)
            scratch = self._scratch_bytes("reads", plan.scratch_bytes)
            chosen.read(
                self._fd_array[plan.shard], plan.offset, plan.length, scratch, plan.dest_offset
            )
            assemble(plan, scratch, out2d)
        backend.feedback(chosen, n, time.perf_counter() - t0)

    def _mapped_state(self) -> bool:
        """Whether reads are served from the mapping: the mmap backend, or `auto` in its
        mapped (resident) state. Cheap: attribute reads only."""
        b = self._backend
        if isinstance(b, AutoBackend):
            return b.mapped is not None and b._state is b.mapped and not b._suspect
        return b is not None and b.name == "mmap"

    def _resident_state(self) -> bool:
        """Whether the `auto` read rule last saw this table's pages resident (its mapped
        state). Fixed backends say nothing about residency: False."""
        b = self._backend
        return isinstance(b, AutoBackend) and b.mapped is not None and b._state is b.mapped

    def _gather_tiered(self, cache: RowCache, flat: np.ndarray, out2d: np.ndarray) -> None:
        """A large batch through the RAM tier, or past it while the table is resident.

        While the `auto` rule serves the table from the page cache (its mapped state) a tier
        hit saves nothing — one gather from the mapping is cheaper than probing the tier and
        scattering hits and misses (~7x slower on a zipfian batch, ~10x on a uniform one) — so
        the batch is read below in one pass, and every `_TIER_ADMIT_EVERY` such batches the
        misses among its first `_TIER_SAMPLE` ids are admitted, so the tier learns what is
        popular before the page cache lets go of the table. Otherwise (reads may go to the
        device, or the backend says nothing about residency) every hit saves a read: the
        batch is served through the tier."""
        chosen = None
        if self._resident_state():
            # The rule samples a large batch's pages anyway: ask it before deciding, so the
            # first batch after the table went cold already goes through the tier.
            chosen = self._choose(flat)
        if chosen is None or chosen.wants_plan:
            self._fill_misses(cache, flat, out2d, cache.get_into(flat, out2d))
            return
        self._read_below(flat, out2d, chosen=chosen)
        self._bypasses += 1
        if self._bypasses % _TIER_ADMIT_EVERY == 0:
            head = flat[:_TIER_SAMPLE]
            new = ~cache.present(head)  # the presence bitmap: one gather, no hash probes
            cache.admit(head[new], out2d[: head.size][new])
        cache.stats.bypassed += flat.size

    def _fill_misses(
        self, cache: RowCache, flat: np.ndarray, out2d: np.ndarray, miss: np.ndarray
    ) -> None:
        n_miss = int(np.count_nonzero(miss))
        if n_miss:
            missed = flat[miss]
            rows = self._scratch_bytes("miss", n_miss * self.row_bytes).reshape(
                n_miss, self.row_bytes
            )
            self._read_below(missed, rows)
            out2d[miss] = rows
            cache.admit(missed, rows)

    def _gather(self, flat: np.ndarray, out2d: np.ndarray, *, serial: bool = False) -> None:
        pf = self._prefetcher
        if pf is not None and pf.busy:
            pf.wait_for(flat)  # rows still in flight, or a failed prefetch of these rows
        cache = self._cache
        if cache is None:
            self._read_below(flat, out2d, serial=serial)
        elif flat.size > _TIER_SAMPLE:
            self._gather_tiered(cache, flat, out2d)
        else:
            self._fill_misses(cache, flat, out2d, cache.get_into(flat, out2d))
        self._counters["fetch_calls"] += 1
        self._counters["rows_fetched"] += flat.size

    def _gather_small(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """`_gather` for a decode step's few validated ids: one ``np.take`` from the mapping
        while the read rule is in its mapped state and nothing else (RAM tier, prefetches in
        flight) is involved; a slow gather (page faults) still reaches the rule's feedback so
        an evicted table is noticed. Otherwise the general path."""
        b = self._backend
        pf = self._prefetcher
        if (
            self._cache is not None
            or (pf is not None and pf.busy)
            or flat.size >= self._unsampled_rows
            or not self._mapped_state()
        ):
            self._gather(flat, out2d)
            return
        pc = time.perf_counter
        t0 = pc()
        np.take(self._array(), flat, axis=0, out=out2d, mode="clip")
        dt = pc() - t0
        if isinstance(b, AutoBackend) and dt * 1e6 > b.slow_us * flat.size:
            b.feedback(b.mapped, flat.size, dt)  # type: ignore[arg-type]
        c = self._counters
        c["fetch_calls"] += 1
        c["rows_fetched"] += flat.size
        c["small_gathers"] += 1

    def _gather_resident(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Gather validated ids known to be in the page cache (a finished page-cache
        prefetch) straight from the mapping."""
        take_rows(self._array(), flat, out2d)
        self._counters["fetch_calls"] += 1
        self._counters["rows_fetched"] += flat.size
        self._counters["prefetched_gathers"] = self._counters.get("prefetched_gathers", 0) + 1

    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids`` (any integer array or list), shape
        ``rowids.shape + (row_bytes,)``, uint8. Allocates the result; see `fetch_into`."""
        table = self._array()
        ids = as_rowids(rowids)
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        if flat.size:
            del table
            self._gather(flat, out.reshape(-1, self.row_bytes))
        return out

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """Write the rows of global ``rowids`` into ``out`` (writable C-contiguous uint8 of
        shape ``rowids.shape + (row_bytes,)``). No allocation on the warm path."""
        self._array()
        ids = as_rowids(rowids)
        check_output(out, ids.shape + (self.row_bytes,))
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        if flat.size:
            self._gather(flat, out.reshape(-1, self.row_bytes))
        return out

    def _global_scratch(self, n: int) -> np.ndarray:
        buf = getattr(self._scratch, "ids", None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1024), dtype=np.int64)
            self._scratch.ids = buf
        return buf[:n]

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> None:
        """Mooncake-style lookup: ``row_ids`` int64 C-contiguous ``[B, L, H]`` of per-head
        *local* ids (last axis = head), ``out`` writable C-contiguous uint8
        ``[B, L, H, row_bytes]``. No implicit conversions; an empty batch is a no-op."""
        self._array()
        check_lookup_ids(row_ids, self.n_heads)
        check_output(out, row_ids.shape + (self.row_bytes,))
        if row_ids.size == 0:
            return
        check_head_bounds(row_ids, self.heads)
        g = self._global_scratch(row_ids.size)
        np.add(
            row_ids.reshape(-1, self.n_heads), self.head_offsets, out=g.reshape(-1, self.n_heads)
        )
        self._gather(g, out.reshape(-1, self.row_bytes))

    def to_global(self, local_ids: np.ndarray) -> np.ndarray:
        """Global ids for per-head local ids ``[..., H]`` (validated)."""
        local = np.ascontiguousarray(as_rowids(local_ids))
        if local.ndim == 0 or local.shape[-1] != self.n_heads:
            from engramdb.errors import ShapeMismatch

            raise ShapeMismatch(
                f"local ids need a last axis of {self.n_heads} heads, got {local.shape}"
            )
        check_head_bounds(local, self.heads)
        return local + self.head_offsets

    # -- prefetch ----------------------------------------------------------------------------
    @property
    def prefetcher(self) -> Prefetcher:
        """The background reader of this table (created on first use; see `prefetch`)."""
        pf = self._prefetcher
        if pf is None:
            with self._prefetch_lock:
                self._array()
                if self._prefetcher is None:
                    self._prefetcher = Prefetcher(self)
                pf = self._prefetcher
        return pf

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
            from engramdb import keygen

            h = self._hashers[preset] = keygen.preset(preset)
        return h

    # -- residency ---------------------------------------------------------------------------
    def populate(self, *, threads: int = 2, progress: Callable[[int], None] | None = None) -> None:
        """Fault the whole table into the page tables (``MADV_POPULATE_READ``): reads it from
        the device if cold, in ``threads`` background threads (the GIL is released).
        Afterwards warm gathers run at memory speed. ``progress`` gets byte counts."""
        if self._mapping is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        # With MADV_RANDOM a cold populate reads page by page (~60 MB/s here); sequential
        # advice lets read-ahead stream it at device speed.
        self._mapping.advise(MADV_SEQUENTIAL)
        try:
            self._mapping.populate(threads=threads, progress=progress)
        finally:
            self._mapping.advise(MADV_RANDOM)

    def residency(self) -> float:
        """Fraction of the table's pages in the page cache (0..1), via ``mincore``."""
        if self._mapping is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        return self._mapping.residency()

    # -- Store-P views -------------------------------------------------------------------------
    def view(self, name: str, **options: Any) -> View:
        """Store-P view ``name`` of this table, opened on first use and kept until `close`
        (reads the manifest and two header pages, no data). ``options`` (hasher, key_hash,
        backend, backend_options) apply at first open; misses are served by this store."""
        from engramdb.view import open_view  # engramdb.view imports this module

        with self._views_lock:
            v = self._views.get(name)
            if v is None or v.closed:
                v = open_view(self._db, self, name, **options)
                self._views[name] = v
            return v

    # -- RAM tier ----------------------------------------------------------------------------
    @property
    def cache(self) -> RowCache | None:
        """The RAM tier (``ram_budget=`` at open), or None."""
        return self._cache

    def load_hot(self, rows: Any = None, *, limit: int | None = None) -> int:
        """Pin hot rows in the RAM tier, most frequent first: ``rows`` (global ids in priority
        order) or, by default, the hot set `engramdb index` wrote for this table. Reads them
        once through the normal read path. Returns how many rows were pinned."""
        if self._cache is None:
            raise InvalidArgument(f"table {self.name!r} has no RAM tier: open with ram_budget=")
        if rows is None:
            from engramdb.index import load_index

            rows = load_index(self._db, self.name).hot_rows
        ids = as_rowids(rows).reshape(-1)
        check_bounds(ids, self.n_rows)
        ids = ids[: min(ids.size, self._cache.max_hot if limit is None else limit)]
        data = np.empty((ids.size, self.row_bytes), dtype=np.uint8)
        if ids.size:
            self._read_below(ids, data)
        return self._cache.load_hot(ids, data)

    def stats(self) -> dict[str, Any]:
        """Counters: calls and rows served, the backend's requests/bytes/syscalls (and for
        ``auto`` which path served how many batches), and the RAM tier's hits/misses."""
        out: dict[str, Any] = {"table": self.name, "backend": self.backend_name, **self._counters}
        b = self._backend
        if b is not None:
            out["io"] = b.stats.as_dict()
            choices = getattr(b, "choices", None)
            if choices is not None:  # auto: which path served how many batches
                out["choices"] = dict(choices)
                cold = getattr(b, "cold", None)
                if cold is not None:
                    out["io"] = cold.stats.as_dict()
        if self._cache is not None:
            out["cache"] = self._cache.stats.as_dict()
        if self._prefetcher is not None:
            out["prefetch"] = self._prefetcher.stats.as_dict()
        return out

    def close(self) -> None:
        """Release the mapping and file descriptors. Later calls raise `StoreClosed`."""
        if self._table is None:
            return
        for v in self._views.values():
            v.close()
        self._views.clear()
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._table = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
