"""Durability primitives below every layer: directory fsync and atomic file replacement.

This module imports only the standard library, so both `engramdb.keygen` (which sits below
`engramdb.disk` in the layer map) and `engramdb.disk` can use it. `engramdb.disk.files`
re-exports these names: writers above keygen import them from there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """fsync a directory so renames and creations in it are durable.

    ``strict`` (the database writers): errors propagate. ``strict=False`` (caches such as
    token maps): a directory that cannot be opened or synced is silently skipped.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Yield a binary file that replaces ``path`` only if the block finishes without error.

    Readers see either the old file or the complete new one, never a prefix: the data is
    written to a temp file beside ``path``, fsynced, renamed over it, and the directory is
    fsynced (best effort) so the rename survives a crash.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(target.parent, strict=False)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically (see `atomic_writer`)."""
    with atomic_writer(path) as fh:
        fh.write(data)
