"""The reader side of ``engramdb index``: `load_index` and `TableIndex`.

``DB/<table>/index/`` holds ``hot.zst``, ``keys.zst`` and ``index.json`` (format in
``docs/keygen.md``); `engramdb.build.index` writes them. `pick_table` is the table choice
both sides share.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from engramdb.disk.files import open_regular, read_regular
from engramdb.disk.publish import read_manifest
from engramdb.errors import (
    ChecksumMismatch,
    CorruptFile,
    IndexNotFound,
    InvalidArgument,
    TableNotFound,
    TruncatedFile,
)
from engramdb.layouts.manifest import Manifest, TableInfo

__all__ = ["FORMAT", "VERSION", "TableIndex", "load_index", "pick_table", "read_index_meta"]

FORMAT = "engramdb-index"
VERSION = 1


@dataclass(frozen=True)
class TableIndex:
    """An index read back: ``hot_rows`` / ``hot_counts`` (most frequent first, ties by row id)
    and ``keys`` (int64 ``[K, max_ngram]``, first access first) / ``key_counts``."""

    meta: dict[str, Any]
    hot_rows: np.ndarray
    hot_counts: np.ndarray
    keys: np.ndarray
    key_counts: np.ndarray = field(repr=False)


def pick_table(manifest: Manifest, table: str | None, db: Path) -> TableInfo:
    """The table an index is for: ``table``, or the database's only table when None."""
    tables = manifest.tables
    if table is None:
        if len(tables) != 1:
            raise InvalidArgument(f"{db} has tables {sorted(tables)}: pass table=")
        table = next(iter(tables))
    if table not in tables:
        raise TableNotFound(f"no table {table!r} in {db}; tables are {sorted(tables)}")
    return tables[table]


#: Largest ``index.json`` read (it holds counts and names, a few KiB).
MAX_INDEX_JSON_BYTES = 1 << 20
#: The most raw bytes one compressed byte of a zstd frame can stand for: a block inflates to
#: at most 128 KiB and takes at least 4 bytes (an RLE block: a 3-byte header and its byte).
#: A declared size above ``file bytes x MAX_ZSTD_RATIO`` cannot be true; it is refused
#: before anything is allocated for it.
MAX_ZSTD_RATIO = 32768


def _field(doc: Any, path: str, typ: type | tuple[type, ...], where: str) -> Any:
    """``doc[a][b]...`` for ``path`` ``"a.b"``, of type ``typ`` (bool is never an int);
    `CorruptFile` naming the field otherwise."""
    cur = doc
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise CorruptFile(f"{where}: field {path!r} is missing")
        cur = cur[key]
    ok = isinstance(cur, typ) and not (isinstance(cur, bool) and bool not in _types(typ))
    if not ok:
        raise CorruptFile(
            f"{where}: field {path!r} must be {_names(typ)}, got {type(cur).__name__}"
        )
    if isinstance(cur, int) and not isinstance(cur, bool) and cur < 0:
        raise CorruptFile(f"{where}: field {path!r} must be >= 0, got {cur}")
    return cur


