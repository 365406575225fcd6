"""The decode step reader (`engramdb.read.steps`), its polling ring (`engramdb.io.sqpoll`) and
the vectored read-ahead advice (`engramdb.io.advise`): rows equal the source bytes on every
table layout, errors are typed, and each refusal falls back to a path that still reads."""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.decode import Decoder
from engramdb.errors import TruncatedFile
from engramdb.io.advise import willneed_rows
from engramdb.io.foreground import Foreground
from engramdb.io.mapping import map_file_aligned, range_pages, unmap_range
from engramdb.read.step_plan import StepTicket, grid_view, wait_ring
from engramdb.read.steps import StepReader
from engramdb.testing.pages import evict

pytestmark = pytest.mark.skipif(not StepReader.available(), reason="io_uring is not available")


def _read(reader: StepReader, jobs: list[tuple[object, np.ndarray]]) -> list[np.ndarray]:
    tickets = [StepTicket(ids) for _, ids in jobs]
    assert reader.submit([(st, ids, t) for (st, ids), t in zip(jobs, tickets)])
    out = []
    for t in tickets:
        t.wait()
        assert t.rows is not None
        out.append(t.rows)
    return out


def _rpb(row_bytes: int) -> int:
    """The fewest rows per badge that tile whole 4 KiB pages (small badges, small shards)."""
    return 4096 // math.gcd(row_bytes, 4096)


def _reader(compiled: bool) -> StepReader:
    """A step reader with its compiled entry writers, completion router and row copier, or
    (``compiled`` False) with all of them off, so numpy writes the entries, routes the
    completions and copies the rows; skips where they are not built."""
    reader = StepReader()
    if not compiled:
        reader._spans_fn = reader._files_fn = reader._copy_fn = reader._route_fn = None
    elif None in (reader._spans_fn, reader._files_fn, reader._copy_fn, reader._route_fn):
        pytest.skip("the compiled step writer and copier are not built")
    return reader


def _edges(n: int, rng: np.random.Generator, k: int = 40) -> np.ndarray:
    return np.concatenate([[0, 1, n - 2, n - 1], rng.integers(0, n, k)]).astype(np.int64)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("row_bytes", [160, 264, 320, 2560, 5000])
def test_rows_of_a_built_table_of_many_shards(
    tmp_path: Path, rng: np.random.Generator, row_bytes: int, compiled: bool
) -> None:
    """Each row's file found by its id: by one compiled call that writes each entry's
    descriptor too, or by numpy (the entries staged again each step); the same rows, over
    steps whose entries wrap the ring and steps that do not."""
    full = rng.integers(0, 256, (max(3000, 3 * _rpb(row_bytes)), row_bytes), dtype=np.uint8)
    # small shards: a step's rows come from several files
    rpb = _rpb(row_bytes)
    engramdb.build(
        tmp_path, "t", row_bytes, [full], rows_per_badge=rpb, shard_bytes=rpb * row_bytes * 2
    )
    with engramdb.open(tmp_path) as db:
        st = db["t"]
        assert len(st.step_layout()[0]) > 1  # type: ignore[index]
        evict(tmp_path / st.info.shards[0].path)
        reader = _reader(compiled)
        for step in range(9):  # the plan and ring reused; 2 x 44 rows: the ring wraps
            a, b = _edges(st.n_rows, rng), _edges(st.n_rows, rng)
            ra, rb = _read(reader, [(st, a), (st, b)])
            assert np.array_equal(ra, full[a]) and np.array_equal(rb, full[b]), step
        assert st.counters()["step_rows"] == 9 * 88
        reader.close()


def _safetensors(path: Path, arr: np.ndarray, pad: int) -> None:
    """One F32 tensor whose data starts ``8 + header`` bytes in, the header padded to make
    that offset odd-sized (rows then start off any page or cache-line boundary)."""
    doc = {"w": {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [0, arr.nbytes]}}
    raw = json.dumps(doc).encode()
    raw += b" " * (-len(raw) % 8 + pad)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + arr.tobytes())


