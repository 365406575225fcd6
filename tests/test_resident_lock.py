"""The ``lock`` open option: a finished background warm ``mlock``s the table (``"auto"``,
within half of ``MemTotal``), so reclaim cannot take its pages; ``False`` leaves it to the
page cache; a refusal is reported, never raised from the warm thread. No timing."""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb.errors import InvalidArgument
from engramdb.io import resident_lock
from engramdb.io.tiers import process_rss
from engramdb.testing.pages import drop_mapped_pages, evict, file_residency

ROW = 160


def _can_lock(nbytes: int) -> bool:
    """Whether this process may ``mlock`` ``nbytes`` (root, or a big enough limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= nbytes


def _need_lock(nbytes: int) -> None:
    """Skip where this process may not ``mlock`` ``nbytes``."""
    if not _can_lock(nbytes):
        pytest.skip("this process may not mlock the table (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)")


@pytest.fixture
def cold_db(tmp_path: Path) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(3).integers(0, 256, (40_000, ROW), dtype=np.uint8)  # 6.4 MB
    engramdb.build(tmp_path, "t", ROW, [data])
    for p in tmp_path.rglob("*.edb"):
        evict(p)
    return tmp_path, data


def _warm(s: engramdb.Store, data: np.ndarray) -> np.ndarray:
    """Start the background warm with a cold read (rows checked), wait for the pass (and
    what runs after it: the lock) to end."""
    ids = np.random.default_rng(0).integers(0, s.n_rows, 2048)
    assert np.array_equal(s.fetch(ids), data[ids])
    assert s.tiers.warm.wait(60) and s.memory()["warm"]["state"] == "done"
    return ids


def _files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.edb"))


def test_the_default_locks_a_warmed_table_and_reclaim_cannot_take_it(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    path, data = cold_db
    _need_lock(len(data) * ROW)
    before, auto0 = process_rss()["VmLck"], resident_lock.auto_locked_bytes()
    with engramdb.open(path, warm_rate="256M") as db:
        s = db["t"]
        assert s.memory()["lock"] == "waiting" and s.memory()["locked_bytes"] == 0
        ids = _warm(s, data)
        m = s.memory()
        assert m["lock"] == "locked" and m["locked_bytes"] >= s.nbytes
        assert process_rss()["VmLck"] - before >= s.nbytes
        assert resident_lock.auto_locked_bytes() - auto0 >= s.nbytes
        # what a reclaim would do to unlocked page cache: the locked pages stay
        for p in _files(path):
            evict(p)
        assert min(file_residency(p) for p in _files(path)) == 1.0
        assert np.array_equal(s.fetch(ids), data[ids])
    # closing releases the lock and its share of the auto bound
    assert process_rss()["VmLck"] - before < len(data) * ROW
    assert resident_lock.auto_locked_bytes() == auto0


def test_lock_false_leaves_the_table_to_the_page_cache(cold_db: tuple[Path, np.ndarray]) -> None:
    path, data = cold_db
    with engramdb.open(path, warm_rate="256M", lock=False) as db:
        s = db["t"]
        ids = _warm(s, data)
        m = s.memory()
        assert (m["lock"], m["locked_bytes"]) == ("off", 0)
        drop_mapped_pages(s.array())
        for p in _files(path):
            evict(p)
        assert max(file_residency(p) for p in _files(path)) < 0.5
        assert np.array_equal(s.fetch(ids), data[ids])


def test_auto_stays_within_its_share_of_memory(
    cold_db: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = cold_db
    monkeypatch.setattr(resident_lock, "AUTO_LOCK_SHARE", 1e-9)
    auto0 = resident_lock.auto_locked_bytes()  # (tables other tests left open)
    with engramdb.open(path, warm_rate="256M") as db:
        s = db["t"]
        _warm(s, data)
        m = s.memory()
        assert m["locked_bytes"] == 0 and m["lock"].startswith("not locked:")
        assert "MemTotal" in m["lock"]
    # lock=True has no such bound
    with engramdb.open(path, warm_rate="256M", lock=True) as db:
        s = db["t"]
        drop_mapped_pages(s.array())
        for p in _files(path):
            evict(p)
        _warm(s, data)
        m = s.memory()
        if _can_lock(s.nbytes):
            assert m["lock"] == "locked" and m["locked_bytes"] >= s.nbytes
            assert resident_lock.auto_locked_bytes() == auto0  # not counted under "auto"
        else:
            assert m["lock"].startswith("refused:")


def test_dropping_a_locked_tables_pages_unlocks_it_and_the_next_warm_locks_again(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    path, data = cold_db
    _need_lock(len(data) * ROW)
    with engramdb.open(path, warm_rate="256M", keep_warm=True) as db:
        s = db["t"]
        ids = _warm(s, data)
        assert s.memory()["lock"] == "locked"
        drop_mapped_pages(s.array()[1000:2000])  # meets the locked range: unlocked first
        assert (s.memory()["lock"], s.memory()["locked_bytes"]) == ("waiting", 0)
        for p in _files(path):
            evict(p)
        assert max(file_residency(p) for p in _files(path)) < 1.0
        # the keep-warm watcher re-warms; that finished pass locks the table again
        for _ in range(600):
            if s.memory()["lock"] == "locked":
                break
            s.tiers.warm.wait(0.1)
        assert s.memory()["lock"] == "locked" and s.memory()["locked_bytes"] >= s.nbytes
        assert np.array_equal(s.fetch(ids), data[ids])


def test_a_refused_lock_is_reported_and_reads_stay_right(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    script = textwrap.dedent(
        f"""
        import ctypes, os, resource, numpy as np, engramdb
        db = engramdb.open({str(path)!r}, warm_rate="256M")
        s = db["t"]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)  # drop CAP_IPC_LOCK
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again: /proc/self/fd is ours
        ids = np.arange(0, s.n_rows, 7)
        first = s.fetch(ids)
        assert s.tiers.warm.wait(60)
        m = s.memory()
        print(m["warm"]["state"], m["locked_bytes"])
        print(m["lock"])
        print(bool(np.array_equal(s.fetch(ids), first)))
        db.close()
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    state, lock, same = r.stdout.strip().splitlines()
    assert state == "done 0" and same == "True"
    assert lock.startswith("refused:") and "RLIMIT_MEMLOCK" in lock


