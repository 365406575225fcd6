"""The io_uring kernel interface used by `engramdb.io.uring`: ABI constants and structs,
the mmapped submission/completion rings (`Ring`), completion classification, the O_DIRECT
alignment query and the once-per-process availability probe. No backend logic lives here.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engramdb.io.mapping import LIBC

DISABLE_ENV = "ENGRAMDB_DISABLE_IO_URING"

# --- kernel ABI (include/uapi/linux/io_uring.h; syscall numbers are shared by all
# architectures that use the generic table, including x86-64 and arm64) -----------------------
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_ENTER_GETEVENTS = 1 << 0
IORING_ENTER_SQ_WAKEUP = 1 << 1
IORING_SQ_NEED_WAKEUP = 1 << 0
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_SETUP_SQPOLL = 1 << 1
IORING_SETUP_SQ_AFF = 1 << 2
IORING_SETUP_CLAMP = 1 << 4
IORING_SETUP_ATTACH_WQ = 1 << 5
IORING_SETUP_SUBMIT_ALL = 1 << 7
IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_OP_READ = 22
IORING_OP_ASYNC_CANCEL = 14
IORING_ASYNC_CANCEL_ANY = 1 << 2
CANCEL_TAG = (1 << 64) - 1
STATX_DIOALIGN = 0x2000
AT_EMPTY_PATH = 0x1000

_libc = LIBC  # the one libc binding (engramdb.io.mapping)
_syscall = _libc.syscall  # its restype (long) is set where the binding is made

_L = ctypes.c_long


class SqRingOffsets(ctypes.Structure):
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


class CqRingOffsets(ctypes.Structure):
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


class Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", SqRingOffsets),
        ("cq_off", CqRingOffsets),
    ]


assert ctypes.sizeof(Params) == 120

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
MAX_TRANSIENT_RETRIES = 1000


def enter(ring_fd: int, to_submit: int, min_complete: int, flags: int) -> int:
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


class Ring:
    """One io_uring instance: its fd, the three mmapped regions and numpy views over them."""

    def __init__(
        self,
        entries: int,
        *,
        sqpoll_idle_ms: int | None = None,
        attach_fd: int | None = None,
        sqpoll_cpu: int | None = None,
    ) -> None:
        """``sqpoll_idle_ms``: a kernel thread polls the submission queue (``SQPOLL``) and
        sleeps after that many idle milliseconds, bound to CPU ``sqpoll_cpu`` if given
        (``SQ_AFF``); ``attach_fd``: share the polling thread of that ring (``ATTACH_WQ``).
        Raises `OSError` where the kernel refuses."""
        params = Params()
        if sqpoll_idle_ms is not None:
            params.flags = IORING_SETUP_SQPOLL | IORING_SETUP_CLAMP
            params.sq_thread_idle = int(sqpoll_idle_ms)
            if sqpoll_cpu is not None:
                params.flags |= IORING_SETUP_SQ_AFF
                params.sq_thread_cpu = int(sqpoll_cpu)
            if attach_fd is not None:
                params.flags |= IORING_SETUP_ATTACH_WQ
                params.wq_fd = int(attach_fd)
        else:
            params.flags = IORING_SETUP_CLAMP | IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN
        fd = int(_syscall(_L(SYS_IO_URING_SETUP), _L(entries), ctypes.byref(params)))
        if fd < 0 and ctypes.get_errno() == _errno.EINVAL and sqpoll_idle_ms is None:
            # Older kernels reject the newer setup flags; plain rings work the same here.
            params = Params()
            params.flags = IORING_SETUP_CLAMP
            fd = int(_syscall(_L(SYS_IO_URING_SETUP), _L(entries), ctypes.byref(params)))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup({entries}) failed: {os.strerror(e)}")
        self.fd = fd
        self.sqpoll = sqpoll_idle_ms is not None
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params)
        except BaseException:
            self.close()
            raise
        #: Hands entries just pushed to a thread that submits them (`engramdb.io.sqpoll`);
        #: returns False when it cannot (the caller then submits). None: no such thread.
        self.wake: Callable[[int, int, int, int], bool] | None = None
        #: Called first by `close` (a submitter thread's stop).
        self.closers: list[Callable[[], None]] = []
        self.broken = False

    def _map(self, p: Params) -> None:
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
        self.sq_flags = u32(sq_map, p.sq_off.flags)  # IORING_SQ_NEED_WAKEUP (SQPOLL)
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
        closers, self.closers, self.wake = self.closers, [], None
        for fn in closers:
            fn()
        for name in ("sq_head", "sq_tail", "sq_flags", "cq_head", "cq_tail", "cqes", "sqes"):
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
class Work:
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


def open_direct(fd: int) -> tuple[int, int]:
    """``(a new O_DIRECT descriptor of the file behind fd, its offset alignment)``, reopened
    through ``/proc/self/fd``; ``(-1, 1)`` where the file system refuses ``O_DIRECT``
    (``EINVAL`` / ``EOPNOTSUPP``: tmpfs before 6.6, some FUSE). Other errors raise `OSError`.
    The caller owns (closes) the descriptor."""
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (_errno.EINVAL, _errno.EOPNOTSUPP):
            return -1, 1
        raise
    return dfd, statx_dio_align(dfd)


def statx_dio_align(fd: int) -> int:
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


def probe() -> tuple[bool, str]:
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            level = f.read().strip()
    except OSError:
        level = "0"
    if level == "2":
        return False, "io_uring is disabled by the kernel (/proc/sys/kernel/io_uring_disabled=2)"
    try:
        ring = Ring(8)
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
            rc = enter(ring.fd, 1, 1, IORING_ENTER_GETEVENTS)
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


PROBE_LOCK = threading.Lock()
