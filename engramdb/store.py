"""`Store`: read access to one Store-I table.

The warm path is one vectorised gather: the table's shards are mapped back to back, so
``fetch`` is ``np.take(table, ids, axis=0, out=..., mode="clip")`` after a one-pass bounds
check (``mode="clip"`` avoids numpy's temporary copy for ``mode="raise"``; the ids were
validated already, so clipping never changes a row).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.errors import CorruptFile, StoreClosed, TruncatedFile
from engramdb.io.gather import take_rows
from engramdb.io.mapping import ShardMapping
from engramdb.layouts.manifest import TableInfo
from engramdb.validate import (
    as_rowids,
    check_bounds,
    check_head_bounds,
    check_lookup_ids,
    check_output,
)


def open_shards(db: Path, info: TableInfo) -> list[int]:
    """Open every shard read-only and check its size against the manifest."""
    fds: list[int] = []
    try:
        for s in info.shards:
            path = db / s.path
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise TruncatedFile(f"table {info.name!r}: shard {s.path!r} is missing") from None
            fds.append(fd)
            size = os.fstat(fd).st_size
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


class Store:
    """One table of an open database. Thread-safe for concurrent reads.

    Row ids are *global* (``head_offsets[h] + local``) for `fetch` / `fetch_into`, and
    per-head *local* for `lookup_into`. Every call validates first and writes the output
    only after validation passed, so a bad id never leaves a half-written buffer.
    """

    def __init__(self, db_path: str | os.PathLike[str], info: TableInfo):
        self._db = Path(db_path)
        self.info = info
        self.name = info.name
        self.row_bytes = info.row_bytes
        self.n_rows = info.n_rows
        self.heads = np.asarray(info.heads, dtype=np.int64)
        self.head_offsets = info.head_offsets
        self.dtype = info.dtype
        self.dim = info.dim
        self._fds = open_shards(self._db, info)
        try:
            self._mapping: ShardMapping | None = ShardMapping(
                self._fds, [s.bytes for s in info.shards]
            )
            self._table: np.ndarray | None = self._mapping.array(self.n_rows, self.row_bytes)
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            raise
        self._scratch = threading.local()
        self._counters = {"fetch_calls": 0, "rows_fetched": 0}

    # -- properties --------------------------------------------------------------------------
    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def closed(self) -> bool:
        return self._table is None

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    def _array(self) -> np.ndarray:
        t = self._table
        if t is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        return t

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_rows:,} rows x {self.row_bytes} B"
        return f"<Store {self.name!r} {state}, {self.n_heads} heads>"

    # -- reads -------------------------------------------------------------------------------
    def _gather(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        take_rows(self._array(), flat, out2d)
        self._counters["fetch_calls"] += 1
        self._counters["rows_fetched"] += flat.size

    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids`` (any integer array or list), shape
        ``rowids.shape + (row_bytes,)``, uint8. Allocates the result; see `fetch_into`."""
        table = self._array()
        ids = as_rowids(rowids)
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        if flat.size:
            del table
            self._gather(flat, out.reshape(-1, self.row_bytes))
        return out

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """Write the rows of global ``rowids`` into ``out`` (writable C-contiguous uint8 of
        shape ``rowids.shape + (row_bytes,)``). No allocation on the warm path."""
        self._array()
        ids = as_rowids(rowids)
        check_output(out, ids.shape + (self.row_bytes,))
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        if flat.size:
            self._gather(flat, out.reshape(-1, self.row_bytes))
        return out

    def _global_scratch(self, n: int) -> np.ndarray:
        buf = getattr(self._scratch, "ids", None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1024), dtype=np.int64)
            self._scratch.ids = buf
        return buf[:n]

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> None:
        """Mooncake-style lookup: ``row_ids`` int64 C-contiguous ``[B, L, H]`` of per-head
        *local* ids (last axis = head), ``out`` writable C-contiguous uint8
        ``[B, L, H, row_bytes]``. No implicit conversions; an empty batch is a no-op."""
        self._array()
        check_lookup_ids(row_ids, self.n_heads)
        check_output(out, row_ids.shape + (self.row_bytes,))
        if row_ids.size == 0:
            return
        check_head_bounds(row_ids, self.heads)
        g = self._global_scratch(row_ids.size)
        np.add(
            row_ids.reshape(-1, self.n_heads), self.head_offsets, out=g.reshape(-1, self.n_heads)
        )
        self._gather(g, out.reshape(-1, self.row_bytes))

    def to_global(self, local_ids: np.ndarray) -> np.ndarray:
        """Global ids for per-head local ids ``[..., H]`` (validated)."""
        local = np.ascontiguousarray(as_rowids(local_ids))
        if local.ndim == 0 or local.shape[-1] != self.n_heads:
            from engramdb.errors import ShapeMismatch

            raise ShapeMismatch(
                f"local ids need a last axis of {self.n_heads} heads, got {local.shape}"
            )
        check_head_bounds(local, self.heads)
        return local + self.head_offsets

    # -- residency ---------------------------------------------------------------------------
    def populate(self, *, threads: int = 2, progress: Callable[[int], None] | None = None) -> None:
        """Fault the whole table into the page tables (``MADV_POPULATE_READ``): reads it from
        the device if cold, in ``threads`` background threads (the GIL is released).
        Afterwards warm gathers run at memory speed. ``progress`` gets byte counts."""
        if self._mapping is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        self._mapping.populate(threads=threads, progress=progress)

    def residency(self) -> float:
        """Fraction of the table's pages in the page cache (0..1), via ``mincore``."""
        if self._mapping is None:
            raise StoreClosed(f"table {self.name!r} is closed")
        return self._mapping.residency()

    def stats(self) -> dict[str, Any]:
        return {"table": self.name, "backend": "mmap", **self._counters}

    def close(self) -> None:
        """Release the mapping and file descriptors. Later calls raise `StoreClosed`."""
        if self._table is None:
            return
        self._table = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
