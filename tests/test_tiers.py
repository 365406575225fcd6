"""Memory tiers that manage themselves: the read rule's inputs, the page-cache budget, the
background warm, `Store.memory()`, the RSS budget, mlock, keep-warm, the mapped fast path,
pooled results and the measured split decision. No assertion depends on timing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from warm_checks import warm_pass, warmed_memory

import engramdb
from engramdb.errors import InvalidArgument, MemoryLockRefused, RowIdOutOfRange
from engramdb.io import IoUringBackend, choose_backend
from engramdb.io.gather import SplitDecision
from engramdb.io.mapping import (
    MADV_SEQUENTIAL,
    madvise,
    map_range,
    populate_range,
    unmap_range,
)
from engramdb.io.tiers import (
    BUDGET_ENV,
    mapped_rss_split,
    meminfo,
    page_cache_budget,
    parse_budget,
    process_rss,
    safety_margin,
)
from engramdb.testing.pages import drop_mapped_pages, evict, file_residency

ROW = 160


def _rows(n: int) -> np.ndarray:
    j = np.arange(ROW, dtype=np.int64)
    return ((np.arange(n, dtype=np.int64)[:, None] * 131 + j * 7) & 255).astype(np.uint8)


@pytest.fixture
def cold_db(tmp_path: Path) -> tuple[Path, np.ndarray]:
    data = _rows(50_000)  # 8 MB
    engramdb.build(tmp_path, "t", ROW, [data])
    for p in tmp_path.rglob("*.edb"):
        evict(p)
    return tmp_path, data


def _cold(store: engramdb.Store) -> None:
    drop_mapped_pages(store.array())
    for p in store.db_path.rglob("*.edb"):
        evict(p)


# -- the rule as a pure function ----------------------------------------------------------
@pytest.mark.parametrize(
    ("resident", "mapped", "io_uring", "direct", "fits", "warming", "choice"),
    [
        (1.0, True, True, True, True, False, "mmap"),
        (1.0, True, True, True, False, False, "mmap"),
        (1.0, True, False, True, True, False, "mmap"),
        (1.0, True, True, True, True, True, "mmap"),  # resident: mapped even while warming
        (0.0, True, True, True, False, False, "io_uring_direct"),  # cannot fit: O_DIRECT
        (0.0, True, True, True, True, False, "io_uring"),  # fits: buffered, reading warms it
        (0.0, True, True, True, True, True, "io_uring_direct"),  # the warm pass fills it
        (0.5, True, True, True, True, True, "io_uring_direct"),
        (0.0, True, True, False, False, False, "io_uring"),  # O_DIRECT does not pay / refused
        (0.0, True, True, False, True, True, "io_uring"),
        (0.5, True, True, True, False, False, "io_uring"),  # partly resident: buffered
        (0.5, True, True, True, True, False, "io_uring"),
        (0.0, True, False, True, False, False, "preadv"),
        (0.99, True, False, True, True, True, "preadv"),
        (1.0, False, True, True, True, True, "io_uring"),  # no mapping: no residency info
    ],
)
def test_choose_backend_table(
    resident: float,
    mapped: bool,
    io_uring: bool,
    direct: bool,
    fits: bool,
    warming: bool,
    choice: str,
) -> None:
    got = choose_backend(
        resident, mapped=mapped, io_uring=io_uring, direct=direct, fits=fits, warming=warming
    )
    assert got == choice


# -- budgets ------------------------------------------------------------------------------
def test_budget_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_budget(None) is None and parse_budget("auto") is None
    assert parse_budget("8G") == 8 << 30 and parse_budget(4096) == 4096
    for bad in (-1, True, 1.5, "lots", [1]):
        with pytest.raises(InvalidArgument):
            parse_budget(bad)  # type: ignore[arg-type]
    assert page_cache_budget("1G") == 1 << 30
    monkeypatch.setenv(BUDGET_ENV, "3M")
    assert page_cache_budget() == 3 << 20
    monkeypatch.delenv(BUDGET_ENV)
    info = meminfo()
    assert 0 <= page_cache_budget() <= info["MemAvailable"]
    assert safety_margin(info) >= 512 << 20


def test_open_rejects_a_bad_budget(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    for kw in ({"page_cache_budget": "much"}, {"rss_budget": -5}, {"warm_rate": 0}):
        with engramdb.open(path, **kw) as db, pytest.raises(InvalidArgument):
            db["t"]


# -- the read policy ----------------------------------------------------------------------
io_uring_only = pytest.mark.skipif(
    not IoUringBackend.availability()[0], reason="io_uring unavailable here"
)


@io_uring_only
def test_a_table_that_fits_is_warmed_by_its_first_cold_read(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    path, data = cold_db
    with engramdb.open(path, warm_rate="64M") as db:
        s = db["t"]
        assert s.memory()["fits"] and s.residency() < 0.01
        ids = np.random.default_rng(0).integers(0, s.n_rows, 4096)
        assert np.array_equal(s.fetch(ids), data[ids])
        # the first cold batch started the pass; while it runs, cold batches read O_DIRECT
        # and leave the page cache to the pass
        assert s.stats()["choices"] == {"io_uring_direct": 1}
        assert s.memory()["warm"]["starts"] == 1
        assert s.tiers.warm.wait(60)
        m = s.memory()
        assert m["warm"]["state"] == "done" and m["warm"]["starts"] == 1
        assert m["warm"]["top_up"] is False  # the whole table was missing: not a top-up
        assert m["page_cache_resident_bytes"] >= s.nbytes - 4096
        assert m["rss_file_bytes"] >= 0.9 * s.nbytes  # populated: this process maps it
        assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"].get("mmap", 0) >= 1
        # pages lost after the pass (and no pass running): cold batches read buffered
        _cold(s)
        s.backend.recheck_soon()
        assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"].get("io_uring", 0) >= 1


def test_a_faulting_mapped_read_fills_this_process_page_tables(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    """A table in the page cache (warmed by another process) but not in this process's page
    tables: a mapped batch that was slow (faults) starts the background pass once, which
    fills the page tables without reading anything from the device."""
    path, data = cold_db
    for p in path.rglob("*.edb"):
        p.read_bytes()  # into the page cache, through no mapping of ours
    with engramdb.open(path) as db:
        s = db["t"]
        m = s.memory()
        assert m["page_cache_resident_bytes"] >= s.nbytes - 4096
        assert m["rss_file_bytes"] == 0 and m["warm"]["starts"] == 0
        assert m["warm"]["seconds"] == 0.0 and m["warm"]["started_at"] == 0.0  # no pass yet
        ids = np.random.default_rng(1).integers(0, s.n_rows, 4096)
        assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"] == {"mmap": 1}
        a = s.backend
        a.feedback(a.mapped, 1000, 1.0)  # a batch as slow as a faulting one
        assert s.memory()["warm"]["starts"] == 1
        m = warmed_memory(s, s.nbytes)
        assert m["warm"]["bytes_read"] == 0  # all resident: only page-table entries
        assert m["warm"]["top_up"] is True  # nothing missing: read at once
        w = m["warm"]  # when it ran, on this process's monotonic clock
        assert 0 < w["started_at"] < w["ended_at"] <= time.monotonic()
        assert w["seconds"] == pytest.approx(w["ended_at"] - w["started_at"])
        a.feedback(a.mapped, 1000, 1.0)  # once: a later slow batch starts nothing
        assert s.memory()["warm"]["starts"] == 1
        assert np.array_equal(s.fetch(ids), data[ids])
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        s.backend.feedback(s.backend.mapped, 1000, 1.0)
        assert s.memory()["warm"]["starts"] == 0  # the caller turned the pass off


def test_an_attached_tensor_is_warmed_by_its_first_cold_read(tmp_path: Path) -> None:
    """An attached single tensor gets the built table's memory policy over the byte range
    of its source that holds it: the first cold read starts the background warm, which
    reads that range (not the other tensors of the file) and fills this process's page
    tables."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    rows = _rows(40_000)  # 6.4 MB
    other = np.full((20_000, 160), 7, np.uint8)  # 3.2 MB after it in the file
    src = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.from_numpy(rows), "b.weight": torch.from_numpy(other)}, str(src))
    engramdb.attach(tmp_path / "db", "t", [src], tensor="a.weight")
    evict(src)
    with engramdb.open(tmp_path / "db", warm_rate="256M") as db:
        s = db["t"]
        m = s.memory()
        assert m["fits"] and m["table_bytes"] == rows.nbytes and m["warm"]["starts"] == 0
        assert m["page_cache_resident_bytes"] < rows.nbytes // 10
        ids = np.random.default_rng(2).integers(0, s.n_rows, 2048)
        assert np.array_equal(s.fetch(ids), rows[ids])
        assert s.memory()["warm"]["starts"] == 1
        m = warmed_memory(s, rows.nbytes)
        # the warmed range is the tensor's pages (rounded out to whole pages), not the file
        assert s.tiers.length < rows.nbytes + 2 * 4096 < src.stat().st_size
        assert m["warm"]["bytes_read"] <= s.tiers.length
        assert np.array_equal(s.fetch(ids), rows[ids])
        assert s.stats()["choices"].get("mmap", 0) >= 1


