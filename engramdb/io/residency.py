"""Page-cache residency of sampled addresses (``mincore``), for the `auto` read rule.

`resident_count` answers "are this batch's pages resident?" for a few sampled addresses
(~2 us each), cheap enough to run before every large batch. Whole-file residency, eviction
and page-table helpers used by probes and tests live in `engramdb.testing.pages`.
"""

from __future__ import annotations

import ctypes
import os

from engramdb.io.mapping import LIBC
from engramdb.layouts.geometry import PAGE

__all__ = ["resident_count"]


def resident_count(addresses: list[int]) -> int:
    """How many of the given addresses (plain ints inside live mappings) sit on resident
    pages (one ``mincore`` per address, ~2 us, no numpy). Raises `OSError` (``ENOMEM``)
    for an address outside any mapping."""
    vec = ctypes.c_ubyte(0)
    ref = ctypes.byref(vec)
    mincore = LIBC.mincore
    mask = ~(PAGE - 1)
    hits = 0
    for a in addresses:  # bounded by the sample size the caller chose
        if mincore(a & mask, PAGE, ref) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mincore: {os.strerror(e)}")
        hits += vec.value & 1
    return hits
