"""`LocalTable`: one Store-I table read from local shard files — the engine under `Store`.

It owns the shards' descriptors, their back-to-back mapping, the I/O backend and its read
rule, the RAM tier and the prefetcher, and offers the package a *trusted* read API for ids
that were validated already (keygen output for a table that fits, a prefetch ticket, a
checked batch): `gather`, `gather_small`, `gather_resident`, `read_below`, plus `scratch`,
`mapped_state`, `resident_state`, `fd_array`, `array` and `db_path`. Workloads (`Decoder`,
`engramdb.stream`, the prefetcher) use these names; callers with unchecked ids use the
`RowTable` surface (`fetch`, `fetch_into`, `lookup_into`).

The warm path is one vectorised gather: the shards are mapped back to back, so a gather is
one `engramdb.io.gather.take_one` after a one-pass bounds check: the compiled prefetching
gather for 64 KiB or more, else ``np.take(table, ids, axis=0, out=..., mode="clip")``
(``mode="clip"`` avoids numpy's temporary copy for ``mode="raise"``; the ids were validated
already, so clipping never changes a row).

Why this module is past 600 lines: the per-batch read path (`read_below`, the fast paths of
`fetch_into` / `gather_small`), the RAM-tier policy and the memory policy (`io.tiers`) share
one state machine — the read rule's state, the mapping, the segments of an attached table and
the counters — and each step of a batch consults all of them; split across modules they would
have to reach into each other's private state.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.disk.files import open_shards
from engramdb.errors import InvalidArgument, InvalidLayout, StoreClosed
from engramdb.io import Backend, make_backend
from engramdb.io.foreground import FOREGROUND
from engramdb.io.gather import SplitDecision, take_one
from engramdb.io.mapping import ShardMapping
from engramdb.io.residency import mapped_count, resident_count, spread_pages
from engramdb.io.resident_lock import parse_lock
from engramdb.io.select import AutoBackend
from engramdb.io.tiers import MappedTiers, parse_budget
from engramdb.layouts.geometry import TableGeometry
from engramdb.layouts.manifest import TableInfo
from engramdb.read.attached import SourceSegments
from engramdb.read.cache import BufferPool, RowCache
from engramdb.read.plan import ReadPlan, assemble, locate, plan_reads
from engramdb.read.prefetch import Prefetcher
from engramdb.table_api import RowTable, TableSchema
from engramdb.units import parse_size
from engramdb.validate import (
    MAX_ROWS_PER_CALL,
    SmallBounds,
    check_batch,
    check_bounds,
    unsigned_max,
)

__all__ = ["LocalTable"]

_NO_OFFSETS = np.zeros(1, dtype=np.int64)
# RAM tier with a resident table (see `LocalTable._gather_tiered`): batches above this many
# rows bypass the tier; every `_TIER_ADMIT_EVERY`-th bypassed batch admits its first rows.
_TIER_SAMPLE = 128
_TIER_ADMIT_EVERY = 32  # one admission of <= 128 rows costs ~0.3 ms


#: Cold batches up to this many rows count as foreground reads (`engramdb.io.foreground`).
FOREGROUND_ROWS = 4096
_SMALL = 32  # a decode step's ids: checked as integer lanes (`SmallBounds`), no reduction
#: Default rate bound of the background warm (first cold read, keep-warm), bytes per second:
#: about this machine's disk speed (1.5-1.9 GB/s measured), so a re-warm after a loss takes
#: about as long as `warm` itself; on a faster NVMe device it leaves the rest to foreground
#: reads (which, while the pass runs, read O_DIRECT).
WARM_RATE = "2G"


_clock = time.perf_counter
_I64 = np.dtype(np.int64)
_U8 = np.dtype(np.uint8)


class LocalTable(RowTable):
    """One table of a local database. Thread-safe for concurrent reads.

    Opening maps the shards (no data is read) and builds the backend; ``ram_budget`` (bytes
    or ``"8G"``) adds a RAM tier. `close` releases the mapping, the descriptors, the backend
    and the prefetcher; later reads raise `StoreClosed`.
    """

    def __init__(
        self,
        db_path: str | os.PathLike[str],
        info: TableInfo,
        *,
        backend: str = "auto",
        ram_budget: int | str | None = None,
        page_cache_budget: int | str | None = None,
        rss_budget: int | str | None = None,
        keep_warm: bool = False,
        warm_rate: int | str = WARM_RATE,
        background_warm: bool = True,
        lock: bool | str = "auto",
        fds: list[int] | None = None,
        **backend_options: Any,
    ):
        RowTable.__init__(self, TableSchema.of(info))
        lock = parse_lock(lock)
        pc_budget = parse_budget(page_cache_budget)
        rss = parse_budget(rss_budget, what="rss_budget")
        rate = parse_budget(warm_rate, what="warm_rate")
        if rate is None or rate <= 0:
            raise InvalidArgument(
                f"warm_rate must be a positive size per second, got {warm_rate!r}"
            )
        direct_forced = backend == "auto" and backend_options.get("direct") is True
        self._db = Path(db_path)
        self.info = info
        self.geometry: TableGeometry = info.geometry
        # ``fds``: the shards (attached: the identity-checked source files) already opened by
        # `Database` at open time; this table owns them from here on (closes them on error
        # and in `close`)
        self._fds = open_shards(self._db, info) if fds is None else list(fds)
        self._mapping: ShardMapping | SourceSegments | None = None
        #: An attached table's source mappings (None for a built table).
        self._segments: SourceSegments | None = None
        try:
            for fd in self._fds:
                # The table is read at random: no read-ahead on the syscall paths either.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            if info.attached is not None:
                seg = self._segments = SourceSegments(info, self._fds)
                self._mapping = seg
                # several columns / runs are not one array: `array()` refuses, reads use `seg`
                one = seg.single
                self._table: np.ndarray | None = (
                    one if one is not None else np.zeros((0, self.row_bytes), np.uint8)
                )
                regions = seg.regions()
            else:
                self._mapping = ShardMapping(self._fds, [s.bytes for s in info.shards])
                self._table = self._mapping.array(self.n_rows, self.row_bytes)
                flat = self._table.reshape(-1)
                regions = {}
                start = 0
                for fd, sh in zip(self._fds, info.shards):
                    regions[fd] = flat[start : start + sh.bytes]
                    start += sh.bytes
            self._backend: Backend | None = make_backend(
                backend, regions=regions, **backend_options
            )
            # The memory policy watches one back-to-back mapping: built tables. An attached
            # table's rows sit inside its source files, read through its segments instead.
            self._tiers: MappedTiers | None = None
            wide = self._segments.warm_region() if self._segments is not None else None
            if wide is not None:  # attached: the range of the source holding the rows
                fd, off, nbytes, addr = wide
                self._tiers = MappedTiers(
                    addr,
                    nbytes,
                    [(fd, nbytes, off)],
                    budget=pc_budget,
                    rate=float(rate),
                    rss_budget=rss,
                    keep_warm=keep_warm,
                    background=background_warm and backend == "auto" and not direct_forced,
                    lock=lock,
                )
            elif isinstance(self._mapping, ShardMapping):
                self._tiers = MappedTiers(
                    self._mapping.address,
                    self._mapping.length,
                    [(fd, sh.bytes) for fd, sh in zip(self._fds, info.shards)],
                    budget=pc_budget,
                    rate=float(rate),
                    rss_budget=rss,
                    keep_warm=keep_warm,
                    background=background_warm and backend == "auto" and not direct_forced,
                    lock=lock,
                )
        except BaseException:
            b0 = getattr(self, "_backend", None)
            if b0 is not None:
                b0.close()
            if self._mapping is not None:
                self._mapping.close()
            for fd in self._fds:
                os.close(fd)
            raise
        self.backend_name = backend
        b = self._backend
        self._auto: AutoBackend | None = b if isinstance(b, AutoBackend) else None
        if self._auto is not None:
            # A table that fits the page-cache budget is read buffered so reading warms it.
            fits = self._tiers.fits if self._tiers is not None else True
            self._auto.fits = fits and not direct_forced
            # An RSS budget below the table: never serve from the mapping (its gathers would
            # fault the table into this process's RSS); resident rows come by buffered reads.
            mapped_bytes = self._tiers.length if self._tiers is not None else self.nbytes
            self._auto.serve_mapped = rss is None or rss >= mapped_bytes
            if self._tiers is not None:
                self._tiers.warm.on_done = self._warm_done
                warm = self._tiers.warm
                self._auto.warming = lambda: warm.running
                if self._auto.serve_mapped:
                    self._auto.on_slow_mapped = self._tiers.warm_once
                    self._auto.on_mapped = self._first_mapped
        self._split = SplitDecision()
        self._heads_u64 = self.heads.astype(np.uint64)
        self._pool = BufferPool()
        self._unsampled_rows = b.min_sampled if isinstance(b, AutoBackend) else 0
        self._mmap_only = b.name == "mmap"
        self._base = self._mapping.address if isinstance(self._mapping, ShardMapping) else 0
        self._fd_array = np.asarray(self._fds, dtype=np.int32)
        self._scratch = threading.local()
        self._counters = {
            "fetch_calls": 0,
            "rows_fetched": 0,
            "small_gathers": 0,
            "prefetched_gathers": 0,
            "step_rows": 0,
            "step_device_bytes": 0,
        }
        self._fast_counts = {"calls": 0, "rows": 0}  # the mapped fast paths
        self._small_bounds = SmallBounds(self.n_rows)  # the decode-step bounds check
        self._cache: RowCache | None = None
        self._prefetcher: Prefetcher | None = None
        #: No RAM tier, and a built table or an attached one whose rows are one mapped array:
        #: the mapped fast paths may run (`fetch_into` / `lookup_into` also need no
        #: prefetcher: rows may be in flight). An attached table's fast path first checks its
        #: source file's size (`_guard`: one fstat, truncation raises instead of SIGBUS).
        seg0 = self._segments
        one0 = seg0.single if seg0 is not None else None
        self._plain = ram_budget is None and (seg0 is None or one0 is not None)
        self._guard = seg0.guard_mapped if seg0 is not None else None
        #: Where row 0 of the fast paths' array sits (its sampled pages' addresses).
        self._fast_base = (
            self._base if seg0 is None else (int(one0.ctypes.data) if one0 is not None else 0)
        )
        #: ``(address of row 0, stride)`` of the pages the read rule's mapped-state check
        #: samples without locating ids: the table's rows, or an attached table's widest
        #: column when it is one run (None: the rule locates a sample instead).
        self._sample_at: tuple[int, int] | None = (
            (self._fast_base, self.row_bytes)
            if self._fast_base
            else (seg0.sample_layout() if seg0 is not None else None)
        )
        #: No RAM tier, and an attached table whose rows are assembled from several columns,
        #: the widest one run: `fetch_into`'s large-batch fast path gathers through its
        #: segments (the rule's residency sample reads that run's pages).
        self._cols_fast = (
            ram_budget is None and seg0 is not None and one0 is None and self._sample_at is not None
        )
        # The table's lock where it covers every row (a built table, or an attached one
        # whose rows are one run) tells the read rule when no page can have gone
        # (`AutoBackend.locked`): no residency samples, no doubt after a slow gather.
        if (
            self._auto is not None
            and self._tiers is not None
            and (seg0 is None or one0 is not None)
        ):
            held = self._tiers.resident_lock
            self._auto.locked = lambda: held.whole
        self._bypasses = 0
        self._prefetch_lock = threading.Lock()
        if ram_budget is not None:
            self._cache = RowCache(self.row_bytes, parse_size(ram_budget), self.n_rows)
        self._opened()

    def _opened(self) -> None:
        """What a subclass sets up once the table is open (the constructor is shared)."""

    # -- state -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._table is None

    def check_open(self) -> None:
        """Raise `StoreClosed` if the table was closed (one attribute test)."""
        if self._table is None:
            raise StoreClosed(f"table {self.name!r} is closed")

    @property
    def db_path(self) -> Path:
        """The database directory this table was opened from."""
        return self._db

    @property
    def fd_array(self) -> np.ndarray:
        """The shards' open descriptors (int32, shard order): index it with a plan's
        ``shard`` array to get each read's descriptor. Owned by the table; do not close."""
        return self._fd_array

    @property
    def backend(self) -> Backend | None:
        """The I/O backend (None once closed)."""
        return self._backend

    @property
    def cache(self) -> RowCache | None:
        """The RAM tier (``ram_budget=`` at open), or None."""
        return self._cache

    def array(self) -> np.ndarray:
        """The mapped table, a read-only ``[n_rows, row_bytes]`` uint8 view (valid until
        `close`; touching a cold page faults it in). Raises `StoreClosed` once closed."""
        t = self._table
        if t is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        seg = self._segments
        if seg is not None:
            seg.guard_mapped()  # a source truncated while open: TruncatedFile, not SIGBUS
            if seg.single is None:
                raise InvalidLayout(
                    f"attached table {self.name!r} assembles rows from several source "
                    "tensors: it is not one mapped array (use fetch / gather)"
                )
        return t

    def array_guard(self) -> tuple[int, int] | None:
        """For an attached table that is one mapped array: ``(fd, size)``, the source file
        a reader of `array()` must find still ``size`` bytes long before each read (what
        `array()` itself checks: a read of a truncated file's mapping raises SIGBUS; the
        descriptor is the table's, valid until `close`). None otherwise."""
        seg = self._segments
        return None if seg is None else seg.single_guard()

    @property
    def attached(self) -> bool:
        """Whether the table reads its rows in place from source files (`engramdb.attach`)."""
        return self._segments is not None

    def plan_for(self, flat: np.ndarray) -> ReadPlan:
        """The syscall reads of validated ids ``flat`` (read them into a scratch of
        ``plan.scratch_bytes`` with descriptors ``fd_array[plan.shard]``, then `assemble`)."""
        seg = self._segments
        if seg is not None:
            return seg.plan(flat)  # guards the files it reads
        return plan_reads(flat, self.geometry, validated=True)

    def take_mapped(self, flat: np.ndarray, out2d: np.ndarray, *, serial: bool = False) -> None:
        """Rows of validated ids gathered from the mapping (faults in cold pages)."""
        seg = self._segments
        if seg is not None and seg.single is None:
            self.check_open()
            seg.take(flat, out2d)
            return
        self._take_mapped(self.array(), flat, out2d, serial=serial)

    def scratch(self, name: str, nbytes: int) -> np.ndarray:
        """A reused per-thread uint8 buffer of ``nbytes`` for the caller's ``name`` (fresh
        allocations fault pages in: expensive here). Valid until the same thread asks for
        ``name`` again."""
        buf = getattr(self._scratch, name, None)
        if buf is None or buf.size < nbytes:
            buf = np.zeros(max(nbytes, 1 << 16), dtype=np.uint8)
            setattr(self._scratch, name, buf)
        return buf[:nbytes]

    def mapped_state(self) -> bool:
        """Whether reads are served from the mapping: the mmap backend, or `auto` in its
        mapped (resident) state. Cheap: attribute reads only."""
        a = self._auto
        if a is not None:
            return a.mapped_ok
        return self._mmap_only and self._backend is not None

    def warming(self) -> bool:
        """Whether the table's background warm pass is reading it from the device now
        (attribute reads): a pass over a table already in the page cache (after ``engramdb
        warm`` in another process) only fills this process's page tables, and rows sampled
        resident then are resident."""
        t = self._tiers
        return t is not None and t.warm.running and t.warm.reading

    def resident_state(self) -> bool:
        """Whether the `auto` read rule last saw this table's pages resident (its mapped
        state). Fixed backends say nothing about residency: False."""
        a = self._auto
        return a is not None and a.in_mapped_state

    # -- the trusted read API (validated ids) ------------------------------------------------
    def _choose(self, flat: np.ndarray) -> Backend:
        """The backend's pick for a batch of validated ids (it sees an evenly spread sample)."""
        backend = self._backend
        assert backend is not None
        sample = flat[:: max(1, flat.size // 16)]
        seg = self._segments
        shard, off = locate(sample, self.geometry) if seg is None else seg.where(sample)
        return backend.choose(self._fd_array[shard], off, self.row_bytes, batch_rows=flat.size)

    def read_below(
        self,
        flat: np.ndarray,
        out2d: np.ndarray,
        *,
        serial: bool = False,
        chosen: Backend | None = None,
    ) -> None:
        """Rows of validated ids from the page cache or the device, through the backend
        (past the RAM tier and the prefetcher; no counters).

        The backend picks the path per batch (``auto``: mmap gather for resident data,
        io_uring/preadv for cold data); syscall paths dedupe and sort the reads. ``serial``
        keeps a large mapped gather on this thread (callers that run their own workers);
        ``chosen`` is the backend's pick when the caller already asked for it."""
        seg = self._segments
        if seg is not None and seg.single is None:
            self.check_open()  # rows assembled from several sources: no one mapped array
            table = self._table
            assert table is not None
        else:
            table = self.array()
        backend = self._backend
        assert backend is not None
        if not backend.wants_plan and backend.name == "mmap":
            self._take_mapped(table, flat, out2d, serial=serial)
            return
        n = flat.size
        a = self._auto
        if (
            chosen is None
            and a is not None
            and a.mapped_ok
            and n >= self._unsampled_rows
            and self._sample_at is not None
        ):
            # The rule's mapped-state check, without locating ids: rows sit at
            # ``row * stride`` from one address (the back-to-back mapping, or an attached
            # table's widest column), so 1 + n // 65536 spread ids give their page
            # addresses directly (one mincore each, ~2 us).
            if self._sampled_resident(flat, min(a.samples, 1 + n // 65536)):
                a.count_mapped()
                self._take_mapped(table, flat, out2d, serial=serial, chosen=a.mapped)
                return
            # a miss: the rule samples again below and leaves its mapped state
        if chosen is None and n < self._unsampled_rows and self.mapped_state():
            # The rule would not sample a batch this small in the mapped state (a stray fault
            # costs it less than the check): skip locating it, ~3 us of a 16-row decode step.
            chosen = backend.choose(self._fd_array[:1], _NO_OFFSETS, batch_rows=n)
            if not chosen.wants_plan:  # still mapped (another thread may have moved the state)
                self._take_mapped(table, flat, out2d, serial=True, chosen=chosen)
                return
        chosen = self._choose(flat) if chosen is None else chosen
        if not chosen.wants_plan:
            self._take_mapped(table, flat, out2d, serial=serial, chosen=chosen)
            return
        tiers = self._tiers
        if tiers is not None and tiers.fits and tiers.on_cold_read() and a is not None:
            # a cold read of a table that fits started the background warm: this batch and
            # the cold ones after it read O_DIRECT while the pass fills the page cache
            chosen = a.warm_started(chosen)
        t0 = time.perf_counter()
        plan = self.plan_for(flat)
        scratch = self.scratch("reads", plan.scratch_bytes)
        # a decode step's batch: the background warm reads around it
        with FOREGROUND.reading() if n <= FOREGROUND_ROWS else nullcontext():
            chosen.read(
                self._fd_array[plan.shard], plan.offset, plan.length, scratch, plan.dest_offset
            )
        assemble(plan, scratch, out2d)
        if seg is not None:
            seg.fill_resident(flat, out2d)  # attached: the columns kept in RAM, not read
        backend.feedback(chosen, n, time.perf_counter() - t0)

    def _take_mapped(
        self,
        table: np.ndarray,
        flat: np.ndarray,
        out2d: np.ndarray,
        *,
        serial: bool = False,
        chosen: Backend | None = None,
    ) -> None:
        """One gather from the mapping; a large one is split across the gather pool only
        while observed timings say splitting pays (`SplitDecision`)."""
        seg = self._segments
        if seg is not None and seg.single is None:
            t0 = time.perf_counter()
            seg.take(flat, out2d)  # one gather per source column
            dt = time.perf_counter() - t0
        elif serial:
            t0 = time.perf_counter()
            take_one(table, flat, out2d)
            dt = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            self._split.take(table, flat, out2d)
            dt = time.perf_counter() - t0
        backend = self._backend
        if chosen is not None and backend is not None:
            backend.feedback(chosen, flat.size, dt)

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
        if self.resident_state():
            # The rule samples a large batch's pages anyway: ask it before deciding, so the
            # first batch after the table went cold already goes through the tier.
            chosen = self._choose(flat)
        if chosen is None or chosen.wants_plan:
            self._fill_misses(cache, flat, out2d, cache.get_into(flat, out2d))
            return
        self.read_below(flat, out2d, chosen=chosen)
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
            rows = self.scratch("miss", n_miss * self.row_bytes).reshape(n_miss, self.row_bytes)
            self.read_below(missed, rows)
            out2d[miss] = rows
            cache.admit(missed, rows)

    def gather(self, flat: np.ndarray, out2d: np.ndarray, *, serial: bool = False) -> None:
        """Rows of validated global ids ``flat`` into ``out2d`` (see `RowTable.gather`):
        waits for prefetches of these rows still in flight (raising a failed one's error),
        serves through the RAM tier when there is one, else `read_below`; counted in
        ``stats()``. ``serial`` keeps a large mapped gather on this thread."""
        pf = self._prefetcher
        if pf is not None and pf.busy:
            pf.wait_for(flat)  # rows still in flight, or a failed prefetch of these rows
        cache = self._cache
        if cache is None:
            self.read_below(flat, out2d, serial=serial)
        elif flat.size > _TIER_SAMPLE:
            self._gather_tiered(cache, flat, out2d)
        else:
            self._fill_misses(cache, flat, out2d, cache.get_into(flat, out2d))
        c = self._counters
        c["fetch_calls"] += 1
        c["rows_fetched"] += flat.size

    def gather_small(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """`gather` for a decode step's few validated ids: one ``np.take`` from the mapping
        while the read rule is in its mapped state and nothing else (RAM tier, prefetches in
        flight) is involved; a slow gather (page faults) still reaches the rule's feedback so
        an evicted table is noticed. Otherwise the general path."""
        pf = self._prefetcher
        if (
            self._cache is not None
            or (self._segments is not None and self._segments.single is None)
            or (pf is not None and pf.busy)
            or flat.size >= self._unsampled_rows
            or not self.mapped_state()
        ):
            self.gather(flat, out2d)
            return
        pc = time.perf_counter
        t0 = pc()
        self.array().take(flat, 0, out2d, "clip")
        dt = pc() - t0
        a = self._auto
        if a is not None and a.mapped is not None and dt * 1e6 > a.slow_us * flat.size:
            a.feedback(a.mapped, flat.size, dt)
        c = self._counters
        c["fetch_calls"] += 1
        c["rows_fetched"] += flat.size
        c["small_gathers"] += 1

    def note_mapped_gather(self, rows: int, seconds: float) -> None:
        """A caller that gathered validated ids from `array()` itself while `mapped_state()`
        held reports a slow gather here (it may have faulted), so the read rule leaves its
        mapped state as after a slow `gather_small`."""
        a = self._auto
        if a is not None and a.mapped is not None and seconds * 1e6 > a.slow_us * rows:
            a.feedback(a.mapped, rows, seconds)

    def rows_resident(self, flat: np.ndarray, samples: int = 8) -> bool:
        """Whether ``samples`` spread rows (`_sampled_resident`) of validated ids ``flat``
        sit on resident pages (one ``mincore`` each, ~2 us); False for a closed table or one
        that is not a mapped array."""
        n = flat.size
        if n == 0:
            return True
        if self._table is None or not self._fast_base:
            return False
        try:
            return self._sampled_resident(flat.reshape(-1), min(n, samples))
        except OSError:  # the mapping is gone
            return False

    def _sampled_resident(self, ids: np.ndarray, k: int) -> bool:
        """Whether ``k`` spread ids of 1-D ``ids`` sit on resident pages: rows sit at ``row *
        stride`` from one address (`_sample_at`: the mapped array, or an attached table's
        widest column), so no id is located (one ``mincore`` each, ~2 us). The positions
        follow the golden ratio (``j * 0.618 * n``), not a fixed stride: a stride that is a
        multiple of the head count picks one head of every sequence, and at a prompt's first
        position every sequence's n-grams are the same pad rows (a prefill's sample was one
        row eight times)."""
        at = self._sample_at
        assert at is not None
        base, rb = at
        n = ids.shape[0]
        pos = range(n) if n <= k else [(j * 40503 * n >> 16) % n for j in range(k)]
        rows = [int(ids[p]) for p in pos]
        if not all(0 <= r < self.n_rows for r in rows):  # ids the gather checks itself
            check_bounds(ids, self.n_rows)  # raises, naming the id
        return bool(resident_count([base + r * rb for r in rows]) == len(rows))

    def note_buffered_read(self) -> None:
        """A prefetch is about to read rows by syscalls, past the mapping: it starts the
        background warm when the table fits (`MappedTiers.warm_once`), so a table read only
        through prefetches also ends up resident and mapped."""
        t = self._tiers
        if t is not None:
            t.warm_once()

    def gather_resident(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Gather validated ids known to be in the page cache (a finished page-cache
        prefetch) straight from the mapping."""
        self.take_mapped(flat, out2d)
        c = self._counters
        c["fetch_calls"] += 1
        c["rows_fetched"] += flat.size
        c["prefetched_gathers"] += 1

    # -- the read surface, with the mapped fast path -----------------------------------------
    def _fast_table(self, out: np.ndarray) -> np.ndarray | None:
        """The mapped table when a batch may skip the general path: served from the mapping
        (``auto`` in its mapped state, or the mmap backend), no RAM tier, no prefetcher, a
        built table, and ``out`` a plain C-contiguous writable uint8 array. Else None."""
        a = self._auto
        if (
            self._plain
            and self._prefetcher is None
            and (a.mapped_ok if a is not None else self._mmap_only)
            and type(out) is np.ndarray
            and out.dtype is _U8
            and out.flags.carray  # C-contiguous, aligned and writable
        ):
            return self._table
        return None

    def _take_fast(
        self, table: np.ndarray, ids: np.ndarray, out2d: np.ndarray, *, checked: bool = True
    ) -> bool:
        """One gather of validated ids from the mapping, for the fast paths: a batch the
        rule would sample first checks ``1 + n // 65536`` of its pages with ``mincore``
        (False on a miss: nothing written, the caller takes the general path). No lock;
        a slow gather (it faulted, or the machine was busy) reaches the rule's feedback.
        ``checked=False`` (only where the segments' gather `checks_ids`): ids not yet
        validated, and `RowIdOutOfRange` with nothing written for one out of range."""
        n = ids.shape[0]
        a = self._auto
        if a is not None and n >= self._unsampled_rows:
            # Checked every batch: one that faulted the evicted table in from the device would
            # stall for ~n device reads (seconds), far more than a ``mincore`` costs. A
            # locked table cannot have been evicted: no check (~2 us a batch).
            locked = a.locked
            if (locked is None or not locked()) and not self._sampled_resident(
                ids, min(a.samples, 1 + n // 65536)
            ):
                return False
            a.count_mapped()
        guard = self._guard
        if guard is not None:
            guard()  # an attached source truncated while open: TruncatedFile, not SIGBUS
        return self._gather_fast(a, table, ids, out2d, n, checked)

    def _gather_fast(
        self,
        a: AutoBackend | None,
        table: np.ndarray,
        ids: np.ndarray,
        out2d: np.ndarray,
        n: int,
        checked: bool,
    ) -> bool:
        seg = self._segments
        if self._cols_fast and seg is not None:
            t0 = _clock()
            # columns assembled (it splits while timings say it pays); guarded just above
            seg.take(ids, out2d, checked=checked, guarded=self._guard is not None)
            dt = _clock() - t0
        else:
            dt = self._split.take(table, ids, out2d)  # split only while timings say it pays
        if a is not None and dt * 1e6 > a.slow_us * n:
            a.fault_feedback(n, dt)  # it faulted: the rule checks harder next time
        c = self._fast_counts
        c["calls"] += 1
        c["rows"] += n
        return True

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """See `RowTable.fetch_into`. While the table is served from the mapping, a 1-D
        batch of int64 ids is one bounds check (plain Python for a few ids, else one
        ``max`` of the ids viewed unsigned) and one ``np.take``: no lock, no backend call.
        An attached table's rows from several columns leave the check to their compiled
        gather, which checks every id before it writes."""
        a = self._auto
        if (
            (self._plain or self._cols_fast)
            and self._prefetcher is None
            and (a.mapped_ok if a is not None else self._mmap_only)
            and type(rowids) is np.ndarray
            and type(out) is np.ndarray
            and rowids.dtype is _I64
            and out.dtype is _U8
            and rowids.ndim == 1
            and out.flags.carray  # C-contiguous, aligned and writable
            and out.shape == ((n := rowids.shape[0]), self.row_bytes)
            and (table := self._table) is not None
        ):
            if 0 < n <= _SMALL and not self._cols_fast:
                # a decode step: the shortest path (no numpy reductions): the ids' bytes
                # checked as one integer of 64-bit lanes (`SmallBounds`)
                if not self._small_bounds.ok(rowids):
                    check_bounds(rowids, self.n_rows)  # raises, naming the id
                if (rowids.base is not None or out.base is not None) and np.may_share_memory(
                    rowids, out
                ):
                    rowids = rowids.copy()  # the gather would overwrite ids not read yet
                guard = self._guard
                if guard is not None:
                    guard()  # an attached source truncated while open: TruncatedFile
                c = self._fast_counts
                c["rows"] += n
                k = c["calls"] + 1
                c["calls"] = k
                if k & 7:  # timed one call in 8: an evicted table is noticed within 8 calls
                    table.take(rowids, 0, out, "clip")  # the method: no dispatch wrapper
                    return out
                t0 = _clock()
                table.take(rowids, 0, out, "clip")
                dt = _clock() - t0
                if a is not None and dt * 1e6 > a.slow_us * n:
                    a.fault_feedback(n, dt)  # it faulted: the rule checks harder next time
                return out
            if 0 < n <= MAX_ROWS_PER_CALL:
                seg = self._segments
                # rows from several columns: the compiled gather checks every id before it
                # writes (`SourceSegments.checks_ids`), so no numpy pass over the ids here
                lean = self._cols_fast and seg is not None and seg.checks_ids
                if not lean and unsigned_max(rowids) >= self.n_rows:
                    check_bounds(rowids, self.n_rows)  # raises, naming the id
                if (rowids.base is not None or out.base is not None) and np.may_share_memory(
                    rowids, out
                ):
                    rowids = rowids.copy()
                if self._take_fast(table, rowids, out, checked=not lean):
                    return out
                if lean:
                    check_bounds(rowids, self.n_rows)  # the general path wants checked ids
        return RowTable.fetch_into(self, rowids, out)

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """See `RowTable.lookup_into`. While the table is served from the mapping: one
        per-head ``max`` (the bounds check), one add of the head offsets into a reused id
        buffer, one ``np.take`` — no lock, no backend call."""
        table = self._fast_table(out)
        h = self.n_heads
        if (
            table is not None
            and type(row_ids) is np.ndarray
            and row_ids.dtype is _I64
            and row_ids.flags.c_contiguous
            and row_ids.ndim == 3
            and row_ids.shape[2] == h
            and 0 < (n := row_ids.size) <= MAX_ROWS_PER_CALL
            and out.shape == row_ids.shape + (self.row_bytes,)
        ):
            local = row_ids.reshape(-1, h)
            if bool((local.view(np.uint64).max(axis=0) < self._heads_u64).all()):
                if (row_ids.base is not None or out.base is not None) and np.may_share_memory(
                    row_ids, out
                ):
                    local = local.copy()
                buf = getattr(self._ids_scratch, "ids", None)
                if buf is None or buf.size < n:
                    buf = np.empty(max(n, 1024), dtype=np.int64)
                    self._ids_scratch.ids = buf
                g = buf[:n]
                np.add(local, self.head_offsets, out=g.reshape(-1, h))
                if self._take_fast(table, g, out.reshape(n, self.row_bytes)):
                    return out
        return RowTable.lookup_into(self, row_ids, out)

    def fetch(self, rowids: Any) -> np.ndarray:
        """See `RowTable.fetch`; a large result comes from a pool of reused buffers (a
        fresh large allocation faults every page), never one the caller still holds."""
        self.check_open()
        ids = rowids if type(rowids) is np.ndarray and rowids.dtype is _I64 else None
        if ids is None:
            return RowTable.fetch(self, rowids)
        check_batch(ids.shape, self.row_bytes)
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        out = self._pool.empty(ids.shape + (self.row_bytes,), flat.size * self.row_bytes)
        if flat.size:
            self.gather(flat, out.reshape(-1, self.row_bytes))
        return out

    @property
    def tiers(self) -> MappedTiers:
        """The table's memory policy (page-cache budget, background warm, RSS budget,
        ``mlock``, keep-warm); see `engramdb.io.tiers.MappedTiers`."""
        t = self._tiers
        if t is None:
            self.check_open()
            raise InvalidArgument(
                f"table {self.name!r} is attached with its widest column in several source "
                "runs: it is read in place without the page-cache budget, RSS budget or "
                "keep-warm policy (those watch one byte range)"
            )
        return t

    @property
    def split_decision(self) -> SplitDecision:
        """Whether large mapped gathers are split across threads, from observed timings."""
        return self._split

    def pool_bytes(self) -> int:
        """Bytes held by this thread's pool of reused result buffers."""
        return self._pool.nbytes()

    # -- prefetch ----------------------------------------------------------------------------
    @property
    def prefetcher(self) -> Prefetcher:
        """The background reader of this table (created on first use)."""
        pf = self._prefetcher
        if pf is None:
            with self._prefetch_lock:
                self.check_open()
                if self._prefetcher is None:
                    self._prefetcher = Prefetcher(self)
                pf = self._prefetcher
        return pf

    # -- residency ---------------------------------------------------------------------------
    def _warm_done(self) -> None:
        """A background warm pass read the whole table (called from its thread): the read
        rule checks residency at its next batch, and an attached table's record takes its
        wide rows' spill (`engramdb.read.resident`), resident now."""
        if self._auto is not None:
            self._auto.recheck_soon()
        if self._segments is not None:
            self._segments.record.start_spill()

    def _first_mapped(self) -> None:
        """The read rule first found this table's pages resident: if this process maps
        fewer than half of 64 spread pages of them (`mapped_count`: the table was warmed by
        another process, e.g. ``engramdb warm``), start the background pass, which then only
        fills the page tables (no device read), so gathers stop taking a minor fault per new
        page (~15 a step at B=8 here, each a few us) long before random reads would have
        touched every page."""
        t = self._tiers
        if t is None or t.warm.state != "idle" or not t.background or not t.fits:
            return
        addrs = spread_pages(t.base, t.length, 64)
        have = mapped_count(addrs)
        if have is not None and 2 * have < len(addrs):
            t.warm_once()

    def populate(self, *, threads: int = 2, progress: Callable[[int], None] | None = None) -> None:
        """Fault the whole table into the page tables (``MADV_POPULATE_READ``): reads it from
        the device if cold, in ``threads`` background threads (the GIL is released).
        Afterwards warm gathers run at memory speed. ``progress`` gets byte counts."""
        if self._mapping is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        # one sequential pass per shard (read-ahead at device speed, 2 MiB page-cache folios)
        self._mapping.populate(threads=threads, progress=progress)

    def residency(self) -> float:
        """Fraction of the table's pages in the page cache (0..1), via ``mincore``."""
        if self._mapping is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        return self._mapping.residency()

    # -- counters ----------------------------------------------------------------------------
    def note_step_read(self, rows: int, device_bytes: int) -> None:
        """A decoder's `engramdb.read.steps.StepReader` read ``rows`` rows of this table with
        ``device_bytes`` asked of the device (``O_DIRECT`` spans); counted in `counters`."""
        c = self._counters
        c["step_rows"] += rows
        c["step_device_bytes"] += device_bytes

    def step_layout(self) -> tuple[list[int], int, int] | None:
        """Where rows lie, for readers that compute offsets themselves: ``(descriptors,
        rows per file, byte offset of row 0)`` — row ``r`` is at ``base + (r % rows_per_file)
        * row_bytes`` of descriptor ``r // rows_per_file`` (``rows_per_file`` 0: one file).
        None for an attached table assembled from several tensors."""
        seg = self._segments
        if seg is None:  # (one shard: one file, its rows from byte 0)
            one_file = len(self._fds) == 1
            return list(self._fds), 0 if one_file else int(self.geometry.rows_per_shard), 0
        one = seg.single_layout()
        if one is None:
            return None
        return [self._fds[one[0]]], 0, one[1]

    def counters(self) -> dict[str, int]:
        """Calls and rows served so far (a copy): ``fetch_calls``, ``rows_fetched``,
        ``small_gathers`` (decode steps and `fetch_into`'s mapped fast path),
        ``prefetched_gathers``, ``step_rows`` / ``step_device_bytes`` (rows a decoder's step
        reader read ahead of its fills, and the bytes it asked of the device)."""
        out = dict(self._counters)
        f = self._fast_counts
        out["fetch_calls"] += f["calls"]
        out["rows_fetched"] += f["rows"]
        out["small_gathers"] += f["calls"]
        return out

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the prefetcher, the mapping, the backend and the file descriptors. Later
        calls raise `StoreClosed`. Idempotent."""
        if self._table is None:
            return
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._table = None
        self._auto = None
        if self._tiers is not None:
            self._tiers.close()
            self._tiers = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
