"""Pure planning for corpus streaming: a look-ahead window's rows -> sequential runs.

A corpus stream knows the row ids of many batches before the consumer needs them. For a
window of such batches the planner

1. marks the window's rows in a reusable bitmap of the table (`WindowMarks`): the distinct
   rows come out **sorted by file offset without a sort** (``np.flatnonzero`` of the bitmap,
   ``O(batch ids + n_rows / 8)`` per window), and the window stops growing once its distinct
   rows reach a byte cap (the memory bound: what the window keeps resident is exactly its
   distinct rows, ``n_distinct * row_bytes``);
2. coalesces the sorted rows into sequential runs (`plan_runs`): a run continues while the
   gap to the next row of the same shard is at most ``merge_gap`` bytes and the run stays
   within ``max_read`` bytes (plus one row); each run is one large read;
3. maps every requested id to its index among the distinct rows (`WindowMarks.rank`), so a
   batch is served by one ``np.take`` from the window's compact row store.

No I/O happens here: arrays in, arrays out (tested with hypothesis and no files).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engramdb.errors import InvalidArgument

__all__ = ["PLAN_BYTES_PER_ROW", "PackedRanks", "RunPlan", "WindowMarks", "plan_runs"]

#: Peak bytes per distinct row that planning a window needs besides the rows themselves
#: (the sorted ids, their offsets and `plan_runs`' temporaries): budget it with the window.
PLAN_BYTES_PER_ROW = 64

# Above this many bytes a dense rank array (int32 per table row) is not kept: ranks come
# from a binary search over the window's distinct rows instead.
_DENSE_RANK_MAX_BYTES = 256 << 20

# `WindowMarks.regions` ran to the end with the dense rank array: ranks are fixed, the
# window's rows were never held in one array.
_RANKED = np.empty(0, np.int64)


class GeometryLike(Protocol):
    """Compact rows in shards of ``rows_per_shard`` rows, row 0 of each at byte 0 (e.g.
    ``engramdb.layouts.geometry.TableGeometry`` or ``engramdb.read.plan.Geometry``)."""

    @property
    def row_bytes(self) -> int: ...
    @property
    def rows_per_shard(self) -> int: ...


@dataclass(frozen=True)
class RunPlan:
    """The reads of one window, in file order.

    * ``rows`` — the window's distinct row ids, ascending (= ascending shard, then offset);
    * ``shard``, ``offset``, ``length`` — one entry per run: read ``length`` bytes of shard
      file ``shard`` at byte ``offset`` (runs of a shard are ascending and do not overlap);
    * ``first_row`` — run ``i`` covers ``rows[first_row[i]:first_row[i + 1]]`` (one extra
      entry at the end: ``len(rows)``);
    * ``row_offset`` — byte offset of each row in its shard file.
    """

    rows: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    first_row: np.ndarray
    row_offset: np.ndarray
    row_bytes: int
    merge_gap: int
    max_read: int

    @property
    def n_runs(self) -> int:
        return int(self.offset.shape[0])

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def read_bytes(self) -> int:
        """Bytes the runs read (payload plus the merged gaps)."""
        return int(self.length.sum()) if self.n_runs else 0

    @property
    def payload_bytes(self) -> int:
        """Bytes of the distinct rows themselves."""
        return self.n_rows * self.row_bytes


def plan_runs(
    rows: np.ndarray, geometry: GeometryLike, *, merge_gap: int, max_read: int
) -> RunPlan:
    """Coalesce distinct, ascending row ids ``rows`` into sequential runs.

    A new run starts where the shard changes, where the gap between the end of one row and
    the start of the next exceeds ``merge_gap`` bytes, or where the run would grow past
    ``max_read`` bytes (measured from the run's first byte; a run always holds at least one
    row, so it is at most ``max_read + row_bytes`` long). ``rows`` must be sorted and
    distinct (as `WindowMarks.distinct` returns them); this is not re-checked."""
    if merge_gap < 0 or max_read <= 0:
        raise InvalidArgument(f"merge_gap={merge_gap} must be >= 0 and max_read={max_read} > 0")
    rb = int(geometry.row_bytes)
    rps = int(geometry.rows_per_shard)
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = r.shape[0]
    shard_of, off = np.divmod(r, rps)
    off *= rb  # in place: transient memory per row stays ~50 B (`PLAN_BYTES_PER_ROW`)
    if n == 0:
        e = np.empty(0, np.int64)
        return RunPlan(
            r,
            np.empty(0, np.int32),
            e,
            e.copy(),
            np.zeros(1, np.int64),
            off,
            rb,
            merge_gap,
            max_read,
        )
    end = off + rb
    starts_run = np.ones(n, dtype=bool)
    starts_run[1:] = (shard_of[1:] != shard_of[:-1]) | (off[1:] - end[:-1] > merge_gap)
    run_start = off[starts_run][np.cumsum(starts_run) - 1]
    run_start -= end
    run_start += 1
    run_start //= -int(max_read)  # the read-cap piece of each row, negated (in place)
    starts = starts_run
    starts[1:] |= run_start[1:] != run_start[:-1]
    del run_start
    first = np.flatnonzero(starts)
    last = np.append(first[1:], n) - 1
    r_off = off[first]
    return RunPlan(
        rows=r,
        shard=shard_of[first].astype(np.int32),
        offset=r_off,
        length=end[last] - r_off,
        first_row=np.append(first, n).astype(np.int64),
        row_offset=off,
        row_bytes=rb,
        merge_gap=int(merge_gap),
        max_read=int(max_read),
    )


class WindowMarks:
    """A reusable bitmap of a table's rows for building look-ahead windows.

    `add` marks a batch's ids and returns the window's distinct row count; `distinct`
    returns the marked rows ascending; `rank` maps ids of the window to their index among
    them; `clear` unmarks the window (``O(distinct)``). Memory: ``n_rows`` bytes, plus
    ``4 * n_rows`` for a dense rank array when that is at most ``dense_max_bytes`` (256 MiB by
    default; else ranks come from a binary search). Not thread-safe: one window builder owns it."""

    def __init__(self, n_rows: int, *, dense_max_bytes: int = _DENSE_RANK_MAX_BYTES):
        if n_rows < 0:
            raise InvalidArgument(f"n_rows must be >= 0, got {n_rows}")
        self.n_rows = int(n_rows)
        # padded to whole 64-row words for `freeze`
        self._mark = np.zeros(-(-self.n_rows // 64) * 64, dtype=bool)
        self._count = 0
        self._dense = self.n_rows * 4 <= dense_max_bytes and self.n_rows < 2**31
        self._rank = np.zeros(self.n_rows if self._dense else 0, dtype=np.int32)
        self._rows: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this bitmap (and the dense rank array) hold."""
        return int(self._mark.nbytes + self._rank.nbytes)

    @staticmethod
    def packed_nbytes(n_rows: int) -> int:
        """Bytes of one `freeze` result for a table of ``n_rows`` rows."""
        return -(-int(n_rows) // 64) * 16

    @property
    def count(self) -> int:
        """Distinct rows marked so far."""
        return self._count

    def add(self, ids: np.ndarray) -> int:
        """Mark validated ids (any shape); returns the distinct count of the window."""
        flat = ids.reshape(-1)
        if flat.size:
            new = flat[~self._mark[flat]]
            if new.size:
                self._mark[new] = True
                if not self._dense and self._mark.size <= 64 * new.size:
                    self._count = int(np.count_nonzero(self._mark))  # a scan beats a sort
                else:
                    self._count += self._distinct_count(new)
        self._rows = None
        return self._count

    def _distinct_count(self, new: np.ndarray) -> int:
        """Distinct entries of ``new`` (ids may repeat): with the dense rank array as
        scratch, the last write of each id wins, so an entry is the first of its id's
        survivors exactly once (``O(len)``); else a sort."""
        if new.size < 2:
            return int(new.size)
        if self._dense:
            pos = np.arange(new.size, dtype=np.int32)
            self._rank[new] = pos
            return int(np.count_nonzero(self._rank[new] == pos))
        s = np.sort(new)
        return int(new.size - np.count_nonzero(s[1:] == s[:-1]))

    def distinct(self) -> np.ndarray:
        """The window's distinct rows, ascending (int64). Fixes the ranks."""
        rows = np.flatnonzero(self._mark).astype(np.int64)
        if self._dense:
            self._rank[rows] = np.arange(rows.shape[0], dtype=np.int32)
        self._rows = rows
        return rows

    def freeze(self) -> PackedRanks:
        """The ranks of the window's rows as a compact structure of its own (`PackedRanks`,
        ~0.19 B per table row), valid after `clear` while the next window is marked."""
        return PackedRanks(self._mark)

    def regions(
        self, region_rows: int, *, keep_rows: bool = True
    ) -> Iterator[tuple[int, np.ndarray]]:
        """The window's distinct rows one table region at a time: ``(base, rows)`` for the
        regions ``[k * region_rows, (k + 1) * region_rows)`` that hold marked rows, ``rows``
        ascending (int64) and ``base`` the index of ``rows[0]`` among all distinct rows.
        Memory: one region's rows at a time (with the dense rank array, or with
        ``keep_rows=False`` when ranks come from `freeze`; else the window's rows are kept
        for `rank`, 8 B each). `rank` works once it is exhausted (not after
        ``keep_rows=False`` without the dense array)."""
        if region_rows < 1:
            raise InvalidArgument(f"region_rows must be >= 1, got {region_rows}")
        self._rows = None
        pieces: list[np.ndarray] = []
        base = 0
        for lo in range(0, self.n_rows, region_rows):
            hi = min(self.n_rows, lo + region_rows)
            rows = np.flatnonzero(self._mark[lo:hi])
            if rows.size == 0:
                continue
            rows += lo
            if self._dense:
                self._rank[rows] = np.arange(base, base + rows.size, dtype=np.int32)
            elif keep_rows:
                pieces.append(rows)
            yield base, rows
            base += int(rows.size)
        if self._dense:
            self._rows = _RANKED
        elif keep_rows:
            self._rows = np.concatenate(pieces) if pieces else np.empty(0, np.int64)

    def rank(self, ids: np.ndarray) -> np.ndarray:
        """Index of each id (all marked, after `distinct`) among the distinct rows (int32,
        same shape)."""
        rows = self._rows
        if rows is None:
            raise InvalidArgument("call distinct() before rank()")
        if self._dense:
            return self._rank[ids]
        return np.searchsorted(rows, ids).astype(np.int32)

    def clear(self) -> None:
        """Unmark the window (only its rows are touched)."""
        rows = self._rows
        if rows is None or rows is _RANKED:
            rows = np.flatnonzero(self._mark)
        self._mark[rows] = False
        self._count = 0
        self._rows = None


class PackedRanks:
    """Ranks of a window's marked rows from a snapshot of the bitmap: the bits packed into
    64-row words plus the count of marked rows before each word (16 B per 64 rows). The rank
    of a marked id is its word's prefix plus the set bits below it in the word."""

    def __init__(self, mark: np.ndarray):
        self._words = np.packbits(mark, bitorder="little").view(np.uint64)  # 64 rows a word
        counts = np.bitwise_count(self._words)
        self._prefix = np.zeros(self._words.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=self._prefix[1:])
        self.count = int(self._prefix[-1] + counts[-1]) if counts.size else 0

    @property
    def nbytes(self) -> int:
        return int(self._words.nbytes + self._prefix.nbytes)

    def rank(self, ids: np.ndarray) -> np.ndarray:
        """Index of each (marked) id among the window's distinct rows (int32 if they fit)."""
        w = ids >> 6
        below = (np.uint64(1) << (ids & 63).astype(np.uint64)) - np.uint64(1)
        r = self._prefix[w] + np.bitwise_count(self._words[w] & below)
        return r.astype(np.int32) if self.count < 2**31 else r
