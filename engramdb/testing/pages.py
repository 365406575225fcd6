"""Page-cache helpers for tests and probes: make a file cold, prove it is, inspect mappings.

* `resident_pages` — residency of sampled addresses inside live mappings (one ``mincore``
  each).
* `mapped_residency` / `file_residency` — fraction of a mapped view's / a file's pages in
  the page cache (`file_residency` maps the range without populating it; ~1 ms per GB).
* `evict` — ``fdatasync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)``. Pages still mapped by
  this process are not dropped until the mapping lets go of them: call `drop_mapped_pages`
  on every live mapping of the file first (e.g. ``drop_mapped_pages(store.array())``).
* `populate` / `advise_random` — ``MADV_POPULATE_READ`` / ``MADV_RANDOM`` on a mapped view.

The library itself only needs `engramdb.io.residency.resident_count` and the mapping's own
methods; everything here goes through the one libc binding in `engramdb.io.mapping`.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.io.mapping import (
    MADV_DONTNEED,
    MADV_RANDOM,
    madvise,
    map_range,
    mincore,
    populate_range,
    range_pages,
    unmap_range,
)
from engramdb.io.resident_lock import release_range
from engramdb.layouts.geometry import PAGE

__all__ = [
    "PAGE",
    "advise_random",
    "drop_mapped_pages",
    "evict",
    "file_residency",
    "mapped_residency",
    "populate",
    "resident_pages",
]


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
    for i, a in enumerate(pages):  # bounded by the sample size the caller chose
        mincore(a, PAGE, base + i)
    return (vec & 1).astype(bool)


def mapped_residency(view: np.ndarray) -> float:
    """Fraction (0..1) of the pages under a mapped numpy view that are resident."""
    if view.nbytes == 0:
        return 1.0
    have, n = range_pages(*_view_range(view))
    return float(have) / n


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
            addr = map_range(fd, start, span)
            try:
                have, n = range_pages(addr, span)
            finally:
                unmap_range(addr, span)
            total += n
            resident += have
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


def drop_mapped_pages(view: np.ndarray) -> None:
    """``MADV_DONTNEED`` over a mapped view: drops this process's page-table entries so
    `evict` can drop the pages. The data stays valid (it is re-read on the next touch). A
    table of this process locked over the view (the ``lock`` open option) is unlocked first:
    a locked page cannot be dropped."""
    if view.nbytes:
        addr, length = _view_range(view)
        release_range(addr, length)
        madvise(addr, length, MADV_DONTNEED)


def advise_random(view: np.ndarray) -> None:
    """``MADV_RANDOM``: a fault reads one page instead of the read-ahead window."""
    if view.nbytes:
        madvise(*_view_range(view), MADV_RANDOM)


def populate(view: np.ndarray) -> None:
    """Fill the page tables for a mapped view (reads cold pages at device speed).

    ``MADV_POPULATE_READ`` (Linux 5.14+), else ``MADV_WILLNEED`` (which only starts I/O).
    Blocks for the whole range; the GIL is released.
    """
    if view.nbytes:
        populate_range(*_view_range(view))
