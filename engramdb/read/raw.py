"""Raw row shards: a directory of ``shard_{i:03d}.bin`` files with no header, read in place.

This is the layout of the published EngramDB Python API (``Store(path, shards,
rows_per_shard, width)``): row ``r`` lives in shard ``r // rows_per_shard`` at byte
``(r % rows_per_shard) * width``. Nothing is copied or converted; the files are described in
memory as a table.

* `raw_shard_info` describes such a directory as a `TableInfo` (an in-memory table
  description, no manifest written) when the shards can be mapped back to back, i.e. every
  shard but the last is a whole number of 4 KiB pages, or there is only one shard. A `Store`
  opened on that description has every read path of a built table.
* `RawShardTable` serves the other case (e.g. the Qwen PLE geometry, 2,500,012 rows x 160 B
  = 400,001,920 B per shard, not a page multiple): one read-only mapping per shard and a
  gather grouped by shard (one ``np.take`` per shard a batch touches, never a loop per row).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.disk.files import open_shards
from engramdb.errors import CorruptFile, InvalidArgument, StoreClosed, TruncatedFile
from engramdb.io.mapping import MADV_RANDOM, ShardMapping
from engramdb.layouts.geometry import PAGE, TableGeometry
from engramdb.layouts.manifest import ShardInfo, TableInfo
from engramdb.table_api import RowTable, TableSchema

__all__ = ["RawShardTable", "raw_layout", "raw_shard_info", "raw_shard_name"]


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
) -> tuple[TableInfo, bool]:
    """Describe the raw shards under ``path`` as a `TableInfo` and say whether they can be
    mapped back to back (``True``: open a `Store` on it; ``False``: use `RawShardTable`).

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
    # The geometry a built table would have: badges that tile pages; with one shard (or page
    # multiples) the back-to-back mapping holds the rows at r * width.
    rpb = math.lcm(width, PAGE) // width
    mappable = shards == 1 or full % PAGE == 0
    rps = rows_per_shard if full % PAGE == 0 else rpb * max(1, -(-n_rows // rpb))
    geometry = TableGeometry(n_rows=n_rows, row_bytes=width, rows_per_badge=rpb, rows_per_shard=rps)
    head_rows = (n_rows,) if heads is None else tuple(int(h) for h in np.asarray(heads).ravel())
    if sum(head_rows) > n_rows:
        raise InvalidArgument(f"heads sum to {sum(head_rows)} rows, the shards hold {n_rows}")
    info = TableInfo(
        name=name or root.name or "raw",
        row_bytes=width,
        heads=head_rows,
        geometry=geometry,
        shards=tuple(entries),
        dtype=dtype,
        dim=dim,
        provenance={"kind": "raw-shards", "shards": shards, "rows_per_shard": rows_per_shard},
    )
    return info, mappable


def raw_shard_info(
    path: str | os.PathLike[str], shards: int, rows_per_shard: int, width: int, **kw: Any
) -> TableInfo:
    """The `TableInfo` of `raw_layout` (whether or not the shards map back to back)."""
    return raw_layout(path, shards, rows_per_shard, width, **kw)[0]


class RawShardTable(RowTable):
    """Raw row shards that cannot be mapped back to back, read in place.

    Each shard is mapped on its own (read-only, no data read at open); a gather splits the
    ids by shard and does one ``np.take`` per shard touched. ``rows_per_shard`` and
    ``width`` say where row ``r`` is; out-of-range ids raise `RowIdOutOfRange`."""

    def __init__(self, path: str | os.PathLike[str], info: TableInfo, rows_per_shard: int):
        RowTable.__init__(self, TableSchema.of(info))
        self.info = info
        self.rows_per_shard = int(rows_per_shard)
        self._db = Path(path)
        self._fds = open_shards(self._db, info)
        self._maps: list[ShardMapping] = []
        self._arrays: list[np.ndarray] | None = []
        try:
            for fd, sh in zip(self._fds, info.shards):
                m = ShardMapping([fd], [sh.bytes])
                self._maps.append(m)
                self._arrays.append(m.array(sh.rows, info.row_bytes))
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            self.close()
            raise

    @property
    def db_path(self) -> Path:
        return self._db

    @property
    def width(self) -> int:
        """Bytes per row (the published API's name for ``row_bytes``)."""
        return self.row_bytes

    @property
    def closed(self) -> bool:
        return self._arrays is None

    def shard_arrays(self) -> list[np.ndarray]:
        """Each shard's read-only ``[rows, width]`` uint8 view (valid until `close`)."""
        a = self._arrays
        if a is None:
            raise StoreClosed(self._closed_message())
        return a

    def gather(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        arrays = self.shard_arrays()
        shard, within = np.divmod(flat, self.rows_per_shard)
        lo, hi = int(shard.min()), int(shard.max())
        if lo == hi:
            np.take(arrays[lo], within, axis=0, out=out2d, mode="clip")
            return
        order = np.argsort(shard, kind="stable")
        sorted_shards = shard[order]
        cuts = np.flatnonzero(np.diff(sorted_shards)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [flat.size]))
        for s, e in zip(starts.tolist(), ends.tolist()):  # one np.take per shard touched
            pos = order[s:e]
            out2d[pos] = np.take(arrays[int(sorted_shards[s])], within[pos], axis=0, mode="clip")

    def fetch_one(self, rowid: int) -> np.ndarray:
        """Row ``rowid`` as a ``[width]`` uint8 array."""
        return self.fetch([rowid])[0]

    def populate(self, *, threads: int = 2) -> None:
        for m in self._maps:
            m.populate(threads=threads)
            m.advise(MADV_RANDOM)

    def close(self) -> None:
        self._arrays = None
        for m in self._maps:
            m.close()
        self._maps = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
