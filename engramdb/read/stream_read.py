"""The executor of `stream_plan`: a quick device calibration and the window reader.

* `calibrate` measures the device on the table's own files (a batch of random 4 KiB reads
  and a few MiB of sequential reads, through the reader's own backend) and derives the
  streaming knobs from it: the **merge gap** is the number of bytes the device streams in
  the time one extra random request costs (reading a gap that small is cheaper than a new
  request), a run is capped at ``max_read`` (a multiple of the gap, 1-8 MiB) and ``depth``
  runs are kept in flight (enough bytes for ~20 ms of sequential transfer).
* `RunReader.load` reads a window's runs (`stream_plan.RunPlan`) in file order, ``depth``
  runs per backend batch, and copies each run's rows into the window's compact row store;
  the next batch of runs is read while the previous one is copied out.

Reads go through ``io_uring`` with ``O_DIRECT`` where it runs (device bytes = bytes read,
no page-cache use: a table larger than the page cache is streamed without evicting anything
else), else buffered ``preadv`` followed by ``POSIX_FADV_DONTNEED`` of what was read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from engramdb.errors import BackendUnavailable
from engramdb.io import Backend, IoUringBackend, PreadvBackend, copy_segments
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
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engramdb-runs")
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

    def load(self, plan: RunPlan, compact: np.ndarray) -> None:
        """Read every run of ``plan`` and copy row ``plan.rows[i]`` into ``compact[i]``
        (``compact``: C-contiguous uint8 ``[>= plan.n_rows, row_bytes]``)."""
        flat = compact.reshape(-1)
        groups = self._groups(plan)
        t0 = time.perf_counter()
        pending: Future[np.ndarray] | None = None
        if groups:
            pending = self._pool.submit(self._read, plan, *groups[0], self._bounce[0])
        try:
            self._copy_out(plan, groups, pending, flat)
        except BaseException:
            # No read may still be landing in a bounce buffer once this call returns.
            self._pool.submit(lambda: None).result()
            raise
        c = self.counters
        with self._lock:
            c["windows"] += 1
            c["runs"] += plan.n_runs
            c["bytes_read"] += plan.read_bytes
            c["rows"] += plan.n_rows
            c["read_seconds"] += time.perf_counter() - t0

    def _copy_out(
        self,
        plan: RunPlan,
        groups: list[tuple[int, int]],
        pending: Future[np.ndarray] | None,
        flat: np.ndarray,
    ) -> None:
        rb = plan.row_bytes
        for gi, (a, b) in enumerate(groups):
            assert pending is not None
            dest = pending.result()
            buf = self._bounce[gi % 2]
            if gi + 1 < len(groups):
                pending = self._pool.submit(
                    self._read, plan, *groups[gi + 1], self._bounce[(gi + 1) % 2]
                )
            r0, r1 = int(plan.first_row[a]), int(plan.first_row[b])
            counts = np.diff(plan.first_row[a : b + 1])
            run_of_row = np.repeat(np.arange(b - a), counts)
            src = dest[run_of_row] + (plan.row_offset[r0:r1] - plan.offset[a:b][run_of_row])
            dst = np.arange(r0, r1, dtype=np.int64) * rb
            copy_segments(buf, src, rb, flat, dst)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.backend.close()


_DONE = object()


class WindowStream:
    """Corpus streaming for a table larger than the page-cache budget.

    A loader thread takes the corpus's batches in order, computes their row ids
    (``rows_of``), and gathers them into a look-ahead window until the window's distinct
    rows would pass ``window_cap_bytes`` (derived from ``budget`` after the fixed costs:
    the bitmap, the bounce buffers, the output ring); it plans the window's runs in file
    order (`stream_plan.plan_runs`, knobs from `calibrate`), reads them into the one
    compact row store once the consumer is done with the previous window, and hands the
    window over. The consumer gathers each batch from the compact store (one ``np.take``)
    into a ring of two output buffers. Keygen and planning of the next window overlap the
    consumer's use of the current one; nothing is read twice within a window and nothing
    but the window stays resident. `close` stops the loader (after the read in progress).
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
        # Reads in flight take at most 1/24 of the budget (a small budget shrinks them).
        max_read = max(64 << 10, min(profile.max_read, _pow2_floor(max(1, budget // 64))))
        depth = max(2, min(profile.depth, budget // 24 // max_read))
        profile = replace(profile, max_read=max_read, depth=depth)
        # A dense rank array (4 B per table row, ~20x faster ranks than a binary search)
        # while it costs at most 1/8 of the budget.
        self._marks = WindowMarks(int(geometry.n_rows), dense_max_bytes=budget // 8)
        self._reader = RunReader(fds, profile, rb)
        self._ring = [np.empty(slot_bytes, np.uint8) for _ in range(2)]
        # The backend's own bounce buffer is as large as one of ours.
        fixed = 2 * slot_bytes + self._marks.nbytes + self._reader.nbytes * 3 // 2
        # What is left: 88 % for the window's rows (compact copy + planning), 12 % for its ids (int64 while
        # the window grows, int32 ranks once planned: 12 B per row id).
        left = max(0, int(0.95 * budget) - fixed)
        slot_rows = slot_bytes // rb
        self._cap_rows = max(int(0.88 * left) // (rb + PLAN_BYTES_PER_ROW), slot_rows, 1)
        self._max_tokens = max(1, int(0.12 * left) // (12 * self._heads))
        self._compact = np.empty((self._cap_rows, rb), np.uint8)
        self._stats = stats
        memory = (
            fixed + self._cap_rows * (rb + PLAN_BYTES_PER_ROW) + self._max_tokens * 12 * self._heads
        )
        stats.update(
            device=profile.as_dict(),
            backend=self._reader.backend.name,
            direct=self._reader.direct,
            window_cap_bytes=self._cap_rows * rb,
            window_max_tokens=self._max_tokens,
            memory_bytes=memory,
            within_budget=memory <= budget,
            windows=0,
            runs=0,
            bytes_read=0,
            rows_read=0,
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

    def _ship(self, pending: list[tuple[Any, int, np.ndarray]], ntok: int) -> bool:
        """Plan, read and hand over one window; False when stopped."""
        marks = self._marks
        t0 = time.perf_counter()
        rows = marks.distinct()
        plan = plan_runs(
            rows,
            self._geometry,
            merge_gap=self._reader.profile.merge_gap,
            max_read=self._reader.profile.max_read,
        )
        batches = [(tokens, skip, marks.rank(r)) for tokens, skip, r in pending]
        marks.clear()
        t1 = time.perf_counter()
        with self._cond:
            while not self._free and not self._stop:
                self._cond.wait()
            if self._stop:
                return False
            self._free = False
        t2 = time.perf_counter()
        self._reader.load(plan, self._compact)
        st = self._stats
        st["plan_seconds"] += t1 - t0
        st["wait_seconds"] += t2 - t1
        st["load_seconds"] += time.perf_counter() - t2
        st["windows"] += 1
        st["runs"] += plan.n_runs
        st["bytes_read"] += plan.read_bytes
        st["rows_read"] += plan.n_rows
        st["window_tokens_max"] = max(st["window_tokens_max"], ntok)
        self._put(batches)
        return True

    def _load(self, work: Iterator[tuple[Any, int]], rows_of: Callable[[Any], np.ndarray]) -> None:
        pending: list[tuple[Any, int, np.ndarray]] = []
        ntok = 0
        err: BaseException | None = None
        try:
            try:
                for tokens, skip in work:
                    if self._stop:
                        return
                    rows = rows_of(tokens)
                    full = self._marks.count + rows.size > self._cap_rows
                    if pending and (full or ntok + tokens.size > self._max_tokens):
                        if not self._ship(pending, ntok):
                            return
                        pending, ntok = [], 0
                    self._marks.add(rows)
                    pending.append((tokens, skip, rows))
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
        k = 0
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
                for tokens, skip, rank in item:
                    buf = self._ring[k % 2]
                    k += 1
                    shape = tokens.shape + (heads, rb)
                    e = buf[: int(np.prod(shape))].reshape(shape)
                    np.take(
                        self._compact, rank.reshape(-1), axis=0, out=e.reshape(-1, rb), mode="clip"
                    )
                    t, out = (tokens[skip:], e[skip:]) if skip else (tokens, e)
                    st["batches"] += 1
                    st["tokens"] += int(t.size)
                    yield (t, out.copy()) if copy else (t, out)
                with self._cond:
                    self._free = True
                    self._cond.notify_all()
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
