"""The foreground record (`engramdb.io.foreground`) and the background warm reading in the
gaps between periodic foreground batches."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from warm_checks import warm_pass

import engramdb
from engramdb.errors import InvalidArgument
from engramdb.io import foreground as fg_mod
from engramdb.io.foreground import (
    OVERLAP_RATE_ENV,
    YIELD_ENV,
    Foreground,
    background_idle,
    idle_priority,
    overlap_rate,
    read_in_gaps,
)
from engramdb.testing.pages import evict

ROW = 160


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _batch(f: Foreground, clock: Clock, start: float, length: float) -> None:
    clock.t = start
    f.enter()
    clock.t = start + length
    f.exit()


def test_learns_a_periodic_rhythm_and_yields_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(YIELD_ENV, raising=False)
    c = Clock()
    f = Foreground(clock=c)
    assert not f.yielding()  # nothing seen yet
    for i in range(20):  # a 5 ms step reading for 1 ms
        _batch(f, c, 100.0 + 0.005 * i, 0.001)
    assert f.period == pytest.approx(0.005)
    assert f.busy == pytest.approx(0.2, abs=0.01)
    assert f.yielding()
    monkeypatch.setenv(YIELD_ENV, "0")
    assert not f.yielding()  # turned off
    monkeypatch.delenv(YIELD_ENV)
    c.t += 0.3  # no batch for longer than the recent window: no longer active
    assert not f.yielding()


def test_a_loop_of_prefetches_is_overlapped_until_a_caller_waits() -> None:
    c = Clock()
    f = Foreground(clock=c)

    def prefetch(start: float) -> None:
        c.t = start
        f.enter(waited=False)
        c.t = start + 0.001
        f.exit()

    for i in range(20):  # a 5 ms step whose reads are all prefetches
        prefetch(100.0 + 0.005 * i)
    assert f.yielding() and f.overlapped()
    _batch(f, c, 100.1, 0.001)  # one read a caller waited on (a prefetch missed)
    assert f.yielding() and not f.overlapped()
    for i in range(1, 60):  # prefetches only again, for longer than the recent window
        prefetch(100.1 + 0.005 * i)
    assert f.overlapped()
    for i in range(20):  # a loop of waited reads is yielded to but not paced
        _batch(f, c, 101.0 + 0.005 * i, 0.001)
    assert f.yielding() and not f.overlapped()


def test_note_counts_as_a_prefetch() -> None:
    """`StepReader` announces its reads with `note`: nobody waits on them."""
    c = Clock()
    f = Foreground(clock=c)
    for i in range(20):
        c.t = 100.0 + 0.005 * i
        f.note(0.001)
    assert f.period == pytest.approx(0.005)
    c.t += 0.001
    assert f.overlapped()


def test_overlap_rate_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERLAP_RATE_ENV, raising=False)
    assert overlap_rate() == 16 << 20
    monkeypatch.setenv(OVERLAP_RATE_ENV, "1G")
    assert overlap_rate() == 1 << 30
    monkeypatch.setenv(OVERLAP_RATE_ENV, "123456")
    assert overlap_rate() == 123456
    for bad in ("fast", "0", "-5M"):
        monkeypatch.setenv(OVERLAP_RATE_ENV, bad)
        with pytest.raises(InvalidArgument, match=OVERLAP_RATE_ENV):
            overlap_rate()


def test_read_in_gaps_holds_its_pieces_to_the_pace(tmp_path: Path) -> None:
    """Paced at 16 MiB/s, 4 MiB take at least a quarter second, and every byte is read;
    unpaced the same read is quick; a set stop ends a paced read early."""
    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    f = Foreground()  # no rhythm: every gap is open, and the record is not overlapped
    fd = os.open(p, os.O_RDONLY)
    try:
        stop = threading.Event()
        t0 = time.monotonic()
        pieces, paced_n, _ = read_in_gaps(f, fd, 0, 0, 4 << 20, 1e9, populate=False, stop=stop)
        quick = time.monotonic() - t0
        assert (pieces, paced_n) == (4, 0)
        # a record with no overlapped loop: the pace does not apply
        pieces, paced_n, _ = read_in_gaps(
            f, fd, 0, 0, 4 << 20, 1e9, populate=False, stop=stop, pace=1.0
        )
        assert (pieces, paced_n) == (4, 0)
        f.overlapped = lambda: True  # type: ignore[method-assign]
        evict(p)
        t0 = time.monotonic()
        pieces, paced_n, bps = read_in_gaps(
            f, fd, 0, 0, 4 << 20, 1e9, populate=False, stop=stop, pace=16 << 20
        )
        paced = time.monotonic() - t0
        assert (pieces, paced_n) == (4, 4) and bps > 0
        assert paced >= 0.24 and paced > quick
        stop.set()
        t0 = time.monotonic()
        got, _, _ = read_in_gaps(f, fd, 0, 0, 4 << 20, 1e9, populate=False, stop=stop, pace=1.0)
        assert got == 0 and time.monotonic() - t0 < 1.0
    finally:
        os.close(fd)


def test_the_pace_is_shared_by_every_warm_of_the_process() -> None:
    """Two tables' warms pacing at once share one schedule: each piece waits behind the
    slots of the pieces before it, so together they keep to the rate."""
    p = fg_mod._Pacer()
    now = time.monotonic()
    first = p.slot(1 << 20, float(1 << 20), now) - now  # 1 MiB at 1 MiB/s: one second
    second = p.slot(1 << 20, float(1 << 20), now) - now  # another table's piece, same moment
    assert 0.9 < first <= 1.0
    assert 1.9 < second <= 2.0
    later = p.slot(1 << 20, float(1 << 20), now + 10.0) - now  # after a pause: its own slot
    assert 10.9 < later <= 11.0


def test_a_throughput_load_is_not_yielded_to() -> None:
    c = Clock()
    f = Foreground(clock=c)
    for i in range(20):  # back to back: reading 90 % of each interval
        _batch(f, c, 100.0 + 0.010 * i, 0.009)
    assert f.busy > 0.6 and not f.yielding()


def test_a_pause_resets_the_rhythm() -> None:
    c = Clock()
    f = Foreground(clock=c)
    for i in range(5):
        _batch(f, c, 100.0 + 0.005 * i, 0.001)
    assert f.period > 0
    _batch(f, c, 102.0, 0.001)  # 2 s later: not the same loop
    assert f.period == 0.0 and not f.yielding()


def test_wait_gap_waits_for_the_batch_in_flight_then_returns() -> None:
    f = Foreground()
    for _ in range(3):  # a rhythm of ~20 ms
        f.enter()
        f.exit()
        time.sleep(0.02)
    f.enter()  # a batch in flight
    done = threading.Event()

    def waiter() -> None:
        assert f.wait_gap(0.001, timeout=5.0)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.03)
    assert not done.is_set()  # held while the batch reads
    f.exit()
    t.join(5)
    assert done.is_set()


def test_wait_gap_holds_a_piece_that_would_overlap_the_next_batch() -> None:
    c = Clock()
    f = Foreground(clock=c)
    for i in range(10):
        _batch(f, c, 100.0 + 0.005 * i, 0.001)
    # the last batch started at 100.045 and ended at 100.046; the next is due at 100.050
    c.t = 100.0465
    assert f.wait_gap(0.002, timeout=1.0)  # 100.0485 <= 100.050: fits
    c.t = 100.049
    # 100.051 > 100.050: it would still be reading when the next batch comes. The clock
    # does not move, so only the timeout ends the wait (a real clock would pass the batch)
    t0 = time.monotonic()
    assert not f.wait_gap(0.002, timeout=0.0)
    assert time.monotonic() - t0 < 1.0
    c.t = 100.070  # long past the due time with no batch: the loop stopped, read now
    assert f.wait_gap(0.002, timeout=0.0)


def _source_rows(rows: int) -> np.ndarray:
    """The rows `_cold_db` builds its table from."""
    return np.random.default_rng(5).integers(0, 256, (rows, ROW), dtype=np.uint8)


def _cold_db(tmp_path: Path, rows: int) -> Path:
    engramdb.build(tmp_path, "t", ROW, [_source_rows(rows)])
    for p in tmp_path.rglob("*.edb"):
        evict(p)
    return tmp_path


@contextmanager
def _decode_loop(f: Foreground, waited: bool) -> Iterator[None]:
    """A periodic foreground loop in a thread (1 ms reads every 4 ms; ``waited=False``:
    prefetches) for the body of the ``with``, its rhythm learnt by ``f`` first."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with f.reading(waited=waited):
                time.sleep(0.001)
            time.sleep(0.003)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        time.sleep(0.05)  # the rhythm is learnt
        yield
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("yield_on", [True, False])
@pytest.mark.parametrize("waited", [True, False])
def test_background_warm_reads_in_the_gaps_of_a_decode_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, yield_on: bool, waited: bool
) -> None:
    """A periodic foreground loop (1 ms reads every 4 ms): the warm reads the table in gap
    pieces (none when yielding is off), paced when the loop's reads are prefetches,
    completes, and leaves it resident (the waiting itself is tested on
    `Foreground.wait_gap` above)."""
    if not yield_on:
        monkeypatch.setenv(YIELD_ENV, "0")
    monkeypatch.setenv(OVERLAP_RATE_ENV, "256M")  # the test's 6.4 MB in ~25 ms of pauses
    f = Foreground()
    monkeypatch.setattr("engramdb.io.tiers.FOREGROUND", f)
    path = _cold_db(tmp_path, 40_000)  # 6.4 MB
    with _decode_loop(f, waited), engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        w = warm_pass(s, rate=1e12, budget=1 << 40, chunk=2 << 20)
        w.start()
        assert w.wait(60)
        assert w.state == "done"
        assert s.residency() == 1.0
        assert not w.top_up  # the whole table was missing
        if yield_on:
            assert w.gap_pieces >= 1  # read in 1 MiB pieces in the gaps
            # paced only beside prefetches
            assert (w.paced_pieces >= 1) if not waited else (w.paced_pieces == 0)
        else:
            assert w.gap_pieces == w.paced_pieces == 0
        # the rows read back equal the source
        ids = np.arange(0, 40_000, 997, dtype=np.int64)
        assert np.array_equal(s.fetch(ids), _source_rows(40_000)[ids])


