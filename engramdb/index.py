"""Compatibility shim: ``engramdb index`` now lives in `engramdb.build.index` (writer),
`engramdb.read.index` (reader) and `engramdb.corpus` (token files)."""

from __future__ import annotations

from engramdb.build.index import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_HOT_ROWS,
    IndexSummary,
    KeyCounter,
    build_index,
)
from engramdb.corpus import BIN_DTYPES, corpus_files, open_tokens
from engramdb.read.index import FORMAT, VERSION, TableIndex, load_index

__all__ = [
    "BIN_DTYPES",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_HOT_ROWS",
    "FORMAT",
    "VERSION",
    "IndexSummary",
    "KeyCounter",
    "TableIndex",
    "build_index",
    "corpus_files",
    "load_index",
    "open_tokens",
]
