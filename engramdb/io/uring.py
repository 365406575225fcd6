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

import ctypes
import errno as _errno
import mmap
import os
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engramdb.errors import BackendUnavailable, InvalidArgument, ReadError, StoreClosed
from engramdb.io.base import Backend, Batch, copy_segments, eof_error, read_error
from engramdb.io.mapping import LIBC

__all__ = ["DISABLE_ENV", "IoUringBackend"]

DISABLE_ENV = "ENGRAMDB_DISABLE_IO_URING"

# --- kernel ABI (include/uapi/linux/io_uring.h; syscall numbers are shared by all
# architectures that use the generic table, including x86-64 and arm64) -----------------------
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_ENTER_GETEVENTS = 1 << 0
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_SETUP_CLAMP = 1 << 4
IORING_SETUP_SUBMIT_ALL = 1 << 7
IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_OP_READ = 22
IORING_OP_ASYNC_CANCEL = 14
IORING_ASYNC_CANCEL_ANY = 1 << 2
_CANCEL_TAG = (1 << 64) - 1
STATX_DIOALIGN = 0x2000
AT_EMPTY_PATH = 0x1000

_libc = LIBC  # the one libc binding (engramdb.io.mapping)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

_L = ctypes.c_long


class _SqRingOffsets(ctypes.Structure):
    _fields_ = [
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("dropped", ctypes.c_uint32),
        ("array", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    ]


class _CqRingOffsets(ctypes.Structure):
    _fields_ = [
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32),
        ("overflow", ctypes.c_uint32),
        ("cqes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    ]


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqRingOffsets),
        ("cq_off", _CqRingOffsets),
    ]


assert ctypes.sizeof(_Params) == 120

# Every byte of the 64-byte SQE is a named field, so a whole-record numpy copy writes all of
# it (numpy skips unnamed padding when copying structured records).
SQE_DTYPE = np.dtype(
    {
        "names": [
            "opcode",
            "flags",
            "ioprio",
            "fd",
            "off",
            "addr",
            "len",
            "rw_flags",
            "user_data",
            "buf_index",
            "personality",
            "splice_fd_in",
            "addr3",
            "pad2",
        ],
        "formats": [
            "u1",
            "u1",
            "<u2",
            "<i4",
            "<u8",
            "<u8",
            "<u4",
            "<u4",
            "<u8",
            "<u2",
            "<u2",
            "<i4",
            "<u8",
            "<u8",
        ],
        "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32, 40, 42, 44, 48, 56],
        "itemsize": 64,
    }
)
CQE_DTYPE = np.dtype(
    {
        "names": ["user_data", "res", "flags"],
        "formats": ["<u8", "<i4", "<u4"],
        "offsets": [0, 8, 12],
        "itemsize": 16,
    }
)

#: One SQE reads at most this much; longer requests continue as "short reads". Linux caps a
#: single read at 0x7ffff000 bytes anyway. Tests lower it to exercise continuation.
MAX_SQE_BYTES = 1 << 30
_MAX_TRANSIENT_RETRIES = 1000


def _enter(ring_fd: int, to_submit: int, min_complete: int, flags: int) -> int:
    """``io_uring_enter``; returns the count submitted or ``-errno`` (GIL released)."""
    r = _syscall(
        _L(SYS_IO_URING_ENTER),
        _L(ring_fd),
        _L(to_submit),
        _L(min_complete),
        _L(flags),
        _L(0),
        _L(0),
    )
    return int(r) if r >= 0 else -ctypes.get_errno()


