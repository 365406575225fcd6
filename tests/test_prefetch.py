"""Prefetch: rows read in the background equal the source, a fetch waits for rows in flight,
errors surface at the fetch that needs the rows, the queue is bounded, the RAM tier keeps
its budget."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from warm_checks import warmed_memory

import engramdb
from engramdb.errors import ReadError, RowIdOutOfRange, StoreClosed
from engramdb.testing.dbs import TableSpec
from engramdb.testing.pages import drop_mapped_pages, evict, resident_pages

ROW = 160


@pytest.fixture
def table(db_factory: Any) -> tuple[Path, np.ndarray]:
    path, rows = db_factory({"t": TableSpec(ROW, (20_000,), rows_per_badge=128)})
    return path, rows["t"]


@pytest.mark.parametrize("ram_budget", [None, "1M"])
def test_prefetched_rows_equal_the_source(
    table: tuple[Path, np.ndarray], rng: np.random.Generator, ram_budget: str | None
) -> None:
    path, full = table
    with engramdb.open(path, ram_budget=ram_budget) as db:
        s = db["t"]
        ids = rng.integers(0, full.shape[0], (40, 16))
        tickets = [s.prefetch(r) for r in ids]
        assert s.prefetcher.target == ("page_cache" if ram_budget is None else "ram")
        for t, r in zip(tickets, ids):
            assert np.array_equal(s.fetch(r), full[r])
            t.wait()
        s.prefetcher.drain()
        st = s.stats()["prefetch"]
        assert st["submitted"] == 40 and st["failed"] == 0
        assert st["completed"] + st["cancelled"] + st["dropped"] == 40
        if ram_budget is not None:
            last = ids[-1]
            assert s.cache is not None and s.cache.contains(last).all()


def test_prefetch_fills_the_page_cache_of_a_cold_file(
    table: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    path, full = table
    with engramdb.open(path, backend="preadv") as db:
        s = db["t"]
        table_view = s.array()
        drop_mapped_pages(table_view)
        for sh in s.info.shards:
            evict(path / sh.path)
        ids = np.unique(rng.integers(0, full.shape[0], 64))
        addrs = table_view.ctypes.data + ids * ROW
        if resident_pages(addrs).mean() > 0.5:
            pytest.skip("this filesystem does not drop cached pages on request")
        s.prefetch(ids).wait()
        assert resident_pages(addrs).all(), "prefetched rows sit in the page cache"
        assert np.array_equal(s.fetch(ids), full[ids])


def test_a_table_read_only_through_prefetches_is_warmed(
    table: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    """Prefetches read by syscalls, past the read rule: the first one of a cold table that
    fits starts the background warm all the same, so the table ends up resident and mapped
    (a decoder prefetching every step would otherwise read from the page cache forever)."""
    path, full = table
    for p in path.rglob("*.edb"):
        evict(p)
    with engramdb.open(path) as db:
        s = db["t"]
        assert s.memory()["warm"]["starts"] == 0
        ids = rng.integers(0, full.shape[0], 64)
        t = s.prefetcher.submit_trusted(ids, keep_rows=True)
        t.wait()
        assert s.memory()["warm"]["starts"] == 1
        warmed_memory(s, s.nbytes)
        s.prefetcher.submit_trusted(ids, keep_rows=True).wait()  # once: no second pass
        assert s.memory()["warm"]["starts"] == 1
        out = np.empty((ids.size, ROW), np.uint8)
        s.fetch_into(ids, out)
        assert np.array_equal(out, full[ids])
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        s.prefetcher.submit_trusted(ids, keep_rows=True).wait()
        assert s.memory()["warm"]["starts"] == 0


def test_prefetch_of_an_invalid_id_raises_at_the_fetch(table: tuple[Path, np.ndarray]) -> None:
    path, full = table
    with engramdb.open(path) as db:
        s = db["t"]
        t = s.prefetch([3, full.shape[0]])  # returns: prefetch is advisory
        assert t.state == "failed"
        with pytest.raises(RowIdOutOfRange):
            s.fetch([3, full.shape[0]])
        assert np.array_equal(s.fetch([3]), full[[3]])  # the valid row is unaffected
        with pytest.raises(RowIdOutOfRange):
            t.wait()
        s.prefetch([-1])
        with pytest.raises(RowIdOutOfRange):
            s.prefetcher.drain()  # an error no fetch surfaced is not lost
        s.prefetcher.drain()  # ... and raised once


def test_a_read_error_surfaces_at_the_fetch_that_needs_the_row(
    table: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, full = table
    with engramdb.open(path) as db:
        s = db["t"]
        pf = s.prefetcher

        def broken(ids: np.ndarray) -> int:
            raise ReadError(f"injected failure for {ids.size} rows")

        monkeypatch.setattr(pf, "_read", broken)
        t = s.prefetch([10, 11, 12])
        while not t.done():
            time.sleep(0.001)
        assert np.array_equal(s.fetch([500, 501]), full[[500, 501]])  # other rows: fine
        with pytest.raises(ReadError) as err:
            s.fetch([7, 11])
        assert err.value is t.error
        assert np.array_equal(s.fetch([7, 11]), full[[7, 11]])  # surfaced once, then retried
        assert s.stats()["prefetch"]["failed"] == 1


def test_a_fetch_waits_for_rows_in_flight(
    table: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, full = table
    with engramdb.open(path, ram_budget="1M") as db:
        s = db["t"]
        real = s.read_below
        started = threading.Event()

        def slow(ids: np.ndarray, rows: np.ndarray, **kw: object) -> None:
            started.set()
            time.sleep(0.2)
            real(ids, rows, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(s, "read_below", slow)  # the background read below the tier
        t = s.prefetch([100, 200, 300])
        assert started.wait(5)
        t0 = time.perf_counter()
        assert np.array_equal(s.fetch([200]), full[[200]])
        assert time.perf_counter() - t0 > 0.1, "the fetch waited for the running read"
        assert t.done() and s.stats()["prefetch"]["waits"] == 1
        assert s.stats()["cache"]["hits"] >= 1, "the waited-for row came from the RAM tier"


def test_the_queue_is_bounded_and_cancellable(
    table: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = table
    db = engramdb.open(path)
    s = db["t"]
    from engramdb.read.prefetch import Prefetcher

    pf = Prefetcher(s, depth=3)
    gate = threading.Event()
    monkeypatch.setattr(pf, "_read", lambda ids: gate.wait(10) and 0)
    tickets = [pf.submit([i]) for i in range(10)]
    states = [t.state for t in tickets]
    assert states.count("cancelled") == 7, states  # refused: queue full
    assert pf.stats.dropped == 7
    queued = [t for t in tickets if t.state == "queued"]
    assert queued and queued[-1].cancel() and queued[-1].state == "cancelled"
    gate.set()
    pf.drain(timeout=5)
    assert all(t.done() for t in tickets)
    pf.close()
    with pytest.raises(StoreClosed):
        pf.submit([1])
    s.prefetch([1, 2, 3])
    db.close()  # closes the store's prefetcher and joins its thread
    assert not any(t.name.startswith("engramdb-prefetch") for t in threading.enumerate())


def test_concurrent_prefetch_and_fetch_with_eviction_never_return_wrong_rows(
    table: tuple[Path, np.ndarray],
) -> None:
    path, full = table
    with engramdb.open(path, ram_budget=400 * (ROW + 40)) as db:  # ~400 slots: constant churn
        s = db["t"]
        errors: list[str] = []

        def worker(seed: int) -> None:
            r = np.random.default_rng(seed)
            for _ in range(150):
                ids = r.integers(0, full.shape[0], 64)
                s.prefetch(r.integers(0, full.shape[0], 64))
                if not np.array_equal(s.fetch(ids), full[ids]):
                    errors.append("wrong rows")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        c = s.stats()["cache"]
        assert c["evictions"] > 0 and c["hits"] > 0


def _anon_growth(path: Path, rows: int, budget: int | None) -> tuple[int, int, int]:
    script = textwrap.dedent(
        f"""
        import ctypes, numpy as np, engramdb
        def anon():
            ctypes.CDLL(None).malloc_trim(0)  # freed scratch is not the tier's
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        rng = np.random.default_rng(0)
        db = engramdb.open({str(path)!r}, ram_budget={budget!r})
        s = db["t"]
        s.fetch(np.arange(16))
        s.prefetch(np.arange(16)).wait()
        base = anon()
        for i in range(0, {rows}, 4096):
            s.prefetch(np.arange(i, min({rows}, i + 4096)))
            s.fetch(rng.integers(0, {rows}, 4096))
        s.prefetcher.drain()
        c = s.cache
        print(anon() - base, c.nbytes if c else 0, c.stats.evictions if c else 0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    growth, nbytes, evictions = (int(v) for v in out)
    return growth, nbytes, evictions


def test_ram_tier_with_prefetch_respects_its_budget_in_rss(tmp_path: Path) -> None:
    """The tier adds at most its budget to anonymous RSS while prefetches and fetches stream
    eight times the budget through it (compared with the same run without a tier, which
    measures the readers' own scratch buffers)."""
    rows, budget = 200_000, 4 << 20  # 32 MB table
    engramdb.build(tmp_path, "t", ROW, [np.zeros((rows, ROW), np.uint8)])
    without, _, _ = _anon_growth(tmp_path, rows, None)
    growth, nbytes, evictions = _anon_growth(tmp_path, rows, budget)
    assert nbytes <= budget and evictions > 0
    tier = growth - without
    assert tier <= budget + (1 << 20), f"the tier added {tier / 1e6:.1f} MB for a 4 MB budget"


def test_large_batches_bypass_the_tier_only_while_the_table_is_resident(
    table: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    path, full = table
    with engramdb.open(path, ram_budget="1M") as db:
        s = db["t"]
        assert s.cache is not None
        s.populate()
        ids = rng.integers(0, full.shape[0], 4000)
        s.fetch(ids[:10])  # the read rule samples and settles on the mapping
        assert np.array_equal(s.fetch(ids), full[ids])
        assert s.stats()["cache"]["bypassed"] == ids.size, "resident: one gather, no tier"
        small = ids[:100]
        s.fetch(small)
        assert np.array_equal(s.fetch(small), full[small])
        assert s.stats()["cache"]["hits"] >= small.size, "decode-sized batches use the tier"
    with engramdb.open(path, ram_budget="1M", backend="preadv") as db:
        s = db["t"]  # no residency information: the tier serves every batch
        s.fetch(ids)
        assert np.array_equal(s.fetch(ids), full[ids])
        c = s.stats()["cache"]
        assert c["bypassed"] == 0 and c["hits"] > 0


def test_prefetch_tokens_reads_the_rows_keygen_selects(tmp_path: Path) -> None:
    from engramdb import keygen

    h = keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000)
    rows = h.table_rows(2)
    full = np.random.default_rng(9).integers(0, 256, (rows, ROW), dtype=np.uint8)
    engramdb.build(tmp_path, "ple", ROW, [full])
    toks = np.random.default_rng(10).integers(0, 248_320, (3, 40))
    with engramdb.open(tmp_path, ram_budget="2M") as db:
        s = db["ple"]
        s.prefetch_tokens(toks, preset=h).wait()
        ids = h.row_ids(toks, layer=2)
        assert s.cache is not None and s.cache.contains(ids.reshape(-1)).all()
        assert np.array_equal(s.fetch(ids), full[ids])
        with pytest.raises(engramdb.InvalidArgument):
            s.prefetch_tokens(toks, preset="no-such-preset")
