"""`Store.stats()` byte counters equal the bytes each backend asked the kernel for."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb.io import IoUringBackend
from engramdb.io.uring_ring import statx_dio_align
from engramdb.read.plan import locate
from engramdb.testing.pages import drop_mapped_pages, evict, resident_pages

ROW = 160
ROWS = 40_000
URING = IoUringBackend.availability()[0]


@pytest.fixture()
def table(tmp_path: Path) -> tuple[Path, np.ndarray]:
    full = np.random.default_rng(3).integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    engramdb.build(tmp_path, "t", ROW, [full], rows_per_badge=1024)
    return tmp_path, full


def _ids(rng: np.random.Generator) -> np.ndarray:
    # Distinct rows at least 64 rows apart: no two share a page, so no plan merges them.
    return np.sort(rng.choice(ROWS // 64, 200, replace=False)) * 64 + rng.integers(0, 40, 200)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return -1


def _cold(path: Path, s: engramdb.Store) -> bool:
    drop_mapped_pages(s.array())
    for sh in s.info.shards:
        evict(path / sh.path)
    arr = s.array()
    addrs = arr.ctypes.data + np.arange(0, ROWS, 211) * ROW
    return bool(resident_pages(addrs).mean() < 0.2)


def _direct_spans(path: Path, s: engramdb.Store, ids: np.ndarray) -> int:
    shard, off = locate(ids, s.geometry)
    fd = os.open(path / s.info.shards[0].path, os.O_RDONLY | os.O_DIRECT)
    try:
        align = statx_dio_align(fd)
    finally:
        os.close(fd)
    start = off - off % align
    end = -(-(off + ROW) // align) * align
    return int((end - start).sum())


CASES = ["mmap", "preadv"] + (["io_uring", "io_uring_direct", "auto"] if URING else [])


@pytest.mark.parametrize("case", CASES)
def test_byte_counters_equal_what_the_backend_asked_for(
    table: tuple[Path, np.ndarray], rng: np.random.Generator, case: str
) -> None:
    path, full = table
    backend = "io_uring" if case == "io_uring_direct" else case
    options = {"direct": True} if case == "io_uring_direct" else {}
    ids = _ids(rng)
    with engramdb.open(path, backend=backend, **options) as db:
        s = db["t"]
        cold = _cold(path, s)
        if case in ("io_uring_direct", "auto") and not cold:
            pytest.skip("this filesystem does not drop cached pages on request")
        before = s.stats()["io"]
        rb0 = _read_bytes()
        assert np.array_equal(s.fetch(ids), full[ids])
        rb1 = _read_bytes()
        st = s.stats()
        io = {k: st["io"][k] - before[k] for k in before}
        payload = ids.size * ROW
        if case == "mmap":
            # Gathers from the mapping ask the device for nothing (the kernel faults pages);
            # the table counts them as rows served.
            assert io["device_bytes"] == 0 and io["syscalls"] == 0
            assert st["rows_fetched"] * ROW == payload
            return
        assert io["requests"] == ids.size
        assert io["bytes"] == payload, f"{case}: payload bytes"
        assert io["syscalls"] >= 1
        direct = case == "io_uring_direct" or (
            case == "auto" and st["choices"].get("io_uring_direct", 0) > 0
        )
        fell_back = direct and s.backend is not None and _fallbacks(s.backend) > 0
        if direct and not fell_back:
            spans = _direct_spans(path, s, ids)
            assert io["device_bytes"] == spans, "O_DIRECT asks for the aligned spans"
            warmed = case == "auto" and s.memory()["warm"]["starts"] > 0
            if rb0 >= 0 and rb1 - rb0 > 0 and not warmed:
                # The kernel's own count of bytes read from the device for this process
                # (not comparable while the background warm pass reads in it too).
                assert rb1 - rb0 == spans
        else:
            assert io["device_bytes"] == payload
        if case == "auto":
            paths = st["io_paths"]
            assert (
                sum(p["bytes"] for name, p in paths.items() if name != "mmap") == st["io"]["bytes"]
            )


def _fallbacks(b: object) -> int:
    """O_DIRECT requests the file system refused (read buffered instead)."""
    parts = [b, *getattr(b, "parts", lambda: ())()]
    return sum(int(getattr(p, "direct_fallbacks", 0)) for p in parts)


def test_auto_reports_direct_reads(
    table: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    """The issue's symptom: reads the auto rule served O_DIRECT used to report 0 bytes."""
    if not URING:
        pytest.skip("io_uring unavailable")
    path, full = table
    with engramdb.open(path) as db:
        s = db["t"]
        if not _cold(path, s):
            pytest.skip("this filesystem does not drop cached pages on request")
        ids = _ids(rng)
        s.fetch(ids)
        st = s.stats()
        if not st["choices"].get("io_uring_direct"):
            pytest.skip("the rule did not pick O_DIRECT here")
        assert st["io"]["bytes"] >= ids.size * ROW
        assert st["io_paths"]["io_uring_direct"]["bytes"] == ids.size * ROW
        assert st["io"]["syscalls"] >= 1
