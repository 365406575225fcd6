"""A step's reads in the order the engine needs them (`engramdb.read.read_order`, the
submitter's ``first`` / ``lead`` / ``after``): the first layer's reads go to the device before
the rest, across one reader's layers and across readers, and no order ever stalls a read
for good or changes a row."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.read import read_order
from engramdb.read.step_plan import StepTicket
from engramdb.read.steps import StepReader
from engramdb.testing.pages import evict


def test_a_burst_is_the_reads_one_thread_submits_before_consuming_any() -> None:
    a, b, c = object(), object(), object()
    read_order.end()
    lead, after = read_order.begin(a)
    assert lead > 0 and after == 0  # the first: a new lead number
    assert read_order.begin(b) == (0, lead)  # the next readers come after it
    assert read_order.begin(c) == (0, lead)
    lead2, after2 = read_order.begin(a)  # the first reader again: a new burst
    assert lead2 > lead and after2 == 0
    read_order.end()  # rows consumed: the next read leads
    lead3, _ = read_order.begin(b)
    assert lead3 > lead2
    read_order.led(False)  # its reads went to no submitter: nothing publishes its lead
    assert read_order.begin(c) == (0, 0)
    read_order.end()


def test_each_thread_has_its_own_burst() -> None:
    read_order.end()
    lead, _ = read_order.begin(object())
    seen: list[tuple[int, int]] = []
    t = threading.Thread(target=lambda: seen.append(read_order.begin(object())))
    t.start()
    t.join()
    assert seen[0][0] > lead and seen[0][1] == 0  # a lead of its own, not after ours
    read_order.end()


def _submitter_or_skip() -> Any:
    from engramdb.io import sqpoll

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    if not StepReader.available() or not sqpoll.submitter_state()[0] or sqpoll.sqpoll_state()[0]:
        pytest.skip("no submitter thread here")
    return sqpoll


def _table(tmp_path: Path, rng: np.random.Generator, name: str) -> tuple[Any, Any, np.ndarray]:
    full = rng.integers(0, 256, (6000, 320), dtype=np.uint8)
    engramdb.build(tmp_path / name, "t", 320, [full])
    db = engramdb.open(tmp_path / name)
    st = db["t"]
    for sh in st.info.shards:
        evict(tmp_path / name / sh.path)
    return db, st, full


def _ids(rng: np.random.Generator, n: int = 6000, k: int = 96) -> np.ndarray:
    return rng.integers(0, n, k).astype(np.int64)


def _submitter(reader: StepReader) -> Any:
    ring = reader._ring
    assert ring is not None and ring.wake is not None
    return ring.wake.__self__  # type: ignore[attr-defined]


def test_a_steps_first_layer_goes_first(tmp_path: Path, rng: np.random.Generator) -> None:
    """Two layers in one step: the submitter submits the first layer's reads, waits for
    them, then the rest (`counts`: held); rows equal the source either way."""
    _submitter_or_skip()
    db, st, full = _table(tmp_path, rng, "a")
    reader = StepReader()
    for step in range(30):  # the loop runs at SCHED_IDLE: on a busy machine, more steps
        ids = [_ids(rng), _ids(rng)]
        tickets = [StepTicket(i) for i in ids]
        assert reader.submit([(st, i, t) for i, t in zip(ids, tickets)])
        for i, t in zip(ids, tickets):
            t.wait()
            assert t.rows is not None and np.array_equal(t.rows, full[i])
        if step >= 5 and _submitter(reader).counts()["held"]:
            break
    sub = _submitter(reader)
    assert sub.counts()["held"] >= 1
    reader.close()
    assert sub.result == 0  # stopped cleanly after held hand-overs
    db.close()


def test_the_first_layers_wait_leaves_the_later_layers_reads_to_the_submitter(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A submitter that takes nothing: the wait for the first layer's rows submits only
    that layer's reads; the later layer's stay queued until its own wait submits them."""
    _submitter_or_skip()
    db, st, full = _table(tmp_path, rng, "b")
    reader = StepReader()
    ids = [_ids(rng, k=40), _ids(rng, k=56)]
    tickets = [StepTicket(i) for i in ids]
    assert reader.submit([(st, i, t) for i, t in zip(ids, tickets)])
    tickets[1].wait()
    ring = reader._ring
    assert ring is not None
    # A wake that says it took them and never submits. The loop still runs: a held layer's
    # deferred submission of the first step, run late on a loaded machine, must not take
    # the second step's entries (never handed over to it).
    ring.wake = lambda n, *order: True
    ids = [_ids(rng, k=40), _ids(rng, k=56)]
    tickets = [StepTicket(i) for i in ids]
    assert reader.submit([(st, i, t) for i, t in zip(ids, tickets)])
    assert ring.unsubmitted() == 96
    tickets[0].wait()
    assert tickets[0].rows is not None and np.array_equal(tickets[0].rows, full[ids[0]])
    assert ring.unsubmitted() == 56  # the second layer's: not taken by the first's wait
    tickets[1].wait()
    assert tickets[1].rows is not None and np.array_equal(tickets[1].rows, full[ids[1]])
    assert ring.unsubmitted() == 0
    reader.close()
    db.close()


