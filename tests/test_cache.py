"""The RAM tier never returns a stale or wrong row, respects its budget, and pins the hot set."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engramdb.errors import InvalidArgument
from engramdb.read.cache import RowCache

N_ROWS, ROW = 500, 12
TABLE = np.random.default_rng(5).integers(0, 256, (N_ROWS, ROW), dtype=np.uint8)


def budget_for(slots: int, n_rows: int = N_ROWS, row: int = ROW) -> int:
    """A byte budget that gives at least ``slots`` slots (the sizing rule inverted: rows +
    9 B slot metadata, a power-of-two index of 12 B entries, the presence bitmap)."""
    size = 1 << max(4, int(np.ceil(np.log2(max(8, 2 * slots)))))
    budget = slots * (row + 9) + size * 12 + n_rows // 8 + 1
    assert RowCache(row, budget, n_rows).slots >= slots
    return budget


class CacheVersusDict(RuleBasedStateMachine):
    """Random reads, admissions and hot-set loads against a dict model of what is cached."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = RowCache(ROW, budget_for(40), N_ROWS, hot_fraction=0.25)
        self.model: dict[int, bytes] = {}

    def _sync_model(self) -> None:
        live = self.cache.slot_key >= 0
        self.model = {int(k): TABLE[k].tobytes() for k in self.cache.slot_key[live]}

    @rule(ids=st.lists(st.integers(0, N_ROWS - 1), min_size=1, max_size=80))
    def read_then_admit(self, ids: list[int]) -> None:
        arr = np.array(ids, dtype=np.int64)
        out = np.zeros((arr.size, ROW), np.uint8)
        miss = self.cache.get_into(arr, out)
        for i, rid in enumerate(ids):
            if not miss[i]:
                assert rid in self.model, "a hit for a row the cache never held"
                assert out[i].tobytes() == TABLE[rid].tobytes(), "wrong or stale row"
            else:
                assert rid not in self.model
                assert not out[i].any(), "a missed row must stay untouched"
        self.cache.admit(arr[miss], TABLE[arr[miss]])
        self._sync_model()

    @rule(ids=st.lists(st.integers(0, N_ROWS - 1), min_size=0, max_size=30))
    def load_hot(self, ids: list[int]) -> None:
        arr = np.array(ids, dtype=np.int64)
        self.cache.load_hot(arr, TABLE[arr])
        self._sync_model()
        assert self.cache.n_hot == min(len(set(ids)), self.cache.max_hot)

    @invariant()
    def consistent(self) -> None:
        assert len(self.cache) == len(self.model) <= self.cache.slots
        keys = self.cache.slot_key[self.cache.slot_key >= 0]
        assert len(np.unique(keys)) == keys.size, "a row cached twice"
        if keys.size:
            assert self.cache.contains(keys).all()
            assert np.array_equal(self.cache.data[self.cache.slot_key >= 0], TABLE[keys])


TestCacheVersusDict = CacheVersusDict.TestCase
TestCacheVersusDict.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_hot_rows_survive_a_scan() -> None:
    cache = RowCache(ROW, budget_for(100), N_ROWS, hot_fraction=0.5)
    hot = np.arange(50, dtype=np.int64)
    assert cache.load_hot(hot, TABLE[hot]) == 50
    scan = np.arange(100, N_ROWS, dtype=np.int64)
    for chunk in np.array_split(scan, 8):
        out = np.empty((chunk.size, ROW), np.uint8)
        miss = cache.get_into(chunk, out)
        cache.admit(chunk[miss], TABLE[chunk[miss]])
    out = np.empty((50, ROW), np.uint8)
    assert not cache.get_into(hot, out).any()
    assert np.array_equal(out, TABLE[hot])
    assert cache.stats.evictions > 0


def test_clock_keeps_recently_used_rows() -> None:
    cache = RowCache(ROW, budget_for(64), N_ROWS, hot_fraction=0.0)
    warm = np.arange(32, dtype=np.int64)
    cache.admit(warm, TABLE[warm])
    for start in range(100, 400, 16):
        out = np.empty((32, ROW), np.uint8)
        cache.get_into(warm, out)  # touched every round: reference bits set
        fresh = np.arange(start, start + 16, dtype=np.int64)
        cache.admit(fresh, TABLE[fresh])
    assert cache.contains(warm).all()


def test_budget_and_arguments() -> None:
    cache = RowCache(160, 10 << 20, 1_000_000)
    assert cache.nbytes <= 10 << 20
    with pytest.raises(InvalidArgument):
        RowCache(160, 100, 1000)
    with pytest.raises(InvalidArgument):
        RowCache(0, 1 << 20, 10)
    with pytest.raises(InvalidArgument):
        RowCache(16, 1 << 20, 10, hot_fraction=1.5)


def test_concurrent_reads_and_admissions_never_return_wrong_rows() -> None:
    cache = RowCache(ROW, budget_for(60), N_ROWS)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            ids = rng.integers(0, N_ROWS, rng.integers(1, 64)).astype(np.int64)
            out = np.zeros((ids.size, ROW), np.uint8)
            miss = cache.get_into(ids, out)
            if not np.array_equal(out[~miss], TABLE[ids[~miss]]):
                errors.append("wrong row")
            cache.admit(ids[miss], TABLE[ids[miss]])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.stats.hits > 0 and cache.stats.evictions > 0