class _Ring:
    """One io_uring instance: its fd, the three mmapped regions and numpy views over them."""

    def __init__(self, entries: int) -> None:
        params = _Params()
        params.flags = IORING_SETUP_CLAMP | IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN
        fd = int(_syscall(_L(SYS_IO_URING_SETUP), _L(entries), ctypes.byref(params)))
        if fd < 0 and ctypes.get_errno() == _errno.EINVAL:
            # Older kernels reject the newer setup flags; plain rings work the same here.
            params = _Params()
            params.flags = IORING_SETUP_CLAMP
            fd = int(_syscall(_L(SYS_IO_URING_SETUP), _L(entries), ctypes.byref(params)))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup({entries}) failed: {os.strerror(e)}")
        self.fd = fd
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params)
        except BaseException:
            self.close()
            raise
        self.broken = False

    def _map(self, p: _Params) -> None:
        sq_bytes = p.sq_off.array + p.sq_entries * 4
        cq_bytes = p.cq_off.cqes + p.cq_entries * CQE_DTYPE.itemsize
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq_map = mmap.mmap(
                self.fd, max(sq_bytes, cq_bytes), mmap.MAP_SHARED, prot, offset=IORING_OFF_SQ_RING
            )
            cq_map = sq_map
            self._maps.append(sq_map)
        else:
            sq_map = mmap.mmap(self.fd, sq_bytes, mmap.MAP_SHARED, prot, offset=IORING_OFF_SQ_RING)
            self._maps.append(sq_map)
            cq_map = mmap.mmap(self.fd, cq_bytes, mmap.MAP_SHARED, prot, offset=IORING_OFF_CQ_RING)
            self._maps.append(cq_map)
        sqe_map = mmap.mmap(
            self.fd,
            p.sq_entries * SQE_DTYPE.itemsize,
            mmap.MAP_SHARED,
            prot,
            offset=IORING_OFF_SQES,
        )
        self._maps.append(sqe_map)

        def u32(m: mmap.mmap, off: int) -> np.ndarray:
            return np.frombuffer(m, dtype="<u4", count=1, offset=off)

        self.entries = int(p.sq_entries)
        self.sq_mask = int(u32(sq_map, p.sq_off.ring_mask)[0])
        self.sq_head = u32(sq_map, p.sq_off.head)
        self.sq_tail = u32(sq_map, p.sq_off.tail)
        sq_array = np.frombuffer(sq_map, dtype="<u4", count=self.entries, offset=p.sq_off.array)
        sq_array[:] = np.arange(self.entries, dtype=np.uint32)
        del sq_array
        self.cq_entries = int(p.cq_entries)
        self.cq_mask = int(u32(cq_map, p.cq_off.ring_mask)[0])
        self.cq_head = u32(cq_map, p.cq_off.head)
        self.cq_tail = u32(cq_map, p.cq_off.tail)
        self.cqes = np.frombuffer(
            cq_map, dtype=CQE_DTYPE, count=self.cq_entries, offset=p.cq_off.cqes
        )
        self.sqes = np.frombuffer(sqe_map, dtype=SQE_DTYPE, count=self.entries)
        # Every field we never set stays zero in the staging array (flags, ioprio, rw_flags,
        # buf_index, personality, ...): a whole-record copy keeps the kernel's view clean.
        self.stage = np.zeros(self.entries, dtype=SQE_DTYPE)
        self.stage["opcode"] = IORING_OP_READ

    def push(self, count: int) -> None:
        """Copy ``stage[:count]`` into the SQ slots after the tail and publish the new tail."""
        tail = int(self.sq_tail[0])
        start = tail & self.sq_mask
        first = min(count, self.entries - start)
        self.sqes[start : start + first] = self.stage[:first]
        if first < count:
            self.sqes[: count - first] = self.stage[first:count]
        self.sq_tail[0] = (tail + count) & 0xFFFFFFFF

    def unsubmitted(self) -> int:
        """SQEs published to the ring that the kernel has not consumed yet."""
        return (int(self.sq_tail[0]) - int(self.sq_head[0])) & 0xFFFFFFFF

    def outstanding(self) -> int:
        """SQEs published whose CQE we have not reaped. Every SQE we push yields exactly one
        CQE, and both counters are the kernel-visible ones, so this stays right even if an
        exception interrupts our bookkeeping."""
        return (int(self.sq_tail[0]) - int(self.cq_head[0])) & 0xFFFFFFFF

    def reap(self) -> np.ndarray:
        """Every completion now in the CQ ring (a copy), and free their slots."""
        head = int(self.cq_head[0])
        count = (int(self.cq_tail[0]) - head) & 0xFFFFFFFF
        if count == 0:
            return self.cqes[:0].copy()
        start = head & self.cq_mask
        first = min(count, self.cq_entries - start)
        if first == count:
            got = self.cqes[start : start + count].copy()
        else:
            got = np.concatenate([self.cqes[start:], self.cqes[: count - first]])
        self.cq_head[0] = (head + count) & 0xFFFFFFFF
        return got

    def close(self) -> None:
        for name in ("sq_head", "sq_tail", "cq_head", "cq_tail", "cqes", "sqes"):
            self.__dict__.pop(name, None)
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view escaped; the mapping dies with the process
                pass
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class _Work:
    """Per-request state of one ring run (arrays of the same length)."""

    fd: np.ndarray  # int32
    off: np.ndarray  # int64, file offset of the request start
    addr: np.ndarray  # uint64, destination address of the request start
    length: np.ndarray  # int64, bytes to ask for
    need: np.ndarray  # int64, bytes that must arrive (< length only for widened direct reads)
    done: np.ndarray  # int64, bytes arrived so far
    align: int  # continuation offsets are rounded down to this (1 for buffered reads)
    report_fd: np.ndarray | None = None  # what errors name (the caller's fd and offset when
    report_off: np.ndarray | None = None  # a direct read widened the request)


