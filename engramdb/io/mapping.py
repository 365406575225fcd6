"""One contiguous read-only mapping over many shard files, plus the one libc binding.

Shards are mapped back to back into a single reserved virtual range (``MAP_FIXED`` over a
``PROT_NONE`` reservation), so a table of many shards is still one ``[n_rows, row_bytes]``
numpy array and a gather never groups ids by shard. Every shard but the last is a whole
number of pages (the badge rule guarantees it), so row ``r`` sits at byte ``r * row_bytes``.

madvise goes through ctypes rather than ``mmap.madvise`` because ctypes releases the GIL for
the duration of the call: populating a mapping can then run in background threads. `LIBC` is
the package's one ctypes handle on libc (``mmap``, ``munmap``, ``madvise``, ``mincore`` typed
here; io_uring's ``syscall`` / ``statx`` go through it too); `madvise`, `mincore`,
`populate_range`, `map_range` / `unmap_range` wrap it with errors as `OSError`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engramdb.errors import InvalidArgument, ReadError, StoreClosed
from engramdb.layouts.geometry import PAGE

PROT_NONE, PROT_READ = 0x0, 0x1
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MADV_NORMAL, MADV_RANDOM, MADV_SEQUENTIAL, MADV_WILLNEED, MADV_DONTNEED = 0, 1, 2, 3, 4
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
_MAP_FAILED = ctypes.c_void_p(-1).value

#: The process's libc through ctypes (``use_errno=True``; calls release the GIL).
LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long  # raw system calls return a long (-1: errno)
_libc = LIBC
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(2)`` through ctypes (releases the GIL). Raises `OSError` on failure."""
    if length <= 0:
        return
    start = addr & ~(PAGE - 1)
    length += addr - start
    if _libc.madvise(start, length, advice) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"madvise(advice={advice}) failed: {os.strerror(e)}")


def mincore(addr: int, length: int, vec: int) -> None:
    """``mincore(2)``: one byte per page of ``[addr, addr + length)`` (``addr`` page-aligned,
    inside live mappings) written at address ``vec``. Raises `OSError` (``ENOMEM`` for an
    address outside any mapping)."""
    if _libc.mincore(addr, length, vec) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mincore: {os.strerror(e)}")