def test_readers_of_one_burst_read_in_order(tmp_path: Path, rng: np.random.Generator) -> None:
    """Two readers (a module per layer): the first's lead is published once its reads are
    in, and the second's rows come right."""
    sqpoll = _submitter_or_skip()
    from engramdb.io import _submitter as native

    dba, sta, fulla = _table(tmp_path, rng, "c")
    dbb, stb, fullb = _table(tmp_path, rng, "d")
    ra, rb = StepReader(), StepReader()
    read_order.end()
    for _ in range(4):
        ia, ib = _ids(rng), _ids(rng)
        ta, tb = StepTicket(ia), StepTicket(ib)
        assert ra.submit([(sta, ia, ta)], ordered=True)
        assert rb.submit([(stb, ib, tb)], ordered=True)
        ta.wait()
        tb.wait()
        assert ta.rows is not None and np.array_equal(ta.rows, fulla[ia])
        assert tb.rows is not None and np.array_equal(tb.rows, fullb[ib])
    lead = next(read_order._numbers) - 1  # the last lead number handed out (ra's)
    deadline = time.monotonic() + 5
    while native.landed() < lead and time.monotonic() < deadline:
        time.sleep(0.001)
    assert native.landed() >= lead  # ra's loop published its lead once its reads were in
    assert isinstance(_submitter(rb), sqpoll.Submitter)
    ra.close()
    rb.close()
    dba.close()
    dbb.close()


def test_a_lead_never_published_holds_a_later_reader_only_briefly(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """The first reader's reads bypass its submitter (nothing will publish its lead): the
    second reader's loop holds its reads for at most a few ms, then submits them itself."""
    _submitter_or_skip()
    dba, sta, _ = _table(tmp_path, rng, "e")
    dbb, stb, fullb = _table(tmp_path, rng, "f")
    ra, rb = StepReader(), StepReader()
    for r, st in ((ra, sta), (rb, stb)):  # rings and submitters made
        t = StepTicket(_ids(rng))
        assert r.submit([(st, t.ids, t)])
        t.wait()
    assert ra._ring is not None and rb._ring is not None
    ra._ring.wake = lambda n, *order: True  # takes the entries, never publishes
    read_order.end()
    ia, ib = _ids(rng), _ids(rng)
    ta, tb = StepTicket(ia), StepTicket(ib)
    assert ra.submit([(sta, ia, ta)], ordered=True)
    assert rb.submit([(stb, ib, tb)], ordered=True)
    deadline = time.monotonic() + 5
    while rb._ring.unsubmitted() and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert rb._ring.unsubmitted() == 0  # submitted by its loop, not by a wait of ours
    # (the loop counts the hold once its submission returns: the kernel took the entries
    # a little before that)
    while _submitter(rb).counts()["held"] == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert _submitter(rb).counts()["held"] == 1  # after waiting for the lead, in vain
    tb.wait()
    assert tb.rows is not None and np.array_equal(tb.rows, fullb[ib])
    ta.wait()
    ra.close()
    rb.close()
    dba.close()
    dbb.close()


def test_a_held_hand_overs_late_rest_never_takes_the_next_steps_entries() -> None:
    """The loop holds a hand-over's rest while its first entries are read; the engine's wait
    submits that rest meanwhile and pushes the next step (not handed over yet). The loop's
    late submission of the rest then takes nothing: the next step's entries stay queued
    for their own hand-over and its order."""
    sqpoll = _submitter_or_skip()
    from engramdb.io.uring_ring import IORING_OP_READ, Ring, enter

    first, rest, nxt = 2, 6, 5
    for _ in range(20):  # the late submission must come after the push: a busy machine retries
        r, w = os.pipe()
        ring = Ring(64)
        sub = sqpoll.Submitter(ring)
        try:
            st = ring.stage
            st["opcode"][:first] = IORING_OP_READ  # reads of an empty pipe: never in
            st["fd"][:first] = r
            st["off"][:first] = np.uint64(2**64 - 1)
            sink = np.zeros(first, np.uint8)
            st["addr"][:first] = sink.ctypes.data
            st["len"][:first] = 1
            st["opcode"][first:] = 0  # IORING_OP_NOP: in at once
            ring.push(first + rest)
            assert sub.wake(first + rest, first)
            end = time.monotonic() + 1
            while ring.unsubmitted() != rest and time.monotonic() < end:
                pass  # the loop submits the first entries alone, then holds the rest
            if enter(ring.fd, rest, 0, 0) != rest:  # the engine's wait takes the rest
                continue  # the hold was over before this thread looked
            ring.push(nxt)  # the next step, pushed, not handed over
            in_time = sub.counts()["held"] == 0  # the hold not over yet
            while sub.counts()["held"] == 0 and time.monotonic() < end:
                time.sleep(0.0005)
            assert sub.counts()["held"] == 1
            left = ring.unsubmitted()
            if in_time:
                assert left == nxt
                break
        finally:
            os.write(w, b"xx")  # the pipe reads complete
            ring.close()
            os.close(r)
            os.close(w)
    else:
        pytest.skip("the loop's hold ended before the next step was pushed each time")
