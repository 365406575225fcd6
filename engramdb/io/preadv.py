"""``preadv`` backend: one positioned read per request, spread over a thread pool.

CPython releases the GIL inside ``os.preadv``, so threads overlap their waits on the device.
The per-request loop is unavoidable (one syscall per range); it is kept to a slice and a
call per request, with all arithmetic done up front by numpy.

How many threads run a batch is decided per batch from the batch itself (measured on these
machines, see ``docs/io.md``): a resident request costs ~1-2 us and more than two threads
make warm batches *slower* (GIL hand-offs), while a cold request waits ~50-100 us on the
device and needs ~16-32 requests in flight to approach the device's IOPS. The calling thread
therefore reads the first ``probe_requests`` requests alone and times them; a fast probe
runs the rest on ``warm_threads`` threads, a slow one on ``threads``.
"""

from __future__ import annotations

import errno as _errno
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from engramdb.errors import InvalidArgument, StoreClosed
from engramdb.io.base import Backend, Batch, eof_error, read_error

__all__ = ["PreadvBackend"]

#: Indirection so tests can inject short reads and EINTR/EAGAIN (looked up once per batch).
_preadv: Callable[[int, list[memoryview], int], int] = os.preadv

_MAX_TRANSIENT_RETRIES = 100


class PreadvBackend(Backend):
    """Thread-pool ``os.preadv`` backend (buffered I/O through the page cache).

    ``threads`` caps the threads used for a cold batch (default 32); ``warm_threads`` is used
    when the probe finds the data resident (default 2); ``cold_us`` is the mean probe latency
    per request (microseconds) above which a batch counts as cold. ``chunk`` is how many
    requests a worker takes at a time (work is shared dynamically, so one slow request does
    not stall a static partition).
    """

    name = "preadv"
    supports_direct = False
    wants_plan = True

    def __init__(
        self,
        threads: int = 32,
        *,
        warm_threads: int = 2,
        probe_requests: int = 32,
        cold_us: float = 8.0,
        chunk: int = 64,
    ) -> None:
        super().__init__()
        if threads < 1 or warm_threads < 1:
            raise InvalidArgument(f"threads={threads}, warm_threads={warm_threads}: need >= 1")
        if chunk < 1 or probe_requests < 0 or cold_us <= 0:
            raise InvalidArgument("chunk must be >= 1, probe_requests >= 0 and cold_us > 0")
        self.threads = int(threads)
        self.warm_threads = int(min(warm_threads, threads))
        self.probe_requests = int(probe_requests)
        self.cold_us = float(cold_us)
        self.chunk = int(chunk)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        #: Threads used by the last batch (for probes and tests; racy across threads).
        self.last_threads = 0

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._closed:
                raise StoreClosed("preadv backend is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, self.threads - 1), thread_name_prefix="engramdb-preadv"
                )
            return self._pool

    def _read(self, batch: Batch, dest: np.ndarray) -> None:
        n = batch.n
        fds = batch.fds.tolist()
        offs = batch.offsets.tolist()
        lens = batch.lengths.tolist()
        dofs = batch.dest_offsets.tolist()
        mv = dest.data
        errors: list[BaseException] = []
        stop = threading.Event()
        syscalls = [0]
        count_lock = threading.Lock()

        def run(lo: int, hi: int) -> None:
            pv = _preadv
            calls = 0
            try:
                for i in range(lo, hi):
                    if stop.is_set():
                        return
                    want = lens[i]
                    d = dofs[i]
                    calls += 1
                    try:
                        got = pv(fds[i], [mv[d : d + want]], offs[i])
                    except OSError as e:
                        got = self._recover(pv, e, fds[i], offs[i], mv[d : d + want])
                        calls += 1
                    if got != want:
                        calls += self._finish(pv, fds[i], offs[i], mv[d : d + want], got)
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                errors.append(e)
                stop.set()
            finally:
                with count_lock:
                    syscalls[0] += calls

        # Probe: the caller reads the first requests alone and times them.
        probe = min(n, self.probe_requests)
        t0 = time.perf_counter()
        run(0, probe)
        if errors:
            raise errors[0]
        if probe == n:
            self.last_threads = 1
            self._count(n, batch.nbytes, syscalls[0])
            return
        per_us = (time.perf_counter() - t0) * 1e6 / max(1, probe)
        cold = probe == 0 or per_us >= self.cold_us
        limit = self.threads if cold else self.warm_threads
        width = max(1, min(limit, -(-(n - probe) // self.chunk)))
        self.last_threads = width

        if width == 1:
            run(probe, n)
        else:
            step = self.chunk
            cursor = itertools.count(probe, step)  # next() is atomic under the GIL

            def worker() -> None:
                for lo in cursor:
                    if lo >= n or stop.is_set():
                        return
                    run(lo, min(n, lo + step))

            pool = self._executor()
            futures: list[Future[None]] = [pool.submit(worker) for _ in range(width - 1)]
            try:
                worker()
            except BaseException:
                stop.set()
                raise
            finally:
                # Never return while a worker may still write into dest.
                for f in futures:
                    f.exception()
        if errors:
            raise errors[0]
        self._count(n, batch.nbytes, syscalls[0])

    @staticmethod
    def _recover(
        pv: Callable[[int, list[memoryview], int], int],
        exc: OSError,
        fd: int,
        offset: int,
        view: memoryview,
    ) -> int:
        """Retry a failed call on EAGAIN/EINTR; anything else becomes a `ReadError`."""
        err = exc
        for _ in range(_MAX_TRANSIENT_RETRIES):
            if err.errno not in (_errno.EAGAIN, _errno.EINTR):
                break
            try:
                return pv(fd, [view], offset)
            except OSError as again:
                err = again
        raise read_error(err.errno or _errno.EIO, fd, offset) from err

    @classmethod
    def _finish(
        cls,
        pv: Callable[[int, list[memoryview], int], int],
        fd: int,
        offset: int,
        view: memoryview,
        got: int,
    ) -> int:
        """Continue a short read; 0 bytes before the end means EOF -> `ReadError`."""
        want = len(view)
        calls = 0
        while got < want:
            calls += 1
            try:
                more = pv(fd, [view[got:]], offset + got)
            except OSError as e:
                more = cls._recover(pv, e, fd, offset + got, view[got:])
            if more == 0:
                raise eof_error(fd, offset, want, got)
            got += more
        return calls

    def _close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
