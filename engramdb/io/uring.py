"""``io_uring`` backend in pure Python: ctypes syscalls, mmapped rings, numpy-filled entries.

One batch costs a handful of ``io_uring_enter`` calls, not one syscall per request:

* the submission entries (64-byte SQEs) are viewed as a numpy structured array over the
  kernel's mmapped SQE array and filled for up to a ring's worth of requests at once;
* the SQ index array is the identity, written once at setup (slot ``i`` -> SQE ``i``);
* completions (16-byte CQEs) are read as a structured array, classified with numpy
  (complete / short / end of file / error), and short reads are resubmitted for the rest;
* the ring is kept full: while requests remain, ``io_uring_enter`` waits for only a part of
  the in-flight requests and refills the freed slots (no drain at every window).

Memory ordering: the kernel only looks at the SQ tail inside ``io_uring_enter`` and we only
look at the CQ tail after it returns, so the syscall itself orders our plain numpy stores
and loads (no SQPOLL thread is used).

``O_DIRECT`` (``direct=True``): each caller fd is re-opened with ``O_DIRECT`` through
``/proc/self/fd`` (cached per inode), every request is widened to the file's direct-I/O
alignment (``statx`` ``STATX_DIOALIGN``, else 4 KiB) and read into an aligned bounce buffer,
then copied out with numpy. For 2560 B rows on 512 B sectors this reads exactly the payload
(1.00x device bytes) and leaves the page cache alone.

Availability is probed once per process (a real ring reading a temporary file), and can be
forced off with ``ENGRAMDB_DISABLE_IO_URING=1`` (tests and probes use it to show the fallback).
"""

from __future__ import annotations

import errno as _errno
import mmap
import os
import stat
import threading
from typing import ClassVar

import numpy as np

from engramdb.errors import BackendUnavailable, InvalidArgument, ReadError, StoreClosed
from engramdb.io.base import Backend, Batch, copy_segments, eof_error, read_error
from engramdb.io.uring_ring import (
    AT_EOF,
    CANCEL_TAG,
    DISABLE_ENV,
    IORING_ASYNC_CANCEL_ANY,
    IORING_ENTER_GETEVENTS,
    IORING_OP_ASYNC_CANCEL,
    IORING_OP_READ,
    MAX_SQE_BYTES,
    MAX_TRANSIENT_RETRIES,
    PROBE_LOCK,
    RETRY,
    SQE_DTYPE,
    Ring,
    Work,
    classify,
    enter,
    open_direct,
    probe,
)

__all__ = ["DISABLE_ENV", "IoUringBackend"]


