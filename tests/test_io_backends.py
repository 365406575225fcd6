"""Every backend against the shared contract, plus backend-specific behaviour."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import engramdb.io.preadv as preadv_mod
import engramdb.io.uring as uring_mod
import engramdb.io.uring_ring as ring_mod
from engramdb.errors import BackendUnavailable, InvalidArgument, ReadError
from engramdb.io import (
    AutoBackend,
    Backend,
    IoUringBackend,
    MmapBackend,
    PreadvBackend,
    choose_backend,
    cold_backend,
    copy_segments,
    direct_pays,
    make_backend,
)
from engramdb.testing import BackendContract, DataFile
from engramdb.testing.pages import (
    advise_random,
    drop_mapped_pages,
    evict,
    file_residency,
    populate,
)

URING_OK, URING_WHY = IoUringBackend.availability()
needs_uring = pytest.mark.skipif(not URING_OK, reason=f"io_uring unavailable: {URING_WHY}")


def _map(backend: Backend, data: DataFile) -> None:
    view = np.memmap(data.path, dtype=np.uint8, mode="r")
    mapped = backend if isinstance(backend, MmapBackend) else backend.mapped  # type: ignore[attr-defined]
    mapped.register(data.fd, view)


# --- the contract, once per backend / configuration -------------------------------------------
class TestPreadv(BackendContract):
    def make_backend(self) -> Backend:
        return PreadvBackend()


class TestPreadvManyThreads(BackendContract):
    """Forces the multi-thread (cold) path: every probe counts as slow."""

    def make_backend(self) -> Backend:
        return PreadvBackend(threads=6, probe_requests=3, cold_us=1e-9, chunk=7)


@needs_uring
class TestIoUring(BackendContract):
    def make_backend(self) -> Backend:
        return IoUringBackend(entries=64)


@needs_uring
class TestIoUringDirect(BackendContract):
    def make_backend(self) -> Backend:
        return IoUringBackend(entries=64, direct=True, direct_bounce_bytes=64 * 1024)


class TestMmap(BackendContract):
    def make_backend(self) -> Backend:
        return MmapBackend()

    def register_file(self, backend: Backend, data: DataFile) -> None:
        _map(backend, data)


class TestAuto(BackendContract):
    def make_backend(self) -> Backend:
        return AutoBackend(MmapBackend(), recheck_s=0.0)

    def register_file(self, backend: Backend, data: DataFile) -> None:
        _map(backend, data)


# --- preadv specifics ------------------------------------------------------------------------
@pytest.fixture
def small_file(tmp_path: Path) -> tuple[int, bytes]:
    payload = np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    path = tmp_path / "s.bin"
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    yield fd, payload
    os.close(fd)


def test_preadv_continues_short_reads_and_retries_eintr_eagain(
    monkeypatch: pytest.MonkeyPatch, small_file: tuple[int, bytes]
) -> None:
    fd, payload = small_file
    calls = {"n": 0}

    def flaky(fd_: int, bufs: list[memoryview], off: int) -> int:
        calls["n"] += 1
        if calls["n"] % 3 == 1:
            raise OSError(errno.EINTR if calls["n"] % 2 else errno.EAGAIN, "transient")
        view = bufs[0][:37]  # at most 37 bytes per call: every read comes up short
        return os.preadv(fd_, [view], off)

    monkeypatch.setattr(preadv_mod, "_preadv", flaky)
    b = PreadvBackend(threads=3, probe_requests=2, cold_us=1e-9, chunk=4)
    offsets = np.arange(0, 40_000, 997, dtype=np.int64)
    dest = np.zeros(offsets.shape[0] * 500, dtype=np.uint8)
    b.read(fd, offsets, 500, dest, np.arange(offsets.shape[0]) * 500)
    want = b"".join(payload[o : o + 500] for o in offsets.tolist())
    assert dest.tobytes() == want
    b.close()


def test_preadv_eio_becomes_read_error(
    monkeypatch: pytest.MonkeyPatch, small_file: tuple[int, bytes]
) -> None:
    fd, _ = small_file

    def broken(fd_: int, bufs: list[memoryview], off: int) -> int:
        if off == 3000:
            raise OSError(errno.EIO, "Input/output error")
        return os.preadv(fd_, bufs, off)

    monkeypatch.setattr(preadv_mod, "_preadv", broken)
    with PreadvBackend(threads=4, probe_requests=1, cold_us=1e-9, chunk=2) as b:
        dest = np.zeros(10 * 100, dtype=np.uint8)
        with pytest.raises(ReadError) as info:
            b.read(fd, np.arange(10) * 1000, 100, dest, np.arange(10) * 100)
    assert info.value.errno == errno.EIO
    assert "s.bin" in str(info.value) and "3000" in str(info.value)


def test_preadv_picks_few_threads_for_resident_data(small_file: tuple[int, bytes]) -> None:
    fd, _ = small_file
    with PreadvBackend(threads=16, warm_threads=2, probe_requests=8, cold_us=1e6) as b:
        dest = np.zeros(1000 * 40, dtype=np.uint8)
        b.read(fd, np.arange(1000) * 40, 40, dest, np.arange(1000) * 40)
        assert b.last_threads <= 2


def test_preadv_rejects_bad_options() -> None:
    with pytest.raises(InvalidArgument):
        PreadvBackend(threads=0)
    with pytest.raises(InvalidArgument):
        PreadvBackend(chunk=0)


# --- io_uring specifics ----------------------------------------------------------------------
def test_classify_completions() -> None:
    res = np.array([100, 40, 0, -errno.EINTR, -errno.EAGAIN, -errno.EIO, -errno.EBADF, 60])
    done = np.array([0, 0, 10, 0, 0, 0, 0, 40])
    need = np.array([100, 100, 100, 100, 100, 100, 100, 100])
    kinds = ring_mod.classify(res, done, need)
    C, R, E, F = ring_mod.COMPLETE, ring_mod.RETRY, ring_mod.AT_EOF, ring_mod.FAILED
    assert kinds.tolist() == [C, R, E, R, R, F, F, C]


@needs_uring
@pytest.mark.parametrize("direct", [False, True])
def test_io_uring_continues_long_requests(
    monkeypatch: pytest.MonkeyPatch, small_file: tuple[int, bytes], direct: bool
) -> None:
    # Each SQE asks for at most 4 KiB: a 20 KB request completes as a chain of short reads.
    monkeypatch.setattr(uring_mod, "MAX_SQE_BYTES", 4096)
    fd, payload = small_file
    with IoUringBackend(entries=8, direct=direct) as b:
        offsets = np.array([0, 1234, 29_000], dtype=np.int64)
        dest = np.zeros(3 * 20_000, dtype=np.uint8)
        b.read(fd, offsets, 20_000, dest, np.arange(3) * 20_000)
        want = b"".join(payload[o : o + 20_000] for o in offsets.tolist())
        assert dest.tobytes() == want
        assert b.stats.syscalls >= 2


@needs_uring
def test_io_uring_direct_reads_aligned_spans_only(small_file: tuple[int, bytes]) -> None:
    fd, payload = small_file
    with IoUringBackend(entries=16, direct=True) as b:
        assert b.direct and b.supports_direct
        offsets = np.arange(0, 45_000, 2560, dtype=np.int64)
        dest = np.zeros(offsets.shape[0] * 2560, dtype=np.uint8)
        b.read(fd, offsets, 2560, dest, np.arange(offsets.shape[0]) * 2560)
        assert dest.tobytes() == b"".join(payload[o : o + 2560] for o in offsets.tolist())
        assert b.direct_fallbacks == 0


@needs_uring
def test_io_uring_reports_errno_for_a_directory(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with IoUringBackend(entries=8) as b, pytest.raises(ReadError) as info:
            b.read(fd, np.array([0]), 10, np.zeros(10, np.uint8), np.array([0]))
        assert info.value.errno == errno.EISDIR
    finally:
        os.close(fd)


def test_io_uring_disabled_by_env_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(uring_mod.DISABLE_ENV, "1")
    ok, why = IoUringBackend.availability()
    assert not ok and uring_mod.DISABLE_ENV in why
    with pytest.raises(BackendUnavailable, match=uring_mod.DISABLE_ENV):
        IoUringBackend()
    with pytest.raises(BackendUnavailable, match=uring_mod.DISABLE_ENV):
        make_backend("io_uring")
    cold = cold_backend()
    assert cold.name == "preadv"
    cold.close()
    auto = make_backend("auto")
    assert isinstance(auto, AutoBackend) and auto.cold.name == "preadv"
    assert auto.direct_cold is None
    auto.close()


def test_make_backend_names(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown backend"):
        make_backend("nope")
    with pytest.raises(InvalidArgument):
        make_backend("mmap")
    b = make_backend("preadv", threads=4)
    assert b.name == "preadv" and b.wants_plan
    b.close()


# --- the auto rule ---------------------------------------------------------------------------
def test_choose_backend_rule() -> None:
    assert choose_backend(1.0, mapped=True, io_uring=True) == "mmap"
    assert choose_backend(0.0, mapped=True, io_uring=True) == "io_uring_direct"
    assert choose_backend(0.0, mapped=True, io_uring=True, direct=False) == "io_uring"
    assert choose_backend(0.5, mapped=True, io_uring=True) == "io_uring"
    assert choose_backend(0.99, mapped=True, io_uring=False) == "preadv"
    assert choose_backend(0.0, mapped=True, io_uring=False) == "preadv"
    assert choose_backend(1.0, mapped=False, io_uring=True) == "io_uring"


def test_direct_pays_only_where_it_saves_device_bytes() -> None:
    rows = np.arange(0, 1000, 7, dtype=np.int64)
    assert direct_pays(rows * 160, 160)  # 512-1024 B instead of a 4 KiB page
    assert direct_pays(rows * 2560, 2560)  # 2560 B instead of 1.6 pages
    assert not direct_pays(rows * 4096, 4096)  # the same pages either way
    assert not direct_pays(rows * 8192, 8192)
    assert direct_pays(np.empty(0, np.int64), 10)


@pytest.fixture
def table_file(tmp_path: Path) -> Iterator[tuple[int, np.ndarray]]:
    path = tmp_path / "t.bin"
    payload = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    view = np.memmap(path, dtype=np.uint8, mode="r")
    if evict(fd) > 0.05:
        os.close(fd)
        pytest.skip("this file system does not drop pages on request")
    _EXPECTED[fd] = payload
    yield fd, view
    del _EXPECTED[fd]
    os.close(fd)


_EXPECTED: dict[int, bytes] = {}


def _auto_round(auto: AutoBackend, fd: int, view: np.ndarray) -> str:
    offsets = np.arange(0, (4 << 20) - 4096, 8192, dtype=np.int64)
    dest = np.zeros(offsets.shape[0] * 100, dtype=np.uint8)
    auto.read(fd, offsets, 100, dest, np.arange(offsets.shape[0]) * 100)
    payload = _EXPECTED[fd]
    assert dest.tobytes() == b"".join(payload[o : o + 100] for o in offsets.tolist())
    return auto.last_choice


def test_auto_follows_residency(table_file: tuple[int, np.ndarray]) -> None:
    fd, view = table_file
    auto = AutoBackend(
        MmapBackend({fd: view}), PreadvBackend(threads=4), use_direct=False, recheck_s=0.0
    )
    assert _auto_round(auto, fd, view) == "preadv"  # cold
    populate(view)  # resident and mapped
    assert file_residency(fd) > 0.99
    assert _auto_round(auto, fd, view) == "mmap"
    assert auto.mapped is not None and auto.mapped.stats.requests > 0
    # evicted under a warm state: the per-batch sample notices before reading
    drop_mapped_pages(view)
    evict(fd)
    assert _auto_round(auto, fd, view) == "preadv"
    assert auto.choices == {"preadv": 2, "mmap": 1}
    auto.close()


@needs_uring
def test_auto_reads_cold_data_direct_and_mixed_data_buffered(
    table_file: tuple[int, np.ndarray],
) -> None:
    fd, view = table_file
    auto = AutoBackend(MmapBackend({fd: view}), recheck_s=0.0)
    assert auto.direct_cold is not None and auto.direct_cold.direct
    assert _auto_round(auto, fd, view) == "io_uring_direct"
    assert file_residency(fd) < 0.05  # O_DIRECT left the page cache alone
    # page-sized, page-aligned requests: O_DIRECT would save nothing, buffered it is
    whole_pages = np.arange(0, 1 << 20, 4096, dtype=np.int64)
    dest = np.zeros(whole_pages.shape[0] * 4096, dtype=np.uint8)
    auto.read(fd, whole_pages, 4096, dest, whole_pages)
    assert auto.last_choice == "io_uring"
    drop_mapped_pages(view)
    evict(fd)
    advise_random(view)  # no read-ahead: exactly the populated part becomes resident
    populate(view[: 1 << 20])  # a quarter of the table resident
    assert 0.1 < file_residency(fd) < 0.5
    assert _auto_round(auto, fd, view) == "io_uring"
    populate(view)
    assert _auto_round(auto, fd, view) == "mmap"
    auto.close()
    assert auto.cold.closed and auto.direct_cold.closed


# --- the segment copy ------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["grid", "windows", "mixed", "many_lengths"])
def test_copy_segments(shape: str) -> None:
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, 200_000, dtype=np.uint8)
    n = 300
    if shape == "grid":
        lengths = np.full(n, 160)
        src_off = rng.integers(0, 1000, n) * 160 + 32
        dst_off = rng.permutation(n) * 160
    elif shape == "windows":
        lengths = np.full(n, 160)
        src_off = rng.integers(0, 190_000, n)
        dst_off = rng.permutation(n) * 161 + 3
    elif shape == "mixed":
        lengths = rng.choice([16, 64, 4096], n)
        src_off = rng.integers(0, 190_000, n)
        dst_off = np.cumsum(lengths) - lengths
    else:
        lengths = rng.integers(1, 700, n)
        src_off = rng.integers(0, 190_000, n)
        dst_off = np.cumsum(lengths) - lengths
    dest = np.zeros(int(dst_off.max() + lengths.max()) + 1, dtype=np.uint8)
    copy_segments(src, src_off, lengths, dest, dst_off)
    for s, d, n_ in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(), strict=True):
        assert dest[d : d + n_].tobytes() == src[s : s + n_].tobytes()


@needs_uring
def test_io_uring_interrupted_batch_is_cancelled_and_drained() -> None:
    # A read from an empty pipe never completes; a signal handler raising mid-wait must
    # still leave no request in flight (cancelled), and the backend must keep working.
    import signal

    r, w = os.pipe()

    class Interrupted(Exception):
        pass

    def on_alarm(signum: int, frame: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, on_alarm)
    b = IoUringBackend(entries=8)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            b.read(r, np.array([0]), 10, np.zeros(10, np.uint8), np.array([0]))
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.write(w, b"x" * 10)
        assert os.read(r, 10) == b"x" * 10  # the cancelled read did not consume the data
        assert b._leaked == {}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        b.close()
        os.close(r)
        os.close(w)


@needs_uring
def test_io_uring_direct_falls_back_where_o_direct_is_refused(
    monkeypatch: pytest.MonkeyPatch, small_file: tuple[int, bytes]
) -> None:
    # Some file systems refuse O_DIRECT with EINVAL; the batch is then read buffered.
    real_open = os.open

    def refuse_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    fd, payload = small_file
    with IoUringBackend(entries=8, direct=True) as b:
        dest = np.zeros(300, dtype=np.uint8)
        b.read(fd, np.array([0, 7777, 49_900]), 100, dest, np.array([0, 100, 200]))
        want = payload[0:100] + payload[7777:7877] + payload[49_900:]
        assert dest.tobytes() == want
        assert b.direct_fallbacks == 1


def test_shard_mapping_is_2mib_aligned_and_reads_every_shard(tmp_path: Path) -> None:
    """Shards map back to back from a 2 MiB-aligned address (so the kernel may map a page
    cache huge folio with one PMD entry), the released head and tail of the reservation do
    not break reads, and close unmaps it."""
    from engramdb.io.mapping import HUGE, ShardMapping

    rng = np.random.default_rng(4)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (3 << 20, 1 << 20, 5000)]
    fds = []
    for i, p in enumerate(parts):
        f = tmp_path / f"s{i}"
        f.write_bytes(p.tobytes())
        fds.append(os.open(f, os.O_RDONLY))
    try:
        m = ShardMapping(fds, [p.size for p in parts])
        assert m.address % HUGE == 0
        got = m.array(1, m.length).reshape(-1)
        assert np.array_equal(got, np.concatenate(parts))
        m.close()
        small = ShardMapping(fds[2:], [parts[2].size])  # under 2 MiB: no extra reservation
        assert np.array_equal(small.array(1, small.length).reshape(-1), parts[2])
        small.close()
    finally:
        for fd in fds:
            os.close(fd)
