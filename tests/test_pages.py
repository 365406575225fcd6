"""PageReader / IoUringPageReader: pages in one buffer, validated offsets and descriptors."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import engramdb.io.uring as uring_mod
from engramdb.errors import (
    BackendUnavailable,
    InvalidArgument,
    InvalidDtype,
    ReadError,
    ShapeMismatch,
)
from engramdb.io import IoUringBackend, IoUringPageReader, PageReader, PreadvBackend

PAGE = 4096
URING_OK, URING_WHY = IoUringBackend.availability()


def _readers() -> list[str]:
    return ["preadv", "io_uring", "io_uring_direct"] if URING_OK else ["preadv"]


def _make(kind: str, page_size: int = PAGE) -> PageReader:
    if kind == "preadv":
        return PageReader(page_size)
    return IoUringPageReader(page_size, entries=32, direct=kind == "io_uring_direct")


@pytest.fixture
def pages_file(tmp_path: Path) -> Iterator[tuple[int, np.ndarray, Path]]:
    data = np.random.default_rng(4).integers(0, 256, 64 * PAGE + 100, dtype=np.uint8)
    path = tmp_path / "p.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, data, path
    os.close(fd)


@pytest.mark.parametrize("kind", _readers())
def test_read_pages_exact(kind: str, pages_file: tuple[int, np.ndarray, Path]) -> None:
    fd, data, _ = pages_file
    pages = np.array([5, 0, 63, 5, 17, 2], dtype=np.int64)
    with _make(kind) as reader:
        got = reader.read_pages(fd, pages * PAGE)
        assert got.shape == (6, PAGE) and got.dtype == np.uint8
        want = data[: 64 * PAGE].reshape(64, PAGE)[pages]
        np.testing.assert_array_equal(got, want)
        as_list = reader.read_pages_list([fd] * 2, pages[:2] * PAGE)
        assert as_list == [want[0].tobytes(), want[1].tobytes()]


@pytest.mark.parametrize("kind", _readers())
def test_read_pages_into_out_and_many_files(
    kind: str, pages_file: tuple[int, np.ndarray, Path], tmp_path: Path
) -> None:
    fd, data, _ = pages_file
    other = tmp_path / "q.bin"
    data2 = data[::-1].copy()
    other.write_bytes(data2.tobytes())
    fd2 = os.open(other, os.O_RDONLY)
    try:
        rng = np.random.default_rng(1)
        n = 300
        which = rng.random(n) < 0.5
        fds = np.where(which, fd, fd2)
        pages = rng.integers(0, 64, n)
        out = np.zeros((n, PAGE), dtype=np.uint8)
        with _make(kind) as reader:
            assert reader.read_pages(fds, pages * PAGE, out=out) is out
        a = data[: 64 * PAGE].reshape(64, PAGE)
        b = data2[: 64 * PAGE].reshape(64, PAGE)
        np.testing.assert_array_equal(out, np.where(which[:, None], a[pages], b[pages]))
    finally:
        os.close(fd2)


@pytest.mark.parametrize("kind", _readers())
def test_read_pages_validation(kind: str, pages_file: tuple[int, np.ndarray, Path]) -> None:
    fd, _, path = pages_file
    with _make(kind) as reader:
        with pytest.raises(InvalidArgument, match="position 1"):
            reader.read_pages(fd, np.array([0, 100]))
        with pytest.raises(InvalidArgument):
            reader.read_pages(fd, np.array([-PAGE]))
        with pytest.raises(InvalidDtype):
            reader.read_pages(fd, np.array([0.0]))
        with pytest.raises(ShapeMismatch):
            reader.read_pages([fd, fd], np.array([0]))
        with pytest.raises(ShapeMismatch):
            reader.read_pages(fd, np.array([0]), out=np.zeros((2, PAGE), dtype=np.uint8))
        with pytest.raises(ReadError) as info:
            reader.read_pages((1 << 30) + 7, np.array([0]))
        assert info.value.errno == errno.EBADF
        r, w = os.pipe()
        try:
            with pytest.raises(InvalidArgument, match="not a regular file"):
                reader.read_pages(r, np.array([0]))
        finally:
            os.close(r)
            os.close(w)
        # the partial last page and a page past the end are both errors
        with pytest.raises(ReadError, match="p.bin"):
            reader.read_pages(fd, np.array([64 * PAGE]))
        with pytest.raises(ReadError):
            reader.read_pages(fd, np.array([80 * PAGE]))
        assert reader.read_pages(fd, np.empty(0, np.int64)).shape == (0, PAGE)


def test_page_size_must_be_sector_multiple() -> None:
    with pytest.raises(InvalidArgument):
        PageReader(1000)
    with pytest.raises(InvalidArgument):
        PageReader(0)


def test_small_pages(pages_file: tuple[int, np.ndarray, Path]) -> None:
    fd, data, _ = pages_file
    with PageReader(512) as reader:
        got = reader.read_pages(fd, np.array([512, 1024 * 7]))
    np.testing.assert_array_equal(got[0], data[512:1024])
    np.testing.assert_array_equal(got[1], data[7168 : 7168 + 512])


def test_shared_backend_is_not_closed(pages_file: tuple[int, np.ndarray, Path]) -> None:
    fd, _, _ = pages_file
    shared = PreadvBackend(threads=2)
    PageReader(backend=shared).close()
    assert not shared.closed
    shared.close()


def test_io_uring_page_reader_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(uring_mod.DISABLE_ENV, "1")
    with pytest.raises(BackendUnavailable, match=uring_mod.DISABLE_ENV):
        IoUringPageReader()
    PageReader().close()  # the preadv reader is unaffected


def test_touch_pages_reads_every_page_of_a_range(tmp_path: Path) -> None:
    import mmap

    from engramdb.io.mapping import PAGE, mincore, touch_pages

    p = tmp_path / "f.bin"
    data = np.random.default_rng(3).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, data.nbytes, prot=mmap.PROT_READ)
        arr = np.frombuffer(m, np.uint8)
        base = int(arr.ctypes.data)
        vec = np.zeros(64, np.uint8)
        mincore(base, 64 * PAGE, vec.ctypes.data)
        if np.count_nonzero(vec & 1) == 64:
            pytest.skip("the file could not be evicted here")
        # a range that starts and ends inside pages: pages 3..40 are read (read-ahead may add more)
        touch_pages(base + 3 * PAGE + 100, 37 * PAGE)
        mincore(base, 64 * PAGE, vec.ctypes.data)
        assert np.all(vec[3:41] & 1)
        touch_pages(base, 0)  # nothing to read
        del arr
        m.close()
    finally:
        os.close(fd)


def test_prefault_commits_the_pages_of_a_fresh_buffer() -> None:
    import mmap

    from engramdb.io.mapping import PAGE, mincore, prefault

    region = mmap.mmap(-1, 8 << 20)  # fresh anonymous memory: nothing committed yet
    buf = np.frombuffer(region, np.uint8)
    a = int(buf.ctypes.data)
    pages = buf.nbytes // PAGE
    vec = np.zeros(pages, np.uint8)
    mincore(a, pages * PAGE, vec.ctypes.data)
    assert np.count_nonzero(vec & 1) == 0
    assert prefault(buf) is buf
    mincore(a, pages * PAGE, vec.ctypes.data)
    assert np.count_nonzero(vec & 1) == pages  # every page committed, in one call
    buf[:] = 7  # still an ordinary writable buffer
    assert int(buf[::4096].sum()) == 7 * buf[::4096].size
    small = np.empty(1000, np.uint8)
    assert prefault(small) is small  # under 1 MiB: left to fault in


def _vm_flags(addr: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no THP"
)
def test_small_pages_turns_huge_pages_off_for_a_buffer() -> None:
    import mmap

    from engramdb.io.mapping import PAGE, small_pages

    region = mmap.mmap(-1, 16 << 20)
    buf = np.frombuffer(region, np.uint8)[PAGE:]  # whole pages inside, from its second
    assert "nh" not in _vm_flags(int(buf.ctypes.data))
    assert small_pages(buf) is buf
    assert "nh" in _vm_flags(int(buf.ctypes.data))  # MADV_NOHUGEPAGE on its pages
    buf[:] = 3
    assert int(buf[-1]) == 3
    assert small_pages(np.zeros(10, np.uint8)).size == 10  # a small array: left alone


def test_prefault_watched_commits_and_falls_back_when_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mmap

    from engramdb.io import mapping
    from engramdb.io.mapping import PAGE, mincore, prefault_watched

    def committed(buf: np.ndarray) -> int:
        pages = buf.nbytes // PAGE
        vec = np.zeros(pages, np.uint8)
        mincore(int(buf.ctypes.data), pages * PAGE, vec.ctypes.data)
        return int(np.count_nonzero(vec & 1))

    fast = np.frombuffer(mmap.mmap(-1, 8 << 20), np.uint8)
    # committed at the normal rate (a generous one: a busy machine may preempt a chunk)
    assert prefault_watched(fast, chunk=2 << 20, slow_s_per_gb=1000.0) is False
    assert committed(fast) == fast.nbytes // PAGE
    slow = np.frombuffer(mmap.mmap(-1, 8 << 20), np.uint8)
    ticks = iter(range(0, 10**6, 10))  # every chunk "takes" 10 s
    monkeypatch.setattr(mapping.time, "perf_counter", lambda: float(next(ticks)))
    assert prefault_watched(slow, chunk=2 << 20) is True  # the rest in small pages
    assert committed(slow) == slow.nbytes // PAGE
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "nh" in _vm_flags(int(slow.ctypes.data) + (4 << 20))
        assert "nh" not in _vm_flags(int(slow.ctypes.data))  # the first chunk kept its pages
