"""Opening and syncing files: every size check against the manifest lives here."""

from __future__ import annotations

import os
from pathlib import Path

from engramdb._durable import atomic_write_bytes, atomic_writer, fsync_dir
from engramdb.errors import CorruptFile, TruncatedFile
from engramdb.layouts.manifest import TableInfo

__all__ = [
    "atomic_write_bytes",
    "atomic_writer",
    "fsync_dir",
    "mem_available",
    "open_checked",
    "open_shards",
]


def _open_sized(path: Path) -> tuple[int, int] | None:
    """``(fd, size)`` of ``path`` opened read-only (close-on-exec), or None if missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return fd, os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise


def open_checked(db: Path, rel_path: str, expect_bytes: int, what: str) -> int:
    """Open ``db/rel_path`` read-only; its size must equal ``expect_bytes`` (the manifest's).

    ``what`` names the owner in the error (e.g. ``"view 't/v'"``). A missing or short file
    raises `TruncatedFile`, a longer one `CorruptFile`. Returns the fd (the caller closes it).
    """
    opened = _open_sized(db / rel_path)
    if opened is None:
        raise TruncatedFile(f"{what}: file {rel_path!r} is missing")
    fd, size = opened
    if size != expect_bytes:
        os.close(fd)
        kind = TruncatedFile if size < expect_bytes else CorruptFile
        raise kind(f"{what}: file {rel_path!r} has {size} bytes, the manifest says {expect_bytes}")
    return fd


def open_shards(db: Path, info: TableInfo) -> list[int]:
    """Open every shard of ``info`` read-only and check its size against the manifest.

    A missing or truncated shard raises `TruncatedFile` (naming the first missing row), a
    longer one `CorruptFile`; on error no fd stays open."""
    fds: list[int] = []
    try:
        for s in info.shards:
            opened = _open_sized(db / s.path)
            if opened is None:
                raise TruncatedFile(f"table {info.name!r}: shard {s.path!r} is missing")
            fd, size = opened
            fds.append(fd)
            if size < s.bytes:
                raise TruncatedFile(
                    f"table {info.name!r}: shard {s.path!r} is truncated: {size} bytes, "
                    f"manifest says {s.bytes} (rows from {s.first_row + size // info.row_bytes} "
                    "are missing)"
                )
            if size > s.bytes:
                raise CorruptFile(
                    f"table {info.name!r}: shard {s.path!r} has {size} bytes, manifest says "
                    f"{s.bytes}"
                )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
