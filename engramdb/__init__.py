"""EngramDB: a disk-first embedded database engine for Engram / PLE n-gram embedding tables.

The public surface: `open` → `Database` → `Store` (``fetch`` / ``fetch_into`` /
``lookup_into``), `build`, `verify`, `keygen` (bit-exact row ids), the Mooncake-compatible
`EngramStore`, and every error class of `engramdb.errors`.
"""

from __future__ import annotations

from engramdb.errors import *  # noqa: F403
from engramdb.errors import EngramDBError

__version__ = "0.1.0"

from engramdb import keygen  # noqa: E402
from engramdb.build import BuildSummary, build, drop_table  # noqa: E402
from engramdb.client import Client, RemoteStore, RemoteView, connect  # noqa: E402
from engramdb.database import Database, open  # noqa: E402,A004
from engramdb.decode import Decoder  # noqa: E402
from engramdb.integrations.engramstore import EngramStore, EngramStoreConfig  # noqa: E402
from engramdb.integrations.mooncake import open_mooncake  # noqa: E402
from engramdb.io import IoUringPageReader, PageReader  # noqa: E402
from engramdb.prefetch import Prefetcher, Ticket  # noqa: E402
from engramdb.store import Store  # noqa: E402
from engramdb.stream import stream  # noqa: E402
from engramdb.verify import verify  # noqa: E402
from engramdb.view import View, ViewBuildSummary, build_view, open_view, verify_views  # noqa: E402

__all__ = [
    "BuildSummary",
    "Client",
    "Database",
    "Decoder",
    "EngramDBError",
    "EngramStore",
    "EngramStoreConfig",
    "IoUringPageReader",
    "PageReader",
    "Prefetcher",
    "RemoteStore",
    "RemoteView",
    "Store",
    "Ticket",
    "View",
    "ViewBuildSummary",
    "__version__",
    "build",
    "build_view",
    "connect",
    "drop_table",
    "keygen",
    "open",
    "open_mooncake",
    "open_view",
    "stream",
    "verify",
    "verify_views",
]
