"""Opening and syncing files: every size check against the manifest lives here."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from engramdb._durable import atomic_write_bytes, atomic_writer, fsync_dir
from engramdb.errors import CorruptFile, SourceChanged, SourceError, TruncatedFile
from engramdb.layouts.manifest import SourceFile, TableInfo

#: Blocks hashed per source file at attach and checked at every open (plus the header).
SAMPLE_BLOCKS = 4
SAMPLE_BYTES = 64 * 1024

__all__ = [
    "atomic_write_bytes",
    "atomic_writer",
    "fsync_dir",
    "mem_available",
    "open_checked",
    "open_shards",
    "open_sources",
    "source_identity",
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


def _hash_range(fd: int, offset: int, length: int) -> str:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise TruncatedFile(f"short read of {length} bytes at {offset}")
    return xxhash.xxh3_64_hexdigest(data)


def _sample_spans(size: int, start: int) -> list[tuple[int, int]]:
    """`SAMPLE_BLOCKS` blocks spread evenly over ``[start, size)`` (first and last included)."""
    span = size - start
    if span <= 0:
        return []
    n = min(SAMPLE_BYTES, span)
    if span <= SAMPLE_BLOCKS * n:
        return [(start, span)]
    step = (span - n) // (SAMPLE_BLOCKS - 1)
    return [(start + i * step, n) for i in range(SAMPLE_BLOCKS)]


def source_identity(path: str, header_bytes: int) -> SourceFile:
    """The identity of a source file as `attach` records it: stat fields, the xxh3 of its
    first ``header_bytes`` bytes and of `SAMPLE_BLOCKS` sampled blocks of its data."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SourceError(f"source {path!r} cannot be opened: {e}") from None
    try:
        st = os.fstat(fd)
        head = _hash_range(fd, 0, header_bytes) if header_bytes else ""
        samples = tuple(
            (o, n, _hash_range(fd, o, n)) for o, n in _sample_spans(st.st_size, header_bytes)
        )
    finally:
        os.close(fd)
    return SourceFile(
        path=path,
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        ino=st.st_ino,
        dev=st.st_dev,
        header_bytes=header_bytes,
        header_xxh3=head,
        samples=samples,
    )


def check_source(fd: int, sf: SourceFile, table: str) -> None:
    """Raise `SourceChanged` (or `TruncatedFile` for a shorter file) naming ``sf.path`` and
    what differs from the identity recorded at attach: one ``fstat``, one read of the
    header and `SAMPLE_BLOCKS` small reads."""
    st = os.fstat(fd)
    what = f"table {table!r}: source {sf.path!r}"
    if st.st_size < sf.size:
        raise TruncatedFile(f"{what} is truncated: {st.st_size} bytes, attached with {sf.size}")
    changed = []
    if st.st_size != sf.size:
        changed.append(f"size {sf.size} -> {st.st_size}")
    if (st.st_ino, st.st_dev) != (sf.ino, sf.dev):
        changed.append("inode (the file was replaced)")
    if st.st_mtime_ns != sf.mtime_ns:
        changed.append(f"mtime_ns {sf.mtime_ns} -> {st.st_mtime_ns}")
    if not changed and sf.header_bytes and _hash_range(fd, 0, sf.header_bytes) != sf.header_xxh3:
        changed.append("safetensors header bytes")
    if not changed:
        bad = [o for o, n, h in sf.samples if _hash_range(fd, o, n) != h]
        if bad:
            changed.append(f"data bytes of the sampled block at offset {bad[0]}")
    if changed:
        raise SourceChanged(f"{what} changed since attach: {', '.join(changed)}")


def open_sources(info: TableInfo) -> list[int]:
    """Open every source file of an attached table (file order) and check its identity
    (`check_source`); on error no fd stays open."""
    assert info.attached is not None
    fds: list[int] = []
    try:
        for sf in info.attached.files:
            try:
                fd = os.open(sf.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise TruncatedFile(f"table {info.name!r}: source {sf.path!r} is missing") from None
            fds.append(fd)
            check_source(fd, sf, info.name)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def open_shards(db: Path, info: TableInfo) -> list[int]:
    """Open every shard of ``info`` read-only and check its size against the manifest (an
    attached table: its source files, identity checked by `open_sources`).

    A missing or truncated shard raises `TruncatedFile` (naming the first missing row), a
    longer one `CorruptFile`; on error no fd stays open."""
    if info.attached is not None:
        return open_sources(info)
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
