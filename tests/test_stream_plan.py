"""The stream planner: runs cover exactly a window's rows, in file order, within the merge
gap and the read cap; the window bitmap yields sorted distinct rows and their ranks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engramdb.errors import InvalidArgument
from engramdb.read.plan import Geometry
from engramdb.read.stream_plan import WindowMarks, plan_runs


@st.composite
def windows(draw: st.DrawFn) -> tuple[Geometry, np.ndarray, int, int]:
    rb = draw(st.sampled_from([1, 7, 160, 320, 4096]))
    rps = draw(st.integers(1, 400))
    shards = draw(st.integers(1, 4))
    n_rows = draw(st.integers(1, rps * shards))
    ids = draw(st.lists(st.integers(0, n_rows - 1), max_size=300))
    gap = draw(st.sampled_from([0, 1, rb, 4096, 1 << 20]))
    max_read = draw(st.sampled_from([1, rb, 3 * rb + 1, 8192, 1 << 20]))
    return Geometry(n_rows, rb, rps), np.asarray(ids, dtype=np.int64), gap, max_read


@settings(max_examples=300, deadline=None)
@given(windows())
def test_runs_cover_exactly_the_rows_in_order(w: tuple[Geometry, np.ndarray, int, int]) -> None:
    g, ids, gap, max_read = w
    marks = WindowMarks(g.n_rows, dense_max_bytes=0 if ids.size % 2 else 1 << 30)
    count = marks.add(ids)
    rows = marks.distinct()
    assert np.array_equal(rows, np.unique(ids)) and count == rows.size
    p = plan_runs(rows, g, merge_gap=gap, max_read=max_read)
    rb, rps = g.row_bytes, g.rows_per_shard
    assert p.first_row[0] == 0 and p.first_row[-1] == rows.size
    assert np.all(np.diff(p.first_row) >= 1), "every run holds at least one row"
    covered = []
    for i in range(p.n_runs):  # test-side check, per run
        r = rows[p.first_row[i] : p.first_row[i + 1]]
        assert np.all(r // rps == p.shard[i]), "a run stays in one shard"
        off = (r % rps) * rb
        assert off[0] == p.offset[i] and off[-1] + rb == p.offset[i] + p.length[i]
        assert np.all(np.diff(off) - rb <= gap), "rows inside a run are within the merge gap"
        assert p.length[i] <= max_read + rb, "a run stays within max_read plus one row"
        assert np.array_equal(p.row_offset[p.first_row[i] : p.first_row[i + 1]], off)
        covered.append(r)
        if i:
            same = p.shard[i] == p.shard[i - 1]
            assert p.shard[i] >= p.shard[i - 1]
            if same:
                prev_end = p.offset[i - 1] + p.length[i - 1]
                assert p.offset[i] >= prev_end, "runs of a shard ascend without overlap"
    if rows.size:
        assert np.array_equal(np.concatenate(covered), rows)
    # without the read cap, runs of one shard split only where the gap exceeds merge_gap
    u = plan_runs(rows, g, merge_gap=gap, max_read=1 << 60)
    ends = u.offset + u.length
    same = u.shard[1:] == u.shard[:-1]
    assert np.all(u.offset[1:][same] - ends[:-1][same] > gap)
    assert p.read_bytes >= p.payload_bytes == rows.size * rb
    # memory bound: the plan holds O(distinct rows) entries, never O(table)
    assert p.rows.size == rows.size and p.n_runs <= rows.size
    ranks = marks.rank(ids)
    assert np.array_equal(rows[ranks], ids)
    marks.clear()
    assert marks.count == 0 and marks.distinct().size == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 999), max_size=60), max_size=6))
def test_marks_count_distinct_rows_across_batches(batches: list[list[int]]) -> None:
    marks = WindowMarks(1000)
    seen: set[int] = set()
    for b in batches:
        seen.update(b)
        assert marks.add(np.asarray(b, dtype=np.int64)) == len(seen)
    assert np.array_equal(marks.distinct(), np.asarray(sorted(seen), dtype=np.int64))


def test_merge_gap_decides_where_runs_split() -> None:
    g = Geometry(1000, 100, 1000)
    rows = np.array([0, 1, 3, 10, 11], dtype=np.int64)
    p0 = plan_runs(rows, g, merge_gap=0, max_read=1 << 20)
    assert p0.n_runs == 3 and p0.offset.tolist() == [0, 300, 1000]
    p1 = plan_runs(rows, g, merge_gap=100, max_read=1 << 20)
    assert p1.n_runs == 2 and p1.length.tolist() == [400, 200]
    p2 = plan_runs(rows, g, merge_gap=10_000, max_read=1 << 20)
    assert p2.n_runs == 1 and p2.read_bytes == 1200 and p2.payload_bytes == 500
    p3 = plan_runs(rows, g, merge_gap=10_000, max_read=250)
    assert p3.n_runs > 1 and int(p3.length.max()) <= 350


def test_bad_knobs_are_refused() -> None:
    g = Geometry(10, 4, 10)
    with pytest.raises(InvalidArgument, match="merge_gap"):
        plan_runs(np.arange(3), g, merge_gap=-1, max_read=10)
    with pytest.raises(InvalidArgument, match="max_read"):
        plan_runs(np.arange(3), g, merge_gap=0, max_read=0)
    with pytest.raises(InvalidArgument, match="n_rows"):
        WindowMarks(-1)
    with pytest.raises(InvalidArgument, match="distinct"):
        WindowMarks(5).rank(np.arange(2))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 499), max_size=200),
    st.integers(1, 600),
    st.booleans(),
)
def test_regions_give_the_distinct_rows_in_order_and_fix_their_ranks(
    ids_l: list[int], region_rows: int, dense: bool
) -> None:
    ids = np.asarray(ids_l, dtype=np.int64)
    marks = WindowMarks(500, dense_max_bytes=1 << 30 if dense else 0)
    marks.add(ids)
    got = list(marks.regions(region_rows))
    rows = np.concatenate([r for _, r in got]) if got else np.empty(0, np.int64)
    assert np.array_equal(rows, np.unique(ids))
    bases = [b for b, _ in got]
    assert bases == np.cumsum([0] + [r.size for _, r in got])[:-1].tolist()
    for _, r in got:  # each piece lies inside one region
        assert r.size and r[0] // region_rows == r[-1] // region_rows
    assert np.array_equal(rows[marks.rank(ids)], ids)
    packed = marks.freeze()
    assert packed.count == rows.size == marks.count
    marks.clear()
    assert marks.count == 0 and marks.distinct().size == 0
    marks.add(np.arange(0, 500, 7))  # the next window does not disturb the snapshot
    assert np.array_equal(rows[packed.rank(ids)], ids)
    assert packed.nbytes == WindowMarks.packed_nbytes(500)
    with pytest.raises(InvalidArgument, match="region_rows"):
        next(marks.regions(0))
