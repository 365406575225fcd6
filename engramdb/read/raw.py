"""Raw row shards: a directory of ``shard_{i:03d}.bin`` files with no header, read in place.

This is the layout of the published EngramDB Python API (``Store(path, shards,
rows_per_shard, width)``): row ``r`` lives in shard ``r // rows_per_shard`` at byte
``(r % rows_per_shard) * width``. Nothing is copied or converted; `raw_layout` describes the
files in memory as a `TableInfo` (no manifest is written) that a `Store` opens with every
read path of a built table:

* shards that map back to back (one shard, or every shard a whole number of 4 KiB pages):
  a built table's description, its shards the files themselves (one mapping, the page-cache
  and RSS budgets of a built table);
* any other geometry (e.g. the Qwen PLE one, 2,500,012 rows x 160 B = 400,001,920 B per
  shard, not a page multiple): an *attached* table (``docs/format.md`` section 6), one
  column of ``width`` bytes held by one run per shard file at offset 0, each file's
  identity recorded as `engramdb.attach` records it and checked at open. The rows are read
  through `engramdb.read.attached.SourceSegments` (one mapping per file; gathers grouped by
  shard, never a loop per row).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.disk.files import source_identity
from engramdb.errors import CorruptFile, InvalidArgument, TruncatedFile
from engramdb.layouts.geometry import PAGE, TableGeometry, plan_geometry
from engramdb.layouts.manifest import Attached, ShardInfo, SourceColumn, SourceRun, TableInfo

__all__ = ["raw_layout", "raw_shard_name"]


def raw_shard_name(i: int) -> str:
    """File name of raw shard ``i``: ``shard_000.bin``, ``shard_001.bin``, …"""
    return f"shard_{i:03d}.bin"


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def raw_layout(
    path: str | os.PathLike[str],
    shards: int,
    rows_per_shard: int,
    width: int,
    *,
    name: str | None = None,
    dtype: str = "u8",
    dim: int | None = None,
    heads: Any = None,
) -> TableInfo:
    """Describe the raw shards under ``path`` as a `TableInfo` a `Store` opens (see the
    module docstring: a built table's description when the shards map back to back, else an
    attached one).

    Every shard but the last must hold exactly ``rows_per_shard * width`` bytes (shorter:
    `TruncatedFile`, naming the first missing row); the last may be shorter but must be a
    whole number of rows and no longer (else `CorruptFile`). ``heads`` (per-head row counts)
    defaults to one head over all rows. ``dtype``/``dim`` are the row's dtype hint."""
    root = Path(path)
    shards = _positive("shards", shards)
    rows_per_shard = _positive("rows_per_shard", rows_per_shard)
    width = _positive("width", width)
    if not root.is_dir():
        raise InvalidArgument(f"raw shard directory {str(root)!r} does not exist")
    full = rows_per_shard * width
    entries: list[ShardInfo] = []
    n_rows = 0
    for i in range(shards):
        fname = raw_shard_name(i)
        try:
            size = os.stat(root / fname).st_size
        except FileNotFoundError:
            raise TruncatedFile(
                f"raw shard {fname!r} is missing in {str(root)!r} (rows from "
                f"{i * rows_per_shard} are missing)"
            ) from None
        if size > full:
            raise CorruptFile(f"raw shard {fname!r} has {size} bytes, more than {full}")
        if i < shards - 1 and size < full:
            raise TruncatedFile(
                f"raw shard {fname!r} is truncated: {size} bytes of {full} (rows from "
                f"{i * rows_per_shard + size // width} are missing)"
            )
        if size % width:
            raise CorruptFile(f"raw shard {fname!r}: {size} bytes is not a multiple of {width}")
        rows = size // width
        entries.append(ShardInfo(path=fname, bytes=size, xxh3_64="", first_row=n_rows, rows=rows))
        n_rows += rows
    head_rows = (n_rows,) if heads is None else tuple(int(h) for h in np.asarray(heads).ravel())
    if sum(head_rows) > n_rows:
        raise InvalidArgument(f"heads sum to {sum(head_rows)} rows, the shards hold {n_rows}")
    provenance = {"kind": "raw-shards", "shards": shards, "rows_per_shard": rows_per_shard}
    common: dict[str, Any] = {
        "name": name or root.name or "raw",
        "row_bytes": width,
        "heads": head_rows,
        "dtype": dtype,
        "dim": dim,
    }
    if shards == 1 or full % PAGE == 0:
        # The geometry a built table would have: badges that tile pages; the back-to-back
        # mapping holds row r at r * width.
        rpb = math.lcm(width, PAGE) // width
        rps = rows_per_shard if full % PAGE == 0 else rpb * max(1, -(-n_rows // rpb))
        geometry = TableGeometry(
            n_rows=n_rows, row_bytes=width, rows_per_badge=rpb, rows_per_shard=rps
        )
        return TableInfo(**common, geometry=geometry, shards=tuple(entries), provenance=provenance)
    return _attached(root, entries, n_rows, common, provenance)


def _attached(
    root: Path,
    entries: list[ShardInfo],
    n_rows: int,
    common: dict[str, Any],
    provenance: dict[str, Any],
) -> TableInfo:
    """The attached description of shards that do not map back to back: one run per
    non-empty shard file (offset 0), each file's identity as `attach` records it."""
    used = [e for e in entries if e.rows]
    files = tuple(source_identity(str((root / e.path).resolve()), 0) for e in used)
    runs = tuple(SourceRun(i, 0, e.rows, None) for i, e in enumerate(used))
    sources = tuple(
        {"first_row": e.first_row, "rows": e.rows, "file": f.path, "tensor": None, "offset": 0}
        for e, f in zip(used, files)
    )
    return TableInfo(
        **common,
        geometry=plan_geometry(n_rows, common["row_bytes"]),
        shards=(),
        sources=sources,
        provenance={**provenance, "attached": True},
        attached=Attached(files=files, columns=(SourceColumn(common["row_bytes"], runs),)),
    )
