"""The contract every I/O backend passes, as a reusable pytest class.

Subclass `BackendContract` once per backend (or configuration) and implement
`make_backend`; backends that serve only files they were told about (``mmap``) also
implement `register_file`. Every ``test_*`` method then runs against that backend::

    class TestPreadv(BackendContract):
        def make_backend(self):
            return PreadvBackend()

Files are small (about 1 MiB, random bytes, an odd size so the last page is partial) and
live under pytest's ``tmp_path``; a subclass can raise ``batch_size`` or lower
``ring_entries`` to push "huge batch" past its ring.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import ArrayLike

from engramdb.errors import (
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    ReadError,
    ShapeMismatch,
    StoreClosed,
)
from engramdb.io.base import Backend
from engramdb.testing.threads import run_threads

__all__ = ["BackendContract", "DataFile"]

PAGE = 4096


@dataclass
class DataFile:
    """A test file: its path, an open read-only fd, and its bytes for reference."""

    path: Path
    fd: int
    data: np.ndarray

    @property
    def size(self) -> int:
        return int(self.data.shape[0])


def _reference(
    files: dict[int, DataFile], fds: ArrayLike, offsets: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """The bytes a correct backend must produce, concatenated (test-side loop)."""
    fds = np.broadcast_to(np.asarray(fds), offsets.shape)
    parts = [
        files[int(f)].data[int(o) : int(o) + int(n)]
        for f, o, n in zip(fds.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ]
    if not parts:
        return np.empty(0, dtype=np.uint8)
    out: np.ndarray = np.concatenate(parts)
    return out


def _packed(lengths: np.ndarray) -> np.ndarray:
    starts: np.ndarray = np.cumsum(lengths) - lengths
    return starts.astype(np.int64)


class BackendContract:
    """Tests every `Backend` must pass. Not collected itself (its name lacks ``Test``)."""

    #: Bytes per test file (an odd size: the last page is partial).
    file_bytes = (1 << 20) + 1234
    #: Requests in the "huge batch" test; must exceed the backend's ring / chunk size.
    batch_size = 5000

    # --- hooks ------------------------------------------------------------------------------
    def make_backend(self) -> Backend:
        raise NotImplementedError

    def register_file(self, backend: Backend, data: DataFile) -> None:
        """Tell the backend about a file before it is read (mapping backends map it here)."""

    # --- fixtures ---------------------------------------------------------------------------
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        b = self.make_backend()
        try:
            yield b
        finally:
            b.close()

    def _make_file(self, tmp_path: Path, backend: Backend, name: str, seed: int) -> DataFile:
        rng = np.random.default_rng(seed)
        data = rng.integers(0, 256, self.file_bytes, dtype=np.uint8)
        path = tmp_path / name
        path.write_bytes(data.tobytes())
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        f = DataFile(path, fd, data)
        self.register_file(backend, f)
        return f

    def _open_file(
        self, tmp_path: Path, backend: Backend, name: str, seed: int
    ) -> Iterator[DataFile]:
        f = self._make_file(tmp_path, backend, name, seed)
        try:
            yield f
        finally:
            os.close(f.fd)

    @pytest.fixture
    def data(self, tmp_path: Path, backend: Backend) -> Iterator[DataFile]:
        yield from self._open_file(tmp_path, backend, "a.bin", 1)

    @pytest.fixture
    def data2(self, tmp_path: Path, backend: Backend) -> Iterator[DataFile]:
        yield from self._open_file(tmp_path, backend, "b.bin", 2)

    def _check(
        self,
        backend: Backend,
        files: dict[int, DataFile],
        fds: ArrayLike,
        offsets: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        dest = np.full(int(lengths.sum()) + 17, 0xA5, dtype=np.uint8)
        backend.read(fds, offsets, lengths, dest, _packed(lengths))
        want = _reference(files, fds, offsets, lengths)
        np.testing.assert_array_equal(dest[: want.shape[0]], want)
        assert (dest[want.shape[0] :] == 0xA5).all(), "bytes written past the last request"

    # --- exact bytes ------------------------------------------------------------------------
    def test_random_offsets_and_lengths(self, backend: Backend, data: DataFile) -> None:
        rng = np.random.default_rng(10)
        lengths = rng.integers(1, 3 * PAGE, 700)
        offsets = rng.integers(0, data.size - lengths)
        fds = np.full(700, data.fd, dtype=np.int32)
        self._check(backend, {data.fd: data}, fds, offsets, lengths)

    @pytest.mark.parametrize("row_bytes", [160, 264, 2560, 4096, 6000, 10000])
    def test_compact_rows_straddling_pages(
        self, backend: Backend, data: DataFile, row_bytes: int
    ) -> None:
        n_rows = data.size // row_bytes
        rows = np.arange(n_rows, dtype=np.int64)
        offsets = rows * row_bytes
        straddles = offsets // PAGE != (offsets + row_bytes - 1) // PAGE
        pick = np.concatenate([rows[straddles][:200], rows[~straddles][:50], [n_rows - 1]])
        offsets = pick * row_bytes
        lengths = np.full(pick.shape[0], row_bytes, dtype=np.int64)
        self._check(backend, {data.fd: data}, np.int32(data.fd), offsets, lengths)

    def test_rows_into_a_row_grid(self, backend: Backend, data: DataFile) -> None:
        # The Store's shape: equal rows, gathered into a dense [n, row_bytes] buffer, with
        # the destination rows in a scattered order.
        row_bytes, n = 264, 500
        rng = np.random.default_rng(11)
        rows = rng.integers(0, data.size // row_bytes, n)
        out = np.zeros((n, row_bytes), dtype=np.uint8)
        slots = rng.permutation(n)
        backend.read(data.fd, rows * row_bytes, row_bytes, out, slots * row_bytes)
        table = data.data[: (data.size // row_bytes) * row_bytes].reshape(-1, row_bytes)
        np.testing.assert_array_equal(out[slots], table[rows])

    def test_duplicates(self, backend: Backend, data: DataFile) -> None:
        offsets = np.array([4000, 4000, 17, 4000, 17, 9000] * 20, dtype=np.int64)
        lengths = np.full(offsets.shape[0], 300, dtype=np.int64)
        self._check(backend, {data.fd: data}, np.int32(data.fd), offsets, lengths)

    def test_unsorted_offsets(self, backend: Backend, data: DataFile) -> None:
        rng = np.random.default_rng(12)
        offsets = rng.permutation(np.arange(0, data.size - PAGE, 3 * PAGE + 5))
        lengths = np.full(offsets.shape[0], 700, dtype=np.int64)
        self._check(backend, {data.fd: data}, np.int32(data.fd), offsets, lengths)

    def test_empty_batch(self, backend: Backend, data: DataFile) -> None:
        dest = np.full(8, 7, dtype=np.uint8)
        e = np.empty(0, dtype=np.int64)
        backend.read(data.fd, e, e, dest, e)
        backend.read(np.empty(0, np.int32), e, 100, dest, e)
        assert (dest == 7).all()

    def test_zero_length_requests_are_skipped(self, backend: Backend, data: DataFile) -> None:
        offsets = np.array([10, data.size + 999, 20], dtype=np.int64)  # the 0-byte one is past EOF
        lengths = np.array([5, 0, 5], dtype=np.int64)
        self._check(backend, {data.fd: data}, np.int32(data.fd), offsets, lengths)

    def test_huge_batch(self, backend: Backend, data: DataFile) -> None:
        rng = np.random.default_rng(13)
        n = self.batch_size
        lengths = rng.integers(1, 600, n)
        offsets = rng.integers(0, data.size - lengths)
        self._check(backend, {data.fd: data}, np.int32(data.fd), offsets, lengths)

    def test_reads_at_the_file_end(self, backend: Backend, data: DataFile) -> None:
        size = data.size
        offsets = np.array([size - 1, size - 100, size - PAGE, size - 3 * PAGE - 7, 0])
        lengths = np.array([1, 100, PAGE, 3 * PAGE + 7, size])
        self._check(backend, {data.fd: data}, np.int32(data.fd), offsets, lengths)

    def test_several_files(self, backend: Backend, data: DataFile, data2: DataFile) -> None:
        rng = np.random.default_rng(14)
        n = 400
        fds = np.where(rng.random(n) < 0.5, data.fd, data2.fd).astype(np.int32)
        lengths = rng.integers(1, 5000, n)
        offsets = rng.integers(0, data.size - lengths)
        self._check(backend, {data.fd: data, data2.fd: data2}, fds, offsets, lengths)

    # --- errors -----------------------------------------------------------------------------
    def test_read_past_the_end_raises(self, backend: Backend, data: DataFile) -> None:
        offsets = np.array([0, data.size - 10], dtype=np.int64)
        lengths = np.array([10, 11], dtype=np.int64)
        dest = np.zeros(21, dtype=np.uint8)
        with pytest.raises(ReadError) as info:
            backend.read(data.fd, offsets, lengths, dest, np.array([0, 10]))
        msg = str(info.value)
        assert data.path.name in msg and str(data.size - 10) in msg

    def test_truncated_file(self, backend: Backend, data: DataFile) -> None:
        offsets = np.array([0, data.size - 5000], dtype=np.int64)
        dest = np.zeros(2 * 4000, dtype=np.uint8)
        backend.read(data.fd, offsets, 4000, dest, np.array([0, 4000]))
        os.truncate(data.path, data.size // 2)
        with pytest.raises(ReadError) as info:
            backend.read(data.fd, offsets, 4000, dest, np.array([0, 4000]))
        assert data.path.name in str(info.value)
        assert str(data.size - 5000) in str(info.value)
        # what is still inside the file reads fine
        self._check(backend, {data.fd: data}, np.int32(data.fd), np.array([100]), np.array([900]))

    def test_bad_file_descriptor(self, backend: Backend, data: DataFile) -> None:
        # A number no descriptor can have (above any RLIMIT_NOFILE): a freshly closed one
        # could be reused by the backend itself (a ring, a pool) before the read.
        bad = (1 << 30) + 12345
        dest = np.zeros(10, dtype=np.uint8)
        with pytest.raises(ReadError) as info:
            backend.read(bad, np.array([0]), 10, dest, np.array([0]))
        assert info.value.errno == errno.EBADF
        with pytest.raises(ReadError):
            backend.read(-1, np.array([0]), 10, dest, np.array([0]))

    def test_closed_backend(self, data: DataFile) -> None:
        b = self.make_backend()
        self.register_file(b, data)
        dest = np.zeros(10, dtype=np.uint8)
        b.read(data.fd, np.array([0]), 10, dest, np.array([0]))
        b.close()
        b.close()  # idempotent
        assert b.closed
        with pytest.raises(StoreClosed):
            b.read(data.fd, np.array([0]), 10, dest, np.array([0]))

    def test_bad_arguments(self, backend: Backend, data: DataFile) -> None:
        one = np.array([0])
        with pytest.raises(InvalidDtype):
            backend.read(data.fd, one, 4, np.zeros(4, dtype=np.int32), one)
        with pytest.raises(InvalidLayout):
            backend.read(data.fd, one, 4, np.zeros((4, 4), dtype=np.uint8)[:, 0], one)
        with pytest.raises(InvalidArgument):
            backend.read(data.fd, one, 8, np.zeros(4, dtype=np.uint8), one)
        with pytest.raises(InvalidArgument):
            backend.read(data.fd, np.array([-1]), 4, np.zeros(4, dtype=np.uint8), one)
        with pytest.raises(ShapeMismatch):
            backend.read(data.fd, np.array([0, 1]), 4, np.zeros(8, dtype=np.uint8), one)
        with pytest.raises(InvalidDtype):
            backend.read(data.fd, np.array([0.5]), 4, np.zeros(8, dtype=np.uint8), one)

    # --- concurrency and bookkeeping -------------------------------------------------------
    def test_concurrent_reads(self, backend: Backend, data: DataFile, data2: DataFile) -> None:
        files = {data.fd: data, data2.fd: data2}

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(15):
                n = int(rng.integers(1, 400))
                fds = np.where(rng.random(n) < 0.5, data.fd, data2.fd).astype(np.int32)
                lengths = rng.integers(1, 3000, n)
                offsets = rng.integers(0, data.size - lengths)
                self._check(backend, files, fds, offsets, lengths)

        run_threads(work, [(100 + i,) for i in range(6)])

    def test_stats_count_requests(self, backend: Backend, data: DataFile) -> None:
        before = backend.stats
        dest = np.zeros(30, dtype=np.uint8)
        backend.read(data.fd, np.array([0, 10, 20]), 10, dest, np.array([0, 10, 20]))
        after = backend.stats
        assert after.requests - before.requests == 3
        assert after.bytes - before.bytes == 30
        assert after.batches - before.batches == 1

    def test_capabilities(self, backend: Backend) -> None:
        assert isinstance(backend.name, str) and backend.name
        assert isinstance(backend.supports_direct, bool)
        assert isinstance(backend.wants_plan, bool)
        ok, why = type(backend).availability()
        assert ok and why == ""
