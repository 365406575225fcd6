"""One table contract: `TableSchema` and the `RowTable` base every table handle implements.

A handle (`Store`, `RemoteStore`, `MooncakeTable`) says how to read *validated* global row ids
into a caller's buffer (`RowTable.gather`) and how to tell whether it is closed; this module
writes everything else once: the schema fields, argument checks, `fetch`, `fetch_into`,
`lookup_into`, `to_global` and the context manager. Workloads that consume rows
(`engramdb.stream`, `Decoder`) take any `RowTable`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from engramdb.errors import ShapeMismatch, StoreClosed
from engramdb.validate import (
    as_rowids,
    check_batch,
    check_bounds,
    check_head_bounds,
    check_lookup_ids,
    check_output,
    separate,
)

_C = TypeVar("_C", bound="Closing")


class Closing:
    """The context-manager half of every handle that has a `close` (tables, databases,
    clients, backends, readers): ``with handle:`` closes it when the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def head_offsets_of(heads: Sequence[int] | np.ndarray) -> np.ndarray:
    """Exclusive prefix sum of per-head row counts (int64): the global id of each head's row 0."""
    h = np.asarray(heads, dtype=np.int64).reshape(-1)
    out = np.zeros(h.size, dtype=np.int64)
    if h.size > 1:
        np.cumsum(h[:-1], out=out[1:])
    return out


@dataclass(frozen=True)
class TableSchema:
    """What a reader knows of a table before reading a byte: its name, row width, heads.

    ``heads`` holds each head's row count in table order; ``head_offsets`` is derived once
    (read-only array) so no handle recomputes it."""

    name: str
    row_bytes: int
    n_rows: int
    heads: tuple[int, ...]
    dtype: str = "u8"
    dim: int | None = None
    head_offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        offs = head_offsets_of(self.heads)
        offs.flags.writeable = False
        object.__setattr__(self, "head_offsets", offs)

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @classmethod
    def of(cls, info: Any) -> TableSchema:
        """The schema of anything with ``name``, ``row_bytes``, ``n_rows``, ``heads``
        (a manifest `TableInfo`, a server's table listing as a dict, …)."""

        def get(key: str, default: Any = None) -> Any:
            return info.get(key, default) if isinstance(info, dict) else getattr(info, key, default)

        heads = get("heads")
        heads = tuple(int(h) for h in np.asarray(heads, dtype=np.int64).reshape(-1))
        dim = get("dim", None)
        return cls(
            name=str(get("name")),
            row_bytes=int(get("row_bytes")),
            n_rows=int(get("n_rows")),
            heads=heads,
            dtype=str(get("dtype", "u8") or "u8"),
            dim=None if dim is None else int(dim),
        )


class RowTable(Closing, ABC):
    """The read surface shared by every table handle.

    Global row ids (``head_offsets[h] + local``) go to `fetch` / `fetch_into`; per-head local
    ids ``[B, L, H]`` go to `lookup_into`. Every call validates first and writes ``out`` only
    after validation passed, so a bad id never leaves a half-written buffer.

    Subclasses call ``RowTable.__init__(self, schema)`` and implement `gather` (validated ids
    into a ``[n, row_bytes]`` buffer), `closed` and `close`. They may override
    `_gather_local` when their transport takes per-head ids directly."""

    schema: TableSchema

    def __init__(self, schema: TableSchema):
        self.schema = schema
        self.name = schema.name
        self.row_bytes = schema.row_bytes
        self.n_rows = schema.n_rows
        self.heads = np.asarray(schema.heads, dtype=np.int64)
        self.head_offsets = schema.head_offsets
        self.dtype = schema.dtype
        self.dim = schema.dim
        self._ids_scratch = threading.local()

    # -- what a handle provides ---------------------------------------------------------------
    @abstractmethod
    def gather(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Write the rows of validated global ids ``flat`` (int64, 1-D, every id in
        ``[0, n_rows)``) into ``out2d`` (writable C-contiguous uint8 ``[flat.size,
        row_bytes]``). Callers that validated the ids themselves (workloads, prefetch)
        use this directly; everyone else uses `fetch` / `fetch_into`."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether `close` was called (reads then raise `StoreClosed`)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the handle holds; later reads raise `StoreClosed`."""

    def _closed_message(self) -> str:
        return f"table {self.name!r} is closed"

    def check_open(self) -> None:
        """Raise `StoreClosed` if the handle was closed."""
        if self.closed:
            raise StoreClosed(self._closed_message())

    def _gather_local(self, row_ids: np.ndarray, out2d: np.ndarray) -> None:
        """Rows of validated per-head local ids ``[B, L, H]``: to global ids, then `gather`."""
        n = row_ids.size
        buf = getattr(self._ids_scratch, "ids", None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1024), dtype=np.int64)
            self._ids_scratch.ids = buf
        g = buf[:n]
        h = self.n_heads
        np.add(row_ids.reshape(-1, h), self.head_offsets, out=g.reshape(-1, h))
        self.gather(g, out2d)

    # -- derived schema -----------------------------------------------------------------------
    @property
    def n_heads(self) -> int:
        return self.schema.n_heads

    @property
    def nbytes(self) -> int:
        return self.schema.nbytes

    # -- the read API, written once -----------------------------------------------------------
    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids`` (any integer array or list), shape
        ``rowids.shape + (row_bytes,)``, uint8. Allocates the result; see `fetch_into`."""
        self.check_open()
        ids = as_rowids(rowids)
        check_batch(ids.shape, self.row_bytes)
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        if flat.size:
            self.gather(flat, out.reshape(-1, self.row_bytes))
        return out

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """Write the rows of global ``rowids`` into ``out`` (writable C-contiguous uint8 of
        shape ``rowids.shape + (row_bytes,)``) and return it. No allocation on the warm path."""
        self.check_open()
        ids = as_rowids(rowids)
        check_batch(ids.shape, self.row_bytes)
        check_output(out, ids.shape + (self.row_bytes,))
        flat = separate(ids, out).reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        if flat.size:
            self.gather(flat, out.reshape(-1, self.row_bytes))
        return out

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Mooncake-style lookup: ``row_ids`` int64 C-contiguous ``[B, L, H]`` of per-head
        *local* ids (last axis = head), ``out`` writable C-contiguous uint8
        ``[B, L, H, row_bytes]``; returns ``out``. No implicit conversions; an empty batch is
        a no-op."""
        self.check_open()
        check_lookup_ids(row_ids, self.n_heads)
        check_batch(row_ids.shape, self.row_bytes, what="row_ids")
        check_output(out, row_ids.shape + (self.row_bytes,))
        row_ids = separate(row_ids, out)
        if row_ids.size:
            check_head_bounds(row_ids, self.heads)
            self._gather_local(row_ids, out.reshape(-1, self.row_bytes))
        return out

    def to_global(self, local_ids: Any) -> np.ndarray:
        """Global ids for per-head local ids ``[..., H]`` (validated; no I/O)."""
        local = np.ascontiguousarray(as_rowids(local_ids))
        if local.ndim == 0 or local.shape[-1] != self.n_heads:
            raise ShapeMismatch(
                f"local ids need a last axis of {self.n_heads} heads, got {local.shape}"
            )
        check_head_bounds(local, self.heads)
        return local + self.head_offsets

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_rows:,} rows x {self.row_bytes} B"
        return f"<{type(self).__name__} {self.name!r} {state}, {self.n_heads} heads>"
