"""The table-fits path of corpus streaming: a mapped table read once in file order, with
gathers served from it while it loads (`TableWarm`)."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable

import numpy as np

from engramdb._cpus import run_as_worker
from engramdb.errors import ReadError, StoreClosed
from engramdb.io.gather import take_one
from engramdb.io.mapping import (
    MADV_RANDOM,
    MADV_SEQUENTIAL,
    madvise,
    populate_range,
    touch_pages,
)

__all__ = ["Pending", "TableWarm"]

_PAGE = 4096
_MIB = 1 << 20


class TableWarm:
    """A mapped table read sequentially once, in file order, by background threads — and
    gathers served from it while it loads.

    ``threads`` threads fault the mapping ``arr`` (``[n_rows, row_bytes]``)
    in chunk by chunk (``MADV_POPULATE_READ`` with sequential advice: read-ahead streams it
    at device speed), taking the chunks in file order; ``prefix`` is the number of leading
    chunks done. `gather` serves a batch while the warm proceeds: its rows are grouped by
    the chunk that completes them (one stable radix sort of small ints) and each group is
    gathered as soon as the prefix covers it, so a batch is ready the moment the last chunk
    it needs lands and a consumer with several batches in flight gathers them while the
    device reads. Once done (or from the start with ``serve_now``, for a table already in
    the page cache), a gather is one `take_one` from the mapping."""

    def __init__(
        self,
        arr: np.ndarray,
        *,
        threads: int = 2,
        chunk: int = 64 * _MIB,
        on_done: Callable[[float, BaseException | None], None] | None = None,
        serve_now: bool = False,
    ):
        self._arr = arr
        self._serve_now = serve_now
        addr = int(arr.ctypes.data)
        self._lead = addr % _PAGE  # an attached table's rows may start inside a page
        self._addr = addr - self._lead
        self._len = int(arr.nbytes) + self._lead
        self._chunk = max(_PAGE, chunk // _PAGE * _PAGE)
        self._n_chunks = -(-self._len // self._chunk)
        self._done_flags = np.zeros(self._n_chunks + 1, dtype=bool)
        self._next = 0
        self.prefix = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._on_done = on_done
        self._queue: list[Pending] = []
        self._filler: threading.Thread | None = None
        self._left = max(1, threads)
        self._t0 = time.perf_counter()
        self._rows_v = _row_items(arr)
        madvise(self._addr, self._len, MADV_SEQUENTIAL)
        self._threads = [
            threading.Thread(target=self._run, name="engramdb-stream-warm", daemon=True)
            for _ in range(self._left)
        ]
        for t in self._threads:
            t.start()

    @property
    def done(self) -> bool:
        return self.prefix >= self._n_chunks

    def _run(self) -> None:
        run_as_worker()
        err: BaseException | None = None
        try:
            while True:
                with self._cond:
                    i = self._next
                    if i >= self._n_chunks or self.error is not None:
                        break
                    self._next += 1
                off = i * self._chunk
                length = min(self._chunk, self._len - off)
                try:
                    populate_range(self._addr + off, length)
                    touch_pages(self._addr + off, length)  # its first-read fault, here
                except OSError as e:
                    if e.errno == errno.EFAULT:
                        raise ReadError(f"the warm hit an unreadable page near byte {off}") from e
                    raise
                with self._cond:
                    self._done_flags[i] = True
                    while self._done_flags[self.prefix]:
                        self.prefix += 1
                    self._cond.notify_all()
        except BaseException as e:  # delivered to the gathers waiting on it
            err = e
        with self._cond:
            if err is not None and self.error is None:
                self.error = err
                self._cond.notify_all()
            self._left -= 1
            last = self._left == 0
        if last:
            madvise(self._addr, self._len, MADV_RANDOM)
            if self._on_done is not None:
                self._on_done(time.perf_counter() - self._t0, self.error)

    def stop(self) -> None:
        """Stop reading after the chunks in progress; gathers still waiting raise
        `StoreClosed`. A no-op once the table is read."""
        with self._cond:
            if not self.done and self.error is None:
                self.error = StoreClosed("the stream was closed before its table was read")
                self._cond.notify_all()

    def _wait_past(self, k: int) -> int:
        """Block until more than ``k`` chunks are done (or all); the new prefix."""
        with self._cond:
            while self.prefix <= k and self.error is None and not self.done:
                self._cond.wait()
            if self.error is not None:
                raise self.error
            return self.prefix

    def wait(self) -> None:
        self._wait_past(self._n_chunks)

    def _pending(self, rows: np.ndarray, out2d: np.ndarray) -> Pending:
        rb = int(self._arr.shape[1])
        # the chunk that ends each row (its other bytes lie in that chunk or the one before)
        last = (rows.astype(np.int64) * rb + (self._lead + rb - 1)) // self._chunk
        small = last.astype(np.uint16 if self._n_chunks < 1 << 16 else np.int64)
        order = np.argsort(small, kind="stable")  # a radix sort of small ints
        bounds = np.concatenate(([0], np.cumsum(np.bincount(last, minlength=self._n_chunks))))
        return Pending(self._arr, rows, out2d, order, bounds, self._rows_v)

    def gather(self, rows: np.ndarray, out2d: np.ndarray) -> None:
        """``out2d[i] = arr[rows[i]]`` (``rows`` flat, in range), as soon as the rows are read
        (blocks until then)."""
        if self.done or self._serve_now:
            if self.error is not None:
                raise self.error
            take_one(self._arr, rows, out2d)
            return
        p = self._pending(rows, out2d)
        while p.got < self._n_chunks:
            k = self.prefix
            if k <= p.got:
                k = self._wait_past(p.got)
            p.fill_to(k)

    def submit(self, rows: np.ndarray, out2d: np.ndarray) -> Pending:
        """`gather` without blocking: the rows are gathered by one filler thread as the
        chunks land; `Pending.wait` returns once they all have."""
        p = self._pending(rows, out2d)
        with self._cond:
            if self.done or self.error is not None:
                if self.error is None:
                    p.fill_to(self._n_chunks)
                else:
                    p.fail(self.error)
                return p
            self._queue.append(p)
            if self._filler is None:
                self._filler = threading.Thread(
                    target=self._fill, name="engramdb-stream-fill", daemon=True
                )
                self._filler.start()
            self._cond.notify_all()
        return p

    def _fill(self) -> None:
        run_as_worker()
        while True:
            with self._cond:
                while True:
                    work = [p for p in self._queue if p.got < self.prefix]
                    if work or self.error is not None or (self.done and not self._queue):
                        break
                    self._cond.wait()
                k, err = self.prefix, self.error
                if err is not None:
                    work, self._queue = self._queue, []
            for p in work:
                if err is not None:
                    p.fail(err)
                    continue
                p.fill_to(k)
                if p.got >= self._n_chunks:
                    p.finish()
            with self._cond:
                self._queue = [p for p in self._queue if not p.finished]
                if (self.done or err is not None) and not self._queue:
                    return

    def join(self) -> None:
        for t in self._threads:
            t.join()
        f = self._filler
        if f is not None:
            f.join()


class Pending:
    """One gather waiting on a `TableWarm`: its rows grouped by the chunk that completes
    them (``order``, ``bounds``), gathered chunk group by chunk group (``got``: the chunks
    done). `wait` blocks until every row is in ``out2d`` (or raises the warm's error)."""

    def __init__(
        self,
        arr: np.ndarray,
        rows: np.ndarray,
        out2d: np.ndarray,
        order: np.ndarray,
        bounds: np.ndarray,
        rows_v: np.ndarray | None = None,
    ):
        self._arr = arr
        self._rows = rows
        self._out = out2d
        self._order = order
        self._bounds = bounds
        # Whole-row items (`_row_items`) of the table and of ``out2d``, and the rows in chunk
        # order (each chunk's group one slice): a chunk's rows are one item take and put.
        out_v = _row_items(out2d) if rows_v is not None else None
        self._items = None if rows_v is None or out_v is None else (rows_v, out_v, rows[order])
        self.got = 0
        self.finished = False
        self._error: BaseException | None = None
        self._event = threading.Event()

    def fill_to(self, k: int) -> None:
        """Gather the rows completed by chunks ``[got, k)`` (all of them read)."""
        if k > self.got:
            b0, b1 = int(self._bounds[self.got]), int(self._bounds[k])
            if b1 > b0:
                sel = self._order[b0:b1]
                if self._items is not None:
                    rows_v, out_v, src = self._items
                    np.put(out_v, sel, np.take(rows_v, src[b0:b1]))
                else:
                    self._out[sel] = self._arr[self._rows[sel]]
            self.got = k
            if k >= self._bounds.shape[0] - 1:
                self.finish()

    def finish(self) -> None:
        self.finished = True
        self._event.set()

    def fail(self, err: BaseException) -> None:
        self._error = err
        self.finish()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error


def _row_items(a: np.ndarray) -> np.ndarray | None:
    """``a`` (``[n, row_bytes]`` uint8 with contiguous rows) as ``n`` items of one
    ``V{row_bytes}`` each, a view (a fancy gather/scatter of whole items is a few times
    faster than of 2-D rows); None when its rows are not laid out back to back."""
    rb = int(a.shape[1]) if a.ndim == 2 else 0
    if rb == 0 or a.strides != (rb, 1):
        return None
    try:
        return a.view(np.dtype((np.void, rb))).reshape(-1)
    except ValueError:
        return None
