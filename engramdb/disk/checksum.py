"""Checksums: hashing while writing, checking against the manifest, and the one `Problem`.

Every file the manifest names carries the xxh3-64 of its whole content and of each
`CHECK_BLOCK_BYTES` block (the last block may be short), so a checker can name the damaged
byte range. `BlockHasher` computes both in one pass; `HashedWriter` writes a new file through
it; `check_file` re-reads a file and reports `Problem`s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from engramdb.disk.files import open_regular
from engramdb.errors import EngramDBError
from engramdb.layouts.manifest import CHECK_BLOCK_BYTES, FileEntry

__all__ = ["BlockHasher", "HashedWriter", "HashingFile", "Problem", "check_file"]

#: Read size of `check_file` (one buffer, reused).
CHECK_READ_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Problem:
    """One thing a checker found wrong, with the file's byte range ``[start, end)``.

    ``file`` is the path the manifest names (relative to the database). ``view`` is the view's
    name for a view's file or slot, None for a table's shard. Construct view problems with
    keywords (``view=`` comes last)."""

    table: str
    file: str
    start: int
    end: int
    what: str
    view: str | None = None

    @property
    def shard(self) -> str:
        """The shard's path (a table problem's ``file``)."""
        return self.file

    def line(self) -> str:
        """One line for a human: what, where, which bytes."""
        if self.view is None and "/index" in self.file:
            return f"table {self.table!r} index {self.file!r}: {self.what}"
        if self.view is None:
            return (
                f"table {self.table!r} shard {self.file!r} bytes [{self.start}, {self.end}): "
                f"{self.what}"
            )
        return (
            f"table {self.table!r} view {self.view!r} file {self.file!r} bytes "
            f"[{self.start}, {self.end}): {self.what}"
        )


class BlockHasher:
    """xxh3-64 of a byte stream and of each `CHECK_BLOCK_BYTES` block of it.

    ``update`` with any amount of data; ``block_left`` says how many bytes finish the current
    block (a writer that wants to cut at block ends can bound its chunks with it)."""

    def __init__(self) -> None:
        self._whole = xxhash.xxh3_64()
        self._block = xxhash.xxh3_64()
        self.block_left = CHECK_BLOCK_BYTES
        self.blocks: list[str] = []
        self.size = 0

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self._whole.update(mv)
        self.size += len(mv)
        while len(mv):
            n = min(len(mv), self.block_left)
            self._block.update(mv[:n])
            self.block_left -= n
            if self.block_left == 0:
                self.blocks.append(self._block.hexdigest())
                self._block = xxhash.xxh3_64()
                self.block_left = CHECK_BLOCK_BYTES
            mv = mv[n:]

    def finish(self) -> tuple[str, tuple[str, ...]]:
        """``(whole-file hex digest, block hex digests)``; closes the short last block."""
        if self.block_left != CHECK_BLOCK_BYTES:
            self.blocks.append(self._block.hexdigest())
            self._block = xxhash.xxh3_64()
            self.block_left = CHECK_BLOCK_BYTES
        return self._whole.hexdigest(), tuple(self.blocks)


class HashedWriter:
    """A new file written front to back (``O_EXCL``), hashed as it goes.

    ``write`` any buffer; ``finish(rel_path)`` fsyncs, closes and returns the file's
    `FileEntry` (for the manifest, once the file is at ``rel_path``); ``abort`` closes
    without syncing (the caller removes the staging directory)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._hash = BlockHasher()

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._hash.size

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self._hash.update(mv)
        done = 0
        while done < len(mv):
            done += os.write(self._fd, mv[done:])

    def finish(self, rel_path: str) -> FileEntry:
        """fsync and close; the manifest entry for the file once it is at ``rel_path``."""
        digest, blocks = self._hash.finish()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        return FileEntry(rel_path, self._hash.size, digest, blocks)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HashingFile:
    """A write-through wrapper of a binary file: the xxh3-64 and size of exactly the bytes
    written through it (for files whose checksum lives in their own metadata, e.g. the
    index's ``.zst`` files; no per-block hashes)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self._hash = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: Any) -> int:
        self._hash.update(data)
        n = self.fh.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        self.fh.flush()

    def hexdigest(self) -> str:
        """xxh3-64 of the bytes written so far (16 hex digits)."""
        return self._hash.hexdigest()


def check_file(
    db: Path,
    entry: FileEntry,
    what: str,
    *,
    table: str,
    view: str | None = None,
    full: bool = True,
    progress: Callable[[int], None] | None = None,
    fd: int | None = None,
) -> list[Problem]:
    """Check ``db/entry.path`` against its manifest entry; the problems found (empty: intact).

    ``what`` names the file in the "missing" problem (``"shard file"``, ``"file"``);
    ``table`` / ``view`` go into each `Problem`. Checks existence and size, then with
    ``full`` (the default) recomputes the xxh3-64 of each block and of the whole file.
    ``progress`` is called with each read's byte count. Cost: one sequential read of the
    file with one 8 MiB buffer. ``fd``: the file already opened by the caller (an attached
    table's source, outside the database: identity-checked, not confined), read through a
    duplicate so the caller's descriptor stays open."""

    def problem(start: int, end: int, text: str) -> Problem:
        return Problem(table, entry.path, start, end, text, view=view)

    if fd is not None:
        opened: tuple[int, int] | None = (os.dup(fd), os.fstat(fd).st_size)
    else:
        try:
            opened = open_regular(Path(db), entry.path, what)
        except EngramDBError as e:  # a symlink, FIFO, directory, or a path leaving the database
            return [problem(0, entry.bytes, str(e))]
    if opened is None:
        return [problem(0, entry.bytes, f"{what} is missing")]
    f = open(opened[0], "rb", buffering=0, closefd=True)
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.bytes:
            return [
                problem(
                    min(size, entry.bytes),
                    max(size, entry.bytes),
                    f"size is {size}, manifest says {entry.bytes}",
                )
            ]
        if not full:
            return []
        found: list[Problem] = []
        whole, block = xxhash.xxh3_64(), xxhash.xxh3_64()
        buf = memoryview(bytearray(CHECK_READ_BYTES))
        pos = block_start = index = 0
        blocks = entry.blocks
        while pos < size:
            want = min(CHECK_READ_BYTES, size - pos, block_start + CHECK_BLOCK_BYTES - pos)
            n = f.readinto(buf[:want])
            if not n:
                return found + [problem(pos, size, "unexpected end of file")]
            whole.update(buf[:n])
            block.update(buf[:n])
            pos += n
            if progress is not None:
                progress(n)
            if pos - block_start == CHECK_BLOCK_BYTES or pos == size:
                if blocks and index < len(blocks) and block.hexdigest() != blocks[index]:
                    found.append(problem(block_start, pos, "block checksum mismatch"))
                block, block_start, index = xxhash.xxh3_64(), pos, index + 1
        if whole.hexdigest() != entry.xxh3_64 and not found:
            found.append(
                problem(0, size, f"xxh3-64 is {whole.hexdigest()}, manifest says {entry.xxh3_64}")
            )
        return found