class IoUringBackend(Backend):
    """Batched reads through ``io_uring`` (buffered, or ``O_DIRECT`` with ``direct=True``).

    ``entries`` is the ring size (requests in flight per ring, default 1024); ``refill`` the
    fraction of in-flight requests to wait for before refilling while more remain.
    ``direct_bounce_bytes`` bounds the aligned bounce buffer of a direct window (per ring).
    Thread-safe: each concurrent caller takes its own ring from a small pool (rings are
    created on demand and reused; at most ``max_rings``, beyond which callers wait).

    Construction raises `BackendUnavailable` (with the reason) where io_uring cannot run.
    """

    name = "io_uring"
    supports_direct = True
    wants_plan = True
    _cached: ClassVar[tuple[bool, str] | None] = None

    def __init__(
        self,
        entries: int = 1024,
        *,
        direct: bool = False,
        refill: float = 0.5,
        max_rings: int = 8,
        direct_bounce_bytes: int = 8 << 20,
    ) -> None:
        super().__init__()
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(f"io_uring backend unavailable: {why}")
        if entries < 1 or entries > 32768:
            raise InvalidArgument(f"entries must be in [1, 32768], got {entries}")
        if not 0.0 < refill <= 1.0:
            raise InvalidArgument(f"refill must be in (0, 1], got {refill}")
        if max_rings < 1 or direct_bounce_bytes < 4096:
            raise InvalidArgument("max_rings must be >= 1 and direct_bounce_bytes >= 4096")
        self.entries = int(entries)
        self.refill = float(refill)
        self._direct = bool(direct)
        self._bounce_bytes = int(direct_bounce_bytes)
        self._free: list[Ring] = []
        self._rings = 0
        self._max_rings = int(max_rings)
        self._cv = threading.Condition()
        self._busy = 0
        # Direct descriptors: caller fd -> (st_dev, st_ino, direct fd, alignment).
        self._direct_fds: dict[int, tuple[int, int, int, int]] = {}
        self._direct_lock = threading.Lock()
        self._bounce = threading.local()
        self._leaked: dict[int, object] = {}  # buffers the kernel may still write into
        #: Direct batches read buffered because a file refused O_DIRECT (e.g. tmpfs).
        self.direct_fallbacks = 0

    # --- capability -----------------------------------------------------------------------
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            return False, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        with PROBE_LOCK:
            if IoUringBackend._cached is None:
                IoUringBackend._cached = probe()
            return IoUringBackend._cached

    @property
    def direct(self) -> bool:
        return self._direct

    # --- ring pool ------------------------------------------------------------------------
    def _acquire(self) -> Ring:
        with self._cv:
            while True:
                if self._closed:
                    raise StoreClosed("io_uring backend is closed")
                if self._free:
                    self._busy += 1
                    return self._free.pop()
                if self._rings < self._max_rings:
                    self._rings += 1
                    self._busy += 1
                    break
                self._cv.wait()
        try:
            return Ring(self.entries)
        except OSError as e:
            with self._cv:
                self._rings -= 1
                self._busy -= 1
                self._cv.notify()
            raise ReadError(e.errno, f"cannot create an io_uring: {e.strerror}") from e

    def _release(self, ring: Ring) -> None:
        with self._cv:
            self._busy -= 1
            if ring.outstanding():  # interrupted before or during the drain
                ring.broken = True
            if ring.broken or self._closed:
                self._rings -= 1
                if not ring.broken:
                    ring.close()
            else:
                self._free.append(ring)
            self._cv.notify_all()

    def _close(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait()
            free, self._free = self._free, []
            self._rings -= len(free)
        for ring in free:
            ring.close()
        with self._direct_lock:
            fds, self._direct_fds = self._direct_fds, {}
        for _dev, _ino, dfd, _align in fds.values():
            if dfd >= 0:
                os.close(dfd)

    # --- reading --------------------------------------------------------------------------
    def _read(self, batch: Batch, dest: np.ndarray) -> None:
        ring = self._acquire()
        device = None  # buffered: the request lengths
        try:
            if self._direct:
                calls, device = self._read_direct(ring, batch, dest)
            else:
                calls = self._read_buffered(ring, batch, dest)
        finally:
            self._release(ring)
        self._count(batch.n, batch.nbytes, calls, device_bytes=device)

    def _read_buffered(self, ring: Ring, batch: Batch, dest: np.ndarray) -> int:
        work = Work(
            fd=batch.fds,
            off=batch.offsets,
            addr=np.uint64(dest.ctypes.data) + batch.dest_offsets.astype(np.uint64),
            length=batch.lengths,
            need=batch.lengths,
            done=np.zeros(batch.n, dtype=np.int64),
            align=1,
        )
        return self._run(ring, work, dest)

    def _run(self, ring: Ring, w: Work, keep_alive: object) -> int:
        """Drive every request of ``w`` to completion on ``ring``; returns enter calls.

        Raises `ReadError` for the first failure, after every in-flight request has
        completed. On any other exception (a signal handler raising mid-wait) the requests
        still held by the kernel are cancelled and waited for before it propagates.
        """
        n = int(w.off.shape[0])
        fresh = 0  # next request never submitted
        retry = np.empty(0, dtype=np.int64)
        calls = 0
        transient = 0
        failure: tuple[int, int] | None = None  # (request, -errno, or 0 for end of file)
        stage = ring.stage
        try:
            while True:
                more = failure is None and (retry.shape[0] > 0 or fresh < n)
                if more:
                    space = ring.entries - ring.outstanding()
                    if space > 0:
                        take_retry = retry[:space]
                        retry = retry[take_retry.shape[0] :]
                        take_fresh = min(space - take_retry.shape[0], n - fresh)
                        idx = np.arange(fresh, fresh + take_fresh, dtype=np.int64)
                        if take_retry.shape[0]:
                            idx = np.concatenate([take_retry, idx])
                        fresh += take_fresh
                        k = idx.shape[0]
                        done = w.done[idx]
                        if w.align > 1:
                            done = done - done % w.align
                            w.done[idx] = done
                        s = stage[:k]
                        s["fd"] = w.fd[idx]
                        s["off"] = w.off[idx] + done
                        s["addr"] = w.addr[idx] + done.astype(np.uint64)
                        s["len"] = np.minimum(w.length[idx] - done, MAX_SQE_BYTES)
                        s["user_data"] = idx
                        ring.push(k)
                        more = retry.shape[0] > 0 or fresh < n
                out = ring.outstanding()
                if out == 0:
                    break
                want = max(1, int(out * self.refill)) if more else out
                rc = enter(ring.fd, ring.unsubmitted(), want, IORING_ENTER_GETEVENTS)
                calls += 1
                if rc < 0 and rc not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
                    raise OSError(-rc, f"io_uring_enter failed: {os.strerror(-rc)}")
                cqes = ring.reap()
                if cqes.shape[0] == 0:
                    continue
                req = cqes["user_data"].astype(np.int64)
                res = cqes["res"]
                kind = classify(res, w.done[req], w.need[req])
                w.done[req] += np.maximum(res, 0)
                if w.align > 1:
                    # O_DIRECT only comes up short at the end of the file: a ragged short
                    # read that still misses needed bytes is the end of file.
                    kind[(kind == RETRY) & (res > 0) & (w.done[req] % w.align != 0)] = AT_EOF
                again = req[kind == RETRY]
                if again.shape[0]:
                    # Short reads always progress; only EINTR/EAGAIN could repeat forever.
                    transient += int(np.count_nonzero(res < 0))
                    if transient > MAX_TRANSIENT_RETRIES + 4 * n:
                        failure = failure or (int(again[0]), -_errno.EAGAIN)
                    else:
                        retry = np.concatenate([retry, again])
                if failure is None:
                    bad = np.flatnonzero(kind >= AT_EOF)
                    if bad.shape[0]:
                        i = int(bad[0])
                        failure = (int(req[i]), 0 if kind[i] == AT_EOF else int(res[i]))
        except BaseException:
            self._drain(ring, keep_alive)
            raise
        if failure is not None:
            i, code = failure
            fd = int((w.fd if w.report_fd is None else w.report_fd)[i])
            off = int((w.off if w.report_off is None else w.report_off)[i])
            if code == 0:
                raise eof_error(fd, off, int(w.need[i]), int(w.done[i]))
            raise read_error(-code, fd, off)
        return calls

    def _drain(self, ring: Ring, keep_alive: object) -> None:
        """Cancel what the kernel still holds on ``ring`` and wait for it, so no completion
        writes into ``keep_alive`` after we return. Until that succeeds the ring is marked
        broken (never reused) and ``keep_alive`` stays referenced (leaked rather than freed
        under the kernel), so even an exception inside this method is safe."""
        ring.broken = True
        token = id(keep_alive)
        with self._cv:
            self._leaked[token] = keep_alive
        ring.reap()
        if ring.outstanding() and ring.outstanding() < ring.entries:
            # IORING_OP_ASYNC_CANCEL with IORING_ASYNC_CANCEL_ANY (5.19+): requests that
            # could wait forever (pipes, sockets) complete with -ECANCELED instead.
            s = ring.stage[:1]
            s[0] = np.zeros(1, dtype=SQE_DTYPE)[0]
            s["opcode"] = IORING_OP_ASYNC_CANCEL
            s["fd"] = -1
            s["rw_flags"] = IORING_ASYNC_CANCEL_ANY
            s["user_data"] = CANCEL_TAG
            ring.push(1)
            ring.stage["opcode"] = IORING_OP_READ
            ring.stage["rw_flags"] = 0
        for _ in range(10_000):
            ring.reap()
            out = ring.outstanding()
            if out == 0:
                ring.broken = False
                with self._cv:
                    self._leaked.pop(token, None)
                return
            rc = enter(ring.fd, ring.unsubmitted(), out, IORING_ENTER_GETEVENTS)
            if rc < 0 and rc not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
                return

    # --- O_DIRECT ------------------------------------------------------------------------
    def _direct_fd(self, fd: int) -> tuple[int, int]:
        """``(direct fd, alignment)`` for caller ``fd``, reopened if the fd now names another
        file; ``(-1, 1)`` when the file system refuses ``O_DIRECT`` (tmpfs: EINVAL), in which
        case the batch is read buffered. Raises `ReadError` for a bad fd."""
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise read_error(e.errno or _errno.EBADF, fd, 0) from e
        with self._direct_lock:
            hit = self._direct_fds.get(fd)
            if hit is not None and hit[0] == st.st_dev and hit[1] == st.st_ino:
                return hit[2], hit[3]
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISBLK(st.st_mode):
                return -1, 1  # pipes, directories...: the buffered path reports the error
            try:
                dfd, align = open_direct(fd)
            except OSError as e:
                what = f"cannot open O_DIRECT: {e.strerror}"
                raise read_error(e.errno or _errno.EIO, fd, 0, what) from e
            if hit is not None and hit[2] >= 0:
                os.close(hit[2])
            self._direct_fds[fd] = (st.st_dev, st.st_ino, dfd, align)
            return dfd, align

    def _bounce_buffer(self, nbytes: int) -> np.ndarray:
        """Page-aligned scratch of at least ``nbytes`` (one per thread, reused)."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or buf.shape[0] < nbytes:
            size = max(nbytes, self._bounce_bytes)
            size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            anon = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = np.frombuffer(anon, dtype=np.uint8)
            self._bounce.buf = buf
        return buf

    def _read_direct(self, ring: Ring, batch: Batch, dest: np.ndarray) -> tuple[int, int]:
        """Read ``batch`` through ``O_DIRECT``: ``(syscalls, device bytes)``, the device bytes
        being the aligned spans asked of the kernel (the payload when it fell back)."""
        uniq, where = np.unique(batch.fds, return_inverse=True)
        pairs = [self._direct_fd(int(fd)) for fd in uniq.tolist()]  # one per distinct file
        if any(p[0] < 0 for p in pairs):
            self.direct_fallbacks += 1
            return self._read_buffered(ring, batch, dest), batch.nbytes
        dfds = np.array([p[0] for p in pairs], dtype=np.int32)[where]
        align = max(p[1] for p in pairs)
        start = batch.offsets - batch.offsets % align
        end = batch.offsets + batch.lengths
        span = -(-end // align) * align - start
        need = end - start
        # Windows of requests whose aligned spans fit the bounce buffer (a lone request larger
        # than the buffer gets a window, and a buffer, of its own).
        cum = np.cumsum(span)
        calls = 0
        lo = 0
        n = batch.n
        while lo < n:
            base = int(cum[lo] - span[lo])
            hi = int(np.searchsorted(cum, base + self._bounce_bytes, side="right"))
            hi = min(max(hi, lo + 1), n)
            sel = slice(lo, hi)
            slot = cum[sel] - span[sel] - base
            buf = self._bounce_buffer(int(cum[hi - 1]) - base)
            work = Work(
                fd=dfds[sel],
                off=start[sel],
                addr=np.uint64(buf.ctypes.data) + slot.astype(np.uint64),
                length=span[sel],
                need=need[sel],
                done=np.zeros(hi - lo, dtype=np.int64),
                align=align,
                report_fd=batch.fds[sel],
                report_off=batch.offsets[sel],
            )
            try:
                calls += self._run(ring, work, buf)
            finally:
                if ring.broken:  # the kernel may still own this buffer: never reuse it
                    self._bounce.buf = None
            copy_segments(
                buf,
                slot + (batch.offsets[sel] - start[sel]),
                batch.lengths[sel],
                dest,
                batch.dest_offsets[sel],
            )
            lo = hi
        return calls, int(cum[-1])