# Classification of completions, kept pure so tests can feed it synthetic results.
COMPLETE, RETRY, AT_EOF, FAILED = 0, 1, 2, 3


def classify(res: np.ndarray, done_before: np.ndarray, need: np.ndarray) -> np.ndarray:
    """For each completion: COMPLETE, RETRY (short read or EINTR/EAGAIN), AT_EOF or FAILED."""
    res = res.astype(np.int64)
    out = np.full(res.shape, FAILED, dtype=np.int8)
    after = done_before + np.maximum(res, 0)
    positive = res > 0
    out[positive & (after >= need)] = COMPLETE
    out[positive & (after < need)] = RETRY
    out[res == 0] = AT_EOF
    out[(res == -_errno.EINTR) | (res == -_errno.EAGAIN)] = RETRY
    return out


def _statx_dio_align(fd: int) -> int:
    """Offset alignment O_DIRECT needs on ``fd`` (``STATX_DIOALIGN``); 4096 if unknown."""
    buf = ctypes.create_string_buffer(256)
    try:
        rc = _libc.statx(_L(fd).value, b"", AT_EMPTY_PATH, STATX_DIOALIGN, buf)
    except AttributeError:  # pragma: no cover - libc without statx
        return 4096
    if rc != 0:
        return 4096
    mask = struct.unpack_from("<I", buf.raw, 0)[0]
    mem_align, off_align = struct.unpack_from("<II", buf.raw, 152)
    if not mask & STATX_DIOALIGN or off_align == 0:
        return 4096
    return int(max(off_align, mem_align, 512))


