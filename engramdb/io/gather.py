"""Warm row gathers from a mapped table, split across cores when that measurably pays.

``np.take`` releases the GIL while it copies, so a large batch split over a small
persistent thread pool can scale with cores (21 -> 40 M rows/s for 160 B rows on 2 idle
cores) — or lose, on a busy shared machine (0.74-0.86x single-thread ``np.take`` in the
issue-14 measurements). `SplitDecision` decides from observed timings of the caller's own
batches, not from the core count. Small batches stay on the calling thread: handing work to
a pool costs ~20 us.

Each thread's part is `take_one`: the compiled gather (`engramdb.io.columns.take_prefetched`)
for batches of 64 KiB or more, prefetching rows ahead for a table larger than the
last-level cache (faster than ``np.take`` where rows miss the L2, docs/io.md; ~20 % slower
where they sit in the CPU caches already); ``np.take`` below that or where it is not built.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engramdb.io.columns import take_prefetched

#: Batches smaller than this many bytes are gathered on the calling thread.
PARALLEL_MIN_BYTES = 512 * 1024

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


_threads: int | None = None


def gather_threads() -> int:
    """Threads used for one large gather: the usable cores, at most 8
    (``ENGRAMDB_GATHER_THREADS`` overrides). Computed once per process."""
    global _threads
    if _threads is None:
        env = os.environ.get("ENGRAMDB_GATHER_THREADS")
        if env:
            _threads = max(1, int(env))
        else:
            try:
                n = len(os.sched_getaffinity(0))
            except AttributeError:  # pragma: no cover - non-Linux
                n = os.cpu_count() or 1
            _threads = max(1, min(8, n))
    return _threads


class SplitDecision:
    """Whether a large gather is split across the gather pool, decided from observed
    timings, not the core count.

    Gathers start split (where a second core exists) and run one way; every ``every``-th
    large batch starts a burst of `BURST` batches run the other way (one isolated batch
    would mostly time the pool thread's wake-up; a split burst's first batch is not
    counted). Each way keeps its last `KEEP` timings (ns per row); after a burst the table
    leaves the split when the serial burst's median is below `WIN` x the split's median (one
    lucky batch on a busy machine does not flip it), and returns to it when a split burst's
    median is below the serial median. A burst that does not win doubles ``every`` (up to
    `MAX_EVERY`, so a machine that becomes idle is noticed again); a switch resets it to 16.
    Without a second core (or with ``ENGRAMDB_GATHER_THREADS=1``) it never splits."""

    BURST = 4
    KEEP = 8
    WIN = 0.9
    MAX_EVERY = 256
    FAULTED_NS = 2000.0  # the read rule's "slow mapped gather" bound, 2 us per row

    def __init__(self) -> None:
        self.allowed = gather_threads() > 1
        # Starts split where it may: an exploration burst of the serial way times a warm
        # thread, while a split burst's first batch would time the pool thread's wake-up.
        self.split = self.allowed
        self.every = 16
        self.count = 0
        self.tried = {False: 0, True: 0}
        self._recent: dict[bool, deque[float]] = {
            False: deque(maxlen=self.KEEP),
            True: deque(maxlen=self.KEEP),
        }
        self._burst = 0  # batches of the current exploration still to run

    @property
    def ns(self) -> dict[bool, float]:
        """Median ns per row of each way's recent batches (0.0: not timed yet)."""
        return {k: float(np.median(v)) if v else 0.0 for k, v in self._recent.items()}

    def pick(self) -> bool:
        """The way to run the next large batch."""
        if not self.allowed:
            return False
        if self._burst:
            return not self.split
        self.count += 1
        if self.count % self.every == 0:
            self._burst = self.BURST
            return not self.split  # explore the other way
        return self.split

    def report(self, split: bool, rows: int, seconds: float) -> None:
        """The time one large batch took run ``split`` (or not). A batch slower than
        `FAULTED_NS` per row faulted pages in from the device: it timed the device, not the
        split, and is left out (an exploration burst just runs one batch longer)."""
        ns = seconds * 1e9 / max(1, rows)
        if ns > self.FAULTED_NS:
            return
        self._recent[split].append(ns)
        self.tried[split] += 1
        if split == self.split or not self._burst:
            return
        self._burst -= 1
        if self._burst:
            return
        burst = list(self._recent[split])[-self.BURST :]
        if split:
            burst = burst[1:]  # its first batch timed the pool thread's wake-up
        cur = self._recent[self.split]
        # Leaving the split (where a second core exists) takes a clear win of one thread;
        # returning to it only a win: a noisy burst that went serial is undone at the next
        # burst that measures the split faster, not after a clear margin.
        win = self.WIN if self.split else 1.0
        if cur and float(np.median(burst)) < win * float(np.median(cur)):
            self.split, self.every = split, 16
        else:
            self.every = min(self.MAX_EVERY, self.every * 2)

    def take(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> float:
        """`take_rows` split or on this thread as decided, timed and reported (batches
        under `PARALLEL_MIN_BYTES`, or without a second core, always on this thread, not
        reported); returns the gather's seconds."""
        n = ids.size
        t0 = time.perf_counter()
        if n * table.shape[1] < PARALLEL_MIN_BYTES or not self.allowed:
            take_one(table, ids, out)
            return time.perf_counter() - t0
        split = self.pick()
        if split:
            take_rows(table, ids, out)
        else:
            take_one(table, ids, out)
        dt = time.perf_counter() - t0
        self.report(split, n, dt)
        return dt


#: Batches of at least this many bytes go through the compiled gather; below it
#: ``np.take``, whose call costs less.
PREFETCH_MIN_BYTES = 64 * 1024


_llc: int | None = None


def llc_bytes() -> int:
    """The CPU's last-level cache size in bytes (sysfs; 32 MiB where it cannot be read)."""
    global _llc
    if _llc is None:
        best = (0, 32 << 20)
        root = "/sys/devices/system/cpu/cpu0/cache"
        try:
            for name in os.listdir(root):
                if not name.startswith("index"):
                    continue
                with open(f"{root}/{name}/level") as f:
                    level = int(f.read())
                with open(f"{root}/{name}/size") as f:
                    text = f.read().strip()
                unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                size = int(text.rstrip("KMG")) * unit
                if level >= best[0]:
                    best = (level, size)
        except (OSError, ValueError):
            pass
        _llc = best[1]
    return _llc


def take_one(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = table[ids[i]]`` on the calling thread, for in-range int64 ``ids``: the
    compiled gather (`engramdb.io.columns.take_prefetched`) for batches of
    `PREFETCH_MIN_BYTES` or more, where it is built and the arrays fit it, prefetching rows
    ahead for a table larger than the last-level cache (`llc_bytes`), whose rows mostly miss
    it, and not for a smaller one, whose rows mostly hit it (where the prefetches cost
    ~20 %); ``np.take(mode="clip")`` otherwise (``mode="raise"`` copies through a
    temporary; the ids are in range, so clipping never changes a row)."""
    if ids.size * table.shape[1] * table.itemsize >= PREFETCH_MIN_BYTES and take_prefetched(
        table, ids, out, table.nbytes > llc_bytes()
    ):
        return
    table.take(ids, 0, out, "clip")  # the method: no dispatch wrapper (~0.7 us)


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engramdb-gather")
        return _pool


def take_rows(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = table[ids[i]]`` for validated int64 ``ids`` (1-D) and a 2-D ``out``,
    split across the gather pool (`run_split`) when the batch is large.

    ``mode="clip"`` because ``mode="raise"`` copies through a temporary; the ids are in range,
    so clipping never changes a row.
    """
    n = ids.size
    if n * table.shape[1] < PARALLEL_MIN_BYTES or gather_threads() == 1:
        take_one(table, ids, out)
        return

    def part(lo: int, hi: int) -> None:
        take_one(table, ids[lo:hi], out[lo:hi])

    run_split(part, n, min_items=_PIECE_BYTES // max(1, table.shape[1]))


#: The least work one piece of a split gather holds: small enough that the calling thread
#: takes over the pieces of a pool thread that wakes late, large enough that a piece's
#: Python overhead (~1.5 us) stays under 1 % of its copy.
_PIECE_BYTES = 256 * 1024


class _SplitJob:
    """One split call's shared state. Pool threads hold only this object, and the caller
    clears ``fn`` before it returns: a queued item that runs later finds nothing to do, and
    holds no reference to the caller's arrays (a pooled result buffer is reused only when
    nothing else refers to it)."""

    __slots__ = ("bounds", "claim", "done", "error", "finished", "fn", "pieces")

    def __init__(self, fn: Callable[[int, int], None], bounds: list[int]) -> None:
        self.fn: Callable[[int, int], None] | None = fn
        self.bounds = bounds
        self.pieces = len(bounds) - 1
        self.claim = itertools.count()  # next() is atomic under the GIL
        self.finished = itertools.count()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        while True:
            fn = self.fn
            if fn is None:
                return
            i = next(self.claim)
            if i >= self.pieces:
                return
            try:
                fn(self.bounds[i], self.bounds[i + 1])
            except BaseException as e:  # delivered to the caller
                self.error = e
            if next(self.finished) == self.pieces - 1:
                self.done.set()


def run_split(fn: Callable[[int, int], None], n: int, *, min_items: int = 2) -> None:
    """Call ``fn(lo, hi)`` over ``[0, n)`` in pieces shared by the calling thread and the
    gather pool: each thread claims the next piece until none is left, so a pool thread
    that wakes late (tens of microseconds on a VM) costs only the pieces it did not take,
    and one that has not started when the work runs out is not waited for. ``fn`` must
    release the GIL to gain from this (numpy copies do); pieces hold at least
    ``min_items`` items (at most 4 per thread). An exception from any piece is raised here,
    after every claimed piece has finished."""
    workers = min(gather_threads(), n // max(1, min_items))
    if workers <= 1:
        fn(0, n)
        return
    pieces = max(workers, min(4 * workers, n // max(1, min_items)))
    job = _SplitJob(fn, np.linspace(0, n, pieces + 1).astype(np.int64).tolist())
    pool = _get_pool(gather_threads())
    for _ in range(workers - 1):
        pool.submit(job.work)
    try:
        job.work()
        job.done.wait()  # the pieces the pool threads claimed
    finally:
        job.fn = None
    if job.error is not None:
        raise job.error
