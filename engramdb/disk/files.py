"""Opening and syncing files: every size check against the manifest lives here, and the one
rule for opening a file a manifest (or an index) names: `open_regular`.

Every such file is *confined* to the database directory: its path is relative, made of plain
names (no ``""``, ``.``, ``..``, NUL), no directory on the way is a symlink (``lstat``), the
file itself is opened with ``O_NOFOLLOW`` (a symlinked file is refused, never followed to
``/etc/passwd``) and ``O_NONBLOCK`` (a FIFO cannot hang the open), and it must be a regular
file (``fstat``): a FIFO, device, socket or directory is `CorruptFile`. The database
directory itself may be a symlink (the operator's choice of where it lives).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path

import xxhash

from engramdb._durable import atomic_write_bytes, atomic_writer, fsync_dir
from engramdb.errors import (
    CorruptFile,
    CorruptManifest,
    EngramDBError,
    SourceChanged,
    SourceError,
    TruncatedFile,
)
from engramdb.layouts.manifest import SourceFile, TableInfo
from engramdb.layouts.view import parse_views

#: Blocks hashed per source file at attach and checked at every open (plus the header).
SAMPLE_BLOCKS = 4
SAMPLE_BYTES = 64 * 1024

__all__ = [
    "atomic_write_bytes",
    "atomic_writer",
    "confined",
    "fsync_dir",
    "mem_available",
    "open_checked",
    "open_held",
    "open_view_files",
    "open_regular",
    "open_shards",
    "open_sources",
    "source_identity",
    "read_regular",
]


def confined(db: Path, rel: str, what: str) -> Path:
    """``db/rel`` after checking that ``rel`` stays inside ``db``: a relative ``/``-separated
    path of plain names, and no directory on the way a symlink or a non-directory.
    `CorruptManifest` for a malformed path, `CorruptFile` for a symlinked directory; a
    missing directory is left to the open (missing file)."""
    if (
        not isinstance(rel, str)
        or not rel
        or "\0" in rel
        or rel.startswith("/")
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise CorruptManifest(
            f"{what}: path {rel!r} is not a relative path of plain names inside the database"
        )
    parts = rel.split("/")
    cur = Path(db)
    for part in parts[:-1]:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except (FileNotFoundError, NotADirectoryError):
            break
        if stat.S_ISLNK(st.st_mode):
            raise CorruptFile(
                f"{what}: {rel!r} passes through the symlink {str(cur)!r}; files must lie "
                "inside the database directory"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptFile(f"{what}: {rel!r}: {str(cur)!r} is not a directory")
    return Path(db) / rel


def open_regular(db: Path, rel: str, what: str) -> tuple[int, int] | None:
    """``(fd, size)`` of the confined regular file ``db/rel`` opened read-only (close-on-exec),
    or None if it is missing. A symlink, FIFO, device, socket or directory is `CorruptFile`
    naming ``what`` and the path."""
    path = confined(db, rel, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptFile(
                f"{what}: {rel!r} is a symlink; only regular files are read"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a device or socket"
            )
            raise CorruptFile(f"{what}: {rel!r} is {kind}, not a regular file")
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(db: Path, rel: str, what: str, *, max_bytes: int) -> bytes | None:
    """The bytes of the confined regular file ``db/rel`` (None if missing); `CorruptFile`
    if it is larger than ``max_bytes`` (checked with ``fstat`` before reading)."""
    opened = open_regular(db, rel, what)
    if opened is None:
        return None
    fd, size = opened
    try:
        if size > max_bytes:
            raise CorruptFile(f"{what}: {rel!r} has {size:,} bytes, at most {max_bytes:,} expected")
        chunks = []
        left = size
        while left > 0:
            b = os.read(fd, left)
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_sized(db: Path, rel: str, what: str) -> tuple[int, int] | None:
    return open_regular(db, rel, what)


def open_checked(db: Path, rel_path: str, expect_bytes: int, what: str) -> int:
    """Open ``db/rel_path`` read-only; its size must equal ``expect_bytes`` (the manifest's).

    ``what`` names the owner in the error (e.g. ``"view 't/v'"``). A missing or short file
    raises `TruncatedFile`, a longer one `CorruptFile`. Returns the fd (the caller closes it).
    """
    opened = _open_sized(db, rel_path, what)
    if opened is None:
        raise TruncatedFile(f"{what}: file {rel_path!r} is missing")
    fd, size = opened
    if size != expect_bytes:
        os.close(fd)
        kind = TruncatedFile if size < expect_bytes else CorruptFile
        raise kind(f"{what}: file {rel_path!r} has {size} bytes, the manifest says {expect_bytes}")
    return fd


def open_held(
    held: Mapping[str, int] | None, db: Path, rel_path: str, expect_bytes: int, what: str
) -> int:
    """`open_checked`, through a descriptor opened earlier when ``held`` has one for
    ``rel_path`` (a new descriptor of that file, duplicated: the caller closes it, ``held``
    keeps its own). The file may have been unlinked since; its size is checked again."""
    fd0 = None if held is None else held.get(rel_path)
    if fd0 is None:
        return open_checked(db, rel_path, expect_bytes, what)
    fd = os.dup(fd0)
    size = os.fstat(fd).st_size
    if size != expect_bytes:
        os.close(fd)
        kind = TruncatedFile if size < expect_bytes else CorruptFile
        raise kind(f"{what}: file {rel_path!r} has {size} bytes, the manifest says {expect_bytes}")
    return fd


def open_view_files(db: Path, info: TableInfo) -> dict[str, int]:
    """Descriptors of the files of every view of ``info`` (path -> fd, each size-checked by
    `open_checked`), so a reader that opens a view later reads the generation the manifest
    named, even once a rebuild's garbage collection has unlinked it. A view whose entry or
    files are bad is left out (opening it raises the error then); on error no fd stays open."""
    try:
        views = parse_views(info)
    except EngramDBError:
        return {}
    held: dict[str, int] = {}
    try:
        for name, entry in views.items():
            mine: dict[str, int] = {}
            try:
                for f in entry.files:
                    mine[f.path] = open_checked(db, f.path, f.bytes, f"view {name!r}")
            except BaseException as exc:
                for fd in mine.values():
                    os.close(fd)
                if isinstance(exc, EngramDBError):
                    continue
                raise
            held.update(mine)
    except BaseException:
        for fd in held.values():
            os.close(fd)
        raise
    return held


#: Offset, length and buffer alignment of the identity check's ``O_DIRECT`` reads.
_DIRECT_ALIGN = 4096


class _AroundCache:
    """Reads of one file for its identity (header and sampled blocks) that leave its page
    cache as it was: ``O_DIRECT`` through a descriptor of its own, over the enclosing
    4 KiB-aligned span; through ``fd`` where the file system refuses ``O_DIRECT``.

    Why: a block read through the page cache stays there as small folios, and a later
    ``populate`` of the file (what ``engramdb warm`` runs) builds its read-ahead into 2 MiB
    folios only up to the first such block; past it the file comes in small folios, which
    mappings map with 4 KiB page-table entries. Measured here on a 3 GiB
    attached tensor evicted, opened (4 sampled 64 KiB blocks) and populated: 990 MB of it
    mapped with 2 MiB entries instead of 2,938 MB, and warm gathers at 0.74-0.77x the
    built copy's, against 1.00-1.09x with these reads (paired, `probes/attach.py --gib 3`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct = -1
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                self.direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | flag)
            except OSError:
                self.direct = -1

    def read(self, offset: int, length: int) -> bytes:
        if self.direct >= 0:
            lo = offset - offset % _DIRECT_ALIGN
            span = -(-(offset + length - lo) // _DIRECT_ALIGN) * _DIRECT_ALIGN
            with mmap.mmap(-1, span) as buf:  # page-aligned
                try:
                    got = os.preadv(self.direct, [buf], lo)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    os.close(self.direct)  # refused after all: through the page cache
                    self.direct = -1
                else:
                    at = offset - lo
                    return bytes(buf[at : max(at, min(got, at + length))])
        return os.pread(self.fd, length, offset)

    def hash(self, offset: int, length: int) -> str:
        data = self.read(offset, length)
        if len(data) != length:
            raise TruncatedFile(f"short read of {length} bytes at {offset}")
        return xxhash.xxh3_64_hexdigest(data)

    def close(self) -> None:
        if self.direct >= 0:
            os.close(self.direct)
            self.direct = -1


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
    reads = _AroundCache(fd)
    try:
        st = os.fstat(fd)
        head = reads.hash(0, header_bytes) if header_bytes else ""
        samples = tuple(
            (o, n, reads.hash(o, n)) for o, n in _sample_spans(st.st_size, header_bytes)
        )
    finally:
        reads.close()
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
    header and `SAMPLE_BLOCKS` small reads, around the page cache (`_AroundCache`)."""
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
    if not changed:
        with closing(_AroundCache(fd)) as reads:
            if sf.header_bytes and reads.hash(0, sf.header_bytes) != sf.header_xxh3:
                changed.append("safetensors header bytes")
            else:
                bad = [o for o, n, h in sf.samples if reads.hash(o, n) != h]
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
            opened = _open_sized(db, s.path, f"table {info.name!r}: shard")
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
