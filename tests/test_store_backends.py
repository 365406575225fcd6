"""Store reads through every backend return exactly the source bytes, and fail typed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.errors import BackendUnavailable, InvalidArgument, ReadError, RowIdOutOfRange
from engramdb.testing.dbs import SMALL_BADGE, TableSpec

BACKENDS = ["auto", "mmap", "preadv", "io_uring"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_bytes", [7, 160, 2560, 5000])
def test_every_backend_returns_source_bytes(
    db_factory: Any, backend: str, row_bytes: int, rng: np.random.Generator
) -> None:
    small_badge = SMALL_BADGE[row_bytes]
    spec = TableSpec(
        row_bytes, (301, 517), rows_per_badge=small_badge, shard_bytes=small_badge * row_bytes
    )
    path, rows = db_factory({"t": spec})
    full = rows["t"]
    with engramdb.open(path, backend=backend) as db:
        s = db["t"]
        ids = rng.integers(0, full.shape[0], 3000)
        ids[:5] = [0, full.shape[0] - 1, 300, 301, 300]  # ends, head boundary, duplicates
        assert np.array_equal(s.fetch(ids), full[ids])
        local = np.ascontiguousarray(
            np.stack([rng.integers(0, 301, (4, 9)), rng.integers(0, 517, (4, 9))], -1)
        )
        out = np.empty(local.shape + (row_bytes,), np.uint8)
        s.lookup_into(local, out)
        assert np.array_equal(out, full[local + s.head_offsets])
        with pytest.raises(RowIdOutOfRange):
            s.fetch([full.shape[0]])
        assert s.stats()["backend"] == backend
        if backend in ("preadv", "io_uring"):
            assert s.stats()["io"]["requests"] > 0, "the syscall path served the reads"


def test_truncated_under_a_live_store_is_a_read_error(db_factory: Any) -> None:
    tmp_path, _ = db_factory({"t": (160, (4000,))})
    for backend in ("preadv", "io_uring"):
        db = engramdb.open(tmp_path, backend=backend)
        s = db["t"]
        shard = tmp_path / s.info.shards[0].path
        data = shard.read_bytes()
        with open(shard, "r+b") as f:
            f.truncate(160 * 1000)
        out = np.full((2, 160), 7, np.uint8)
        with pytest.raises(ReadError):
            s.fetch_into(np.array([5, 3500]), out)
        db.close()
        shard.write_bytes(data)


def test_unknown_or_unavailable_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engramdb.build(tmp_path, "t", 8, [np.zeros((10, 8), np.uint8)])
    with pytest.raises(InvalidArgument, match="unknown backend"):
        engramdb.open(tmp_path, backend="nope")
    from engramdb.io import IoUringBackend

    monkeypatch.setenv("ENGRAMDB_DISABLE_IO_URING", "1")
    ok, why = IoUringBackend.availability()
    assert not ok and "ENGRAMDB_DISABLE_IO_URING" in why
    with pytest.raises(BackendUnavailable):
        engramdb.open(tmp_path, backend="io_uring")["t"]
    with engramdb.open(tmp_path, backend="auto") as db:  # auto falls back to preadv
        assert np.array_equal(db["t"].fetch([1, 2]), np.zeros((2, 8), np.uint8))