@io_uring_only
def test_a_table_over_budget_reads_direct_and_does_not_warm(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    path, data = cold_db
    with engramdb.open(path, page_cache_budget="1M") as db:
        s = db["t"]
        assert not s.memory()["fits"]
        ids = np.random.default_rng(1).integers(0, s.n_rows, 4096)
        for _ in range(3):
            assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"] == {"io_uring_direct": 3}
        m = s.memory()
        assert m["warm"]["state"] == "idle"
        assert m["page_cache_resident_bytes"] <= 1 << 20  # O_DIRECT left the cache alone


@io_uring_only
def test_direct_true_is_the_callers_choice(cold_db: tuple[Path, np.ndarray]) -> None:
    path, data = cold_db
    with engramdb.open(path, direct=True) as db:
        s = db["t"]
        ids = np.arange(0, s.n_rows, 97)
        assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"] == {"io_uring_direct": 1}
        assert s.memory()["warm"]["state"] == "idle"


def _plain_sequential_huge(paths: list[Path]) -> int:
    """Bytes a plain sequential mapping of the (evicted) files maps with 2 MiB entries
    after one populate: what this kernel and filesystem give at best."""
    total = 0
    for p in paths:
        evict(p)
        fd = os.open(p, os.O_RDONLY)
        try:
            n = os.fstat(fd).st_size // 4096 * 4096
            addr = map_range(fd, 0, n)
            try:
                madvise(addr, n, MADV_SEQUENTIAL)
                populate_range(addr, n)
                total += mapped_rss_split(addr, n)[1]
            finally:
                unmap_range(addr, n)
        finally:
            os.close(fd)
        evict(p)
    return total


@pytest.fixture(scope="module")
def big_cold_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """96 MB: read-ahead reaches 2 MiB folios only a few tens of MB into a sequential read."""
    path = tmp_path_factory.mktemp("big")
    data = _rows(600_000)
    engramdb.build(path, "t", ROW, [data])
    return path, data


@pytest.mark.parametrize("how", ["populate", "background warm"])
def test_a_sequential_fill_leaves_two_mib_folios(
    big_cold_db: tuple[Path, np.ndarray], how: str
) -> None:
    """`populate` and the background warm read the table so that the page cache holds 2 MiB
    folios and the table's mapping maps them with 2 MiB entries (before: the descriptor's
    POSIX_FADV_RANDOM, or two threads interleaving one file's chunks, left 4 KiB folios)."""
    path, data = big_cold_db
    best = _plain_sequential_huge(sorted(path.rglob("*.edb")))
    if best == 0:
        pytest.skip("no 2 MiB page-cache folios on this kernel / filesystem")
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        if how == "populate":
            s.populate()
        else:
            assert s.tiers.start_warm() and s.tiers.warm.wait(60)
            assert s.tiers.warm.state == "done"
        m = s.memory()
        if how == "populate":
            assert m["rss_file_huge_bytes"] >= 0.9 * best
        else:
            # its doubled read-ahead window (POSIX_FADV_SEQUENTIAL: it keeps the device busy
            # beside foreground reads) ramps the folio size up later in the file
            assert m["rss_file_huge_bytes"] > 0
        assert m["rss_file_bytes"] >= m["rss_file_huge_bytes"]
        ids = np.random.default_rng(3).integers(0, s.n_rows, 4096)
        assert np.array_equal(s.fetch(ids), data[ids])


def test_a_table_warmed_elsewhere_gets_its_page_tables_at_the_first_mapped_batch(
    cold_db: tuple[Path, np.ndarray],
) -> None:
    """In the page cache (warmed by another process) but not mapped here: the read rule's
    first mapped batch starts the background pass (`mapped_count` of spread pages), which
    maps the table without a device read, with no slow batch needed (a decode step's few
    minor faults never look slow). A table this process already maps starts nothing."""
    path, data = cold_db
    shards = list(path.rglob("*.edb"))
    for p in shards:
        p.read_bytes()  # into the page cache, through no mapping of ours
    ids = np.random.default_rng(4).integers(0, 50_000, 4096)
    with engramdb.open(path) as db:
        s = db["t"]
        assert s.memory()["rss_file_bytes"] == 0 and s.memory()["warm"]["starts"] == 0
        # this VM's DAMON scheme pages out page cache it sees idle (docs/probes.md, 21st
        # stop): pages gone before the pass starts are read back, rightly
        resident = min(file_residency(p) for p in shards)
        assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"] == {"mmap": 1}
        assert s.memory()["warm"]["starts"] == 1  # no slow batch reported
        m = warmed_memory(s, s.nbytes)
        if m["warm"]["bytes_read"] and resident < 1.0:
            pytest.skip(f"{1 - resident:.1%} of the table was paged out before the pass")
        assert m["warm"]["bytes_read"] == 0
        assert np.array_equal(s.fetch(ids), data[ids])
    with engramdb.open(path) as db:
        s = db["t"]
        s.populate()  # this process maps it already
        assert np.array_equal(s.fetch(ids), data[ids])
        assert s.stats()["choices"] == {"mmap": 1}
        assert s.memory()["warm"]["starts"] == 0


@pytest.mark.parametrize("cached", [True, False])
def test_a_warm_pass_reads_one_byte_of_every_page_of_the_table(
    cold_db: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """Resident or read from the device, every chunk a pass maps is then read by the CPU, a
    byte a page (`touch_pages`): on a VM whose host reclaims idle guest memory a resident
    page costs a host fault at its next read, paid there and not in the gathers."""
    from engramdb.io import tiers

    path, data = cold_db
    spans: list[tuple[int, int]] = []
    real = tiers.touch_pages

    def spy(addr: int, length: int) -> None:
        spans.append((addr, length))
        real(addr, length)

    monkeypatch.setattr(tiers, "touch_pages", spy)
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        if cached:
            s.populate()
        w = warm_pass(s, rate=1e12, budget=1 << 40, chunk=1 << 20)
        w.start()
        assert w.wait(60) and w.state == "done"
        base, size = int(s.array().ctypes.data), s.nbytes
        covered = sorted(spans)
        assert covered[0][0] == base
        assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))  # no gap
        assert covered[-1][0] + covered[-1][1] >= base + size
        ids = np.arange(0, s.n_rows, 97)
        assert np.array_equal(s.fetch(ids), data[ids])