@pytest.mark.parametrize("missing_kb", [0, 64, 256])
def test_a_pass_over_a_table_that_lost_a_little_reads_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing_kb: int
) -> None:
    """A table the page cache lost a little of (a reclaimed range), beside a prefetching
    decode loop: the pass is a top-up. It reads the missing pages at once (no gap pieces,
    no pacing at 1 byte/s), completes quickly, leaves the table resident, and the rows read
    back equal the source."""
    monkeypatch.setenv(OVERLAP_RATE_ENV, "1")  # a paced piece would take days
    f = Foreground()
    monkeypatch.setattr("engramdb.io.tiers.FOREGROUND", f)
    path = _cold_db(tmp_path, 40_000)  # 6.4 MB
    (edb,) = path.rglob("*.edb")
    with open(edb, "rb") as src:
        while src.read(1 << 20):  # the whole table in the page cache
            pass
    if missing_kb:
        evict(edb, offset=2 << 20, length=missing_kb << 10)
    with _decode_loop(f, False), engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        assert (s.residency() < 1.0) == bool(missing_kb)
        w = warm_pass(s, rate=1e12, budget=1 << 40, chunk=2 << 20)
        t0 = time.monotonic()
        w.start()
        assert w.wait(20)
        assert (w.state, w.reason) == ("done", "")
        assert w.top_up
        assert w.gap_pieces == w.paced_pieces == 0
        assert time.monotonic() - t0 < 10
        assert s.residency() == 1.0
        ids = np.arange(0, 40_000, 613, dtype=np.int64)
        assert np.array_equal(s.fetch(ids), _source_rows(40_000)[ids])