def _probe() -> tuple[bool, str]:
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            level = f.read().strip()
    except OSError:
        level = "0"
    if level == "2":
        return False, "io_uring is disabled by the kernel (/proc/sys/kernel/io_uring_disabled=2)"
    try:
        ring = _Ring(8)
    except OSError as e:
        why = {
            _errno.ENOSYS: "the kernel has no io_uring (ENOSYS)",
            _errno.EPERM: "io_uring_setup is not permitted here (EPERM: sandbox, seccomp, or "
            f"io_uring_disabled={level} without the io_uring group)",
            _errno.EACCES: "io_uring_setup was refused (EACCES)",
        }.get(e.errno or 0, f"io_uring_setup failed: {e}")
        return False, why
    try:
        with tempfile.TemporaryFile() as tmp:
            tmp.write(b"engramdb-io_uring-probe")
            tmp.flush()
            out = np.zeros(8, dtype=np.uint8)
            ring.stage["fd"][0] = tmp.fileno()
            ring.stage["off"][0] = 9
            ring.stage["addr"][0] = out.ctypes.data
            ring.stage["len"][0] = 8
            ring.stage["user_data"][0] = 7
            ring.push(1)
            rc = _enter(ring.fd, 1, 1, IORING_ENTER_GETEVENTS)
            if rc < 0:
                return False, f"io_uring_enter failed: {os.strerror(-rc)}"
            cqe = ring.reap()
            if cqe.shape[0] != 1 or int(cqe["res"][0]) != 8 or out.tobytes() != b"io_uring":
                res = int(cqe["res"][0]) if cqe.shape[0] else None
                return False, f"IORING_OP_READ does not work here (res={res})"
    except OSError as e:
        return False, f"io_uring probe read failed: {e}"
    finally:
        ring.close()
    return True, ""


_probe_lock = threading.Lock()


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
        self._free: list[_Ring] = []
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
        with _probe_lock:
            if IoUringBackend._cached is None:
                IoUringBackend._cached = _probe()
            return IoUringBackend._cached

    @property
    def direct(self) -> bool:
        return self._direct

    # --- ring pool ------------------------------------------------------------------------
    def _acquire(self) -> _Ring:
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
            return _Ring(self.entries)
        except OSError as e:
            with self._cv:
                self._rings -= 1
                self._busy -= 1
                self._cv.notify()
            raise ReadError(e.errno, f"cannot create an io_uring: {e.strerror}") from e

    def _release(self, ring: _Ring) -> None:
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
        try:
            if self._direct:
                calls = self._read_direct(ring, batch, dest)
            else:
                calls = self._read_buffered(ring, batch, dest)
        finally:
            self._release(ring)
        self._count(batch.n, batch.nbytes, calls)

    def _read_buffered(self, ring: _Ring, batch: Batch, dest: np.ndarray) -> int:
        work = _Work(
            fd=batch.fds,
            off=batch.offsets,
            addr=np.uint64(dest.ctypes.data) + batch.dest_offsets.astype(np.uint64),
            length=batch.lengths,
            need=batch.lengths,
            done=np.zeros(batch.n, dtype=np.int64),
            align=1,
        )
        return self._run(ring, work, dest)

    def _run(self, ring: _Ring, w: _Work, keep_alive: object) -> int:
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
                rc = _enter(ring.fd, ring.unsubmitted(), want, IORING_ENTER_GETEVENTS)
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
                    if transient > _MAX_TRANSIENT_RETRIES + 4 * n:
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

    def _drain(self, ring: _Ring, keep_alive: object) -> None:
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
            s["user_data"] = _CANCEL_TAG
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
            rc = _enter(ring.fd, ring.unsubmitted(), out, IORING_ENTER_GETEVENTS)
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
                dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                align = _statx_dio_align(dfd)
            except OSError as e:
                if e.errno != _errno.EINVAL:
                    what = f"cannot open O_DIRECT: {e.strerror}"
                    raise read_error(e.errno or _errno.EIO, fd, 0, what) from e
                dfd, align = -1, 1
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

    def _read_direct(self, ring: _Ring, batch: Batch, dest: np.ndarray) -> int:
        uniq, where = np.unique(batch.fds, return_inverse=True)
        pairs = [self._direct_fd(int(fd)) for fd in uniq.tolist()]  # one per distinct file
        if any(p[0] < 0 for p in pairs):
            self.direct_fallbacks += 1
            return self._read_buffered(ring, batch, dest)
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
            work = _Work(
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
        return calls
