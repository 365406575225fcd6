"""A small-database factory for tests, examples and contract suites.

`make_db` builds a database of small tables filled with seeded random rows and returns the
rows it wrote, so a test compares what it reads against the source bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Small tables still get several shards when the badge is small.
SMALL_BADGE = {1: 4096, 7: 4096, 160: 128, 264: 512, 2560: 8, 4096: 1, 5000: 512}


@dataclass(frozen=True)
class TableSpec:
    """One table of a test database: row width, per-head row counts, and build options."""

    row_bytes: int
    heads: Sequence[int]
    dtype: str = "u8"
    dim: int | None = None
    rows_per_badge: int | None = None
    shard_bytes: int | None = None


#: Two tables shaped like the ones the serve and integration tests use.
DEFAULT_TABLES: Mapping[str, TableSpec] = {
    "ple": TableSpec(160, (3000, 5000), dtype="fp8_e4m3"),
    "eng": TableSpec(264, (4000,)),
}


def random_rows(rng: np.random.Generator, n: int, row_bytes: int) -> np.ndarray:
    """``n`` random rows of ``row_bytes`` bytes (uint8)."""
    return rng.integers(0, 256, size=(n, row_bytes), dtype=np.uint8)


def make_db(
    root: str | os.PathLike[str],
    tables: Mapping[str, TableSpec | tuple[int, Sequence[int]]] | None = None,
    *,
    seed: int = 7,
    name: str = "db",
    small_badges: bool = False,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Build ``root/name`` with ``tables`` (default `DEFAULT_TABLES`) of seeded random rows.

    A table spec is a `TableSpec` or ``(row_bytes, heads)``. ``small_badges`` uses badges of a
    few pages so even small tables get several shards. Returns the database path and, per
    table, the ``[n_rows, row_bytes]`` rows it holds."""
    from engramdb.build import build

    rng = np.random.default_rng(seed)
    db = Path(root) / name
    written: dict[str, np.ndarray] = {}
    for table, spec in (DEFAULT_TABLES if tables is None else tables).items():
        if not isinstance(spec, TableSpec):
            spec = TableSpec(int(spec[0]), tuple(spec[1]))
        rows = random_rows(rng, int(sum(spec.heads)), spec.row_bytes)
        options: dict[str, Any] = {"dtype": spec.dtype, "dim": spec.dim}
        rpb = spec.rows_per_badge
        if rpb is None and small_badges:
            rpb = SMALL_BADGE.get(spec.row_bytes)
        if rpb is not None:
            options["rows_per_badge"] = rpb
        if spec.shard_bytes is not None:
            options["shard_bytes"] = spec.shard_bytes
        build(db, table, spec.row_bytes, [rows], heads=list(spec.heads), **options)
        written[table] = rows
    return db, written
