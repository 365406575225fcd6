"""Rows assembled from several column sources in one pass (an attached table's 256 B weight
row + 8 B scale row into a 264 B row).

numpy cannot gather into a strided destination (``np.take`` wants a contiguous ``out``), so
the numpy way costs one gather per column plus a strided copy of each: ~0.6-0.75x of one
gather of whole rows on this VM, mostly the second column's extra random access. The
compiled loop (``_columns.c``, built at install when a C compiler is there) writes every
column of a row straight into place and prefetches the source lines a few rows ahead, so
the two random accesses of a row overlap: 0.90-0.95x the built table's warm fetch in
``probes/attach.py`` (1.01x where the tensor data starts on a cache line; the numpy path
0.60x). It releases the GIL while it copies, like ``np.take``.

`take_columns` returns False when the loop is not built or is turned off
(``ENGRAMDB_NATIVE=0``, read once per process); the caller then takes its numpy path.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

from engramdb.errors import RowIdOutOfRange

_native: ModuleType | None
try:
    from engramdb.io import _columns as _native
except ImportError:  # pragma: no cover - built without a C compiler
    _native = None

__all__ = ["NATIVE_ENV", "native_enabled", "take_columns"]

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


def take_columns(columns: list[tuple[np.ndarray, int]], ids: np.ndarray, out2d: np.ndarray) -> bool:
    """``out2d[i]`` = the concatenation of row ``ids[i]`` of each ``(source, width)`` column
    (sources C-contiguous ``[rows, width]`` uint8, in row order; ``ids`` int64, ``out2d``
    C-contiguous ``[len(ids), sum of widths]``) in one compiled pass. False (nothing
    written) when the compiled loop is not available or an array is not contiguous; raises
    `RowIdOutOfRange` for an id past a column's rows (rows before it are written)."""
    if not native_enabled():
        return False
    if not (ids.dtype == np.int64 and ids.flags.c_contiguous and out2d.flags.c_contiguous):
        return False
    if not all(src.flags.c_contiguous for src, _ in columns):
        return False
    assert _native is not None
    bad = _native.take(out2d, ids, columns)
    if bad >= 0:
        rows = min(src.shape[0] for src, _ in columns)
        raise RowIdOutOfRange(f"row id {int(ids[bad])} out of range [0, {rows})")
    return True