def test_decode_sized_cold_batches_count_as_foreground(tmp_path: Path) -> None:
    """A small cold batch through the syscall path enters the process's record; a large
    one (a throughput read) does not."""
    path = _cold_db(tmp_path, 20_000)
    before = fg_mod.FOREGROUND.batches
    with engramdb.open(path, background_warm=False, backend="preadv") as db:
        s = db["t"]
        s.fetch(np.arange(0, 20_000, 700, dtype=np.int64))
        small = fg_mod.FOREGROUND.batches - before
        s.fetch(np.arange(0, 20_000, dtype=np.int64) % 20_000)
        large = fg_mod.FOREGROUND.batches - before - small
    assert small == 1 and large == 0
    assert fg_mod.FOREGROUND.inflight == 0


@pytest.mark.parametrize("left", [float("inf"), 0.0, 0.004])
def test_the_pass_completes_whether_or_not_a_gap_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left: float
) -> None:
    """Whether the record finds a gap or times out, the pass reads every chunk and
    finishes."""

    class Stub:
        period = 0.005

        def yielding(self) -> bool:
            return True

        def overlapped(self) -> bool:
            return False

        def wait_gap(self, need: float, *, timeout: float) -> bool:
            return left > 0

    monkeypatch.setattr("engramdb.io.tiers.FOREGROUND", Stub())
    path = _cold_db(tmp_path, 40_000)
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        w = warm_pass(s, rate=1e12, budget=1 << 40)
        w.start()
        assert w.wait(60)
        assert (w.state, w.reason) == ("done", "")
        assert w.gap_pieces >= 1 and s.residency() == 1.0