@pytest.mark.parametrize("bad", ["yes", 1, None, "AUTO"])
def test_a_bad_lock_option_is_refused_by_name(
    cold_db: tuple[Path, np.ndarray], bad: object
) -> None:
    path, _ = cold_db
    with pytest.raises(InvalidArgument, match="lock must be"), engramdb.open(path, lock=bad) as db:
        db["t"]


def test_a_locked_tables_large_batches_skip_the_residency_sample(
    cold_db: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locked pages cannot be evicted, so a mapped batch of a locked table needs no
    ``mincore`` sample first; unlocked, every large batch is sampled again."""
    path, data = cold_db
    _need_lock(len(data) * ROW)
    with engramdb.open(path, warm_rate="256M") as db:
        s = db["t"]
        _warm(s, data)
        assert s.memory()["lock"] == "locked" and s.tiers.resident_lock.whole
        sampled: list[int] = []
        real = s._sampled_resident  # noqa: SLF001

        def spy(ids: np.ndarray, k: int) -> bool:
            sampled.append(ids.shape[0])
            return bool(real(ids, k))

        monkeypatch.setattr(s, "_sampled_resident", spy)
        ids = np.random.default_rng(5).integers(0, s.n_rows, 4096)
        out = np.empty((ids.size, ROW), np.uint8)
        s.backend.recheck_soon()
        s.fetch_into(ids, out)  # the rule's own check, back in its mapped state
        for _ in range(3):
            assert np.array_equal(s.fetch_into(ids, out), data[ids])
        assert sampled == [] and s.stats()["choices"].get("mmap", 0) >= 3
        s.tiers.unlock()
        assert not s.tiers.resident_lock.whole
        assert np.array_equal(s.fetch_into(ids, out), data[ids])
        assert sampled == [ids.size]


def test_a_table_dropped_unclosed_gives_back_its_share_of_the_auto_bound(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    path, data = cold_db
    _need_lock(len(data) * ROW)
    auto0 = resident_lock.auto_locked_bytes()
    db = engramdb.open(path, warm_rate="256M")
    s = db["t"]
    _warm(s, data)
    assert s.memory()["lock"] == "locked"
    assert resident_lock.auto_locked_bytes() - auto0 >= s.nbytes
    del s, db
    gc.collect()
    assert resident_lock.auto_locked_bytes() == auto0


def test_a_locked_tables_slow_gather_leaves_the_read_rule_mapped(
    cold_db: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow mapped gather of a locked table is a busy machine, not page faults: the rule
    stays in its mapped state and samples nothing. Unlocked, the same report makes it
    check residency before the next batch."""
    path, data = cold_db
    _need_lock(len(data) * ROW)
    with engramdb.open(path, warm_rate="256M") as db:
        s = db["t"]
        _warm(s, data)
        rule = s.backend
        ids = np.random.default_rng(6).integers(0, s.n_rows, 4096)
        rule.recheck_soon()
        assert np.array_equal(s.fetch(ids), data[ids])  # the rule's own check: mapped
        assert s.mapped_state() and s.tiers.resident_lock.whole
        sampled: list[int] = []
        real = rule.resident_fraction

        def spy(fds: object, offsets: object, samples: int = 0) -> float:
            sampled.append(samples)
            return float(real(fds, offsets, samples))

        monkeypatch.setattr(rule, "resident_fraction", spy)
        s.note_mapped_gather(100, 1.0)  # 10 ms a row
        assert s.mapped_state() and not rule.suspect
        assert np.array_equal(s.fetch(ids), data[ids])
        assert sampled == [] and rule.last_choice == "mmap"
        s.tiers.unlock()
        s.note_mapped_gather(100, 1.0)
        assert not s.mapped_state() and rule.suspect
        assert np.array_equal(s.fetch(ids), data[ids])
        assert sampled == [rule.samples] and not rule.suspect
