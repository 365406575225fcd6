"""Where rows live in a Mooncake store: `ObjectLayout` and the `RangePlan` of a batch.

Pure geometry: a head is split into store objects of whole rows, and a batch of row ids
becomes, per object, the destination offsets, source offsets and sizes of one
``get_into_ranges`` call (vectorised with numpy). No client, no I/O, so it is tested
without a store (tests/test_mooncake_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.table_api import head_offsets_of


@dataclass(frozen=True)
class RangePlan:
    """The argument lists of one ``get_into_ranges`` call for one destination buffer:
    per object key, the destination offsets, source offsets and sizes (bytes)."""

    keys: list[str]
    dst: list[list[int]]
    src: list[list[int]]
    sizes: list[list[int]]
    n_ranges: int
    #: payload bytes of all ranges
    nbytes: int = 0
    #: every range has the same size (rows), so a result check needs no per-range loop
    uniform: bool = True


class ObjectLayout:
    """Where rows live: head ``h`` is split into objects of ``rows_per_object`` whole rows,
    ``keys[h][k]`` holding local rows ``[k * rows_per_object, ...)``. Pure: no I/O."""

    def __init__(
        self, heads: Sequence[int], row_bytes: int, rows_per_object: int, keys: list[list[str]]
    ):
        self.heads = np.asarray([int(n) for n in heads], dtype=np.int64)
        self.row_bytes = int(row_bytes)
        self.rows_per_object = int(rows_per_object)
        if self.rows_per_object <= 0 or self.row_bytes <= 0:
            raise InvalidArgument("rows_per_object and row_bytes must be > 0")
        parts = -(-self.heads // self.rows_per_object)
        if len(keys) != len(self.heads) or any(len(k) != p for k, p in zip(keys, parts)):
            raise InvalidArgument(
                f"layout names {[len(k) for k in keys]} objects per head, geometry needs "
                f"{parts.tolist()}"
            )
        self.keys = [list(k) for k in keys]
        self.flat_keys = [k for ks in keys for k in ks]
        # global object index of each head's part 0
        self.object_base = head_offsets_of(parts)
        self.head_offsets = head_offsets_of(self.heads)

    @classmethod
    def split(
        cls,
        heads: Sequence[int],
        row_bytes: int,
        object_bytes: int | None,
        key_of: Callable[[int, int, int], str],
    ) -> ObjectLayout:
        """Layout with objects of at most ``object_bytes`` (``None``: one object per head).
        ``key_of(head, part, n_parts)`` names each object."""
        if object_bytes is None:
            rpo = max(int(n) for n in heads)
        else:
            if isinstance(object_bytes, bool) or int(object_bytes) < row_bytes:
                raise InvalidArgument(
                    f"object size {object_bytes!r} B is smaller than one {row_bytes} B row"
                )
            rpo = int(object_bytes) // int(row_bytes)
        keys = []
        for h, n in enumerate(heads):
            parts = -(-int(n) // rpo)
            keys.append([key_of(h, k, parts) for k in range(parts)])
        return cls(heads, row_bytes, rpo, keys)

    @property
    def n_objects(self) -> int:
        return len(self.flat_keys)

    def objects(self) -> Iterator[tuple[str, int, int, int]]:
        """``(key, head, first_local_row, rows)`` of every object, in head/part order."""
        rpo = self.rows_per_object
        for h, ks in enumerate(self.keys):
            n = int(self.heads[h])
            for k, key in enumerate(ks):
                yield key, h, k * rpo, min(rpo, n - k * rpo)

    def _plan(
        self, head: np.ndarray, local: np.ndarray, out_rows: np.ndarray | None = None
    ) -> RangePlan:
        """Ranges for rows ``i`` = (``head[i]``, ``local[i]``), written at
        ``out_rows[i] * row_bytes`` (default ``i * row_bytes``). Grouping by object is one
        stable sort (radix for < 65,536 objects) and a bincount; Python only loops over the
        objects touched."""
        rb, rpo = self.row_bytes, self.rows_per_object
        part = local // rpo
        obj = self.object_base[head] + part
        src = (local - part * rpo) * rb
        n_obj = self.n_objects
        small = obj.astype(np.uint16 if n_obj <= 0xFFFF else np.uint32)
        order = np.argsort(small, kind="stable")
        counts = np.bincount(obj, minlength=n_obj)
        used = np.flatnonzero(counts)
        bounds = np.concatenate([[0], np.cumsum(counts[used])]).tolist()
        dst_all = ((order if out_rows is None else out_rows[order]) * rb).tolist()
        src_all = src[order].tolist()
        cuts = list(zip(bounds[:-1], bounds[1:]))
        return RangePlan(
            keys=[self.flat_keys[i] for i in used.tolist()],
            dst=[dst_all[a:b] for a, b in cuts],
            src=[src_all[a:b] for a, b in cuts],
            sizes=[[rb] * (b - a) for a, b in cuts],
            n_ranges=int(local.size),
            nbytes=int(local.size) * rb,
        )

    def plan_local(self, row_ids: np.ndarray) -> RangePlan:
        """Plan for validated per-head local ids ``[..., H]`` (output in C order)."""
        h = len(self.heads)
        flat = row_ids.reshape(-1)
        head = np.tile(np.arange(h, dtype=np.int64), flat.size // h)
        return self._plan(head, flat)

    def plan_positions(self, row_ids: np.ndarray, positions: np.ndarray) -> RangePlan:
        """Plan for the rows of ``positions`` (indices into ``row_ids.reshape(-1, H)``) of
        validated local ids ``[..., H]``: every head's row of each position, written where
        a full-batch plan would write it."""
        h = len(self.heads)
        local = row_ids.reshape(-1, h)[positions].reshape(-1)
        head = np.tile(np.arange(h, dtype=np.int64), positions.size)
        rows = (positions[:, None] * h + np.arange(h, dtype=np.int64)).reshape(-1)
        return self._plan(head, local, rows)

    def plan_global(self, rowids: np.ndarray) -> RangePlan:
        """Plan for validated global ids (any shape; output in C order)."""
        flat = rowids.reshape(-1)
        head = np.searchsorted(self.head_offsets, flat, side="right") - 1
        return self._plan(head, flat - self.head_offsets[head])


def layer_layout(
    layer_id: int, heads: Sequence[int], row_bytes: int, object_bytes: int | None
) -> ObjectLayout:
    """`EngramStore` keys: ``engram:l{layer}:h{head}`` holds the whole head (the contract's
    key); a head split into several objects uses ``engram:l{layer}:h{head}:p{part}``."""

    def key_of(h: int, k: int, parts: int) -> str:
        base = f"engram:l{layer_id}:h{h}"
        return base if parts == 1 else f"{base}:p{k}"

    return ObjectLayout.split(heads, row_bytes, object_bytes, key_of)


__all__ = ["ObjectLayout", "RangePlan", "layer_layout"]
