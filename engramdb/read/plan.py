"""Pure read planning: row ids -> the reads a backend performs -> rows in the caller's order.

No I/O happens here: every function takes and returns arrays, so the planner is tested
with hypothesis and no files. A plan for a cold fetch

1. validates the ids (integer dtype, ``0 <= id < n_rows``; the first bad id is named with
   its position),
2. deduplicates and sorts them (ascending id is ascending ``(shard, offset)``),
3. locates each row (``shard = id // rows_per_shard``, byte offset from the geometry),
4. optionally coalesces neighbouring rows into one read (off by default: measured here,
   merging reads across gaps gained ~9 % cold and costs bytes; touching rows can be merged
   with ``coalesce=True, max_gap=0``),
5. packs the reads into a scratch buffer and records, for every output row, which unique
   row it is (``inverse``), so `assemble` scatters scratch rows into the output with one
   ``np.take``.

Costs: ``O(n log n)`` for the sort in `np.unique` (~0.5 ms for 16,384 ids), a few vectorised
passes otherwise. Warm gathers from a mapping should skip the plan (``dedupe=False`` keeps
the caller's order and reads straight into the output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from engramdb.errors import InvalidArgument, InvalidDtype, InvalidLayout, ShapeMismatch
from engramdb.io.gather import take_one
from engramdb.validate import as_rowids, check_bounds

__all__ = [
    "Geometry",
    "ReadPlan",
    "assemble",
    "locate",
    "plan_reads",
]


class GeometryLike(Protocol):
    """Anything with these attributes (e.g. ``engramdb.layouts.geometry.TableGeometry``):
    compact rows, shard ``i`` holding rows ``[i * rows_per_shard, (i + 1) * rows_per_shard)``
    from byte 0 of its file."""

    @property
    def n_rows(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def rows_per_shard(self) -> int: ...


@dataclass(frozen=True)
class Geometry:
    """Where rows live: shards of ``rows_per_shard`` compact rows, row 0 of each at byte 0
    (the planner's own geometry, for tables described without a manifest)."""

    n_rows: int
    row_bytes: int
    rows_per_shard: int

    def __post_init__(self) -> None:
        _check_geometry(self)


def _check_geometry(g: GeometryLike) -> None:
    n_rows, row_bytes, rps = int(g.n_rows), int(g.row_bytes), int(g.rows_per_shard)
    if n_rows < 0 or row_bytes <= 0 or rps <= 0:
        raise InvalidArgument(
            f"bad geometry: n_rows={n_rows}, row_bytes={row_bytes}, rows_per_shard={rps}"
        )


def locate(ids: np.ndarray, geometry: GeometryLike) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, byte offset in the shard file)`` for validated int64 ids (vectorised)."""
    shard, local = np.divmod(ids, int(geometry.rows_per_shard))
    return shard.astype(np.int32), local * int(geometry.row_bytes)


# --- the plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReadPlan:
    """What to read and how to put it back together. All arrays are owned by the plan.

    * ``row_ids`` — the distinct ids read, ascending (= ascending shard, then offset);
    * ``inverse`` — for each requested id (flattened), its index into ``row_ids``;
    * ``shard``, ``offset``, ``length``, ``dest_offset`` — one entry per read: read
      ``length`` bytes of shard file ``shard`` at ``offset`` into ``scratch[dest_offset:]``;
    * ``row_scratch`` — byte offset of each ``row_ids`` row in scratch, or ``None`` when
      row ``i`` sits at ``i * row_bytes`` (no coalescing);
    * ``scratch_bytes`` — size of the scratch buffer the reads fill;
    * ``out_shape`` — the shape of the requested ids (the output is ``out_shape + (row_bytes,)``).
    """

    row_ids: np.ndarray
    inverse: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    dest_offset: np.ndarray
    row_scratch: np.ndarray | None
    row_bytes: int
    scratch_bytes: int
    out_shape: tuple[int, ...]

    @property
    def n_out(self) -> int:
        return int(self.inverse.shape[0])

    @property
    def n_unique(self) -> int:
        return int(self.row_ids.shape[0])

    @property
    def n_reads(self) -> int:
        return int(self.offset.shape[0])

    def pages(self, page_size: int = 4096) -> int:
        """Distinct ``page_size`` pages the reads touch (what a buffered cold read costs the
        device; rows straddling a page boundary count both pages)."""
        if self.n_reads == 0:
            return 0
        first = self.offset // page_size
        last = (self.offset + self.length - 1) // page_size
        total = int((last - first + 1).sum())
        if self.n_reads > 1:
            same = self.shard[1:] == self.shard[:-1]
            shared = same & (first[1:] == last[:-1])  # reads are sorted: only neighbours share
            total -= int(np.count_nonzero(shared))
        return total


def _empty_plan(row_bytes: int, shape: tuple[int, ...]) -> ReadPlan:
    e = np.empty(0, dtype=np.int64)
    return ReadPlan(
        e, e.copy(), np.empty(0, np.int32), e.copy(), e.copy(), e.copy(), None, row_bytes, 0, shape
    )


def plan_reads(
    ids: ArrayLike,
    geometry: GeometryLike,
    *,
    dedupe: bool = True,
    coalesce: bool = False,
    max_gap: int = 0,
    max_read_bytes: int = 1 << 20,
    validated: bool = False,
) -> ReadPlan:
    """Plan the reads that fetch rows ``ids`` (any shape) of a table with ``geometry``.

    ``dedupe=False`` keeps one read per requested id in the caller's order (no sort), with
    the scratch laid out exactly like the output: read straight into the output buffer.
    ``coalesce=True`` merges reads in the same shard whose gap is at most ``max_gap`` bytes
    while a merged read stays within ``max_read_bytes`` (plus one row). ``validated=True``
    skips the id checks (the caller ran `engramdb.validate.as_rowids` / `check_bounds`).
    """
    _check_geometry(geometry)
    n_rows, row_bytes = int(geometry.n_rows), int(geometry.row_bytes)
    if max_gap < 0 or max_read_bytes <= 0:
        raise InvalidArgument(f"max_gap={max_gap} must be >= 0, max_read_bytes > 0")
    if not dedupe and coalesce:
        raise InvalidArgument("coalesce=True needs dedupe=True (reads must be sorted)")
    if validated:
        arr = np.asarray(ids)
    else:
        arr = as_rowids(ids)
        check_bounds(arr.reshape(-1), n_rows, shape=arr.shape)
    shape = tuple(arr.shape)
    flat = arr.reshape(-1).astype(np.int64, copy=False)
    if flat.shape[0] == 0:
        return _empty_plan(row_bytes, shape)
    if dedupe:
        uniq, inverse = np.unique(flat, return_inverse=True)
        inverse = inverse.reshape(-1).astype(np.int64, copy=False)
    else:
        uniq, inverse = flat, np.arange(flat.shape[0], dtype=np.int64)
    shard, offset = locate(uniq, geometry)
    u = uniq.shape[0]
    if not coalesce:
        length = np.full(u, row_bytes, dtype=np.int64)
        dest = np.arange(u, dtype=np.int64) * row_bytes
        return ReadPlan(
            uniq, inverse, shard, offset, length, dest, None, row_bytes, u * row_bytes, shape
        )

    # Coalesce: a new read starts where the shard changes, the gap is too large, or the
    # read would grow past max_read_bytes (measured from the start of its run of rows).
    end = offset + row_bytes
    starts_run = np.ones(u, dtype=bool)
    if u > 1:
        starts_run[1:] = (shard[1:] != shard[:-1]) | (offset[1:] - end[:-1] > max_gap)
    run = np.cumsum(starts_run) - 1
    run_start = offset[starts_run][run]
    window = (end - run_start - 1) // max_read_bytes
    starts = starts_run.copy()
    if u > 1:
        starts[1:] |= window[1:] != window[:-1]
    read_of_row = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.append(first[1:], u) - 1
    r_offset = offset[first]
    r_length = end[last] - r_offset
    r_dest = np.cumsum(r_length) - r_length
    row_scratch = r_dest[read_of_row] + (offset - r_offset[read_of_row])
    return ReadPlan(
        uniq,
        inverse,
        shard[first],
        r_offset,
        r_length,
        r_dest,
        row_scratch,
        row_bytes,
        int(r_length.sum()),
        shape,
    )


def assemble(plan: ReadPlan, scratch: np.ndarray, out: np.ndarray) -> None:
    """Copy each requested row from ``scratch`` (filled by the plan's reads) into ``out``.

    ``out`` is uint8, C-contiguous, writable, with ``plan.n_out * row_bytes`` bytes (any
    shape, e.g. ``out_shape + (row_bytes,)``). One ``np.take`` without coalescing.
    """
    rb = plan.row_bytes
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8:
        raise InvalidDtype("out must be a numpy uint8 array")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidLayout("out must be C-contiguous and writable")
    if out.size != plan.n_out * rb:
        raise ShapeMismatch(f"out holds {out.size} bytes, the plan needs {plan.n_out * rb}")
    if scratch.size < plan.scratch_bytes:
        raise ShapeMismatch(f"scratch holds {scratch.size} bytes, need {plan.scratch_bytes}")
    if plan.n_out == 0:
        return
    out2d = out.reshape(plan.n_out, rb)
    flat = scratch.reshape(-1)
    if plan.row_scratch is None:
        rows = flat[: plan.n_unique * rb].reshape(plan.n_unique, rb)
        take_one(rows, plan.inverse, out2d)
        return
    windows = np.lib.stride_tricks.as_strided(
        flat, shape=(flat.shape[0] - rb + 1, rb), strides=(1, 1), writeable=False
    )
    out2d[...] = windows[plan.row_scratch[plan.inverse]]
