"""Moved to `engramdb.read.cache` (this re-export goes once every importer has moved)."""

from engramdb.read.cache import *  # noqa: F403
from engramdb.read.cache import CacheStats, RowCache

__all__ = ["CacheStats", "RowCache"]
