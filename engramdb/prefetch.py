"""Moved to `engramdb.read.prefetch` (this re-export goes once every importer has moved)."""

from engramdb.read.prefetch import *  # noqa: F403
from engramdb.read.prefetch import (
    CANCELLED,
    DONE,
    FAILED,
    QUEUED,
    RUNNING,
    Prefetcher,
    PrefetchStats,
    RowSource,
    Ticket,
)

__all__ = [
    "CANCELLED",
    "DONE",
    "FAILED",
    "QUEUED",
    "RUNNING",
    "PrefetchStats",
    "Prefetcher",
    "RowSource",
    "Ticket",
]
