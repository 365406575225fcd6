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
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike

from engramdb.errors import (
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    RowIdOutOfRange,
    ShapeMismatch,
)

__all__ = [
    "Geometry",
    "ReadPlan",
    "assemble",
    "locate",
    "plan_reads",
    "validate_row_ids",
]


class GeometryLike(Protocol):
    """Anything with these attributes (e.g. ``engramdb.layouts.geometry.TableGeometry``).
    Optional: ``data_offset`` (file offset of row 0 in every shard, default 0) and
    ``rows_per_page`` / ``page_size`` (page-aligned rows with tail padding, default off)."""

    @property
    def n_rows(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def rows_per_shard(self) -> int: ...


@dataclass(frozen=True)
class Geometry:
    """Where rows live: shards of ``rows_per_shard`` rows, row 0 of each at ``data_offset``.

    With ``rows_per_page`` set, each ``page_size`` page holds that many rows followed by
    padding (so no row straddles a page); otherwise rows are compact.
    """

    n_rows: int
    row_bytes: int
    rows_per_shard: int
    data_offset: int = 0
    rows_per_page: int | None = None
    page_size: int = 4096

    def __post_init__(self) -> None:
        _check_geometry(self)


def _geom(g: GeometryLike) -> tuple[int, int, int, int, int | None, int]:
    return (
        int(g.n_rows),
        int(g.row_bytes),
        int(g.rows_per_shard),
        int(getattr(g, "data_offset", 0)),
        getattr(g, "rows_per_page", None),
        int(getattr(g, "page_size", 4096)),
    )


def _check_geometry(g: Any) -> None:
    n_rows, row_bytes, rps, data_offset, rpp, page = _geom(g)
    if n_rows < 0 or row_bytes <= 0 or rps <= 0 or data_offset < 0:
        raise InvalidArgument(
            f"bad geometry: n_rows={n_rows}, row_bytes={row_bytes}, "
            f"rows_per_shard={rps}, data_offset={data_offset}"
        )
    if rpp is not None and (rpp <= 0 or page <= 0 or int(rpp) * row_bytes > page):
        raise InvalidArgument(
            f"rows_per_page={rpp} x row_bytes={row_bytes} does not fit a {page} B page"
        )


# --- validation -----------------------------------------------------------------------------
def validate_row_ids(ids: ArrayLike, n_rows: int) -> np.ndarray:
    """``ids`` as an int64 array of the same shape, checked against ``[0, n_rows)``.

    Any integer dtype is accepted (converted without copying when already int64); floats,
    bools and objects raise `InvalidDtype`; the first out-of-range id raises
    `RowIdOutOfRange` naming its value and position. Two vectorised passes.
    """
    if isinstance(ids, (list, tuple)) and len(ids) == 0:
        return np.empty(0, dtype=np.int64)
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidDtype(f"row ids must be integers, got dtype {arr.dtype}")
    if arr.size == 0:
        return arr.astype(np.int64, copy=False)
    lo, hi = arr.min(), arr.max()
    if (arr.dtype.kind == "i" and int(lo) < 0) or int(hi) >= n_rows:
        bad = arr >= n_rows if arr.dtype.kind == "u" else (arr < 0) | (arr >= n_rows)
        flat = int(np.flatnonzero(bad.reshape(-1))[0])
        pos: int | tuple[int, ...] = (
            flat if arr.ndim <= 1 else tuple(int(i) for i in np.unravel_index(flat, arr.shape))
        )
        value = int(arr.reshape(-1)[flat])
        raise RowIdOutOfRange(f"row id {value} at position {pos} is outside [0, {n_rows})")
    return arr.astype(np.int64, copy=False)


def locate(ids: np.ndarray, geometry: GeometryLike) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, byte offset in the shard file)`` for validated int64 ids (vectorised)."""
    _, row_bytes, rps, data_offset, rpp, page = _geom(geometry)
    shard, local = np.divmod(ids, rps)
    if rpp is None:
        offset = local * row_bytes
    else:
        in_page, slot = np.divmod(local, int(rpp))
        offset = in_page * page + slot * row_bytes
    if data_offset:
        offset += data_offset
    return shard.astype(np.int32), offset


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
    skips the id checks (the caller ran `validate_row_ids`).
    """
    _check_geometry(geometry)
    n_rows, row_bytes, _rps, _off, _rpp, _page = _geom(geometry)
    if max_gap < 0 or max_read_bytes <= 0:
        raise InvalidArgument(f"max_gap={max_gap} must be >= 0, max_read_bytes > 0")
    if not dedupe and coalesce:
        raise InvalidArgument("coalesce=True needs dedupe=True (reads must be sorted)")
    arr = np.asarray(ids) if validated else validate_row_ids(ids, n_rows)
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
        np.take(rows, plan.inverse, axis=0, out=out2d, mode="clip")
        return
    windows = np.lib.stride_tricks.as_strided(
        flat, shape=(flat.shape[0] - rb + 1, rb), strides=(1, 1), writeable=False
    )
    out2d[...] = windows[plan.row_scratch[plan.inverse]]
