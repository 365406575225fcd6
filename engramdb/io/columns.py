"""Compiled row gathers (``_columns.c``, built at install when a C compiler is there).

* `take_prefetched`: rows of one table, asking for the lines of the row 32 ahead while it
  copies the current one: faster than ``np.take`` for rows that miss the L2 (1.05x on one
  thread for 256 B rows from memory; docs/io.md has the figures), used by
  `engramdb.io.gather.take_one` for batches of 64 KiB or more.
* `take_columns`: rows assembled from several column sources in one call (an attached
  table's 256 B weight row + 8 B scale row into a 264 B row; a column may also be a byte
  range of wider source rows placed anywhere in the output row: the weight row less its
  spill, and the RAM record of spill + scale, `engramdb.read.resident`). numpy cannot
  gather into a strided destination (``np.take`` wants a contiguous ``out``), so the numpy
  way costs one gather per column plus a strided copy of each. The compiled loop writes
  every column straight into place, source by source within chunks of 256 rows, each
  source with its own prefetch stream.

Both release the GIL while they copy a large batch, like ``np.take``. They return False
when the loop is not built or is turned off (``ENGRAMDB_NATIVE=0``, read once per
process); the caller then takes its numpy path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from engramdb.errors import RowIdOutOfRange
from engramdb.validate import check_bounds

_native: ModuleType | None
try:
    from engramdb.io import _columns as _native
except ImportError:  # pragma: no cover - built without a C compiler
    _native = None

__all__ = [
    "NATIVE_ENV",
    "globalizer",
    "heads_checker",
    "native_enabled",
    "rows_matcher",
    "take_columns",
    "take_prefetched",
]

#: ``0`` turns the compiled column gather off (the numpy path runs instead).
NATIVE_ENV = "ENGRAMDB_NATIVE"

_enabled: bool | None = None


def native_enabled() -> bool:
    """Whether the compiled column gather is built and not turned off by ``ENGRAMDB_NATIVE=0``
    (read once per process)."""
    global _enabled
    if _enabled is None:
        _enabled = _native is not None and os.environ.get(NATIVE_ENV, "").strip() != "0"
    return _enabled


def take_columns(
    columns: Sequence[tuple[np.ndarray, int] | tuple[np.ndarray, int, int, int, int]],
    ids: np.ndarray,
    out2d: np.ndarray,
) -> bool:
    """Rows of ``ids`` (int64) assembled from column sources into ``out2d`` (C-contiguous
    ``[len(ids), row bytes]``) in one compiled pass. A column is ``(source, width)``: the
    columns' rows follow each other in an output row, in order, their widths summing to a
    row; or ``(source, width, stride, skip, dst)``: ``width`` bytes at ``skip`` of each
    ``stride``-byte row of ``source`` go to byte ``dst`` of an output row (bytes no column
    names are left alone). Sources are C-contiguous arrays of whole rows. False (nothing
    written) when the compiled loop is not available or an array is not contiguous; raises
    `RowIdOutOfRange` for an id past a column's rows (every id is checked first: nothing is
    written then)."""
    if not native_enabled():
        return False
    if not (ids.dtype == np.int64 and ids.flags.c_contiguous and out2d.flags.c_contiguous):
        return False
    if not all(c[0].flags.c_contiguous for c in columns):
        return False
    assert _native is not None
    bad = _native.take(out2d, ids, columns)
    if bad >= 0:
        rows = min(c[0].nbytes // (c[2] if len(c) == 5 else c[1]) for c in columns)
        check_bounds(ids, rows)  # raises, naming the id and its position
    return True


def take_prefetched(
    table: np.ndarray, ids: np.ndarray, out: np.ndarray, prefetch: bool = True
) -> bool:
    """``out[i] = table[ids[i]]`` (``table`` a C-contiguous 2-D array, ``ids`` int64 or a
    narrower integer type, ``out`` C-contiguous with ``len(ids)`` rows of the table's) in
    one compiled pass that asks for the source lines of the row 32 ahead (into L2) while it
    copies the current one: rows that miss the L2 come sooner than with ``np.take``, which
    waits for each row's lines in turn. False (nothing written) when the loop is not built, is turned off, or an
    array does not fit it; raises `RowIdOutOfRange` for an id past the table (rows before
    it are written). ``prefetch=False``: the same loop without the prefetches (rows already
    in the CPU caches copy ~20 % faster without them)."""
    if not native_enabled():
        return False
    if ids.dtype != np.int64 and ids.dtype.kind in "iu" and ids.dtype.itemsize <= 4:
        ids = ids.astype(np.int64)  # a narrower id array (a window's ranks): one cheap pass
    if not (
        ids.dtype == np.int64
        and ids.flags.c_contiguous
        and table.ndim == 2
        and table.flags.c_contiguous
        and out.flags.c_contiguous
        and out.dtype == table.dtype
        and out.size == ids.size * table.shape[1]
    ):
        return False
    assert _native is not None
    bad = _native.take_rows(out, table, table.shape[1] * table.itemsize, ids, prefetch)
    if bad >= 0:
        bad_id = int(ids.reshape(-1)[bad])
        raise RowIdOutOfRange(f"row id {bad_id} out of range [0, {table.shape[0]})")
    return True


def _compiled(name: str) -> Any:
    """The compiled function ``name`` of ``_columns``, or None (not built, turned off, or a
    build older than the function)."""
    return getattr(_native, name, None) if native_enabled() else None


def heads_checker() -> Callable[[int, int, bytes], bool] | None:
    """The compiled per-head bounds check ``check(address, n, bounds) -> bool`` (None when
    the loop is not built or is turned off): whether each of the ``n`` int64 ids at
    ``address`` (a C-contiguous CPU buffer the caller holds for the call, e.g. a torch
    tensor's ``data_ptr()``) is below its head's bound, id ``i`` against head ``i % H`` of
    ``bounds`` (``H`` native-endian uint64 as bytes; a negative id, read unsigned, is
    huge). One call and no numpy array: inside a model step, where numpy's code has left
    the CPU caches, it costs a fraction of a numpy check of the same few ids."""
    return _compiled("in_heads")  # type: ignore[no-any-return]


def globalizer() -> Callable[[object, bytes, bytes, Any], int] | None:
    """The compiled ``to_global(ids, bounds, offsets, out) -> 1 / 0 / -1`` (None when the
    loop is not built or is turned off): `heads_checker`'s check of the local ids of the
    buffer ``ids`` (a CPU tensor's ``.numpy()`` view) and, where they are all in range, each
    id plus its head's offset (``offsets``: ``H`` int64 as bytes) written into ``out`` (a
    writable C-contiguous int64 array of as many), as numpy's ``ids + offsets`` would: 1.
    0 where an id is out of range (``out`` then partly written: discard it); -1, nothing
    written, where ``ids`` is not C-contiguous int64 with a last axis of ``H`` or ``out`` is
    not its size."""
    return _compiled("global_of")  # type: ignore[no-any-return]


def grid_taker() -> Callable[..., int] | None:
    """The compiled ``take_grid(out, offset, group, group_stride, table, width, ids,
    prefetch=True, fd=-1, min_size=0) -> int`` (None when the loop is not built or is turned
    off): `take_prefetched` into a grid of rows, row ``i`` of ``ids`` to byte ``offset + (i //
    group) * group_stride + (i % group) * width`` of the C-contiguous ``out`` (every place
    checked against its size), e.g. one layer's slice ``[B, H, rb]`` of a decoder's ``[B, L, H,
    rb]`` buffer, which ``np.take`` reaches only through a temporary and a strided copy.
    Returns -1, or the position of the first id past the table's rows (rows before it are
    written), or -2 with nothing read when ``fd`` >= 0 names a file that now ends before
    ``min_size`` (an attached table's mapped source, truncated: reading its mapping would
    raise SIGBUS) or cannot be sought."""
    return _compiled("take_grid")  # type: ignore[no-any-return]


def rows_matcher() -> Callable[[int, int, Any, bytes], bool] | None:
    """The compiled check ``match(address, n, rows, offsets) -> bool`` (None when the loop is
    not built or is turned off): whether the ``n`` int64 local ids at ``address`` (as for
    `heads_checker`) plus their head's offset (``offsets``: ``H`` int64 as bytes, id ``i``
    of head ``i % H``) equal the global row ids of the C-contiguous int64 array ``rows``,
    as numpy's wrapping ``ids + offsets == rows`` would say. False where the counts differ
    or ``rows`` is not C-contiguous."""
    return _compiled("rows_match")  # type: ignore[no-any-return]