def _types(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def _names(typ: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _types(typ))


def _read_arrays(
    db: Path,
    index_dir: str,
    meta: dict[str, Any],
    part: str,
    layout: list[tuple[np.dtype, tuple[int, ...]]],
) -> list[np.ndarray]:
    where = f"{index_dir}/index.json"
    name = _field(meta, f"{part}.file", str, where)
    if "/" in name or name in ("", ".", ".."):
        raise CorruptFile(f"{where}: field {part + '.file'!r} {name!r} is not a file name")
    size = _field(meta, f"{part}.bytes", int, where)
    raw_bytes = _field(meta, f"{part}.raw_bytes", int, where)
    digest_want = _field(meta, f"{part}.xxh3_64", str, where)
    if raw_bytes > size * MAX_ZSTD_RATIO:
        raise CorruptFile(
            f"{where}: {part}.raw_bytes {raw_bytes} exceeds what {size} compressed bytes can "
            f"hold (x{MAX_ZSTD_RATIO}, zstd's largest ratio)"
        )
    rel = f"{index_dir}/{name}"
    # confined to the database, a regular file, its size checked before a byte is read
    opened = open_regular(db, rel, f"index file {part}")
    if opened is None:
        raise TruncatedFile(f"{rel}: missing (index.json lists it)")
    fd, actual = opened
    try:
        if actual != size:
            raise TruncatedFile(f"{rel}: {actual} bytes, index.json says {size}")
        with open(fd, "rb", closefd=False) as f:
            blob = f.read(size + 1)
    finally:
        os.close(fd)
    if len(blob) != size:
        raise TruncatedFile(f"{rel}: {len(blob)} bytes, index.json says {size}")
    digest = xxhash.xxh3_64_hexdigest(blob)
    if digest != digest_want:
        raise ChecksumMismatch(f"{rel}: xxh3-64 {digest} differs from index.json {digest_want}")
    want = sum(dt.itemsize * math.prod(shape) for dt, shape in layout)
    if raw_bytes != want:
        raise CorruptFile(f"{where}: {part}.raw_bytes is {raw_bytes}, its rows need {want}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=raw_bytes)
    except zstandard.ZstdError as exc:
        raise CorruptFile(f"{rel}: zstd frame does not decode ({exc})") from exc
    if len(raw) != want:
        raise CorruptFile(f"{rel}: {len(raw)} raw bytes, expected {want}")
    out, pos = [], 0
    for dt, shape in layout:
        n = dt.itemsize * math.prod(shape)
        out.append(np.frombuffer(raw, dtype=dt, count=math.prod(shape), offset=pos).reshape(shape))
        pos += n
    return out


def read_index_meta(db: Path, table: str) -> dict[str, Any] | None:
    """The parsed ``index.json`` of ``table`` (None if the table has none): a confined regular
    file of at most `MAX_INDEX_JSON_BYTES`, a JSON object of this format and version;
    `CorruptFile` naming what is wrong otherwise."""
    rel = f"{table}/index/index.json"
    text = read_regular(db, rel, "index", max_bytes=MAX_INDEX_JSON_BYTES)
    if text is None:
        return None
    if text.count(b"[") + text.count(b"{") > 10_000:
        raise CorruptFile(f"{rel}: nests or lists more containers than an index holds")
    try:
        meta = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptFile(f"{rel}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CorruptFile(f"{rel}: must be a JSON object, got {type(meta).__name__}")
    version = meta.get("version")
    if meta.get("format") != FORMAT or type(version) is not int or version != VERSION:
        raise CorruptFile(f"{rel}: not an {FORMAT} v{VERSION} file (fields format, version)")
    return meta


def load_index(db_path: str | os.PathLike[str], table: str) -> TableIndex:
    """Read and verify (types, sizes, xxh3-64) the index of ``table``. Reads and inflates
    both files; every malformed field is a `CorruptFile` naming it.

    A republish switches the whole index directory at once, but this reader reads
    ``index.json`` and then the data files by path: one that ran across a switch read an old
    ``index.json`` and new files (a size or checksum error). When the read fails and
    ``index.json`` has changed since, it is read once more against the new one."""
    db = Path(db_path)
    info = pick_table(read_manifest(db), table, db)
    meta = read_index_meta(db, table)
    try:
        return _load(db, info, table, meta)
    except (TruncatedFile, ChecksumMismatch, CorruptFile):
        again = read_index_meta(db, table)
        if again == meta:
            raise
    return _load(db, info, table, again)


def _load(db: Path, info: TableInfo, table: str, meta: dict[str, Any] | None) -> TableIndex:
    if meta is None:
        raise IndexNotFound(
            f"table {table!r} in {db} has no index (run `engramdb index {db} CORPUS --preset P`)"
        )
    where = f"{table}/index/index.json"
    n_hot = _field(meta, "hot.rows", int, where)
    if n_hot > info.n_rows:
        raise CorruptFile(
            f"{where}: field 'hot.rows' is {n_hot}, more than the table's {info.n_rows} rows"
        )
    hot_rows, hot_counts = _read_arrays(
        db,
        f"{table}/index",
        meta,
        "hot",
        [(np.dtype("<i8"), (n_hot,)), (np.dtype("<u8"), (n_hot,))],
    )
    n_keys = _field(meta, "keys.keys", int, where)
    width = _field(meta, "keys.width", int, where)
    keys, key_counts = _read_arrays(
        db,
        f"{table}/index",
        meta,
        "keys",
        [(np.dtype("<i8"), (n_keys, width)), (np.dtype("<u8"), (n_keys,))],
    )
    return TableIndex(
        meta=meta, hot_rows=hot_rows, hot_counts=hot_counts, keys=keys, key_counts=key_counts
    )