def test_background_warm_stops_at_its_budget(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        w = warm_pass(s, rate=1e12, budget=256 << 10, chunk=64 << 10)
        w.start()
        assert w.wait(60)
        assert (w.state, w.reason) == ("cancelled", "budget")
        assert 0 < w.bytes_added <= 256 << 10
        assert s.residency() * s.nbytes <= (256 << 10) + (64 << 10)


def test_warming_means_reading_from_the_device(cold_db: tuple[Path, np.ndarray]) -> None:
    """`warming()` (what a decoder's or module's prefetch rule asks) is a pass that reads the
    table from the device, not one that only fills this process's page tables."""
    path, data = cold_db
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        # cold: 1 KiB/s, so after its first 64 KiB chunk the pass waits for the rate bound
        w = s.tiers.warm = warm_pass(s, rate=1024, budget=1 << 40, chunk=64 << 10)
        assert not s.warming()
        w.start()
        deadline = time.monotonic() + 10
        while not w.reading and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.running and w.reading and s.warming()
        w.cancel()
        assert not s.warming()
        # resident (read through no mapping of ours): the pass only maps, it never reads
        for p in path.rglob("*.edb"):
            p.read_bytes()
        w = s.tiers.warm = warm_pass(s, rate=1024, budget=1 << 40, chunk=64 << 10)
        w.start()
        assert w.wait(30) and w.state == "done"
        assert not w.reading and w.bytes_read == 0
        w.state = "running"  # as while such a pass runs: not warming
        assert not s.warming()
        w.reading = True
        assert s.warming()
        w.state = "done"
        ids = np.random.default_rng(2).integers(0, s.n_rows, 500)
        assert np.array_equal(s.fetch(ids), data[ids])


def test_background_warm_cancels(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        # 1 KiB/s: after its first 64 KiB chunk the pass waits a minute for the rate bound.
        w = warm_pass(s, rate=1024, budget=1 << 40, chunk=64 << 10)
        w.start()
        w.cancel()
        assert w.wait(10) and (w.state, w.reason) == ("cancelled", "cancelled")
        assert w.bytes_read <= 64 << 10
        # and under memory pressure (a margin above what is available) it reads nothing.
        # The first pass's read-ahead (16 MB past its one chunk) may have brought in the
        # whole 8 MB table, even after the cancel: evict it again (once its I/O has landed),
        # until it stays out.
        time.sleep(0.05)
        for _ in range(100):
            _cold(s)
            if s.residency() < 0.5:
                break
            time.sleep(0.02)
        assert s.residency() < 0.5
        w2 = warm_pass(s, rate=1e12, budget=1 << 40, margin=1 << 60)
        w2.start()
        assert w2.wait(10) and (w2.state, w2.reason) == ("cancelled", "memory pressure")
        assert w2.bytes_read == 0


# -- memory accounting and budgets --------------------------------------------------------
def test_memory_fields(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    with engramdb.open(path, ram_budget="1M", background_warm=False) as db:
        s = db["t"]
        m = s.memory()
        assert m["table_bytes"] == s.nbytes == 50_000 * ROW
        assert m["ram_tier_bytes"] == s.cache.nbytes > 0  # type: ignore[union-attr]
        assert m["rss_anon_bytes"] >= m["ram_tier_bytes"]
        assert m["rss_file_bytes"] == 0 and m["page_cache_resident_bytes"] < s.nbytes // 10
        assert m["rss_budget"] is None and m["locked_bytes"] == 0
        assert set(m["process"]) >= {"VmRSS", "RssAnon", "RssFile"}
        s.populate()
        m = s.memory()
        assert m["page_cache_resident_bytes"] >= s.nbytes - 4096
        assert m["rss_file_bytes"] >= s.nbytes - 4096


def test_rss_budget_trims_mapped_pages(tmp_path: Path) -> None:
    data = _rows(200_000)  # 32 MB
    engramdb.build(tmp_path, "t", ROW, [data])
    with engramdb.open(tmp_path, rss_budget="8M") as db:
        s = db["t"]
        s.populate()
        before = process_rss()["VmRSS"]
        assert s.tiers.mapped_rss() >= 30 << 20 or s.memory()["rss_file_bytes"] <= 8 << 20
        s.tiers.trim()
        assert s.memory()["rss_file_bytes"] <= 8 << 20
        assert process_rss()["VmRSS"] <= before - (16 << 20) or s.tiers.trims > 1
        assert s.residency() > 0.99  # the page cache kept the pages
        rng = np.random.default_rng(2)
        for _ in range(5):  # a random workload over the whole table
            ids = rng.integers(0, s.n_rows, 20_000)
            assert np.array_equal(s.fetch(ids), data[ids])
        # resident rows came by buffered reads, not mapped gathers: the budget held
        assert "mmap" not in s.stats()["choices"]
        assert s.memory()["rss_file_bytes"] <= 8 << 20


def test_rss_budget_holds_vmrss_under_random_reads(tmp_path: Path) -> None:
    """A fresh process, a 48 MB table, ``rss_budget="8M"``: random `fetch_into`
    batches stay bit-equal and VmRSS grows by no more than the budget (plus slack for the
    interpreter's own allocations): resident rows come by buffered reads, not the mapping."""
    data = _rows(300_000)
    engramdb.build(tmp_path, "t", ROW, [data])
    np.save(tmp_path / "ref.npy", data)
    script = textwrap.dedent(
        f"""
        import numpy as np, engramdb
        from engramdb.io.tiers import process_rss
        ref = np.load({str(tmp_path / "ref.npy")!r})
        db = engramdb.open({str(tmp_path)!r}, rss_budget="8M", background_warm=False)
        s = db["t"]
        s.populate()
        s.tiers.trim()
        out = np.empty((4096, {ROW}), np.uint8)
        rng = np.random.default_rng(5)
        ids = rng.integers(0, s.n_rows, 4096)
        s.fetch_into(ids, out)
        base = process_rss()["VmRSS"]
        peak = 0
        for i in range(60):
            ids = rng.integers(0, s.n_rows, 4096)
            s.fetch_into(ids, out)
            assert np.array_equal(out, ref[ids])
            peak = max(peak, process_rss()["VmRSS"] - base)
        print(peak, s.stats()["choices"].get("mmap", 0), s.tiers.trims)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    peak, mapped, trims = (int(x) for x in out.stdout.split())
    assert mapped == 0 and trims >= 1
    assert peak <= (8 << 20) + (4 << 20), peak  # the budget, plus 4 MB of slack


def test_rss_budget_drops_vmrss(tmp_path: Path) -> None:
    """VmRSS itself falls once the mapping is trimmed (checked in a fresh process)."""
    engramdb.build(tmp_path, "t", ROW, [_rows(200_000)])
    script = textwrap.dedent(
        f"""
        import engramdb
        from engramdb.io.tiers import process_rss
        db = engramdb.open({str(tmp_path)!r}, rss_budget="4M", background_warm=False)
        s = db["t"]
        s.populate()
        a = process_rss()["VmRSS"]
        s.tiers.trim()
        b = process_rss()["VmRSS"]
        print(a, b, s.memory()["rss_file_bytes"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    a, b, mapped = (int(v) for v in out)
    assert a - b >= 24 << 20 and mapped <= 4 << 20


def test_lock_within_a_budget(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    with engramdb.open(path, background_warm=False) as db:
        s = db["t"]
        try:
            n = s.tiers.lock(64 << 10)
        except MemoryLockRefused as e:
            assert "RLIMIT_MEMLOCK" in str(e)
            return
        assert n == 64 << 10 and s.memory()["locked_bytes"] == 64 << 10
        assert process_rss()["VmLck"] >= 64 << 10
        s.tiers.unlock()
        assert s.memory()["locked_bytes"] == 0


def test_lock_refused_is_typed_and_names_the_limit(cold_db: tuple[Path, np.ndarray]) -> None:
    path, _ = cold_db
    script = textwrap.dedent(
        f"""
        import os, resource, engramdb
        from engramdb.errors import MemoryLockRefused
        db = engramdb.open({str(path)!r}, background_warm=False)
        s = db["t"]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)  # drop CAP_IPC_LOCK
        try:
            s.tiers.lock()
            print("locked")
        except MemoryLockRefused as e:
            print("refused", e)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused") and "RLIMIT_MEMLOCK" in r.stdout, r.stdout


def test_keep_warm_rewarms_after_residency_loss(cold_db: tuple[Path, np.ndarray]) -> None:
    path, data = cold_db
    with engramdb.open(path, keep_warm=True, background_warm=False) as db:
        s = db["t"]
        s.populate()
        _cold(s)
        assert s.residency() < 0.5
        s.backend.recheck_s = 3600.0  # only the finished warm may bring the rule back
        few = np.arange(20_000, 20_300)  # 12 pages
        # cold: the rule leaves the mapping, and this read starts the re-warm itself (the
        # watcher would notice the loss only at its next check)
        assert np.array_equal(s.fetch(few), data[few])
        assert s.tiers.warm_starts == 1 and s.tiers.warm.wait(60)
        assert s.residency() > 0.99
        ids = np.arange(0, s.n_rows, 13)
        mapped0 = s.stats()["choices"].get("mmap", 0)
        assert np.array_equal(s.fetch(ids), data[ids])
        # the finished pass told the rule to look again at once (not recheck_s later)
        assert s.stats()["choices"].get("mmap", 0) == mapped0 + 1 and s.resident_state()
        # a loss nobody reads into: the watcher's step notices it and re-warms
        _cold(s)
        s.tiers.check()  # what the watcher does every interval
        assert s.tiers.warm_starts == 2 and s.tiers.warm.wait(60)
        assert s.residency() > 0.99
        assert np.array_equal(s.fetch(ids), data[ids])


# -- the warm path ------------------------------------------------------------------------
def test_small_fetch_into_fast_path_checks_bounds(cold_db: tuple[Path, np.ndarray]) -> None:
    path, data = cold_db
    with engramdb.open(path, backend="mmap") as db:
        s = db["t"]
        out = np.zeros((16, ROW), np.uint8)
        ids = np.arange(16, dtype=np.int64) * 3000
        s.fetch_into(ids, out)
        assert np.array_equal(out, data[ids]) and s.counters()["small_gathers"] == 1
        for bad in (-1, s.n_rows):
            b = ids.copy()
            b[5] = bad
            out[:] = 0
            with pytest.raises(RowIdOutOfRange, match=f"{bad}"):
                s.fetch_into(b, out)
            assert not out.any()  # nothing written
        many = np.arange(100, dtype=np.int64)
        many[-1] = s.n_rows + 7
        with pytest.raises(RowIdOutOfRange):
            s.fetch_into(many, np.zeros((100, ROW), np.uint8))


def test_pooled_fetch_never_reuses_a_held_result(cold_db: tuple[Path, np.ndarray]) -> None:
    path, data = cold_db
    with engramdb.open(path, backend="mmap") as db:
        s = db["t"]
        rng = np.random.default_rng(5)
        a_ids, b_ids = rng.integers(0, s.n_rows, (2, 4096))
        a = s.fetch(a_ids)
        b = s.fetch(b_ids)
        assert not np.shares_memory(a, b)
        assert np.array_equal(a, data[a_ids]) and np.array_equal(b, data[b_ids])
        view = b[10:20]
        del b
        c = s.fetch(a_ids)  # b's buffer is still referenced by a view: not reused
        assert not np.shares_memory(c, view) and np.array_equal(view, data[b_ids][10:20])
        del a, c, view
        held = s.pool_bytes()
        for _ in range(10):
            r = s.fetch(rng.integers(0, s.n_rows, 4096))
            del r
        assert s.pool_bytes() == held  # dropped results were reused, not reallocated


def test_split_decision_follows_observed_timings() -> None:
    d = SplitDecision()
    d.allowed = True
    for _ in range(64):  # splitting measured 3x faster
        split = d.pick()
        d.report(split, 1000, 1e-4 if split else 3e-4)
    assert d.split
    d2 = SplitDecision()
    d2.allowed = True
    for _ in range(64):  # splitting measured slower: stays serial, explores less often
        split = d2.pick()
        d2.report(split, 1000, 3e-4 if split else 1e-4)
    assert not d2.split and d2.every > 16
    d4 = SplitDecision()
    d4.allowed = True
    went_serial = False
    for _ in range(600):  # one thread 15 % faster for a while (a busy minute), then split 5 %
        busy = d4.count < 80
        split = d4.pick()
        d4.report(
            split, 1000, (1e-4 if split else 0.85e-4) if busy else (0.95e-4 if split else 1e-4)
        )
        went_serial |= busy and not d4.split
    assert went_serial and d4.split  # back to the split without needing a 10 % margin
    d3 = SplitDecision()
    d3.allowed = False
    assert not any(d3.pick() for _ in range(100))


def test_os_is_linux() -> None:
    assert os.path.exists("/proc/self/smaps")


# -- the CLI ------------------------------------------------------------------------------
def _cli(*args: object) -> tuple[int, str]:
    from click.testing import CliRunner

    from engramdb.cli import main

    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def test_build_warm_info_memory_and_warm_hold(tmp_path: Path) -> None:
    src = tmp_path / "rows.npy"
    np.save(src, _rows(20_000))
    db = tmp_path / "db"
    code, out = _cli("build", db, src, "-t", "t", "-r", ROW, "--warm", "-q")
    assert code == 0, out
    assert "warmed 't'" in out and "-> 100%" in out
    code, out = _cli("info", db, "--memory")
    assert code == 0 and "100.0%" in out and "fits" in out, out
    code, out = _cli("info", db, "--memory", "--page-cache-budget", "1K", "--json")
    assert code == 0, out
    assert '"page_cache_budget": 1024' in out
    code, out = _cli("warm", db, "--watch", "--seconds", "0.1", "-q")
    assert code == 0 and "held 't'" in out, out
    code, out = _cli("warm", db, "--lock-budget", "1M", "-q")
    assert code != 0 and "--lock-budget applies to --lock" in out
    code, out = _cli("warm", db, "--lock", "--lock-budget", "64K", "--seconds", "0", "-q")
    assert code == 0 and (
        " KiB, 0 re-warm" in out or " B, 0 re-warm" in out or "RLIMIT_MEMLOCK" in out
    ), out


def test_mapped_fast_paths_large_batches_and_errors(tmp_path: Path) -> None:
    """In the mapped state `fetch_into` (any size) and `lookup_into` take the lock-free fast
    path: bytes equal the source, a bad id raises `RowIdOutOfRange` naming it with ``out``
    untouched, and an evicted table is noticed before the gather (the rule serves it)."""
    data = _rows(40_000)
    heads = [10_000, 30_000]
    engramdb.build(tmp_path, "t", ROW, [data], heads=heads)
    with engramdb.open(tmp_path, populate=True, background_warm=False) as db:
        s = db["t"]
        rng = np.random.default_rng(9)
        s.fetch_into(rng.integers(0, s.n_rows, 4096), np.empty((4096, ROW), np.uint8))
        before = s.stats()["small_gathers"]
        ids = rng.integers(0, s.n_rows, 4096)
        out = np.empty((4096, ROW), np.uint8)
        assert np.array_equal(s.fetch_into(ids, out), data[ids])
        local = np.stack([rng.integers(0, h, size=(4, 64)) for h in heads], axis=-1).astype(
            np.int64
        )
        lo = np.empty((4, 64, 2, ROW), np.uint8)
        assert np.array_equal(s.lookup_into(local, lo), data[local + s.head_offsets])
        assert s.stats()["small_gathers"] >= before + 2  # both took the fast path
        for bad in (-1, s.n_rows):
            ids2 = ids.copy()
            ids2[1234] = bad
            out[:] = 7
            with pytest.raises(RowIdOutOfRange, match=str(bad)):
                s.fetch_into(ids2, out)
            assert (out == 7).all()
        local2 = local.copy()
        local2[1, 2, 0] = heads[0]  # valid globally, out of range for head 0
        lo[:] = 7
        with pytest.raises(RowIdOutOfRange, match="head 0"):
            s.lookup_into(local2, lo)
        assert (lo == 7).all()
        # the table evicted under the live store: the next large batch is checked first
        cold0 = sum(v for k, v in s.stats()["choices"].items() if k != "mmap")
        drop_mapped_pages(s.array())
        for sh in s.info.shards:
            evict(tmp_path / sh.path)
        ids3 = rng.integers(0, s.n_rows, 4096)
        assert np.array_equal(s.fetch_into(ids3, out), data[ids3])
        assert sum(v for k, v in s.stats()["choices"].items() if k != "mmap") > cold0


def test_small_fast_path_checks_every_id(tmp_path: Path) -> None:
    """A decode-sized `fetch_into` (≤ 32 ids) in the mapped state: strided ids are served
    right, and -1, n_rows and the most negative int64 each raise `RowIdOutOfRange` naming
    the id, with ``out`` untouched, on every one of many calls (the timing sample is one
    call in 8; the bounds check is every call)."""
    data = _rows(5_000)
    engramdb.build(tmp_path, "t", ROW, [data])
    # the mmap backend: always in the mapped state (on a busy machine `auto`'s rule may take a
    # preempted gather for a faulting one and leave it for a while)
    with engramdb.open(tmp_path, backend="mmap", populate=True, background_warm=False) as db:
        s = db["t"]
        out = np.empty((4, ROW), np.uint8)
        ids = np.arange(16, dtype=np.int64) * 7
        before = s.stats()["small_gathers"]
        for _ in range(16):
            assert np.array_equal(s.fetch_into(ids[::4], out), data[ids[::4]])
            for bad in (-1, s.n_rows, -(2**63)):
                out[:] = 7
                with pytest.raises(RowIdOutOfRange, match=str(bad)):
                    s.fetch_into(np.array([1, bad, 3, 4], dtype=np.int64), out)
                assert (out == 7).all()
        assert s.stats()["small_gathers"] >= before + 16
