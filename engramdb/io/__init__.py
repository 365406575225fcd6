"""The reader layer: one small backend interface, three implementations, the auto rule.

``Backend.read(fds, offsets, lengths, dest, dest_offsets)`` reads a batch of byte ranges into
caller memory. Implementations: `PreadvBackend` (thread pool), `IoUringBackend` (pure-Python
io_uring, optional O_DIRECT), `MmapBackend` (gathers from a mapping); `AutoBackend` picks
per batch. `PageReader` / `IoUringPageReader` read whole pages for engines with their own
descriptors. See ``docs/io.md`` for the contract and the measured rule.
"""

from __future__ import annotations

from engramdb.io.base import Backend, BackendStats, copy_segments
from engramdb.io.mmapio import MmapBackend
from engramdb.io.pages import IoUringPageReader, PageReader
from engramdb.io.preadv import PreadvBackend
from engramdb.io.select import (
    BACKENDS,
    AutoBackend,
    choose_backend,
    cold_backend,
    direct_pays,
    make_backend,
)
from engramdb.io.uring import DISABLE_ENV, IoUringBackend

__all__ = [
    "BACKENDS",
    "DISABLE_ENV",
    "AutoBackend",
    "Backend",
    "BackendStats",
    "IoUringBackend",
    "IoUringPageReader",
    "MmapBackend",
    "PageReader",
    "PreadvBackend",
    "choose_backend",
    "cold_backend",
    "copy_segments",
    "direct_pays",
    "make_backend",
]
