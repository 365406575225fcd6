"""``verify``: recompute every shard checksum and compare with the manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from engramdb.database import read_manifest
from engramdb.errors import TableNotFound
from engramdb.layouts.manifest import CHECK_BLOCK_BYTES, ShardInfo

_READ = 8 * 1024 * 1024


@dataclass(frozen=True)
class Problem:
    table: str
    shard: str
    start: int  # byte range inside the shard, [start, end)
    end: int
    what: str

    def line(self) -> str:
        return f"table {self.table!r} shard {self.shard!r} bytes [{self.start}, {self.end}): {self.what}"


def _check_shard(
    db: Path, table: str, s: ShardInfo, progress: Callable[[int], None] | None
) -> list[Problem]:
    path = db / s.path
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return [Problem(table, s.path, 0, s.bytes, "shard file is missing")]
    problems: list[Problem] = []
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != s.bytes:
            problems.append(
                Problem(
                    table,
                    s.path,
                    min(size, s.bytes),
                    max(size, s.bytes),
                    f"size is {size}, manifest says {s.bytes}",
                )
            )
            return problems
        whole = xxhash.xxh3_64()
        block = xxhash.xxh3_64()
        buf = memoryview(bytearray(_READ))
        pos = 0
        block_start = 0
        block_index = 0
        while pos < s.bytes:
            want = min(_READ, s.bytes - pos, block_start + CHECK_BLOCK_BYTES - pos)
            n = f.readinto(buf[:want])
            if not n:
                problems.append(Problem(table, s.path, pos, s.bytes, "unexpected end of file"))
                return problems
            whole.update(buf[:n])
            block.update(buf[:n])
            pos += n
            if progress is not None:
                progress(n)
            if pos - block_start == CHECK_BLOCK_BYTES or pos == s.bytes:
                if s.blocks and block.hexdigest() != s.blocks[block_index]:
                    problems.append(
                        Problem(table, s.path, block_start, pos, "block checksum mismatch")
                    )
                block = xxhash.xxh3_64()
                block_start = pos
                block_index += 1
        if whole.hexdigest() != s.xxh3_64 and not problems:
            problems.append(
                Problem(
                    table,
                    s.path,
                    0,
                    s.bytes,
                    f"xxh3-64 is {whole.hexdigest()}, manifest says {s.xxh3_64}",
                )
            )
    return problems


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
            problems.extend(_check_shard(db, name, s, progress))
    return problems


def total_bytes(db_path: str | os.PathLike[str], tables: list[str] | None = None) -> int:
    manifest = read_manifest(db_path)
    names = tables if tables else list(manifest.tables)
    return sum(
        manifest.tables[n].n_rows * manifest.tables[n].row_bytes
        for n in names
        if n in manifest.tables
    )
