"""EngramDB: a disk-first embedded database engine for Engram / PLE n-gram embedding tables.

The public surface: `open` → `Database` → `Store` (``fetch`` / ``fetch_into`` /
``lookup_into``), `build`, `verify`, `keygen` (bit-exact row ids), the Mooncake-compatible
`EngramStore`, and every error class of `engramdb.errors`.

This module is a lazy facade (PEP 562): the error classes and ``__version__`` load with it,
every other name loads its module on first access, so ``import engramdb`` (or a client
process that only needs `connect`) pays for nothing it does not use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from engramdb import _cpus  # noqa: F401  (the start-up CPU mask, read at import)
from engramdb._version import __version__
from engramdb.errors import *  # noqa: F403
from engramdb.errors import EngramDBError

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "AttachSummary": "engramdb.build",
    "attach": "engramdb.build",
    "BuildSummary": "engramdb.build",
    "build": "engramdb.build",
    "drop_table": "engramdb.build",
    "Client": "engramdb.client",
    "RemoteStore": "engramdb.client",
    "RemoteView": "engramdb.client",
    "connect": "engramdb.client",
    "Database": "engramdb.database",
    "open": "engramdb.database",
    "Decoder": "engramdb.decode",
    "DecoderProcess": "engramdb.decode_process",
    "PrefetchProcess": "engramdb.prefetch_process",
    "EngramStore": "engramdb.integrations.engramstore",
    "EngramStoreConfig": "engramdb.integrations.engramstore",
    "open_mooncake": "engramdb.integrations.mooncake",
    "IoUringPageReader": "engramdb.io",
    "PageReader": "engramdb.io",
    "Prefetcher": "engramdb.read.prefetch",
    "Ticket": "engramdb.read.prefetch",
    "RowTable": "engramdb.table_api",
    "rowids_for_seq": "engramdb.keygen.seq",
    "rowids_for_seq_with_history": "engramdb.keygen.seq",
    "TableSchema": "engramdb.table_api",
    "Store": "engramdb.store",
    "stream": "engramdb.stream",
    "verify": "engramdb.verify",
    "View": "engramdb.view",
    "ViewBuildSummary": "engramdb.build.view",
    "build_view": "engramdb.build.view",
    "open_view": "engramdb.view",
    "verify_views": "engramdb.verify",
}
# public submodules reachable as attributes (``engramdb.keygen.preset(...)``)
_SUBMODULES = ("keygen",)

if TYPE_CHECKING:
    from engramdb import keygen
    from engramdb.build import AttachSummary, BuildSummary, attach, build, drop_table
    from engramdb.build.view import ViewBuildSummary, build_view
    from engramdb.client import Client, RemoteStore, RemoteView, connect
    from engramdb.database import Database, open  # noqa: A004
    from engramdb.decode import Decoder
    from engramdb.decode_process import DecoderProcess
    from engramdb.integrations.engramstore import EngramStore, EngramStoreConfig
    from engramdb.integrations.mooncake import open_mooncake
    from engramdb.io import IoUringPageReader, PageReader
    from engramdb.keygen.seq import rowids_for_seq, rowids_for_seq_with_history
    from engramdb.prefetch_process import PrefetchProcess
    from engramdb.read.prefetch import Prefetcher, Ticket
    from engramdb.store import Store
    from engramdb.stream import stream
    from engramdb.table_api import RowTable, TableSchema
    from engramdb.verify import verify, verify_views
    from engramdb.view import View, open_view


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"engramdb.{name}")
    else:
        raise AttributeError(f"module 'engramdb' has no attribute {name!r}")
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


# Three public functions share their name with the submodule that defines them (`build`,
# `stream`, `verify`). Importing a submodule sets it as an attribute of its parent package; an
# eager facade re-bound the function afterwards, a lazy one must refuse the module instead, so
# ``engramdb.build(...)`` stays the function whichever import ran first. The submodules stay
# importable by name (``from engramdb.stream import KeyStream`` reads ``sys.modules``).
_SHADOWED = frozenset(n for n, m in _LAZY.items() if m == f"engramdb.{n}")


class _Facade(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade


__all__ = [
    "AttachSummary",
    "BuildSummary",
    "Client",
    "Database",
    "Decoder",
    "DecoderProcess",
    "PrefetchProcess",
    "EngramDBError",
    "EngramStore",
    "EngramStoreConfig",
    "IoUringPageReader",
    "PageReader",
    "Prefetcher",
    "RemoteStore",
    "RemoteView",
    "RowTable",
    "Store",
    "TableSchema",
    "Ticket",
    "View",
    "ViewBuildSummary",
    "__version__",
    "attach",
    "build",
    "build_view",
    "connect",
    "drop_table",
    "keygen",
    "open",
    "open_mooncake",
    "open_view",
    "rowids_for_seq",
    "rowids_for_seq_with_history",
    "stream",
    "verify",
    "verify_views",
]
