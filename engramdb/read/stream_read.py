"""The executor of `stream_plan`: a quick device calibration and the window reader.

* `calibrate` measures the device on the table's own files (a batch of random 4 KiB reads
  and a few MiB of sequential reads, through the reader's own backend) and derives the
  streaming knobs from it: the **merge gap** is the number of bytes the device streams in
  the time one extra random request costs (reading a gap that small is cheaper than a new
  request), a run is capped at ``max_read`` (a multiple of the gap, 1-8 MiB) and ``depth``
  runs are kept in flight (enough bytes for ~20 ms of sequential transfer).
* `RunReader.load` reads a window's runs (`stream_plan.RunPlan`s, one per table region,
  made lazily) in file order, ``depth`` runs per backend batch, and copies each run's rows
  into the window's compact row store; two batches of runs are queued on the device while
  the one before is copied out.

Reads go through ``io_uring`` with ``O_DIRECT`` where it runs (device bytes = bytes read,
no page-cache use: a table larger than the page cache is streamed without evicting anything
else), else buffered ``preadv`` followed by ``POSIX_FADV_DONTNEED`` of what was read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from engramdb._cpus import run_as_worker
from engramdb.errors import BackendUnavailable
from engramdb.io import Backend, IoUringBackend, PreadvBackend, copy_segments
from engramdb.io.gather import take_one
from engramdb.io.mapping import prefault, prefault_watched, small_pages
from engramdb.read.stream_plan import PLAN_BYTES_PER_ROW, RunPlan, WindowMarks, plan_runs

__all__ = ["DeviceProfile", "RunReader", "WindowStream", "calibrate"]

_PAGE = 4096
_MIB = 1 << 20
_MAX_IN_FLIGHT = 64 * _MIB  # bytes of runs in one backend batch, at most


@dataclass(frozen=True)
class DeviceProfile:
    """What `calibrate` measured and the knobs it chose (all reported in stream stats)."""

    random_iops: float
    seq_bytes_per_s: float
    merge_gap: int
    max_read: int
    depth: int
    calib_bytes: int
    calib_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def calibrate(
    backend: Backend, fds: np.ndarray, sizes: list[int], *, seed: int = 0
) -> DeviceProfile:
    """Measure ``backend`` on the files ``fds`` (sizes in bytes): 256 random page reads in
    one batch, then up to 16 MiB of sequential reads in 1 MiB and in 4 MiB requests (one
    batch each; the faster size sets the floor of ``max_read``). Costs ~35 MB of device
    reads and a few tens of ms."""
    rng = np.random.default_rng(seed)
    sizes_a = np.asarray(sizes, dtype=np.int64)
    pages = sizes_a // _PAGE
    usable = np.flatnonzero(pages > 0)
    t0 = time.perf_counter()
    if usable.size == 0:
        return DeviceProfile(0.0, 0.0, _PAGE, _MIB, 4, 0, 0.0)
    n = 256
    which = usable[rng.integers(0, usable.size, n)]
    offs = rng.integers(0, pages[which]) * _PAGE
    buf = np.empty(max(n * _PAGE, 16 * _MIB), dtype=np.uint8)
    dest = np.arange(n, dtype=np.int64) * _PAGE
    t1 = time.perf_counter()
    backend.read(fds[which], offs, _PAGE, buf, dest)
    iops = n / max(time.perf_counter() - t1, 1e-6)
    big = int(usable[np.argmax(sizes_a[usable])])
    span = min(16 * _MIB, int(pages[big]) * _PAGE)
    seq_bytes = 0
    best: tuple[float, int] = (0.0, _MIB)
    for chunk in (_MIB, 4 * _MIB):  # request sizes: the larger one when it streams faster
        chunk = min(chunk, span)
        k = max(1, span // chunk)
        hi = max(1, (int(sizes_a[big]) - k * chunk) // _PAGE + 1)
        start = int(rng.integers(0, hi)) * _PAGE
        seq_offs = start + np.arange(k, dtype=np.int64) * chunk
        t1 = time.perf_counter()
        backend.read(int(fds[big]), seq_offs, chunk, buf, np.arange(k, dtype=np.int64) * chunk)
        bw_c = k * chunk / max(time.perf_counter() - t1, 1e-6)
        seq_bytes += k * chunk
        if bw_c > best[0] * 1.05:
            best = (bw_c, chunk)
    bw, seq_chunk = best
    # A gap is worth reading when streaming it is cheaper than one more random request.
    gap = int(np.clip(bw / max(iops, 1.0), _PAGE, _MIB)) // _PAGE * _PAGE
    max_read = int(np.clip(max(_pow2_floor(16 * gap), seq_chunk), _MIB, 8 * _MIB))
    depth = int(np.clip(np.ceil(bw * 0.02 / max_read), 4, 32))
    depth = max(2, min(depth, _MAX_IN_FLIGHT // max_read))  # bounce memory stays bounded
    return DeviceProfile(
        random_iops=float(iops),
        seq_bytes_per_s=float(bw),
        merge_gap=gap,
        max_read=max_read,
        depth=depth,
        calib_bytes=n * _PAGE + seq_bytes,
        calib_seconds=time.perf_counter() - t0,
    )


def open_reader_backend(bounce_bytes: int) -> Backend:
    """``io_uring`` with ``O_DIRECT`` (bounce buffer ``bounce_bytes``), else ``preadv``."""
    try:
        return IoUringBackend(direct=True, direct_bounce_bytes=max(bounce_bytes, 1 << 16))
    except BackendUnavailable:
        return PreadvBackend()


class RunReader:
    """Reads the runs of window plans from the shard files ``fds`` into compact row stores.

    Owns its backend and two bounce buffers of ``depth * (max_read + 2 * row_bytes)`` bytes
    (the memory the reads need besides the window itself). `close` releases them."""

    def __init__(self, fds: np.ndarray, profile: DeviceProfile, row_bytes: int):
        self._fds = fds
        self.profile = profile
        self._slot = profile.max_read + 2 * row_bytes
        self._group_bytes = profile.depth * profile.max_read
        self._bounce_bytes = profile.depth * self._slot
        self.backend = open_reader_backend(self._bounce_bytes)
        self._bounce = [np.empty(self._bounce_bytes, np.uint8) for _ in range(2)]
        # Two reading threads: both queued groups are on the device at once (each thread's
        # backend bounce buffer is as large as one of ours).
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engramdb-runs")
        self._lock = threading.Lock()
        self.counters = {"windows": 0, "runs": 0, "bytes_read": 0, "rows": 0, "read_seconds": 0.0}

    @property
    def nbytes(self) -> int:
        """Bytes of the bounce buffers."""
        return 2 * self._bounce_bytes

    @property
    def direct(self) -> bool:
        return self.backend.direct

    def _groups(self, plan: RunPlan) -> list[tuple[int, int]]:
        """Consecutive run ranges ``[a, b)`` of at most ``depth`` runs and group bytes."""
        if plan.n_runs == 0:
            return []
        cum = np.cumsum(plan.length)
        out = []
        a = 0
        while a < plan.n_runs:
            base = int(cum[a - 1]) if a else 0
            b = int(np.searchsorted(cum, base + self._group_bytes, side="right"))
            b = min(max(b, a + 1), a + self.profile.depth, plan.n_runs)
            out.append((a, b))
            a = b
        return out

    def _read(self, plan: RunPlan, a: int, b: int, buf: np.ndarray) -> np.ndarray:
        lens = plan.length[a:b]
        dest = np.cumsum(lens) - lens
        self.backend.read(self._fds[plan.shard[a:b]], plan.offset[a:b], lens, buf, dest)
        if not self.backend.direct:
            # Buffered fallback: let go of the pages read (the stream keeps its own copy).
            for fd, off, n in zip(
                self._fds[plan.shard[a:b]].tolist(), plan.offset[a:b].tolist(), lens.tolist()
            ):  # one call per run (a few per MiB), not per row
                os.posix_fadvise(int(fd), int(off), int(n), os.POSIX_FADV_DONTNEED)
        return dest

    def load(self, plans: RunPlan | Iterable[tuple[int, RunPlan]], compact: np.ndarray) -> None:
        """Read every run of ``plans`` and copy row ``plan.rows[i]`` into
        ``compact[base + i]`` (``compact``: C-contiguous uint8 ``[rows, row_bytes]``).

        ``plans``: one `RunPlan` (base 0) or an iterable of ``(base, plan)``, taken lazily:
        the next plan is made while the device reads. Two groups of runs are queued on the
        device at any time (each into its own bounce buffer), so it never waits for a copy."""
        items = self._items([(0, plans)] if isinstance(plans, RunPlan) else plans)
        flat = compact.reshape(-1)
        t0 = time.perf_counter()
        queued: list[tuple[RunPlan, int, int, int, np.ndarray, Future[np.ndarray]]] = []
        k = 0

        def submit() -> None:
            nonlocal k
            item = next(items, None)
            if item is not None:
                base, plan, a, b = item
                buf = self._bounce[k % 2]
                queued.append(
                    (plan, base, a, b, buf, self._pool.submit(self._read, plan, a, b, buf))
                )
                k += 1

        try:
            submit()
            submit()
            while queued:
                plan, base, a, b, buf, fut = queued[0]
                self._copy_group(plan, base, a, b, fut.result(), buf, flat)
                queued.pop(0)
                submit()  # into the buffer just copied out
        except BaseException:
            # No read may still be landing in a bounce buffer once this call returns.
            wait_futures([q[-1] for q in queued])
            raise
        with self._lock:
            self.counters["windows"] += 1
            self.counters["read_seconds"] += time.perf_counter() - t0

    def _items(
        self, plans: Iterable[tuple[int, RunPlan]]
    ) -> Iterator[tuple[int, RunPlan, int, int]]:
        c = self.counters
        for base, plan in plans:
            with self._lock:
                c["runs"] += plan.n_runs
                c["bytes_read"] += plan.read_bytes
                c["rows"] += plan.n_rows
            for a, b in self._groups(plan):
                yield base, plan, a, b

    @staticmethod
    def _copy_group(
        plan: RunPlan,
        base: int,
        a: int,
        b: int,
        dest: np.ndarray,
        buf: np.ndarray,
        flat: np.ndarray,
    ) -> None:
        rb = plan.row_bytes
        r0, r1 = int(plan.first_row[a]), int(plan.first_row[b])
        counts = np.diff(plan.first_row[a : b + 1])
        run_of_row = np.repeat(np.arange(b - a), counts)
        src = dest[run_of_row] + (plan.row_offset[r0:r1] - plan.offset[a:b][run_of_row])
        dst = np.arange(base + r0, base + r1, dtype=np.int64) * rb
        copy_segments(buf, src, rb, flat, dst)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.backend.close()


_DONE = object()


class WindowStream:
    """Corpus streaming for a table larger than the page-cache budget.

    A loader thread takes the corpus's batches in order, computes their row ids
    (``rows_of``), and marks them into a look-ahead window until the window's distinct
    rows would pass what the budget leaves after the fixed costs (the bitmap and two packed
    rank snapshots, the bounce buffers, one output buffer, the planning of a few regions);
    the ids themselves are dropped (the consumer recomputes them).
    Once the consumer is done with the previous window it reads the window's rows region
    by region of the table, in file order (`stream_plan.plan_runs` per region, knobs from
    `calibrate`), into the one compact row store, and hands the window over. The consumer
    recomputes each batch's ids, ranks them (`stream_plan.PackedRanks`) and gathers the
    batch from the compact store (one ``np.take``). The windows are as large
    as the budget allows: where a window touches most pages of the table, each window costs
    one sequential pass over the table, so device bytes per payload byte fall as the window
    grows. Keygen of the next window overlaps the consumer's use of the current one; nothing
    is read twice within a window and nothing but the window stays resident. `close` stops
    the loader (after the read in progress).
    """

    def __init__(
        self,
        fds: np.ndarray,
        sizes: list[int],
        geometry: Any,
        *,
        n_heads: int,
        budget: int,
        slot_bytes: int,
        stats: dict[str, Any],
    ):
        self._geometry = geometry
        rb = int(geometry.row_bytes)
        self._rb = rb
        self._heads = int(n_heads)
        cal = open_reader_backend(16 * _MIB)
        try:
            profile = calibrate(cal, fds, sizes)
        finally:
            cal.close()
        # A group of reads takes at most ~1/128 of the budget (its bounce buffers and plans
        # ~1/30): the rest is the window, and a larger window means fewer passes.
        max_read = min(profile.max_read, max(64 << 10, _pow2_floor(max(1, budget // 256))))
        depth = max(2, min(profile.depth, budget // 128 // max_read))
        profile = replace(profile, max_read=max_read, depth=depth)
        # The bitmap (1 B per table row) marks a window; its ranks come from a packed
        # snapshot (`PackedRanks`, 0.19 B per row; two alive: the window served and the one
        # being read), so the window's ids need not be kept: the consumer recomputes them.
        n_rows = int(geometry.n_rows)
        self._marks = WindowMarks(n_rows, dense_max_bytes=0)
        ranks_bytes = 2 * WindowMarks.packed_nbytes(n_rows)
        self._reader = RunReader(fds, profile, rb)
        # Regions of about one group of reads: their plans are made while the device reads.
        self._region_rows = max(1, depth * max_read // rb)
        plan_bytes = 3 * self._region_rows * PLAN_BYTES_PER_ROW  # made, queued, in flight
        # One output buffer: a batch is valid until the next one is asked for.
        self._out = prefault(small_pages(np.empty(slot_bytes, np.uint8)))
        # Each reading thread's backend bounce buffer is as large as one of ours.
        fixed = slot_bytes + self._marks.nbytes + ranks_bytes + 2 * self._reader.nbytes + plan_bytes
        # What is left holds the window: its distinct rows and its token ids (8 B a token,
        # should the corpus hand out copies).
        self._window_bytes = max(0, int(0.98 * budget) - fixed)
        self._id_bytes = 8  # per token
        cap_rows = max(self._window_bytes // rb, slot_bytes // rb, 1)
        # Virtual until touched: a window commits only the rows it holds.
        self._compact = np.empty((cap_rows, rb), np.uint8)
        self._committed = 0  # the most rows any window held (their pages stay committed)
        self._stats = stats
        stats.update(
            device=profile.as_dict(),
            backend=self._reader.backend.name,
            direct=self._reader.direct,
            window_cap_bytes=cap_rows * rb,
            window_small_pages=False,
            fixed_bytes=fixed,
            memory_bytes=fixed,
            within_budget=True,
            windows=0,
            runs=0,
            bytes_read=0,
            rows_read=0,
            payload_bytes=0,
            window_tokens_max=0,
            plan_seconds=0.0,
            wait_seconds=0.0,
            load_seconds=0.0,
        )
        self._cond = threading.Condition()
        self._queue: list[Any] = []
        self._free = True
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- loader ------------------------------------------------------------------------------
    def _put(self, item: Any) -> None:
        with self._cond:
            self._queue.append(item)
            self._cond.notify_all()

    def _plans(self) -> Iterator[tuple[int, RunPlan]]:
        prof = self._reader.profile
        for base, rows in self._marks.regions(self._region_rows, keep_rows=False):
            t0 = time.perf_counter()
            plan = plan_runs(rows, self._geometry, merge_gap=prof.merge_gap, max_read=prof.max_read)
            self._stats["plan_seconds"] += time.perf_counter() - t0
            yield base, plan

    def _ship(self, pending: list[tuple[Any, int]], ntok: int) -> bool:
        """Read and hand over one window; False when stopped."""
        marks = self._marks
        t1 = time.perf_counter()
        with self._cond:
            while not self._free and not self._stop:
                self._cond.wait()
            if self._stop:
                return False
            self._free = False
        t2 = time.perf_counter()
        n_new = marks.count
        if n_new > self._committed:  # the rows this window adds: committed in one call
            if prefault_watched(self._compact[self._committed : n_new]):
                self._stats["window_small_pages"] = True
        c0 = dict(self._reader.counters)
        self._reader.load(self._plans(), self._compact)
        c1 = self._reader.counters
        ranks = marks.freeze()
        n_distinct = marks.count
        marks.clear()
        st = self._stats
        st["wait_seconds"] += t2 - t1
        st["load_seconds"] += time.perf_counter() - t2
        st["windows"] += 1
        st["runs"] += c1["runs"] - c0["runs"]
        st["bytes_read"] += c1["bytes_read"] - c0["bytes_read"]
        st["rows_read"] += c1["rows"] - c0["rows"]
        st["window_tokens_max"] = max(st["window_tokens_max"], ntok)
        self._committed = max(self._committed, n_distinct)
        mem = st["fixed_bytes"] + self._committed * self._rb + ntok * self._id_bytes
        st["memory_bytes"] = max(st["memory_bytes"], mem)
        st["within_budget"] = st["memory_bytes"] <= st["page_cache_budget"]
        self._put((pending, ranks))
        return True

    def _full(self, new_rows: int, ntok: int) -> bool:
        """Would the window pass its bytes with ``new_rows`` more (distinct, at most) rows
        and ``ntok`` tokens?"""
        rows = max(self._committed, self._marks.count + new_rows)
        return rows * self._rb + ntok * self._id_bytes > self._window_bytes

    def _load(self, work: Iterator[tuple[Any, int]], rows_of: Callable[[Any], np.ndarray]) -> None:
        run_as_worker()
        pending: list[tuple[Any, int]] = []
        ntok = 0
        err: BaseException | None = None
        try:
            try:
                for tokens, skip in work:
                    if self._stop:
                        return
                    rows = rows_of(tokens)
                    if pending and self._full(rows.size, ntok + int(tokens.size)):
                        if not self._ship(pending, ntok):
                            return
                        pending, ntok = [], 0
                    self._marks.add(rows)
                    del rows  # recomputed by the consumer: a window keeps no ids
                    pending.append((tokens, skip))
                    ntok += int(tokens.size)
            except BaseException as e:  # corpus or keygen: after the batches before it
                err = e
            if pending and not self._ship(pending, ntok):
                return
            self._put(err if err is not None else _DONE)
        except BaseException as e:  # a read error: in the window's place
            self._put(e)

    # -- consumer ----------------------------------------------------------------------------
    def run(
        self, work: Iterator[tuple[Any, int]], rows_of: Callable[[Any], np.ndarray], copy: bool
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The batches, in corpus order (a generator; closing it stops the loader)."""
        self._thread = threading.Thread(
            target=self._load, args=(work, rows_of), name="engramdb-stream-windows", daemon=True
        )
        self._thread.start()
        rb, heads, st = self._rb, self._heads, self._stats
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    item = self._queue.pop(0)
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                batches, ranks = item
                last = len(batches) - 1
                for j, (tokens, skip) in enumerate(batches):
                    shape = tokens.shape + (heads, rb)
                    e = self._out[: int(np.prod(shape))].reshape(shape)
                    rank = ranks.rank(rows_of(tokens).reshape(-1))
                    take_one(self._compact, rank, e.reshape(-1, rb))
                    if j == last:  # the window's rows are no longer needed: load the next
                        with self._cond:
                            self._free = True
                            self._cond.notify_all()
                    t, out = (tokens[skip:], e[skip:]) if skip else (tokens, e)
                    st["batches"] += 1
                    st["tokens"] += int(t.size)
                    st["payload_bytes"] += int(t.size) * heads * rb
                    yield (t, out.copy()) if copy else (t, out)
        finally:
            self.close()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._free = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self._thread = None
        self._reader.close()
