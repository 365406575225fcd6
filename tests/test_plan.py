"""The planner, property-tested against an in-memory table (no files, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engramdb.errors import InvalidArgument, InvalidDtype, RowIdOutOfRange, ShapeMismatch
from engramdb.read.plan import Geometry, ReadPlan, assemble, locate, plan_reads
from engramdb.validate import as_rowids


def _shard_images(table: np.ndarray, g: Geometry) -> list[np.ndarray]:
    """Byte images of the shard files for ``table`` laid out by ``g`` (test-side)."""
    n_rows = table.shape[0]
    n_shards = max(1, -(-n_rows // g.rows_per_shard))
    ids = np.arange(n_rows, dtype=np.int64)
    shard, offset = locate(ids, g)
    images = []
    for s in range(n_shards):
        sel = shard == s
        size = int((offset[sel] + g.row_bytes).max()) if sel.any() else 0
        img = np.zeros(size, dtype=np.uint8)
        for o, row in zip(offset[sel].tolist(), table[sel], strict=True):
            img[o : o + g.row_bytes] = row
        images.append(img)
    return images


def _execute(plan: ReadPlan, images: list[np.ndarray]) -> np.ndarray:
    """Do the plan's reads against shard images (what a backend would do)."""
    scratch = np.full(plan.scratch_bytes, 0xEE, dtype=np.uint8)
    for s, o, n, d in zip(
        plan.shard.tolist(),
        plan.offset.tolist(),
        plan.length.tolist(),
        plan.dest_offset.tolist(),
        strict=True,
    ):
        assert o + n <= images[s].shape[0], "a read runs past its shard"
        scratch[d : d + n] = images[s][o : o + n]
    return scratch


@dataclass
class Case:
    geometry: Geometry
    table: np.ndarray
    ids: np.ndarray


@st.composite
def cases(draw: st.DrawFn) -> Case:
    row_bytes = draw(st.sampled_from([1, 3, 8, 160, 264, 2560, 4096, 5000]))
    n_rows = draw(st.integers(1, 120))
    rows_per_shard = draw(st.integers(1, 50))
    g = Geometry(n_rows, row_bytes, rows_per_shard)
    seed = draw(st.integers(0, 2**32 - 1))
    table = np.random.default_rng(seed).integers(0, 256, (n_rows, row_bytes), dtype=np.uint8)
    ids = draw(st.lists(st.integers(0, n_rows - 1), min_size=0, max_size=60))
    return Case(g, table, np.array(ids, dtype=np.int64))


@settings(max_examples=150, deadline=None)
@given(cases(), st.booleans(), st.integers(0, 9000), st.sampled_from([1, 4096, 1 << 20]))
def test_plan_reproduces_the_rows(case: Case, coalesce: bool, gap: int, max_read: int) -> None:
    g = case.geometry
    plan = plan_reads(case.ids, g, coalesce=coalesce, max_gap=gap, max_read_bytes=max_read)
    images = _shard_images(case.table, g)
    scratch = _execute(plan, images)
    out = np.zeros((case.ids.shape[0], g.row_bytes), dtype=np.uint8)
    assemble(plan, scratch, out)
    np.testing.assert_array_equal(out, case.table[case.ids])

    # deduplicated and sorted by physical position
    assert plan.n_unique == np.unique(case.ids).shape[0]
    assert np.all(np.diff(plan.row_ids) > 0)
    key = plan.shard.astype(np.int64) * (1 << 40) + plan.offset
    assert np.all(np.diff(key) > 0), "reads are sorted by (shard, offset)"
    # reads never overlap inside a shard, never span shards, and land disjointly in scratch
    ends = plan.offset + plan.length
    same = plan.shard[1:] == plan.shard[:-1]
    assert np.all(plan.offset[1:][same] >= ends[:-1][same])
    assert np.all(np.diff(plan.dest_offset) == plan.length[:-1])
    if not coalesce:
        assert plan.n_reads == plan.n_unique and plan.row_scratch is None
    else:
        assert plan.n_reads <= plan.n_unique
        assert np.all(plan.length <= max_read + g.row_bytes)
        if max_read == 1 << 20:  # larger than any test table: only gaps split reads
            gaps = plan.offset[1:][same] - ends[:-1][same]
            assert np.all(gaps > gap), "two mergeable neighbours were left apart"


