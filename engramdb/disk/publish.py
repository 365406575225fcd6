"""Publication: the writer lock, the manifest (the one reader, atomic writes), staging
directories and garbage collection.

The protocol (docs/format.md): a writer takes `database_lock`, writes its files into a
hidden staging directory (`new_staging_dir`), fsyncs and renames them into place (still
unreferenced, so invisible), then commits by `write_manifest` (temp file, fsync, rename,
directory fsync) and finally `collect_garbage` removes what the manifest no longer names.
"""

from __future__ import annotations

import builtins
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engramdb._durable import fsync_dir
from engramdb.errors import CorruptManifest, DatabaseNotFound, EngramDBError
from engramdb.layouts.manifest import (
    EMPTY,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    parse_manifest,
)
from engramdb.layouts.view import parse_views

__all__ = [
    "LOCK_NAME",
    "STAGING_PREFIX",
    "collect_garbage",
    "database_lock",
    "new_generation_id",
    "new_staging_dir",
    "read_manifest",
    "read_manifest_or_empty",
    "write_manifest",
]

LOCK_NAME = ".lock"
#: Name prefix of a directory being written; never referenced by a manifest.
STAGING_PREFIX = ".staging-"


@contextmanager
def database_lock(db: Path) -> Iterator[None]:
    """Exclusive writer lock on a database directory (blocks until free)."""
    fd = os.open(Path(db) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _manifest_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``<path>/manifest.json``, refused above `MAX_MANIFEST_BYTES`."""
    with builtins.open(Path(path) / MANIFEST_NAME, "rb") as f:
        text = f.read(MAX_MANIFEST_BYTES + 1)
    if len(text) > MAX_MANIFEST_BYTES:
        raise CorruptManifest(f"manifest of {str(path)!r} exceeds {MAX_MANIFEST_BYTES} bytes")
    return text


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse ``<path>/manifest.json``; `DatabaseNotFound` if there is none.

    The one manifest reader: the size cap, then `parse_manifest` (`CorruptManifest` on any
    violation). Reads one small file."""
    try:
        text = _manifest_bytes(path)
    except (FileNotFoundError, NotADirectoryError):
        raise DatabaseNotFound(
            f"no EngramDB database at {str(path)!r} (no {MANIFEST_NAME})"
        ) from None
    return parse_manifest(text)


def read_manifest_or_empty(db: str | os.PathLike[str]) -> Manifest:
    """`read_manifest`, but a directory without a manifest is an empty database (writers)."""
    try:
        text = _manifest_bytes(db)
    except FileNotFoundError:
        return EMPTY
    return parse_manifest(text)


def write_manifest(db: Path, manifest: Manifest) -> None:
    """Atomically replace ``manifest.json`` (temp file + fsync + rename + dir fsync).

    The rename is the commit point of every writer."""
    db = Path(db)
    tmp = db / f".{MANIFEST_NAME}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, db / MANIFEST_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(db)


def new_generation_id() -> str:
    """A fresh, time-ordered id for a generation directory: ``YYYYmmddTHHMMSS-<8 hex>``."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def new_staging_dir(parent: Path, tag: str) -> Path:
    """Create and return ``parent/.staging-<tag>`` (``parent`` is created if missing).

    Hidden and never named by a manifest, so readers cannot see it; `collect_garbage`
    removes it if the writer dies. Raises `FileExistsError` if it exists already."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f"{STAGING_PREFIX}{tag}"
    staging.mkdir()
    return staging


def _collect_table_garbage(db: Path, manifest: Manifest) -> None:
    referenced: set[str] = set()
    for t in manifest.tables.values():
        for s in t.shards:
            referenced.add(s.path.rsplit("/", 1)[0])
    for tdir in db.iterdir():
        if not tdir.is_dir() or tdir.name.startswith("."):
            continue
        for gen in tdir.iterdir():
            if gen.is_dir() and (gen.name.startswith("g-") or gen.name.startswith(STAGING_PREFIX)):
                if f"{tdir.name}/{gen.name}" not in referenced:
                    shutil.rmtree(gen, ignore_errors=True)
        if tdir.name not in manifest.tables and not any(tdir.iterdir()):
            tdir.rmdir()
    for tmp in db.glob(f".{MANIFEST_NAME}.tmp-*"):
        tmp.unlink(missing_ok=True)


def _collect_view_garbage(db: Path, manifest: Manifest) -> None:
    for name, info in manifest.tables.items():
        vdir = db / name / "views"
        if not vdir.is_dir():
            continue
        try:
            named = {f.path for e in parse_views(info).values() for f in e.files}
        except EngramDBError:
            continue  # never delete on the word of a manifest we cannot read
        for p in vdir.iterdir():
            rel = f"{name}/views/{p.name}"
            if p.is_dir() and p.name.startswith(STAGING_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file() and rel not in named:
                p.unlink(missing_ok=True)


def collect_garbage(
    db: Path, manifest: Manifest, *, tables: bool = True, views: bool = True
) -> None:
    """Remove what ``manifest`` does not name: table generation and staging directories,
    leftover manifest temp files, view files and view staging directories.

    Only call with the database lock held: an in-flight build's staging directory would
    otherwise be removed under it. ``tables`` / ``views`` restrict the sweep to one kind."""
    db = Path(db)
    if tables:
        _collect_table_garbage(db, manifest)
    if views:
        _collect_view_garbage(db, manifest)
