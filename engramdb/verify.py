"""``verify``: recompute every shard checksum and compare with the manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from engramdb.disk.checksum import Problem, check_file
from engramdb.disk.publish import read_manifest
from engramdb.errors import TableNotFound

__all__ = ["Problem", "total_bytes", "verify"]


def verify(
    db_path: str | os.PathLike[str],
    *,
    tables: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Recompute the xxh3-64 of every shard (and of each 64 MiB block). Returns the problems
    found (empty list = intact). Reads every byte once: cost is one sequential pass."""
    db = Path(db_path)
    manifest = read_manifest(db)
    names = tables if tables else sorted(manifest.tables)
    problems: list[Problem] = []
    for name in names:
        info = manifest.tables.get(name)
        if info is None:
            raise TableNotFound(f"no table {name!r} in {str(db)!r}")
        for s in info.shards:
            problems.extend(check_file(db, s, "shard file", table=name, progress=progress))
    return problems


def total_bytes(db_path: str | os.PathLike[str], tables: list[str] | None = None) -> int:
    """Bytes `verify` reads (for a progress bar)."""
    manifest = read_manifest(db_path)
    names = tables if tables else list(manifest.tables)
    return sum(
        manifest.tables[n].n_rows * manifest.tables[n].row_bytes
        for n in names
        if n in manifest.tables
    )
