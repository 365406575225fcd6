"""fetch / fetch_into / lookup_into return exactly the source bytes, for random tables."""

from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engramdb
from engramdb.testing.dbs import SMALL_BADGE, TableSpec, make_db

ROW_SIZES = [1, 7, 160, 264, 2560, 4096, 5000]


@st.composite
def tables(draw: st.DrawFn) -> tuple[int, list[int], int]:
    row_bytes = draw(st.sampled_from(ROW_SIZES))
    heads = draw(st.lists(st.integers(1, 700), min_size=1, max_size=5))
    seed = draw(st.integers(0, 2**32 - 1))
    return row_bytes, heads, seed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=tables(), n_ids=st.integers(0, 3000), data=st.data())
def test_fetch_and_lookup_equal_source(
    spec: tuple[int, list[int], int], n_ids: int, data: st.DataObject
) -> None:
    row_bytes, heads, seed = spec
    rng = np.random.default_rng(seed)
    badge = SMALL_BADGE[row_bytes]
    spec = TableSpec(row_bytes, heads, rows_per_badge=badge, shard_bytes=badge * row_bytes * 2)
    with tempfile.TemporaryDirectory() as d:
        path, rows = make_db(d, {"t": spec}, seed=seed)
        full = rows["t"]
        with engramdb.open(path) as db:
            s = db["t"]
            assert s.n_rows == full.shape[0] and list(s.heads) == heads
            assert s.head_offsets.tolist() == np.concatenate([[0], np.cumsum(heads)[:-1]]).tolist()
            ids = rng.integers(0, full.shape[0], size=n_ids)
            got = s.fetch(ids)
            assert got.shape == (n_ids, row_bytes) and got.dtype == np.uint8
            assert np.array_equal(got, full[ids])
            # table ends and head boundaries
            edges = np.array([0, full.shape[0] - 1] + [int(o) for o in s.head_offsets])
            assert np.array_equal(s.fetch(edges), full[edges])
            two_d = ids[: (n_ids // 2) * 2].reshape(-1, 2)
            out = np.empty(two_d.shape + (row_bytes,), np.uint8)
            s.fetch_into(two_d, out)
            assert np.array_equal(out, full[two_d])
            b = data.draw(st.integers(0, 3))
            n_l = data.draw(st.integers(0, 9))
            local = np.stack([rng.integers(0, h, size=(b, n_l)) for h in heads], axis=-1)
            local = np.ascontiguousarray(local, dtype=np.int64)
            lout = np.empty(local.shape + (row_bytes,), np.uint8)
            s.lookup_into(local, lout)
            assert np.array_equal(lout, full[local + s.head_offsets])


def test_large_batch_parallel_gather_equals_source(rng: np.random.Generator) -> None:
    """Batches above the parallel threshold are split across threads; bytes stay exact."""
    with tempfile.TemporaryDirectory() as d:
        path, rows = make_db(d, {"t": (160, (20_000,))})
        full = rows["t"]
        with engramdb.open(path) as db:
            ids = rng.integers(0, 20_000, size=50_001)
            assert np.array_equal(db["t"].fetch(ids), full[ids])


def test_several_tables_in_one_database(rng: np.random.Generator) -> None:
    with tempfile.TemporaryDirectory() as d:
        path, rows = make_db(d, {"a": (264, (300,)), "b": (7, (400, 600))})
        a, b = rows["a"], rows["b"]
        with engramdb.open(path) as db:
            assert db.tables == ["a", "b"]
            assert np.array_equal(db["a"].fetch([5, 299]), a[[5, 299]])
            assert np.array_equal(db["b"].fetch([0, 999]), b[[0, 999]])
            assert db["b"].heads.tolist() == [400, 600]


def test_concurrent_fetches_from_threads(rng: np.random.Generator) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory() as d:
        path, rows = make_db(d, {"t": (264, (5000,))})
        full = rows["t"]
        with engramdb.open(path) as db:
            s = db["t"]
            id_sets = [rng.integers(0, 5000, size=4000) for _ in range(16)]
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(s.fetch, id_sets))
            for ids, got in zip(id_sets, results):
                assert np.array_equal(got, full[ids])
