"""Warm row gathers from a mapped table, split across cores when that measurably pays.

``np.take`` releases the GIL while it copies, so a large batch split over a small
persistent thread pool can scale with cores (21 -> 40 M rows/s for 160 B rows on 2 idle
cores) — or lose, on a busy shared machine (0.74-0.86x single-thread ``np.take`` in the
issue-14 measurements). `SplitDecision` decides from observed timings of the caller's own
batches, not from the core count. Small batches stay on the calling thread: handing work to
a pool costs ~20 us.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

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

    Gathers run on one thread; every ``every``-th large batch is run the other way. Each way
    keeps a moving average of its ns per row. The table switches only when the other way
    has at least `MIN_SAMPLES` timings and its average is below `WIN` x the current one's
    (a single lucky batch on a busy machine does not flip it); each exploration that does
    not win doubles ``every`` (up to 1024), a switch resets it to 16. Without a second core
    (or with ``ENGRAMDB_GATHER_THREADS=1``) it never splits."""

    MIN_SAMPLES = 4
    WIN = 0.85

    def __init__(self) -> None:
        self.allowed = gather_threads() > 1
        self.ns = {False: 0.0, True: 0.0}  # moving average ns/row: serial, split
        self.split = False
        self.every = 16
        self.count = 0
        self.tried = {False: 0, True: 0}

    def pick(self) -> bool:
        """The way to run the next large batch."""
        if not self.allowed:
            return False
        self.count += 1
        if self.count % self.every == 0:
            return not self.split  # explore the other way
        return self.split

    def report(self, split: bool, rows: int, seconds: float) -> None:
        """The time one large batch took run ``split`` (or not)."""
        ns = seconds * 1e9 / max(1, rows)
        old = self.ns[split]
        self.ns[split] = ns if old == 0.0 else 0.75 * old + 0.25 * ns
        self.tried[split] += 1
        if split == self.split:
            return
        cur = self.ns[self.split]
        if cur > 0.0 and self.tried[split] >= self.MIN_SAMPLES and self.ns[split] < self.WIN * cur:
            self.split, self.every = split, 16  # the explored way won clearly
        elif self.tried[split] >= self.MIN_SAMPLES:
            self.every = min(1024, self.every * 2)

    def take(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        """`take_rows` split or on this thread as decided, timed and reported (batches
        under `PARALLEL_MIN_BYTES` always on this thread, not counted)."""
        n = ids.size
        if n * table.shape[1] < PARALLEL_MIN_BYTES:
            np.take(table, ids, axis=0, out=out, mode="clip")
            return
        split = self.pick()
        t0 = time.perf_counter()
        if split:
            take_rows(table, ids, out)
        else:
            np.take(table, ids, axis=0, out=out, mode="clip")
        self.report(split, n, time.perf_counter() - t0)


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engramdb-gather")
        return _pool


def take_rows(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = table[ids[i]]`` for validated int64 ``ids`` (1-D) and a 2-D ``out``.

    ``mode="clip"`` because ``mode="raise"`` copies through a temporary; the ids are in range,
    so clipping never changes a row.
    """
    n = ids.size
    if n * table.shape[1] < PARALLEL_MIN_BYTES or (workers := gather_threads()) == 1:
        np.take(table, ids, axis=0, out=out, mode="clip")
        return
    pool = _get_pool(workers)
    bounds = np.linspace(0, n, workers + 1).astype(np.int64)
    futures: list[Future[object]] = []
    for w in range(1, workers):
        lo, hi = int(bounds[w]), int(bounds[w + 1])
        futures.append(pool.submit(np.take, table, ids[lo:hi], 0, out[lo:hi], "clip"))
    hi0 = int(bounds[1])
    np.take(table, ids[:hi0], axis=0, out=out[:hi0], mode="clip")
    for f in futures:
        f.result()


def run_split(fn: Callable[[int, int], None], n: int, *, min_items: int = 2) -> None:
    """Call ``fn(lo, hi)`` over ``[0, n)`` split across the gather pool (the caller's thread
    takes the first part). ``fn`` must release the GIL to gain from this (numpy copies do)."""
    workers = min(gather_threads(), n)
    if workers <= 1 or n < min_items:
        fn(0, n)
        return
    pool = _get_pool(gather_threads())
    bounds = np.linspace(0, n, workers + 1).astype(np.int64)
    futures = [pool.submit(fn, int(bounds[w]), int(bounds[w + 1])) for w in range(1, workers)]
    fn(0, int(bounds[1]))
    for f in futures:
        f.result()
