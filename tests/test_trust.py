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