def _unaligned_tensor(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    """A table ``t`` in ``tmp_path / "db"`` attached over one F32 tensor of 320 B rows
    starting off any page or cache-line boundary: the source file and its rows' bytes."""
    arr = rng.standard_normal((5000, 80)).astype(np.float32)
    src = tmp_path / "model.safetensors"
    _safetensors(src, arr, pad=8 * 37)
    engramdb.attach(tmp_path / "db", "t", [src])
    return src, arr.view(np.uint8).reshape(5000, 320)


def test_rows_of_an_attached_tensor_at_an_unaligned_offset(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    src, raw = _unaligned_tensor(tmp_path, rng)
    with engramdb.open(tmp_path / "db") as db:
        st = db["t"]
        evict(src)
        reader = StepReader()
        a, b = _edges(st.n_rows, rng), _edges(st.n_rows, rng)
        ra, rb = _read(reader, [(st, a), (st, b)])  # two jobs of one step
        assert np.array_equal(ra, raw[a]) and np.array_equal(rb, raw[b])
        reader.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_step_entries_written_by_either_path_read_the_same_rows(
    tmp_path: Path, rng: np.random.Generator, compiled: bool
) -> None:
    """A step's reads go into the ring by one compiled call (`engramdb.io.sqpoll.step_compiled`)
    or by numpy: the same rows and device bytes, over steps whose entries wrap the ring
    (staged) and steps that do not, from a source whose rows start off any boundary."""
    src, raw = _unaligned_tensor(tmp_path, rng)
    with engramdb.open(tmp_path / "db") as db:
        st = db["t"]
        reader = _reader(compiled)
        for step in range(9):  # 2 x 44 rows a step: the 256-entry ring wraps on the 3rd
            evict(src)
            a, b = _edges(st.n_rows, rng), _edges(st.n_rows, rng)
            ra, rb = _read(reader, [(st, a), (st, b[::-1].copy())])
            assert np.array_equal(ra, raw[a]) and np.array_equal(rb, raw[b[::-1]]), step
        c = st.counters()
        assert c["step_rows"] == 9 * 88 and c["step_device_bytes"] >= 9 * 88 * 320
        # ids of another integer type: the compiled writer refuses them (nothing written)
        # and numpy reads them
        a = _edges(st.n_rows, rng)
        (ra,) = _read(reader, [(st, a.astype(np.int32))])
        assert np.array_equal(ra, raw[a])
        reader.close()


def test_route_hands_each_completion_to_its_request_and_ticket() -> None:
    """The compiled router (`StepReader._reap`) over a CQ whose entries wrap its end: each
    result lands at its request, each ticket counts its own, the head moves to the tail;
    a completion naming no request raises."""
    route = StepReader()._route_fn
    if route is None:
        pytest.skip("the compiled router is not built")
    from engramdb.io.uring_ring import CQE_DTYPE

    cqes = np.zeros(8, CQE_DTYPE)
    head, tail = np.array([6], np.uint32), np.array([6 + 5], np.uint32)
    order = [4, 0, 9, 2, 7]  # user_data, in completion order; slots 6, 7, 0, 1, 2
    for k, ud in enumerate(order):
        cqes[(6 + k) % 8] = (ud, 1000 + ud, 0)
    got = np.full(10, -1, np.int64)
    ends = np.array([3, 8, 10], np.int64)  # tickets: requests 0-2, 3-7, 8-9
    counts, sums = np.zeros((2, 3), np.int64)
    assert route(head, tail, cqes, got, ends, counts, sums) == 5
    assert int(head[0]) == 11
    assert {i: int(got[i]) for i in np.flatnonzero(got >= 0)} == {u: 1000 + u for u in order}
    assert counts.tolist() == [2, 2, 1]
    assert sums.tolist() == [1000 + 0 + 1000 + 2, 1000 + 4 + 1000 + 7, 1000 + 9]
    assert route(head, tail, cqes, got, ends, counts) == 0  # nothing new
    with pytest.raises(ValueError, match="sums"):
        route(head, tail, cqes, got, ends, counts, np.zeros(2, np.int64))  # one per ticket
    for ud in (10, 12):  # past the step's requests; past got too
        tail[0] += 1
        cqes[(int(tail[0]) - 1) % 8] = (ud, 5, 0)
        with pytest.raises(ValueError, match="name no request"):
            route(head, tail, cqes, np.full(11 if ud == 10 else 10, -1, np.int64), ends, counts)
        assert int(head[0]) == int(tail[0])  # the slot is freed all the same
    assert counts.tolist() == [2, 2, 1]
    with pytest.raises(ValueError):
        route(head, tail, cqes[:6], got, ends, counts)  # not a power of two


@pytest.mark.parametrize("compiled", [True, False])
def test_a_step_is_taken_at_once_only_when_all_its_reads_are_in_and_whole(
    rng: np.random.Generator, compiled: bool
) -> None:
    """`take_step` (compiled, or its numpy twin): a CQ holding exactly the step's completions,
    wrapping its end, whose results sum to the step's spans is taken (the head moves past
    them); fewer, more, or one read short or failed takes nothing; a CQ whose entry count
    is not a power of two is refused. A reader uses the compiled one where built."""
    from engramdb.io.sqpoll import step_compiled
    from engramdb.io.uring_ring import CQE_DTYPE
    from engramdb.read.step_plan import take_step

    take = step_compiled("take_step") if compiled else take_step
    if take is None:
        pytest.skip("the compiled step parts are not built")
    cqes = np.zeros(16, CQE_DTYPE)
    cqes["user_data"] = rng.integers(0, 1 << 40, 16)
    cqes["flags"] = rng.integers(0, 1 << 32, 16)
    spans = rng.integers(1, 1 << 20, 6)
    for k, res in enumerate(spans):  # six completions in slots 13, 14, 15, 0, 1, 2
        cqes["res"][(13 + k) % 16] = res
    total = int(spans.sum())
    head, tail = np.array([13], np.uint32), np.array([13 + 6], np.uint32)
    assert take(head, tail, cqes, 7, total) == 0 and int(head[0]) == 13  # one still out
    assert take(head, tail, cqes, 5, total) == -1 and int(head[0]) == 13  # more than asked
    for bad in (-5, int(spans[4]) - 1):  # a failed read; a short one
        cqes["res"][1] = bad
        assert take(head, tail, cqes, 6, total) == -1 and int(head[0]) == 13
    cqes["res"][1] = spans[4]
    assert take(head, tail, cqes, 6, total) == 1 and int(head[0]) == 19  # taken: slots free
    if compiled:
        assert StepReader()._take_fn is take
        with pytest.raises(ValueError, match="entries"):
            take(head, tail, cqes[:12], 0, 0)  # not a power of two


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_finish_into_writes_a_strided_destination_per_ticket(
    tmp_path: Path, rng: np.random.Generator, compiled: bool
) -> None:
    full = rng.integers(0, 256, (4000, 160), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 160, [full], rows_per_badge=128)
    with engramdb.open(tmp_path) as db:
        st = db["t"]
        reader = _reader(compiled)
        for step in range(2):  # per ticket, then the whole step at once
            evict(tmp_path / st.info.shards[0].path)
            a = rng.integers(0, 4000, (3, 8)).astype(np.int64)  # [B, H]
            b = rng.integers(0, 4000, (3, 8)).astype(np.int64)
            ta, tb = StepTicket(a), StepTicket(b)
            assert reader.submit([(st, a, ta), (st, b, tb)])
            out = np.zeros((3, 2, 8, 160), np.uint8)  # [B, L, H, rb]: each layer's slice strided
            unit = reader.step_unit
            if step == 0:
                for i, t in ((1, tb), (0, ta)):  # any order
                    dest = grid_view(out, (3,), 2, 8, unit, i)
                    assert reader.finish_into(dest, t)
                    assert not reader.finish_into(dest, t)  # collected: nothing more
            else:
                assert reader.finish_into(grid_view(out, (3,), 2, 8, unit, -1))  # [L, B, H, ...]
                assert ta.state == tb.state == "done"
            assert np.array_equal(out[:, 0], full[a]) and np.array_equal(out[:, 1], full[b])
        reader.close()


def test_a_ticket_whose_reads_are_in_is_served_by_the_fast_path(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """`StepReader.finish_fast` (a decode step's per-layer fill): it routes the completions
    in the ring and, once every read of the ticket is in and whole, copies its rows into the
    destination and ends it done; it declines, writing nothing, while the ticket's reads are
    not all routed, for a ticket already collected, and for another reader's ticket. The
    step's reads are counted on their table once."""
    full = rng.integers(0, 256, (4000, 160), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 160, [full], rows_per_badge=128)
    with engramdb.open(tmp_path, background_warm=False) as db:
        st = db["t"]
        evict(tmp_path / st.info.shards[0].path)
        reader, other = _reader(True), StepReader()
        a = rng.integers(0, 4000, (3, 8)).astype(np.int64)
        b = rng.integers(0, 4000, (3, 8)).astype(np.int64)
        ta, tb = StepTicket(a), StepTicket(b)
        assert reader.submit([(st, a, ta), (st, b, tb)])
        ring = reader._ring
        assert ring is not None
        for _ in range(100):  # every read in (submitting any the submitter holds), none reaped
            in_cq = (int(ring.cq_tail[0]) - int(ring.cq_head[0])) & 0xFFFFFFFF
            if in_cq == 48:
                break
            r = wait_ring(ring, 48 - in_cq)
            assert r >= 0 or r == -errno.EINTR, r
        assert in_cq == 48, "the step's reads did not come in"
        out = np.zeros((3, 2, 8, 160), np.uint8)  # [B, L, H, rb]
        dests = [grid_view(out, (3,), 2, 8, reader.step_unit, i) for i in (0, 1)]
        route = reader._route_fn
        reader._route_fn = lambda *args: 0  # completions not routed yet: counts stay short
        assert not reader.finish_fast(dests[0], ta) and ta.state == "running"
        assert not out.any()
        reader._route_fn = route
        assert not other.finish_fast(dests[0], ta)
        assert reader.finish_fast(dests[0], ta) and ta.state == "done"
        assert not reader.finish_fast(dests[0], ta)  # collected
        assert reader.finish_fast(dests[1], tb) and tb.state == "done"
        assert np.array_equal(out[:, 0], full[a]) and np.array_equal(out[:, 1], full[b])
        assert st.counters()["step_rows"] == 48
        reader.close()
        other.close()


def test_a_repeated_one_table_step_takes_the_short_submission(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """`StepReader.submit_fast`: after an ordered one-table step read the long way, a step of
    the same table and row count is submitted by the short path, with the same rows; it
    declines (nothing submitted) for another row count, another table, a step whose reads
    are still in flight, after a step of two tables, and before any step; the long path
    then reads it. A table of several files takes it too."""
    full = rng.integers(0, 256, (4000, 160), dtype=np.uint8)
    engramdb.build(tmp_path, "a", 160, [full])  # one shard each: one file
    engramdb.build(tmp_path, "b", 160, [full[::-1].copy()])
    with engramdb.open(tmp_path, background_warm=False) as db:
        a, b = db["a"], db["b"]
        for st in (a, b):
            evict(tmp_path / st.info.shards[0].path)
        reader = _reader(True)

        def step(store: Any, ids: np.ndarray, fast: bool) -> np.ndarray:
            t = StepTicket(ids)
            assert reader.submit_fast(store, ids, t) is fast
            if not fast:
                assert reader.submit([(store, ids, t)], ordered=True)
            out = np.zeros((ids.size, 160 // reader.step_unit, reader.step_unit), np.uint8)
            assert reader.finish_into(out, t) and t.state == "done"
            return out.reshape(ids.size, 160)

        ids = [rng.integers(0, 4000, 24).astype(np.int64) for _ in range(12)]
        assert np.array_equal(step(a, ids[0], False), full[ids[0]])  # no step before
        for k in range(1, 8):  # the ring's positions come round: each one's entries kept
            assert np.array_equal(step(a, ids[k], True), full[ids[k]])
        assert np.array_equal(step(a, ids[8][:20], False), full[ids[8][:20]])  # other count
        assert np.array_equal(step(b, ids[9][:20], False), full[::-1][ids[9][:20]])
        t = StepTicket(ids[10][:20])
        assert reader.submit_fast(b, ids[10][:20], t)  # in flight, not reaped:
        assert not reader.submit_fast(b, ids[11][:20], StepTicket(ids[11][:20]))
        t.wait()
        assert np.array_equal(t.rows, full[::-1][ids[10][:20]])
        two = [StepTicket(ids[0]), StepTicket(ids[1])]
        assert reader.submit([(a, ids[0], two[0]), (b, ids[1], two[1])], ordered=True)
        for tk in two:
            tk.wait()
        assert not reader.submit_fast(a, ids[2], StepTicket(ids[2]))  # after two tables
        reader.close()
    engramdb.build(tmp_path, "m", 160, [full], rows_per_badge=128, shard_bytes=64 << 10)
    with engramdb.open(tmp_path, background_warm=False) as db:
        m = db["m"]
        assert len(m.info.shards) > 1
        reader = _reader(True)
        assert np.array_equal(step(m, ids[0], False), full[ids[0]])
        for k in range(1, 8):  # each entry's descriptor written with its offset
            assert np.array_equal(step(m, ids[k], True), full[ids[k]])
        reader.close()


def test_a_hand_over_before_the_submitter_loop_starts_is_submitted(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new ring's submitter thread may reach its loop after the engine's first hand-over
    (here held back 0.2 s): the loop still submits those entries, with nothing else asking
    (no wait, no later step)."""
    from engramdb.io import sqpoll

    if not sqpoll.submitter_state()[0] or os.environ.get(sqpoll.SQPOLL_ENV, "") == "1":
        pytest.skip("no submitter thread here")
    start = sqpoll.run_as_worker
    monkeypatch.setattr(sqpoll, "run_as_worker", lambda: (time.sleep(0.2), start()))
    full = rng.integers(0, 256, (4000, 160), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 160, [full], rows_per_badge=128)
    with engramdb.open(tmp_path, background_warm=False) as db:
        st = db["t"]
        reader = StepReader()
        ids = rng.integers(0, 4000, 24).astype(np.int64)
        t = StepTicket(ids)
        assert reader.submit([(st, ids, t)])
        ring = reader._ring
        assert ring is not None and ring.wake is not None
        end = time.monotonic() + 5
        while (int(ring.cq_tail[0]) - int(ring.cq_head[0])) & 0xFFFFFFFF < 24:
            assert time.monotonic() < end, f"{ring.unsubmitted()} entries never submitted"
            time.sleep(0.005)
        t.wait()
        assert t.rows is not None and np.array_equal(t.rows, full[ids])
        reader.close()


@pytest.mark.parametrize("rows_bytes", [(3, 320), (40, 320), (300, 128), (64, 960)])
def test_copy_out_puts_every_row_of_a_step_into_a_strided_grid(
    rng: np.random.Generator, rows_bytes: tuple[int, int]
) -> None:
    """The compiled copy of a step's rows out of the staging buffer (with its loads of rows
    ahead where a step has many) writes each row, in order, into a strided grid of the
    engine's buffer, and refuses a row past the buffer."""
    from engramdb.io.sqpoll import step_compiled

    copy = step_compiled("copy_out")
    if copy is None:
        pytest.skip("engramdb.io._submitter is not built")
    n, rb = rows_bytes
    slot_size = 1024
    buf = rng.integers(0, 256, n * slot_size + 4096, dtype=np.uint8)
    slot = rng.permutation(n).astype(np.int64) * slot_size
    ip = rng.integers(0, (slot_size - rb) // 64 + 1, n).astype(np.int64) * 64
    out = np.zeros((n, 2, rb // 64, 64), np.uint8)  # [rows, layers, k, unit]: layer 1 strided
    copy(out[:, 1], buf, slot, ip, 0)
    want = buf[(slot + ip)[:, None] + np.arange(rb)]
    assert np.array_equal(out[:, 1].reshape(n, rb), want)
    assert not out[:, 0].any()  # the other layer's slice untouched
    part = np.zeros((n - 1, rb // 64, 64), np.uint8)
    copy(part, buf, slot, ip, 1)  # rows 1.. of the step
    assert np.array_equal(part.reshape(n - 1, rb), want[1:])
    bad = slot.copy()
    bad[-1] = buf.size - rb + 1  # the last row would end past the buffer
    with pytest.raises(ValueError, match="past the staging buffer"):
        copy(np.zeros((n, rb // 64, 64), np.uint8), buf, bad, ip, 0)


def _attached_rows(tmp_path: Path, rng: np.random.Generator) -> tuple[np.ndarray, Path]:
    """Table ``t`` of ``tmp_path / "db"`` attached over a raw file of 20,000 random 160 B
    rows: the rows and the file."""
    raw = rng.integers(0, 256, (20_000, 160), dtype=np.uint8)
    src = tmp_path / "rows.bin"
    raw.tofile(src)
    engramdb.attach(tmp_path / "db", "t", [src], row_bytes=160)
    return raw, src


def test_a_source_truncated_under_the_reader_raises_truncated_file(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    raw, src = _attached_rows(tmp_path, rng)
    with engramdb.open(tmp_path / "db") as db:
        st = db["t"]
        reader = StepReader()
        ids = np.array([5, 19_990], np.int64)
        (rows,) = _read(reader, [(st, ids)])
        assert np.array_equal(rows, raw[ids])
        os.truncate(src, 10_000 * 160)  # rows past 10,000 are gone
        t = StepTicket(ids)
        assert reader.submit([(st, ids, t)])
        with pytest.raises(TruncatedFile, match="rows.bin"):
            t.wait()
        reader.close()


@pytest.mark.parametrize("compiled", [True, False])
def test_a_cut_read_of_a_steps_first_ticket_raises_before_the_rest_is_read(
    tmp_path: Path, rng: np.random.Generator, compiled: bool
) -> None:
    """A step of two tickets whose second one's reads nobody has submitted yet: the first is
    checked on its own (its reads' results summed against its spans as they are routed), so
    its rows come back equal to the source, and a row cut off by a truncation under the
    reader raises `TruncatedFile` there, before the second ticket's reads are sent."""
    from engramdb.io import sqpoll

    if not sqpoll.submitter_state()[0] or sqpoll.sqpoll_state()[0]:
        pytest.skip("no submitter here")
    raw, src = _attached_rows(tmp_path, rng)
    with engramdb.open(tmp_path / "db") as db:
        st = db["t"]
        reader = _reader(compiled)
        _read(reader, [(st, np.array([1], np.int64))])  # the ring exists now
        ring = reader._ring
        assert ring is not None and ring.wake is not None
        ring.wake = lambda n, *order: True  # takes nothing: each wait submits what it needs
        first, later = np.array([5, 19_990, 3], np.int64), np.array([7, 8], np.int64)
        for cut in (False, True):
            if cut:
                os.truncate(src, 10_000 * 160)  # rows past 10,000 are gone
            t1, t2 = StepTicket(first), StepTicket(later)
            assert reader.submit([(st, first, t1), (st, later, t2)])
            if cut:
                with pytest.raises(TruncatedFile, match="rows.bin"):
                    t1.wait()
            else:
                t1.wait()
                assert t1.rows is not None and np.array_equal(t1.rows, raw[first])
            assert ring.unsubmitted() == later.size  # the second ticket's reads still wait
            if not cut:
                t2.wait()
                assert t2.rows is not None and np.array_equal(t2.rows, raw[later])
        reader.close()


def _one_layer_table(tmp_path: Path, rng: np.random.Generator) -> tuple[Any, int, np.ndarray]:
    """Table ``p`` of random rows for a small Qwen PLE hasher's first layer."""
    from engramdb import keygen

    h = keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000)
    lay = int(h.layers[0])
    big = rng.integers(0, 256, (int(h.table_rows(lay)), 160), dtype=np.uint8)
    engramdb.build(tmp_path, "p", 160, [big], rows_per_badge=128)
    return h, lay, big


def _decode_steps(table: Any, h: Any, lay: int, big: np.ndarray, tokens: np.ndarray) -> None:
    """A prefetching decoder over ``table`` pushes ``tokens`` one by one; every fill equals
    the rows of ``big`` its push named."""
    dec = Decoder(table, h, layer=lay, prefetch=True)
    out = np.empty(dec.out_shape, np.uint8)
    for tok in tokens.tolist():
        rows = dec.push(tok)
        dec.fill(out)
        assert np.array_equal(out, big[rows[0]])


def test_a_file_system_without_o_direct_falls_back_to_the_prefetcher(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``open(O_DIRECT)`` fails with EINVAL (older tmpfs, some FUSE file systems) the
    reader refuses the step and the decoder's table prefetcher reads it."""
    from engramdb.io import uring_ring

    real_open = os.open

    def no_direct(path: str, flags: int, *a: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(uring_ring.os, "open", no_direct)
    h, lay, big = _one_layer_table(tmp_path, rng)
    with engramdb.open(tmp_path) as db:
        t = StepTicket(np.array([1], np.int64))
        assert not StepReader().submit([(db["p"], t.ids, t)])
        _decode_steps(db["p"], h, lay, big, rng.integers(0, 1000, 20))
        st = db["p"].stats()
        assert st["step_rows"] == 0 and st["prefetch"]["submitted"] == 20


def test_the_decoder_reads_cold_steps_through_the_step_reader(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    from engramdb import keygen

    h = keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000, ple_layer_ids=[2, 5])
    lays = [2, 5]
    fulls = {}
    for lay in lays:
        fulls[lay] = rng.integers(0, 256, (int(h.table_rows(lay)), 160), dtype=np.uint8)
        engramdb.build(tmp_path, f"l{lay}", 160, [fulls[lay]], rows_per_badge=128)
    toks = rng.integers(0, 1000, (4, 24))
    with engramdb.open(tmp_path, background_warm=False) as db:
        for lay in lays:
            evict(tmp_path / db[f"l{lay}"].info.shards[0].path)
        dec = Decoder({lay: db[f"l{lay}"] for lay in lays}, h, batch=4, prefetch=True)
        out = np.empty(dec.out_shape, np.uint8)
        for k in range(toks.shape[1]):
            rows = dec.push(toks[:, k])
            for i, lay in enumerate(reversed(lays)):  # a layer at a time, either order
                dec.fill(out, layer=lay)
                j = len(lays) - 1 - i
                assert np.array_equal(out[:, j], fulls[lay][rows[j]])
        assert all(db[f"l{lay}"].counters()["step_rows"] == 4 * 24 * dec.n_heads for lay in lays)


def test_polling_can_be_turned_off() -> None:
    out = _sqpoll_in_child("0")
    assert out.split()[:2] == ["False", "False"]
    assert "ENGRAMDB_SQPOLL=0" in out


def _sqpoll_in_child(setting: str | None, cpus: int | None = None) -> str:
    """``sqpoll_state`` and a polled ring's mode in a child allowed on ``cpus`` CPUs (None:
    all of this process's), with ``ENGRAMDB_SQPOLL`` set to ``setting`` (None: unset)."""
    pin = f"os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:{cpus}]))\n"
    code = (
        "import os\n"
        + (pin if cpus else "")
        + "from engramdb.io.sqpoll import sqpoll_state, polled_ring\n"
        "on, why = sqpoll_state(); print(on, polled_ring(8).sqpoll, '|', why)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ENGRAMDB_SQPOLL"}
    if setting is not None:
        env["ENGRAMDB_SQPOLL"] = setting
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _refused(why: str) -> bool:
    """A kernel or sandbox without SQPOLL, or not x86-64: no polling whatever the setting."""
    return "refused" in why or "x86-64" in why


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_two_cpus_get_no_polling_thread_unless_asked() -> None:
    from engramdb.io.sqpoll import MIN_CPUS

    assert MIN_CPUS > 2
    default = _sqpoll_in_child(None, 2)
    assert default.split()[:2] == ["False", "False"]
    assert "2 CPUs" in default and "ENGRAMDB_SQPOLL=1" in default
    forced = _sqpoll_in_child("1", 2)
    assert forced.split()[:2] == ["True", "True"] or _refused(forced), forced
    assert _sqpoll_in_child("1", 1).split()[:2] == ["False", "False"]  # never the only CPU


def test_rows_through_the_polling_thread_equal_the_source(tmp_path: Path) -> None:
    """The polled ring's path (entries written, the tail moved, the thread woken), forced on
    in a child process (this machine may have too few CPUs for it by default)."""
    code = f"""
import numpy as np, engramdb
from engramdb.decode import Decoder
from engramdb.io.sqpoll import sqpoll_state
from engramdb import keygen
from engramdb.testing.pages import evict
h = keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000)
lay = int(h.layers[0])
n = int(h.table_rows(lay))
rng = np.random.default_rng(5)
full = rng.integers(0, 256, (n, 160), dtype=np.uint8)
engramdb.build({str(tmp_path)!r}, "t", 160, [full], rows_per_badge=128)
with engramdb.open({str(tmp_path)!r}) as db:
    st = db["t"]
    evict({str(tmp_path)!r} + "/" + st.info.shards[0].path)
    dec = Decoder(st, h, layer=lay, batch=4, prefetch=True)
    out = np.empty(dec.out_shape, np.uint8)
    for tok in rng.integers(0, 1000, (12, 4)):
        rows = dec.push(tok)
        dec.fill(out)
        assert np.array_equal(out, full[rows[0]])
    on, why = sqpoll_state()
    print(on, st.counters()["step_rows"], "|", why)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, ENGRAMDB_SQPOLL="1"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    polled, step_rows, _, *why = out.stdout.split()
    assert int(step_rows) == 12 * 4 * 16  # every row came through the step reader
    if len(os.sched_getaffinity(0)) >= 2:
        assert polled == "True" or _refused(" ".join(why)), out.stdout


def test_willneed_rows_starts_the_reads_of_exactly_those_pages(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    path = tmp_path / "t.bin"
    rng.integers(0, 256, 16 << 20, dtype=np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        evict(fd)
        addr = map_file_aligned(fd, 16 << 20)
        try:
            # 320 B rows: pages 0, 1000 + 1001 (the row crosses a page), 3125, 3906
            ids = np.array([0, 12_812, 40_000, 50_000], np.int64)
            advised = willneed_rows(addr, ids, 320)
            assert advised == 5 * 4096
            deadline = time.monotonic() + 5
            while range_pages(addr, 16 << 20)[0] < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert range_pages(addr, 16 << 20)[0] == 5  # those pages and no read-ahead
        finally:
            unmap_range(addr, 16 << 20)
    finally:
        os.close(fd)


def test_a_noted_batch_holds_the_gap_until_its_estimated_end() -> None:
    now = [10.0]
    fg = Foreground(clock=lambda: now[0])
    for _ in range(4):  # a periodic loop: a batch every 4 ms, each ~1 ms of device time
        fg.note(0.001)
        now[0] += 0.004
    assert fg.yielding() and 0.0035 < fg.period < 0.0045
    fg.note(0.001)
    assert not fg.wait_gap(0.0001, timeout=0.0)  # in flight until its estimated end
    now[0] += 0.0012
    assert fg.wait_gap(0.0001, timeout=0.0)  # done, and the next batch is 2.8 ms away


def test_without_io_uring_the_decoder_uses_the_table_prefetcher(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setenv("ENGRAMDB_DISABLE_IO_URING", "1")
    assert not StepReader.available()
    h, lay, big = _one_layer_table(tmp_path, rng)
    with engramdb.open(tmp_path, backend="preadv") as db:
        _decode_steps(db["p"], h, lay, big, rng.integers(0, 1000, 10))
        assert db["p"].stats()["step_rows"] == 0


def test_a_process_on_one_cpu_gets_no_polling_thread() -> None:
    out = _sqpoll_in_child(None, 1)
    assert out.split()[:2] == ["False", "False"]
    assert "one CPU" in out


def _evicted_table(tmp_path: Path, rng: np.random.Generator) -> tuple[Any, Any, np.ndarray]:
    full = rng.integers(0, 256, (4000, 264), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 264, [full])
    db = engramdb.open(tmp_path)
    st = db["t"]
    for sh in st.info.shards:
        evict(tmp_path / sh.path)
    return db, st, full


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_rows_through_the_submitter_thread_equal_the_source(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    from engramdb.io import sqpoll

    if not sqpoll.submitter_state()[0] or sqpoll.sqpoll_state()[0]:
        pytest.skip(f"no submitter here: {sqpoll.submitter_state()[1] or 'polling thread'}")
    db, st, full = _evicted_table(tmp_path, rng)
    reader = StepReader()
    for _ in range(4):
        ids = _edges(st.n_rows, rng, 200)
        (rows,) = _read(reader, [(st, ids)])
        assert np.array_equal(rows, full[ids])
    ring = reader._ring
    assert ring is not None and ring.wake is not None  # the submitter took the entries
    sub = ring.wake.__self__  # type: ignore[attr-defined]
    assert isinstance(sub, sqpoll.Submitter) and sub._thread.is_alive()
    assert sub._thread.name == "engramdb-submitter"
    reader.close()
    assert not sub._thread.is_alive() and sub.result == 0  # the ring's close stopped it
    db.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_entries_the_submitter_never_takes_are_submitted_by_the_wait(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    from engramdb.io import sqpoll

    if not sqpoll.submitter_state()[0] or sqpoll.sqpoll_state()[0]:
        pytest.skip("no submitter here")
    db, st, full = _evicted_table(tmp_path, rng)
    reader = StepReader()
    (rows,) = _read(reader, [(st, _edges(st.n_rows, rng))])  # the ring exists now
    ring = reader._ring
    assert ring is not None and ring.wake is not None
    sub = ring.wake.__self__  # type: ignore[attr-defined]
    assert isinstance(sub, sqpoll.Submitter)
    ring.wake = lambda n, *order: True  # says it took them, never submits: the wait must
    for _ in range(3):
        ids = _edges(st.n_rows, rng, 100)
        (rows,) = _read(reader, [(st, ids)])
        assert np.array_equal(rows, full[ids])
    sub.stop()  # a stopped submitter: wake() is False, the reader enters the ring itself
    assert sub.result == 0 and not sub.wake(1)
    ring.wake = sub.wake
    ids = _edges(st.n_rows, rng, 100)
    (rows,) = _read(reader, [(st, ids)])
    assert np.array_equal(rows, full[ids])
    reader.close()
    db.close()


def _paced_steps(
    reader: StepReader, st: object, full: np.ndarray, rng: np.random.Generator, steps: int
) -> None:
    """Decode-like steps: submit, 'compute' 3 ms, then wait; rows equal the source."""
    for _ in range(steps):
        ids = _edges(full.shape[0], rng, 60)
        t = StepTicket(ids)
        assert reader.submit([(st, ids, t)])
        end = time.perf_counter() + 3e-3
        while time.perf_counter() < end:
            pass
        t.wait()
        assert t.rows is not None and np.array_equal(t.rows, full[ids])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize(("spin_us", "nap_us"), [("0", "0"), ("5000", "0"), ("5000", "50")])
def test_the_submitter_watches_for_steady_steps(
    tmp_path: Path,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    spin_us: str,
    nap_us: str,
) -> None:
    """Steps at a steady pace: the submitter learns it and watches around the next
    hand-over, spinning or napping, which then costs the engine no doorbell (`counts`:
    caught); with the watch off (``ENGRAMDB_SUBMITTER_SPIN_US=0``) every hand-over rings
    it. Rows are right either way, and the ring's close stops the loop (a napping one too)."""
    from engramdb.io import sqpoll

    if not sqpoll.submitter_state()[0] or sqpoll.sqpoll_state()[0]:
        pytest.skip("no submitter here")
    monkeypatch.setenv(sqpoll.SPIN_ENV, spin_us)
    monkeypatch.setenv(sqpoll.NAP_ENV, nap_us)
    db, st, full = _evicted_table(tmp_path, rng)
    reader = StepReader()
    steps = 0
    for _ in range(3):  # the loop runs at SCHED_IDLE: on a busy machine give it more steps
        _paced_steps(reader, st, full, rng, 30)
        steps += 30
        ring = reader._ring
        assert ring is not None and ring.wake is not None
        sub = ring.wake.__self__  # type: ignore[attr-defined]
        c = sub.counts()
        if c["caught"] or spin_us == "0":
            break
    reader.close()
    assert sub.result == 0 and not sub._thread.is_alive()
    db.close()
    if spin_us == "0":
        assert c["caught"] == 0 and c["watched_ns"] == 0 and c["rung"] >= 1
    else:  # caught hand-overs rang no doorbell (a race may count one twice, rarely)
        assert c["caught"] > 0 and c["watched_ns"] > 0, c
        assert c["caught"] + c["rung"] <= steps + 2, c


def test_a_hand_over_carries_the_engines_clock() -> None:
    """`notify` adds the count and stamps the engine's monotonic clock beside it (the loop
    learns the pace from those stamps, not from when it saw them); it rings the eventfd
    only while the loop is not watching."""
    from engramdb.io import sqpoll

    native = sqpoll._native_submitter
    if native is None:
        pytest.skip("engramdb.io._submitter is not built")
    state = np.zeros(native.STATE_WORDS, np.int64)
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    try:
        before = time.monotonic_ns()
        assert native.notify(int(state.ctypes.data), efd, 3) == 1  # not watching: rung
        after = time.monotonic_ns()
        assert state[0] == 3 and before <= state[5] <= after
        assert os.eventfd_read(efd) == 1
        state[1] = 1  # the loop watches: no doorbell
        assert native.notify(int(state.ctypes.data), efd, 2) == 0
        assert state[0] == 5 and state[5] >= after
        with pytest.raises(BlockingIOError):
            os.eventfd_read(efd)
    finally:
        os.close(efd)


def test_the_watch_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's window is `SPIN_US` unless set; it spins from `MIN_CPUS` CPUs up and naps
    `NAP_US` at a time below; each setting wins anywhere, clamped to 0..10 ms."""
    from engramdb.io import sqpoll

    on, nap = sqpoll.SPIN_US * 1000, sqpoll.NAP_US * 1000
    assert sqpoll.MIN_CPUS > 2 and 0 < nap < on
    spin_cases = [(8, "", on), (2, "", on), (2, "250", 250_000), (8, "0", 0), (8, "-3", 0),
                  (2, "1e9", 10_000_000), (8, "x", on), (2, "x", on)]  # fmt: skip
    nap_cases = [(8, "", 0), (2, "", nap), (2, "0", 0), (8, "100", 100_000), (2, "x", nap),
                 (8, "x", 0)]  # fmt: skip
    for cpus, raw, ns in spin_cases:
        monkeypatch.setattr(sqpoll, "PROCESS_CPUS", frozenset(range(cpus)))
        monkeypatch.setenv(sqpoll.SPIN_ENV, raw)
        assert sqpoll.spin_ns() == ns, (cpus, raw)
    for cpus, raw, ns in nap_cases:
        monkeypatch.setattr(sqpoll, "PROCESS_CPUS", frozenset(range(cpus)))
        monkeypatch.setenv(sqpoll.NAP_ENV, raw)
        assert sqpoll.nap_ns() == ns, (cpus, raw)


def test_the_submitter_can_be_turned_off() -> None:
    code = (
        "from engramdb.io.sqpoll import submitter_state, polled_ring\n"
        "on, why = submitter_state(); print(on, polled_ring(8).wake is None, '|', why)\n"
    )
    env = {**os.environ, "ENGRAMDB_SUBMITTER": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["False", "True"]
    assert "ENGRAMDB_SUBMITTER=0" in out.stdout


def test_a_forked_child_does_not_wake_its_parents_submitter() -> None:
    """The child has the ring's memory but not the parent's submitter thread: its wake is
    refused (the caller then enters the ring itself), told by the fork counter."""
    from engramdb.io.sqpoll import polled_ring, submitter_state

    if not submitter_state()[0]:
        pytest.skip(f"no submitter thread here: {submitter_state()[1]}")
    ring = polled_ring(8)
    try:
        if ring.wake is None:
            pytest.skip("this ring is read by the polling thread, not a submitter")
        assert ring.wake(0)  # the parent's own: taken
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0 if ring.wake(0) is False else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        ring.close()
