"""Page-cache residency of sampled addresses (``mincore``), for the `auto` read rule.

`resident_count` answers "are this batch's pages resident?" for a few sampled addresses
(~2 us each), cheap enough to run before every large batch. `mapped_count` answers "does
this process map them?" (``/proc/self/pagemap``): a table in the page cache (warmed by
another process) is not yet in this process's page tables, and each first touch of a page
faults. Whole-file residency, eviction and page-table helpers used by probes and tests live
in `engramdb.testing.pages`.
"""

from __future__ import annotations

import ctypes
import os

from engramdb.io.mapping import LIBC
from engramdb.layouts.geometry import PAGE

__all__ = ["mapped_count", "resident_count", "sampled_residency", "spread_pages"]


def spread_pages(base: int, length: int, samples: int) -> list[int]:
    """Addresses of up to ``samples`` evenly spread pages of ``[base, base + length)`` (the
    first and the last page among them); none for an empty range."""
    pages = -(-length // PAGE)
    k = min(samples, pages)
    return [base + (i * (pages - 1) // max(1, k - 1)) * PAGE for i in range(k)]


def sampled_residency(base: int, length: int, samples: int) -> float:
    """Share of ``samples`` evenly spread pages of ``[base, base + length)`` (a live
    mapping) in the page cache (one ``mincore`` each, ~2 us, whatever the range's size); 1.0
    for an empty range."""
    addrs = spread_pages(base, length, samples)
    return resident_count(addrs) / len(addrs) if addrs else 1.0


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


_PRESENT = 1 << 63  # a pagemap entry's "page present" bit (readable without privileges)


def mapped_count(addresses: list[int]) -> int | None:
    """How many of the given addresses (plain ints inside live mappings) this process has
    in its page tables now (``/proc/self/pagemap``: one 8-byte ``pread`` per address, no
    numpy); None where pagemap cannot be read (not Linux, or a restricted /proc)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        hits = 0
        for a in addresses:  # bounded by the sample size the caller chose
            entry = os.pread(fd, 8, (a // PAGE) * 8)
            if len(entry) != 8:
                return None
            hits += int.from_bytes(entry, "little") & _PRESENT != 0
        return hits
    except OSError:
        return None
    finally:
        os.close(fd)
