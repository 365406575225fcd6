"""Publication: the writer lock, the manifest (the one reader, atomic writes), staging
directories and garbage collection.

The protocol (docs/format.md): a writer takes `database_lock`, writes its files into a
hidden staging directory (`new_staging_dir`), fsyncs and renames them into place (still
unreferenced, so invisible), then commits by `write_manifest` (temp file, fsync, rename,
directory fsync) and finally `collect_garbage` removes what the manifest no longer names.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engramdb._durable import fsync_dir
from engramdb.disk.files import open_regular
from engramdb.errors import CorruptFile, CorruptManifest, DatabaseNotFound, EngramDBError
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
    "gc",
    "leftovers",
    "new_generation_id",
    "new_staging_dir",
    "publish_dir",
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
    path = Path(db) / LOCK_NAME
    try:
        # never through a symlink: the writer must not create or lock a file outside the DB
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptFile(
                f"{str(path)!r} is a symlink; the writer lock must be a regular file inside the "
                "database directory"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptFile(f"{str(path)!r} is not a regular file; cannot use it as the lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _manifest_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``<path>/manifest.json``, refused above `MAX_MANIFEST_BYTES`."""
    opened = open_regular(Path(path), MANIFEST_NAME, "manifest")  # no symlink, no FIFO
    if opened is None:
        raise FileNotFoundError(MANIFEST_NAME)
    with builtins.open(opened[0], "rb", closefd=True) as f:
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
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, EngramDBError) or e.errno is None:
            raise
        raise OSError(e.errno, f"{e.strerror or e} while writing the manifest ({tmp.name})") from e
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


_RENAME_EXCHANGE = 2


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swap the directories ``a`` and ``b`` (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``). False where the kernel or libc lacks it."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(staging: Path, target: Path) -> None:
    """Make the complete, fsynced directory ``staging`` visible as ``target`` in one atomic
    step: a plain ``rename`` when ``target`` does not exist, else an atomic exchange
    (``renameat2(RENAME_EXCHANGE)``) after which the previous directory, now at ``staging``,
    is removed. Readers see the old set of files or the new one, never a mix. (Where the
    exchange is unavailable, the old directory is moved aside first: a reader in that
    instant finds no directory, never a mixed one.) Call with the database lock held."""
    staging, target = Path(staging), Path(target)
    if target.is_symlink():
        raise CorruptFile(f"{str(target)!r} is a symlink; refusing to publish through it")
    if not target.exists():
        os.rename(staging, target)
    elif _renameat2_exchange(staging, target):
        pass
    else:
        aside = staging.with_name(staging.name + "-old")
        os.rename(target, aside)
        os.rename(staging, target)
        staging = aside
    fsync_dir(target.parent)
    if staging.exists():
        _remove_tree(staging)


def _real_dirs(d: Path) -> list[Path]:
    """The real (not symlinked) subdirectories of ``d``: garbage collection never descends
    into, or deletes through, a symlink (it may point outside the database)."""
    try:
        with os.scandir(d) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_tree(path: Path) -> None:
    """Remove the real directory ``path`` (``shutil.rmtree`` unlinks symlinks inside it, never
    follows them); a symlink in its place is left alone."""
    if os.path.islink(path):
        return
    shutil.rmtree(path, ignore_errors=True)


def leftovers(db: Path, manifest: Manifest) -> list[tuple[str, int]]:
    """What garbage collection would remove: ``(relative path, bytes)`` of every staging
    directory, unreferenced generation, view staging directory and manifest temp file (the
    traces of killed or finished writers). Symlinks are neither followed nor listed."""
    db = Path(db)
    found = _stale_generations(db, manifest)
    for tdir in _table_dirs(db):
        found.extend(st for st in _real_dirs(tdir / "views") if st.name.startswith(STAGING_PREFIX))
    found.extend(_manifest_temps(db))
    return [(str(p.relative_to(db)), _tree_bytes(p)) for p in sorted(found)]


def gc(db: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """``engramdb gc``: under the writer lock, remove what killed or finished writers left
    (`leftovers`: staging directories, replaced generations, manifest temp files; and view
    files the manifest no longer names). Returns what was removed, ``(path, bytes)``. Safe
    while readers run: nothing a manifest names is touched, and an open `Database` keeps
    descriptors of the files it serves."""
    db = Path(db)
    with database_lock(db):
        manifest = read_manifest(db)
        found = leftovers(db, manifest)
        collect_garbage(db, manifest)
    return found


def _tree_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return os.lstat(path).st_size
    total = 0
    for root, _dirs, files in os.walk(path):  # os.walk does not follow symlinks
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _referenced_generations(manifest: Manifest) -> set[str]:
    referenced: set[str] = set()
    for t in manifest.tables.values():
        for s in t.shards:
            referenced.add(s.path.rsplit("/", 1)[0])
    return referenced


def _table_dirs(db: Path) -> list[Path]:
    """The table directories of ``db`` (real directories, not hidden)."""
    return [d for d in _real_dirs(db) if not d.name.startswith(".")]


def _stale_generations(db: Path, manifest: Manifest) -> list[Path]:
    """Generation and staging directories of every table that ``manifest`` does not name."""
    referenced = _referenced_generations(manifest)
    return [
        gen
        for tdir in _table_dirs(db)
        for gen in _real_dirs(tdir)
        if (gen.name.startswith("g-") or gen.name.startswith(STAGING_PREFIX))
        and f"{tdir.name}/{gen.name}" not in referenced
    ]


def _manifest_temps(db: Path) -> list[Path]:
    """Manifest temp files killed writers left (symlinks excluded)."""
    return [p for p in db.glob(f".{MANIFEST_NAME}.tmp-*") if not p.is_symlink()]


def _collect_table_garbage(db: Path, manifest: Manifest) -> None:
    for gen in _stale_generations(db, manifest):
        _remove_tree(gen)
    for tdir in _table_dirs(db):
        if tdir.name not in manifest.tables and not any(tdir.iterdir()):
            tdir.rmdir()
    for tmp in _manifest_temps(db):
        tmp.unlink(missing_ok=True)


def _collect_view_garbage(db: Path, manifest: Manifest) -> None:
    for name, info in manifest.tables.items():
        vdir = db / name / "views"
        if vdir.is_symlink() or not vdir.is_dir() or (db / name).is_symlink():
            continue
        try:
            named = {f.path for e in parse_views(info).values() for f in e.files}
        except EngramDBError:
            continue  # never delete on the word of a manifest we cannot read
        for p in vdir.iterdir():
            rel = f"{name}/views/{p.name}"
            if p.is_symlink():
                continue  # never deleted through, never followed
            if p.is_dir() and p.name.startswith(STAGING_PREFIX):
                _remove_tree(p)
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
