"""The table contract (`engramdb.testing.tables.TableContract`) on local tables: `Store` over
every backend, with and without a RAM tier, and the bare `LocalTable` engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engramdb
from engramdb.database import read_manifest
from engramdb.io import IoUringBackend
from engramdb.read.table import LocalTable
from engramdb.testing import TableContract
from engramdb.testing.dbs import TableSpec, make_db
from engramdb.testing.tables import MemoryTable

HEADS = (3000, 5000)
# 128-row badges and 1024-row shards: the 8,000-row table spans 8 shards.
SPEC = TableSpec(160, HEADS, rows_per_badge=128, shard_bytes=1024 * 160)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    db, rows = make_db(tmp_path_factory.mktemp("contract"), {"t": SPEC})
    return db, rows["t"]


class _OnStore(TableContract):
    backend = "auto"
    ram_budget: str | None = None

    @pytest.fixture
    def table(self, built: tuple[Path, Any]) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        db, rows = built
        with engramdb.open(db, backend=self.backend, ram_budget=self.ram_budget) as d:
            s = d["t"]
            assert len(s.info.shards) > 1, "the contract table spans several shards"
            yield s, rows, HEADS


class TestStoreAuto(_OnStore):
    backend = "auto"


class TestStoreMmap(_OnStore):
    backend = "mmap"


class TestStorePreadv(_OnStore):
    backend = "preadv"


@pytest.mark.skipif(not IoUringBackend.availability()[0], reason="io_uring unavailable here")
class TestStoreIoUring(_OnStore):
    backend = "io_uring"


class TestStoreRamTier(_OnStore):
    backend = "auto"
    ram_budget = "256K"  # smaller than the table: hits, misses and evictions


class TestStorePreadvRamTier(_OnStore):
    backend = "preadv"
    ram_budget = "2M"


class TestLocalTable(TableContract):
    @pytest.fixture
    def table(self, built: tuple[Path, Any]) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        db, rows = built
        info = read_manifest(db).tables["t"]
        with LocalTable(db, info) as t:
            yield t, rows, HEADS


class TestMemoryTable(TableContract):
    """The contract holds for a handle written only against `RowTable` (no local engine)."""

    @pytest.fixture
    def table(self, built: tuple[Path, Any]) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        _, rows = built
        with MemoryTable(rows, HEADS) as t:
            yield t, rows, HEADS
