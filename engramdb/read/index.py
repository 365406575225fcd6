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

from engramdb.disk.publish import read_manifest
from engramdb.errors import (
    ChecksumMismatch,
    CorruptFile,
    InvalidArgument,
    TableNotFound,
    TruncatedFile,
)
from engramdb.layouts.manifest import Manifest, TableInfo

__all__ = ["FORMAT", "VERSION", "TableIndex", "load_index", "pick_table"]

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


def _read_arrays(
    path: Path, meta: dict[str, Any], layout: list[tuple[np.dtype, tuple[int, ...]]]
) -> list[np.ndarray]:
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise TruncatedFile(f"{path}: missing (index.json lists it)") from None
    if len(blob) != meta.get("bytes"):
        raise TruncatedFile(f"{path}: {len(blob)} bytes, index.json says {meta.get('bytes')}")
    digest = xxhash.xxh3_64_hexdigest(blob)
    if digest != meta.get("xxh3_64"):
        raise ChecksumMismatch(
            f"{path}: xxh3-64 {digest} differs from index.json {meta.get('xxh3_64')}"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=int(meta["raw_bytes"]))
    except zstandard.ZstdError as exc:
        raise CorruptFile(f"{path}: zstd frame does not decode ({exc})") from exc
    want = sum(dt.itemsize * math.prod(shape) for dt, shape in layout)
    if len(raw) != want:
        raise CorruptFile(f"{path}: {len(raw)} raw bytes, expected {want}")
    out, pos = [], 0
    for dt, shape in layout:
        n = dt.itemsize * math.prod(shape)
        out.append(np.frombuffer(raw, dtype=dt, count=math.prod(shape), offset=pos).reshape(shape))
        pos += n
    return out


def load_index(db_path: str | os.PathLike[str], table: str) -> TableIndex:
    """Read and verify (sizes, xxh3-64) the index of ``table``. Reads and inflates both files."""
    db = Path(db_path)
    pick_table(read_manifest(db), table, db)
    out_dir = db / table / "index"
    meta_path = out_dir / "index.json"
    if not meta_path.is_file():
        raise TableNotFound(f"table {table!r} in {db} has no index (run `engramdb index`)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptFile(f"{meta_path}: not valid JSON ({exc})") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CorruptFile(f"{meta_path}: not an {FORMAT} v{VERSION} file")
    n_hot = int(meta["hot"]["rows"])
    hot_rows, hot_counts = _read_arrays(
        out_dir / meta["hot"]["file"],
        meta["hot"],
        [(np.dtype("<i8"), (n_hot,)), (np.dtype("<u8"), (n_hot,))],
    )
    n_keys, width = int(meta["keys"]["keys"]), int(meta["keys"]["width"])
    keys, key_counts = _read_arrays(
        out_dir / meta["keys"]["file"],
        meta["keys"],
        [(np.dtype("<i8"), (n_keys, width)), (np.dtype("<u8"), (n_keys,))],
    )
    return TableIndex(
        meta=meta, hot_rows=hot_rows, hot_counts=hot_counts, keys=keys, key_counts=key_counts
    )