@settings(max_examples=60, deadline=None)
@given(cases())
def test_plan_without_dedupe_keeps_caller_order(case: Case) -> None:
    g = case.geometry
    plan = plan_reads(case.ids, g, dedupe=False)
    assert plan.n_reads == case.ids.shape[0]
    np.testing.assert_array_equal(plan.dest_offset, np.arange(case.ids.shape[0]) * g.row_bytes)
    scratch = _execute(plan, _shard_images(case.table, g))
    rows = scratch.reshape(case.ids.shape[0], g.row_bytes)
    np.testing.assert_array_equal(rows, case.table[case.ids])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=40), st.integers(1, 10**6))
def test_validation_names_the_first_bad_id(ids: list[int], n_rows: int) -> None:
    arr = np.array(ids, dtype=np.int64)
    g = Geometry(n_rows, 1, n_rows)
    bad = (arr < 0) | (arr >= n_rows)
    if not bad.any():
        assert as_rowids(arr) is arr, "int64 ids are not copied"
        assert plan_reads(arr, g).n_out == arr.size
        return
    first = int(np.flatnonzero(bad)[0])
    with pytest.raises(RowIdOutOfRange) as info:
        plan_reads(arr, g)
    assert f"row id {ids[first]} at position {first} " in str(info.value)
    assert isinstance(info.value, IndexError)


def test_validation_dtypes_and_shapes() -> None:
    g = Geometry(5, 1, 5)
    assert as_rowids([]).dtype == np.int64
    assert plan_reads([], g).n_out == 0
    assert as_rowids(np.array([1, 2], dtype=np.uint16)).dtype == np.int64
    assert plan_reads(np.array([1, 2], dtype=np.uint16), g).row_ids.dtype == np.int64
    with pytest.raises(InvalidDtype):
        plan_reads(np.array([1.0]), g)
    with pytest.raises(InvalidDtype):
        plan_reads(np.array([True]), g)
    with pytest.raises(InvalidDtype):
        plan_reads(["a"], g)
    with pytest.raises(RowIdOutOfRange, match="2\\*\\*64|18446744073709551615"):
        plan_reads(np.array([2**64 - 1], dtype=np.uint64), g)
    with pytest.raises(RowIdOutOfRange, match=r"position \(1, 0\)"):
        plan_reads(np.array([[0, 1], [7, 0]]), g)


def test_plan_keeps_the_request_shape() -> None:
    g = Geometry(n_rows=100, row_bytes=8, rows_per_shard=30)
    table = np.arange(800, dtype=np.uint8).reshape(100, 8)
    ids = np.array([[[3, 99], [3, 40]]])
    plan = plan_reads(ids, g)
    assert plan.out_shape == (1, 2, 2) and plan.n_out == 4 and plan.n_unique == 3
    out = np.zeros((1, 2, 2, 8), dtype=np.uint8)
    assemble(plan, _execute(plan, _shard_images(table, g)), out)
    np.testing.assert_array_equal(out, table[ids])


def test_plan_pages_counts_straddles_and_shared_pages() -> None:
    g = Geometry(n_rows=10**6, row_bytes=160, rows_per_shard=10**6)
    # rows 0 and 1 share page 0; row 25 (4000..4160) straddles pages 0 and 1
    assert plan_reads(np.array([0, 1]), g).pages() == 1
    assert plan_reads(np.array([25]), g).pages() == 2
    assert plan_reads(np.array([0, 25]), g).pages() == 2
    big = Geometry(n_rows=100, row_bytes=10_000, rows_per_shard=100)
    assert plan_reads(np.array([1]), big).pages() == 3  # 10000..20000 spans pages 2..4


def test_geometry_and_knob_validation() -> None:
    with pytest.raises(InvalidArgument):
        Geometry(n_rows=10, row_bytes=0, rows_per_shard=5)
    with pytest.raises(InvalidArgument):
        Geometry(n_rows=10, row_bytes=8, rows_per_shard=0)
    g = Geometry(n_rows=10, row_bytes=8, rows_per_shard=5)
    with pytest.raises(InvalidArgument):
        plan_reads([1], g, max_gap=-1)
    with pytest.raises(InvalidArgument):
        plan_reads([1], g, dedupe=False, coalesce=True)
    plan = plan_reads([1, 2], g)
    with pytest.raises(ShapeMismatch):
        assemble(plan, np.zeros(16, np.uint8), np.zeros(8, np.uint8))


def test_plan_accepts_a_layouts_geometry() -> None:
    # Any object with n_rows / row_bytes / rows_per_shard works (duck typing).
    @dataclass(frozen=True)
    class Other:
        n_rows: int = 50
        row_bytes: int = 16
        rows_per_shard: int = 20

    plan = plan_reads(np.array([49, 0, 20]), Other())
    assert plan.shard.tolist() == [0, 1, 2]
    assert plan.offset.tolist() == [0, 0, 9 * 16]
