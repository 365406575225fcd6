"""Page-cache residency checks (``mincore``) and eviction of our own files.

Used by the `auto` rule (is this batch's data resident?), by probes (make a file cold and
prove it is), and by tests. Everything goes through ctypes so long calls release the GIL.

* `resident_pages` — residency of a few sampled pages of a mapped view (one ``mincore`` per
  sample, ~1 us each): cheap enough to run before every batch.
* `file_residency` — fraction of a file's pages in the page cache (maps the range without
  populating it, ``mincore``, unmaps; ~1 ms per GB).
* `evict` — ``fdatasync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)``. Pages still mapped by
  this process are not dropped until the mapping lets go of them: call `drop_mapped_pages`
  on every live mapping of the file first.
* `populate` / `advise_random` — ``MADV_POPULATE_READ`` / ``MADV_RANDOM`` on a mapped view.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from engramdb.errors import InvalidArgument

__all__ = [
    "advise_random",
    "drop_mapped_pages",
    "evict",
    "file_residency",
    "populate",
    "resident_count",
    "resident_pages",
]

from engramdb.io.mapping import (  # noqa: E402  one set of libc bindings
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    MADV_RANDOM,
    MADV_WILLNEED,
    _libc,
)

PAGE = mmap.PAGESIZE
_MADV_RANDOM = MADV_RANDOM
_MADV_WILLNEED = MADV_WILLNEED
_MADV_DONTNEED = MADV_DONTNEED
_MADV_POPULATE_READ = MADV_POPULATE_READ
_MAP_FAILED = ctypes.c_void_p(-1).value


def _oserror(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


@contextmanager
def _fd(path_or_fd: str | os.PathLike[str] | int) -> Iterator[int]:
    if isinstance(path_or_fd, int):
        yield path_or_fd
        return
    fd = os.open(path_or_fd, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _view_range(view: np.ndarray) -> tuple[int, int]:
    """Page-aligned ``(address, length)`` covering a numpy view's bytes."""
    start = int(view.ctypes.data)
    end = start + int(view.nbytes)
    lo = start - start % PAGE
    return lo, end - lo


def resident_pages(addresses: np.ndarray) -> np.ndarray:
    """For each address (inside a live mapping), whether its page is in the page cache.

    One ``mincore`` per address: meant for a sample (tens), not for every row.
    Raises `OSError` (``ENOMEM``) for an address outside any mapping.
    """
    addrs = np.asarray(addresses, dtype=np.uint64)
    pages = (addrs & ~np.uint64(PAGE - 1)).tolist()
    vec = np.zeros(len(pages), dtype=np.uint8)
    base = int(vec.__array_interface__["data"][0])
    mincore = _libc.mincore
    for i, a in enumerate(pages):  # bounded by the sample size the caller chose
        if mincore(a, PAGE, base + i) != 0:
            raise _oserror("mincore")
    return (vec & 1).astype(bool)


def resident_count(addresses: list[int]) -> int:
    """How many of the given addresses (plain ints inside live mappings) sit on resident
    pages: `resident_pages` for a short list, without numpy overhead (~2 us per address)."""
    vec = ctypes.c_ubyte(0)
    ref = ctypes.byref(vec)
    mincore = _libc.mincore
    mask = ~(PAGE - 1)
    hits = 0
    for a in addresses:  # bounded by the sample size the caller chose
        if mincore(a & mask, PAGE, ref) != 0:
            raise _oserror("mincore")
        hits += vec.value & 1
    return hits


def mapped_residency(view: np.ndarray) -> float:
    """Fraction (0..1) of the pages under a mapped numpy view that are resident."""
    if view.nbytes == 0:
        return 1.0
    addr, length = _view_range(view)
    n = -(-length // PAGE)
    vec = np.zeros(n, dtype=np.uint8)
    if _libc.mincore(addr, length, vec.ctypes.data) != 0:
        raise _oserror("mincore")
    return float(np.count_nonzero(vec & 1)) / n


def file_residency(
    path_or_fd: str | os.PathLike[str] | int, offset: int = 0, length: int | None = None
) -> float:
    """Fraction (0..1) of the file's pages in ``[offset, offset+length)`` that are resident.

    Maps the range read-only without touching it (no page is read), asks ``mincore``,
    unmaps. Cost ~1 ms per GB. An empty range counts as fully resident.
    """
    with _fd(path_or_fd) as fd:
        size = os.fstat(fd).st_size
        if offset < 0:
            raise InvalidArgument(f"offset must be >= 0, got {offset}")
        end = size if length is None else min(size, offset + length)
        lo = offset - offset % PAGE
        if end <= lo:
            return 1.0
        total = resident = 0
        step = 1 << 30
        for start in range(lo, end, step):  # 1 GiB per mapping keeps the vector small
            span = min(step, end - start)
            addr = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
            if addr in (None, _MAP_FAILED):
                raise _oserror("mmap")
            try:
                n = -(-span // PAGE)
                vec = np.zeros(n, dtype=np.uint8)
                if _libc.mincore(addr, span, vec.ctypes.data) != 0:
                    raise _oserror("mincore")
            finally:
                _libc.munmap(addr, span)
            total += n
            resident += int(np.count_nonzero(vec & 1))
        return resident / total


def evict(path_or_fd: str | os.PathLike[str] | int, offset: int = 0, length: int = 0) -> float:
    """Drop the file's clean pages from the page cache; returns the residency afterwards.

    Writes dirty pages back first (``fdatasync``; dirty pages cannot be dropped). Only
    affects pages no mapping holds: `drop_mapped_pages` on our own mappings first.
    ``length=0`` means to the end of the file.
    """
    with _fd(path_or_fd) as fd:
        try:
            os.fdatasync(fd)
        except OSError as e:  # read-only or special files: nothing of ours can be dirty
            if e.errno not in (_errno.EBADF, _errno.EINVAL, _errno.EROFS):
                raise
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return file_residency(fd, offset, length or None)


def _madvise(view: np.ndarray, advice: int, what: str) -> None:
    if view.nbytes == 0:
        return
    addr, length = _view_range(view)
    if _libc.madvise(addr, length, advice) != 0:
        raise _oserror(what)


def drop_mapped_pages(view: np.ndarray) -> None:
    """``MADV_DONTNEED`` over a mapped view: drops this process's page-table entries so
    `evict` can drop the pages. The data stays valid (it is re-read on the next touch)."""
    _madvise(view, _MADV_DONTNEED, "madvise(MADV_DONTNEED)")


def advise_random(view: np.ndarray) -> None:
    """``MADV_RANDOM``: a fault reads one page instead of the read-ahead window."""
    _madvise(view, _MADV_RANDOM, "madvise(MADV_RANDOM)")


def populate(view: np.ndarray) -> None:
    """Fill the page tables for a mapped view (reads cold pages at device speed).

    ``MADV_POPULATE_READ`` (Linux 5.14+), else ``MADV_WILLNEED`` (which only starts I/O).
    Blocks for the whole range; the GIL is released.
    """
    if view.nbytes == 0:
        return
    addr, length = _view_range(view)
    if _libc.madvise(addr, length, _MADV_POPULATE_READ) != 0:
        if ctypes.get_errno() != _errno.EINVAL:
            raise _oserror("madvise(MADV_POPULATE_READ)")
        if _libc.madvise(addr, length, _MADV_WILLNEED) != 0:
            raise _oserror("madvise(MADV_WILLNEED)")
