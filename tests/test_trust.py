"""Files, the file protocol and the read paths under faults and hostile input (issue 16,
findings 5-13)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.build import build
from engramdb.errors import EngramDBError, InvalidArgument


# -- 5. an open database serves the generation it opened --------------------------------------
def test_open_database_serves_its_generation_after_a_rebuild(db_factory: Any) -> None:
    db, written = db_factory({"t": (32, (3000,)), "u": (16, (100,))})
    old = written["t"]
    with engramdb.open(db) as opened:
        opened["u"].fetch(np.arange(4))  # one table in use, "t" not opened yet
        new = np.random.default_rng(1).integers(0, 256, old.shape, dtype=np.uint8)
        build(db, "t", 32, [new], force=True)  # GC unlinks the old generation
        assert not any((db / s.path).exists() for s in opened.manifest.tables["t"].shards)
        got = opened["t"].fetch(np.arange(3000))
        assert np.array_equal(got, old)  # the generation it opened, not a TruncatedFile
    with engramdb.open(db) as fresh:
        assert np.array_equal(fresh["t"].fetch(np.arange(3000)), new)


# -- 11. `out` aliasing the ids ----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["mmap", "preadv", "auto"])
def test_out_sharing_memory_with_the_ids(db_factory: Any, backend: str) -> None:
    db, written = db_factory({"t": (32, (8000,))})
    table = written["t"]
    rng = np.random.default_rng(11)
    with engramdb.open(db, backend=backend) as opened:
        t = opened["t"]
        out = np.empty((5000, 32), np.uint8)
        ids = out.reshape(-1)[: 5000 * 8].view(np.int64)  # the ids live inside `out`
        ids[:] = rng.integers(0, 8000, 5000)
        want = table[ids.copy()]
        t.fetch_into(ids, out)
        assert np.array_equal(out, want)
        # lookup_into: [B, L, H] per-head local ids inside the output
        out4 = np.empty((10, 50, 1, 32), np.uint8)
        local = out4.reshape(-1)[: 500 * 8].view(np.int64).reshape(10, 50, 1)
        local[:] = rng.integers(0, 8000, (10, 50, 1))
        want4 = table[local.reshape(-1).copy()].reshape(10, 50, 1, 32)
        t.lookup_into(local, out4)
        assert np.array_equal(out4, want4)


# -- 13. huge empty shapes and the per-call row limit --------------------------------------------
def test_huge_and_empty_shapes_are_typed(db_factory: Any) -> None:
    from engramdb.validate import MAX_ROWS_PER_CALL

    db, _ = db_factory({"t": (32, (100,))})
    with engramdb.open(db) as opened:
        t = opened["t"]
        with pytest.raises(InvalidArgument, match="per-call limit"):
            t.fetch(np.zeros((0, 10**9, 10**9), np.int64))
        big = np.broadcast_to(np.int64(0), (MAX_ROWS_PER_CALL + 1,))
        with pytest.raises(InvalidArgument, match="split the batch"):
            t.fetch(big)
        with pytest.raises(InvalidArgument, match="per-call limit"):
            t.fetch_into(np.zeros((0, 10**9, 10**9), np.int64), np.empty((0, 32), np.uint8))
        assert t.fetch(np.zeros((0, 5), np.int64)).shape == (0, 5, 32)