def range_pages(addr: int, length: int) -> tuple[int, int]:
    """``(resident, total)`` pages under ``[addr, addr + length)`` of a live mapping (one
    ``mincore`` over the page-aligned span; ``(0, 0)`` for an empty range)."""
    if length <= 0:
        return 0, 0
    start = addr & ~(PAGE - 1)
    pages = -(-(addr + length - start) // PAGE)
    vec = np.zeros(pages, dtype=np.uint8)
    mincore(start, pages * PAGE, vec.ctypes.data)
    return int(np.count_nonzero(vec & 1)), pages


def address_view(addr: int, nbytes: int) -> np.ndarray:
    """A read-only flat uint8 array over ``nbytes`` bytes of a live mapping at ``addr`` (no
    copy; valid while the mapping is)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    arr = np.frombuffer(memoryview(buf), dtype=np.uint8)
    arr.flags.writeable = False
    return arr


def populate_range(addr: int, length: int) -> None:
    """Fill the page tables for ``[addr, addr + length)`` of a live mapping (reads cold pages
    at device speed; blocks, the GIL released): ``MADV_POPULATE_READ`` (Linux 5.14+), else
    ``MADV_WILLNEED`` (which only starts I/O). Raises `OSError` (``EFAULT``: an unreadable
    page)."""
    try:
        madvise(addr, length, MADV_POPULATE_READ)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: kernel < 5.14, no POPULATE_READ
            raise
        madvise(addr, length, MADV_WILLNEED)


def touch_pages(addr: int, length: int) -> None:
    """Read one byte of every page of ``[addr, addr + length)`` of a live readable mapping
    (one strided ``max``; numpy releases the GIL). Pages not in the page cache are read in.

    For pages just populated: on a VM that returns free guest memory to its host (free
    page reporting, as on these machines), a page-cache page the guest CPU has not read yet
    can cost a second-level fault at its first read, after the kernel has read it and
    mapped it. Touching each chunk in the thread that populated it moves that cost off the
    gathers that follow. Measured on a 2.56 GB table after a cache drop, corpus stream
    (`stream_warm.TableWarm`): 1.65-1.69 M tokens/s once the table was read, against
    1.54-1.57 M without; ~0.1 us a page where there is nothing to pay."""
    if length <= 0:
        return
    view = np.frombuffer(memoryview((ctypes.c_ubyte * length).from_address(addr)), np.uint8)
    view[:1].max()  # the page holding addr
    first = _round_up(addr, PAGE) - addr  # then every page that starts inside the range
    if first < length:
        view[first::PAGE].max()


def _whole_pages(buf: np.ndarray, *, writable: bool) -> tuple[int, int] | None:
    """``(lo, hi)``: the page-aligned span of the whole pages inside ``buf``, a C-contiguous
    array of 1 MiB or more (writable if asked); None for anything else or no whole page."""
    if buf.nbytes < 1 << 20 or not buf.flags.c_contiguous:
        return None
    if writable and not buf.flags.writeable:
        return None
    a = int(buf.ctypes.data)
    lo = _round_up(a, PAGE)
    hi = (a + buf.nbytes) // PAGE * PAGE
    return (lo, hi) if hi > lo else None


def prefault(buf: np.ndarray) -> np.ndarray:
    """Commit the whole pages inside ``buf`` (a fresh, writable C-contiguous array) in one
    call (``MADV_POPULATE_WRITE``, Linux 5.14+; a no-op elsewhere), and return ``buf``.

    Touching a fresh buffer page by page takes one page fault per 4 KiB; on this VM a fault
    costs ~6 us, so writing a fresh GB costs 1.7 s against 0.13 s populated in one call
    (measured: 48 buffers of 21 MB). Only for buffers about to be written in full."""
    span = _whole_pages(buf, writable=True)
    if span is not None:
        try:
            madvise(span[0], span[1] - span[0], MADV_POPULATE_WRITE)
        except OSError:
            pass  # an older kernel: the pages fault in as they are written
    return buf


def small_pages(buf: np.ndarray) -> np.ndarray:
    """Ask that the whole pages inside ``buf`` (a fresh array, not yet touched) be backed by
    4 KiB pages, not transparent huge pages (``MADV_NOHUGEPAGE``; numpy asks for huge pages
    for arrays of 4 MiB or more), and return ``buf``.

    For large buffers committed inside a memory cgroup after other processes churned the
    page cache: there, a stream's first 1.2 GB window took 7-14 s to commit and load in huge
    pages against 2.1-2.6 s in small pages (`probes/stream.py`, the over-budget arm right
    after the memmap arm), with the same rate after it."""
    span = _whole_pages(buf, writable=False)
    if span is not None:
        try:
            madvise(span[0], span[1] - span[0], MADV_NOHUGEPAGE)
        except OSError:
            pass  # a kernel without transparent huge pages
    return buf


def prefault_watched(buf: np.ndarray, chunk: int = 64 << 20, slow_s_per_gb: float = 0.5) -> bool:
    """`prefault` a large fresh buffer in chunks of ``chunk`` bytes, in whatever pages numpy
    asked for (transparent huge pages for 4 MiB or more: faster random gathers later), but
    watched: once a chunk commits slower than ``slow_s_per_gb`` (huge pages that the kernel
    must first assemble from fragmented memory: 5-12 s for a 1.2 GB stream window here,
    against ~0.1 s normally), the rest is committed in small pages (`small_pages`). Returns
    whether it fell back."""
    span = _whole_pages(buf, writable=True)
    if span is None:
        return False
    pos, hi = span
    while pos < hi:
        n = min(chunk, hi - pos)
        t0 = time.perf_counter()
        try:
            madvise(pos, n, MADV_POPULATE_WRITE)
        except OSError:
            return False  # an older kernel: the pages fault in as they are written
        pos += n
        if pos < hi and time.perf_counter() - t0 > slow_s_per_gb * n / 1e9:
            try:
                madvise(pos, hi - pos, MADV_NOHUGEPAGE)
                madvise(pos, hi - pos, MADV_POPULATE_WRITE)
            except OSError:
                pass
            return True
    return False


def map_range(fd: int, offset: int, length: int) -> int:
    """Map ``length`` bytes of ``fd`` from ``offset`` (page-aligned) read-only and shared,
    without reading anything; returns the address. Release it with `unmap_range`."""
    addr = _libc.mmap(None, length, PROT_READ, MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"mmap: {os.strerror(e)}")
    return int(addr)


def _reserve_aligned(length: int) -> int:
    """Reserve ``length`` bytes of address space (no access, no memory) starting on a 2 MiB
    boundary (the head and tail of a larger reservation released): the kernel maps a
    page-cache folio of 2 MiB with one PMD entry only when file offset and address agree
    modulo 2 MiB. Mappings are then placed inside with `_map_fixed`."""
    extra = HUGE if length >= HUGE else 0
    raw = _libc.mmap(
        None, length + extra, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
    )
    if raw in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"cannot reserve {length} bytes: {os.strerror(e)}")
    raw = int(raw)
    base = -(-raw // HUGE) * HUGE if extra else raw
    if base > raw:
        _libc.munmap(raw, base - raw)
    if raw + extra > base:
        _libc.munmap(base + length, raw + extra - base)
    return base


def _map_fixed(fd: int, addr: int, length: int) -> None:
    """Map the first ``length`` bytes of ``fd``'s file read-only and shared at ``addr``
    (inside a `_reserve_aligned` range), through a new open file description: the
    caller's descriptor may carry ``POSIX_FADV_RANDOM`` (for its syscall reads), which
    would also turn the mapping's sequential read-ahead (populate) into 4 KiB folios. The
    mapping keeps the file; the new descriptor is closed at once."""
    own = _own_description(fd)
    try:
        got = _libc.mmap(addr, length, PROT_READ, MAP_SHARED | MAP_FIXED, own, 0)
        if got in (None, _MAP_FAILED) or got != addr:
            e = ctypes.get_errno()
            raise OSError(e, f"cannot map fd {fd}: {os.strerror(e)}")
    finally:
        if own != fd:
            os.close(own)


def map_file_aligned(fd: int, length: int) -> int:
    """Map the first ``length`` bytes (a page multiple) of ``fd``'s file read-only and shared
    at a 2 MiB-aligned address through a new open file description (`_map_fixed`), reading
    nothing. Release it with `unmap_range`."""
    base = _reserve_aligned(length)
    try:
        _map_fixed(fd, base, length)
    except BaseException:
        _libc.munmap(base, length)
        raise
    return base


def populate_sequential(
    groups: Sequence[Sequence[tuple[int, int]]],
    *,
    threads: int = 2,
    chunk: int = 64 * 1024 * 1024,
    progress: Callable[[int], None] | None = None,
    restore: int = MADV_RANDOM,
) -> None:
    """Fault ``(addr, length)`` ranges of live mappings into the page tables, each group
    (the ranges of one file) in one sequential pass (``MADV_SEQUENTIAL``, then
    ``MADV_POPULATE_READ`` chunk by chunk, the GIL released), up to ``threads`` groups at
    once; each range's advice is set to ``restore`` afterwards.

    One pass per file, because the kernel's read-ahead state belongs to the open file: two
    threads faulting interleaved chunks of one file look random to it, and it fills the
    page cache with 4 KiB folios instead of 2 MiB ones, which mappings then map with 4 KiB
    page-table entries (measured here: 16,384 random 160 B rows gathered at 41-44 ns/row
    through 4 KiB entries, 32-35 ns/row through 2 MiB ones). An unreadable page is a
    `ReadError`."""

    def one(ranges: Sequence[tuple[int, int]]) -> None:
        for addr, n in ranges:
            madvise(addr, n, MADV_SEQUENTIAL)
            try:
                for off in range(0, n, chunk):
                    k = min(chunk, n - off)
                    try:
                        populate_range(addr + off, k)
                    except OSError as e:
                        if e.errno == errno.EFAULT:
                            raise ReadError(
                                f"populate hit an unreadable page near byte {off} of a "
                                f"{n}-byte range"
                            ) from e
                        raise
                    if progress is not None:
                        progress(k)
            finally:
                madvise(addr, n, restore)

    todo = [g for g in groups if g]
    if threads <= 1 or len(todo) <= 1:
        for g in todo:
            one(g)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(todo))) as pool:
        list(pool.map(one, todo))


def unmap_range(addr: int, length: int) -> None:
    """Release a mapping made by `map_range`."""
    _libc.munmap(addr, length)


def _own_description(fd: int) -> int:
    """A new read-only open file description of ``fd``'s file (``/proc/self/fd``), or
    ``fd`` itself where that cannot be opened."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return fd


#: The size of a PMD mapping (a 2 MiB page) on x86-64 and arm64 with 4 KiB pages.
HUGE = 2 << 20


class ShardMapping:
    """Read-only mapping of shard files laid end to end.

    ``fds`` are open read-only descriptors (the caller keeps ownership), ``sizes`` their
    byte lengths. ``array(n_rows, row_bytes)`` returns a zero-copy 2-D view; it is valid
    until `close`. Construction is cheap (no data is read).
    """

    def __init__(self, fds: Sequence[int], sizes: Sequence[int], *, random_access: bool = True):
        if len(fds) != len(sizes):
            raise InvalidArgument("fds and sizes differ in length")
        for i, s in enumerate(sizes[:-1]):
            if s % PAGE:
                raise InvalidArgument(f"shard {i} size {s} is not a page multiple")
        self._spans = [_round_up(s, PAGE) for s in sizes]
        self.length = sum(int(s) for s in sizes)
        self._reserved = max(PAGE, sum(self._spans))
        self._lock = threading.Lock()
        self._random = bool(random_access)  # the advice restored after a populate
        # Reserved 2 MiB-aligned (`_reserve_aligned`). Measured on a view of 2560 B records
        # whose page cache held 2 MiB folios: np.take through an unaligned mapping ran
        # 0.86-0.88x one through an aligned np.memmap of the same file (TLB misses).
        self._base: int | None = _reserve_aligned(self._reserved)
        try:
            pos = self._base
            for fd, span in zip(fds, self._spans):
                if span:
                    _map_fixed(fd, pos, span)
                pos += span
            if random_access and self.length:
                # Cold faults through a mapping otherwise pull megabytes of read-ahead per row.
                madvise(self._base, self.length, MADV_RANDOM)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> int:
        if self._base is None:
            raise StoreClosed("mapping is closed")
        return self._base

    def array(self, n_rows: int, row_bytes: int) -> np.ndarray:
        """Zero-copy ``[n_rows, row_bytes]`` uint8 view over the mapping (read-only)."""
        nbytes = n_rows * row_bytes
        if nbytes > self.length:
            raise InvalidArgument(f"{n_rows} rows x {row_bytes} B exceed the mapping")
        if nbytes == 0:
            return np.zeros((n_rows, row_bytes), dtype=np.uint8)
        return address_view(self.address, nbytes).reshape(n_rows, row_bytes)

    def populate(
        self,
        *,
        threads: int = 2,
        chunk: int = 64 * 1024 * 1024,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Fault every page into the page tables (reads cold pages from the device): each
        shard in one sequential pass, up to ``threads`` shards at once
        (`populate_sequential`); afterwards the mapping's own advice (random or normal) is
        restored. On kernels without ``MADV_POPULATE_READ`` falls back to ``MADV_WILLNEED``
        per chunk (which only starts I/O). Cost: one pass over the table at device speed
        when cold, ~0.1 s/GB when resident."""
        base, length = self.address, self.length
        groups = []
        pos = 0
        for span in self._spans:
            n = min(span, length - pos)
            if n > 0:
                groups.append([(base + pos, n)])
            pos += span
        populate_sequential(
            groups,
            threads=threads,
            chunk=chunk,
            progress=progress,
            restore=MADV_RANDOM if self._random else MADV_NORMAL,
        )

    def advise(self, advice: int) -> None:
        madvise(self.address, self.length, advice)

    def residency(self) -> float:
        """Fraction (0..1) of the mapping's pages resident in the page cache (``mincore``)."""
        if self.length == 0:
            return 1.0
        pages = -(-self.length // PAGE)
        vec = np.zeros(pages, dtype=np.uint8)
        mincore(self.address, pages * PAGE, vec.ctypes.data)
        return float(np.count_nonzero(vec & 1)) / pages

    def close(self) -> None:
        with self._lock:
            if self._base is not None:
                _libc.munmap(self._base, self._reserved)
                self._base = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
