"""Start the device reads of scattered rows of a mapping in one system call.

`willneed_rows` asks the kernel to read the pages under a batch of rows of a file mapping into
the page cache, without waiting for them: ``MADV_WILLNEED`` on every row's page span, all in
one ``process_madvise(2)`` call on this process (Linux 5.10+; up to 1,024 spans a call)
through ctypes, so the GIL is released for the whole submission. Every span's read is in
flight at once; a gather from the mapping right after waits only for the pages still on
their way, then finds them cached.

This is the decode path's prefetch (`engramdb.read.prefetch.Prefetcher` with kept rows):
a step's few dozen rows cost one call and a few numpy operations of Python, where a batch
of ``io_uring`` reads costs ~230 us of Python (measured here on 32 rows), which a model
thread pays as GIL waits. Where ``process_madvise`` is missing or refused (an older kernel,
a seccomp filter), each span gets its own ``madvise`` (still no Python loop per row beyond
the call itself: one ctypes call per span, the GIL released in each).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import numpy as np

from engramdb.io.mapping import LIBC, MADV_WILLNEED, madvise
from engramdb.layouts.geometry import PAGE

__all__ = ["MAX_SPANS", "willneed_rows", "willneed_spans"]

#: Spans one ``process_madvise`` call takes (the kernel's ``UIO_MAXIOV``).
MAX_SPANS = 1024
# pidfd_open (5.3) and process_madvise (5.10) have the same number on every architecture
# (the unified system call table, from 424 on).
_SYS_PIDFD_OPEN = 434
_SYS_PROCESS_MADVISE = 440


class _Self:
    """A pidfd of this process (reopened after a fork), or None once the call is refused."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = -1
        self.fd: int | None = None
        self.refused = False

    def pidfd(self) -> int | None:
        pid = os.getpid()
        if self.pid == pid:
            return self.fd
        with self.lock:
            if self.pid != pid:  # first call, or a child after fork: the parent's fd is not ours
                fd = int(LIBC.syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0)))
                self.fd = fd if fd >= 0 else None
                self.refused = fd < 0
                self.pid = pid
        return self.fd


_SELF = _Self()


def willneed_spans(spans: np.ndarray) -> None:
    """``MADV_WILLNEED`` on each ``[start, start + length)`` of ``spans`` (C-contiguous
    ``uint64 [n, 2]`` of page-aligned starts and lengths inside live mappings of this
    process): reads start, nothing waits. Raises `OSError` if the kernel refuses a span of a
    live mapping (``EFAULT``-like errors other than a missing system call)."""
    n = int(spans.shape[0])
    if n == 0:
        return
    fd = _SELF.pidfd() if not _SELF.refused else None
    if fd is not None:
        addr = int(spans.ctypes.data)
        done = 0
        while done < n:
            k = min(MAX_SPANS, n - done)
            r = LIBC.syscall(
                _SYS_PROCESS_MADVISE,
                ctypes.c_long(fd),
                ctypes.c_void_p(addr + done * 16),
                ctypes.c_size_t(k),
                ctypes.c_int(MADV_WILLNEED),
                ctypes.c_uint(0),
            )
            if r < 0:
                e = ctypes.get_errno()
                if e in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.EBADF):
                    _SELF.refused = True  # not offered here: one madvise per span from now on
                    break
                raise OSError(e, f"process_madvise(MADV_WILLNEED): {os.strerror(e)}")
            done += k
        else:
            return
        spans = spans[done:]
    for start, length in spans.tolist():
        madvise(start, length, MADV_WILLNEED)


def willneed_rows(base: int, ids: np.ndarray, row_bytes: int) -> int:
    """Start reading rows ``ids`` (validated int64) of the ``[n_rows, row_bytes]`` table mapped
    at address ``base``: one span per row covering its pages. Returns the bytes of the spans
    advised (pages already cached cost no read)."""
    n = int(ids.size)
    if n == 0:
        return 0
    spans = np.empty((n, 2), np.uint64)
    start = spans[:, 0]
    np.multiply(ids.reshape(-1), row_bytes, out=start, casting="unsafe")
    start += np.uint64(base)
    end = spans[:, 1]
    np.add(start, np.uint64(row_bytes - 1 + PAGE), out=end)
    mask = np.uint64(~(PAGE - 1) & 0xFFFFFFFFFFFFFFFF)
    np.bitwise_and(start, mask, out=start)
    np.bitwise_and(end, mask, out=end)
    end -= start  # the length of the page span: 1 page, 2 where the row crosses a page
    willneed_spans(spans)
    return int(end.sum())