def test_idle_priority_sets_and_restores_the_calling_threads_policy() -> None:
    seen: list[int] = []

    def run() -> None:
        seen.append(os.sched_getscheduler(0))
        assert idle_priority(True) is True
        seen.append(os.sched_getscheduler(0))
        assert idle_priority(False) is False
        seen.append(os.sched_getscheduler(0))

    t = threading.Thread(target=run)  # its own thread: the policy is per thread
    t.start()
    t.join()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread untouched
    if seen[1] == seen[0]:
        pytest.skip("SCHED_IDLE not allowed here")
    assert seen == [os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_OTHER]


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("idle", [False, True])
def test_background_idle_puts_every_warm_pass_under_sched_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle: bool, cold: bool
) -> None:
    """`background_idle(True)` (a companion process's setting): the warm runs under
    ``SCHED_IDLE`` from its start, the page-table work over a table already in the page cache
    included; without it, and no foreground rhythm, under the normal policy."""
    monkeypatch.setattr(fg_mod, "_ALL_IDLE", [False])
    assert background_idle(idle) is idle and background_idle() is idle
    seen: list[tuple[bool, int]] = []
    real = fg_mod.idle_priority

    def spy(on: bool) -> bool:
        got = real(on)
        seen.append((on, os.sched_getscheduler(0)))
        return got

    monkeypatch.setattr("engramdb.io.tiers.idle_priority", spy)
    if cold:
        path = _cold_db(tmp_path, 40_000)
    else:
        engramdb.build(tmp_path, "t", ROW, [_source_rows(40_000)])
        path = tmp_path
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        w = warm_pass(s, rate=1e12, budget=1 << 40)
        w.start()
        assert w.wait(60)
        assert (w.state, w.reason) == ("done", "") and s.residency() == 1.0
    assert seen and {on for on, _ in seen} == {idle}
    policies = {p for _, p in seen}
    if idle and policies == {os.SCHED_OTHER}:
        pytest.skip("SCHED_IDLE not allowed here")
    assert policies == {os.SCHED_IDLE if idle else os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the pass's thread only


def test_noted_batches_enter_the_rhythm_in_order_when_it_is_next_read() -> None:
    """`note` only records (the engine's thread pays for an append); the next reader of the
    rhythm takes the notes in, in order and before its own event: a note at 10.000 then a
    batch entered at 10.004 is an interval of 4 ms. Unread notes are bounded."""
    c = Clock()
    f = Foreground(clock=c)
    c.t = 10.0
    f.note(0.001)
    c.t = 10.004
    f.enter(waited=False)
    c.t = 10.005
    f.exit()
    assert f.period == pytest.approx(0.004)
    assert f.batches == 2
    g = Foreground(clock=c)
    for i in range(1000):  # nobody reads: the oldest notes go
        c.t = 20.0 + 0.002 * i
        g.note(0.0005)
    assert g.period == pytest.approx(0.002) and g.batches == 64  # the last 64


native_piece = pytest.mark.skipif(fg_mod._read_piece is None, reason="_pieces not built")


def _mapped_rss(addr: int) -> int:
    """Resident bytes of the mapping that starts at ``addr`` (this process's page tables)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}":
            for rest in lines[i + 1 :]:
                if rest.startswith("Rss:"):
                    return int(rest.split()[1]) << 10
    raise AssertionError(f"no mapping at {addr:#x}")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_install_builds_the_warm_piece_call() -> None:
    assert fg_mod._read_piece is not None


@native_piece
def test_a_native_piece_reads_and_maps_its_bytes_and_sleeps_to_its_slot(tmp_path: Path) -> None:
    """`read_piece` reads an evicted file's piece into the page cache and this process's page
    tables (populate at the address), sleeps until the wake time it is given, ends that
    sleep once its stop byte is set, and raises OSError for a piece it cannot read."""
    from engramdb.io._pieces import read_piece
    from engramdb.io.mapping import map_range, range_pages, unmap_range

    p = tmp_path / "f.bin"
    size = 2 << 20
    p.write_bytes(np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8).tobytes())
    evict(p)
    fd = os.open(p, os.O_RDONLY)
    addr = map_range(fd, 0, size)
    try:
        assert range_pages(addr, size)[0] < size // 4096 and _mapped_rss(addr) == 0
        took = read_piece(fd, 0, size, addr, 0, None)
        assert took > 0
        assert range_pages(addr, size) == (size // 4096, size // 4096)
        assert _mapped_rss(addr) == size  # the page tables too: no fault at the first touch
        wake = time.monotonic() + 0.2
        read_piece(fd, 0, 4096, 0, int(wake * 1e9), None)  # the last-byte read, then the pause
        assert time.monotonic() >= wake - 0.002
        flag = bytearray(1)
        threading.Timer(0.1, lambda: flag.__setitem__(0, 1)).start()
        t0 = time.monotonic()
        read_piece(fd, 0, 4096, 0, int((t0 + 30.0) * 1e9), flag)  # a 30 s slot, stopped
        assert time.monotonic() - t0 < 2.0
        past = map_range(fd, 0, size + 4096)  # a page past the file's end: unreadable
        try:
            with pytest.raises(OSError):
                read_piece(fd, size, 4096, past + size, 0, None)
        finally:
            unmap_range(past, size + 4096)
        with pytest.raises(ValueError):
            read_piece(fd, 0, 0, addr, 0, None)
        with pytest.raises((BufferError, TypeError)):
            read_piece(fd, 0, 4096, addr, 0, b"\0")  # a read-only stop byte
    finally:
        unmap_range(addr, size)
        os.close(fd)


@pytest.mark.parametrize("calls", ["native", "python"])
def test_a_paced_read_in_gaps_keeps_the_pace_and_stops_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: str
) -> None:
    """With the background warm's stop signal (its byte read by the native call), paced
    pieces keep the pace (4 MiB at 16 MiB/s: a quarter second at least, every piece paced,
    every page read) whether a piece is one native call or the calls one by one, and a stop
    set during a long pause ends it."""
    if calls == "python":
        monkeypatch.setattr(fg_mod, "_read_piece", None)
    elif fg_mod._read_piece is None:
        pytest.skip("_pieces not built")
    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    evict(p)
    f = Foreground()
    f.overlapped = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(fg_mod, "_PACER", fg_mod._Pacer())  # a schedule of its own
    fd = os.open(p, os.O_RDONLY)
    try:
        stop = fg_mod.StopSignal()
        t0 = time.monotonic()
        pieces, paced_n, bps = read_in_gaps(
            f, fd, 0, 0, 4 << 20, 1e9, populate=False, stop=stop, pace=16 << 20
        )
        assert (pieces, paced_n) == (4, 4) and bps > 0
        assert time.monotonic() - t0 >= 0.24
        from engramdb.testing.pages import file_residency

        assert file_residency(p) == 1.0

        threading.Timer(0.2, stop.set).start()  # as BackgroundWarm.cancel does
        t0 = time.monotonic()
        got, _, _ = read_in_gaps(
            f, fd, 0, 0, 4 << 20, 1e9, populate=False, stop=stop, pace=(1 << 20) / 30
        )
        assert got == 1 and time.monotonic() - t0 < 2.0  # the first piece's 30 s pause, cut short
    finally:
        os.close(fd)
