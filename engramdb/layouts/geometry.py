"""Store-I geometry: badges, shards and row offsets as pure, vectorised arithmetic.

A table is one compact ``[n_rows, row_bytes]`` array. It is cut into *badges* of
``rows_per_badge`` consecutive rows whose byte size tiles whole pages, and the badges are
grouped into shard files that each begin at file offset 0 (2 MiB-aligned by definition).
Every shard except the last holds whole badges, so every shard's length is a page multiple
and the shards can be mapped back to back into one contiguous virtual range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engramdb.errors import InvalidArgument

PAGE = 4096
HUGE_PAGE = 2 * 1024 * 1024
#: Largest badge accepted on the huge-page rule; above it badges fall back to 4 KiB tiling.
MAX_HUGE_BADGE_BYTES = 128 * 1024 * 1024
#: Default shard size target (whole badges are kept, so shards may be slightly larger).
DEFAULT_SHARD_BYTES = 1024 * 1024 * 1024


def badge_rows_for(row_bytes: int) -> int:
    """Rows per badge for ``row_bytes``: the fewest rows whose bytes are a 2 MiB multiple,
    or, when that badge would exceed 128 MiB, a 4 KiB multiple."""
    if row_bytes <= 0:
        raise InvalidArgument(f"row_bytes must be > 0, got {row_bytes}")
    huge = math.lcm(row_bytes, HUGE_PAGE)
    if huge <= MAX_HUGE_BADGE_BYTES:
        return huge // row_bytes
    return math.lcm(row_bytes, PAGE) // row_bytes


@dataclass(frozen=True)
class TableGeometry:
    """Where every row of a table lives. All fields are plain ints; methods are vectorised."""

    n_rows: int
    row_bytes: int
    rows_per_badge: int
    rows_per_shard: int

    def __post_init__(self) -> None:
        if self.row_bytes <= 0:
            raise InvalidArgument(f"row_bytes must be > 0, got {self.row_bytes}")
        if self.n_rows < 0:
            raise InvalidArgument(f"n_rows must be >= 0, got {self.n_rows}")
        if self.rows_per_badge <= 0 or (self.rows_per_badge * self.row_bytes) % PAGE:
            raise InvalidArgument(
                f"rows_per_badge={self.rows_per_badge} x row_bytes={self.row_bytes} "
                "does not tile whole 4 KiB pages"
            )
        if self.rows_per_shard <= 0 or self.rows_per_shard % self.rows_per_badge:
            raise InvalidArgument(
                f"rows_per_shard={self.rows_per_shard} is not a positive multiple of "
                f"rows_per_badge={self.rows_per_badge}"
            )

    @property
    def badge_bytes(self) -> int:
        return self.rows_per_badge * self.row_bytes

    @property
    def shard_bytes(self) -> int:
        """Byte size of a full shard (every shard but possibly the last)."""
        return self.rows_per_shard * self.row_bytes

    @property
    def n_shards(self) -> int:
        return max(1, -(-self.n_rows // self.rows_per_shard)) if self.n_rows else 0

    @property
    def table_bytes(self) -> int:
        return self.n_rows * self.row_bytes

    def shard_rows(self, shard: int) -> int:
        """Rows held by shard number ``shard``."""
        if not 0 <= shard < self.n_shards:
            raise InvalidArgument(f"shard {shard} out of range [0, {self.n_shards})")
        return min(self.rows_per_shard, self.n_rows - shard * self.rows_per_shard)

    def shard_sizes(self) -> list[int]:
        return [self.shard_rows(s) * self.row_bytes for s in range(self.n_shards)]

    def locate(self, rowids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and byte offset inside the shard for each (already validated) row id."""
        rows = np.asarray(rowids, dtype=np.int64)
        shard, within = np.divmod(rows, self.rows_per_shard)
        return shard, within * self.row_bytes

    def to_dict(self) -> dict[str, int | str]:
        return {
            "kind": "compact",
            "rows_per_badge": self.rows_per_badge,
            "badge_bytes": self.badge_bytes,
            "rows_per_shard": self.rows_per_shard,
            "alignment": HUGE_PAGE,
        }


def plan_geometry(
    n_rows: int,
    row_bytes: int,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    rows_per_badge: int | None = None,
) -> TableGeometry:
    """Geometry for a new table: whole badges per shard, about ``shard_bytes`` per shard.

    ``rows_per_badge`` overrides the badge rule (it must still tile whole 4 KiB pages); it
    exists for small test tables that need several shards.
    """
    if shard_bytes <= 0:
        raise InvalidArgument(f"shard_bytes must be > 0, got {shard_bytes}")
    rpb = badge_rows_for(row_bytes) if rows_per_badge is None else int(rows_per_badge)
    if rpb <= 0 or (rpb * row_bytes) % PAGE:
        raise InvalidArgument(
            f"rows_per_badge={rpb} x row_bytes={row_bytes} does not tile whole 4 KiB pages"
        )
    badges_per_shard = max(1, shard_bytes // (rpb * row_bytes))
    return TableGeometry(
        n_rows=n_rows,
        row_bytes=row_bytes,
        rows_per_badge=rpb,
        rows_per_shard=rpb * badges_per_shard,
    )
