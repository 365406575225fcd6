"""Writers: tables (`engramdb.build.table`), Store-P views (`engramdb.build.view`) and the
corpus index (`engramdb.build.index`).

Every writer publishes through `engramdb.disk.publish` (lock, staging, manifest rename,
garbage collection). The names below are today's ``engramdb.build`` surface.
"""

from __future__ import annotations

from engramdb.build.attach import AttachSummary, attach
from engramdb.build.table import CHUNK_BYTES, STAGE_BYTES, BuildSummary, build, drop_table
from engramdb.build.view import ViewBuildSummary, build_view
from engramdb.disk.publish import (
    LOCK_NAME,
    collect_garbage,
    database_lock,
    read_manifest_or_empty,
    write_manifest,
)

__all__ = [
    "AttachSummary",
    "attach",
    "CHUNK_BYTES",
    "LOCK_NAME",
    "STAGE_BYTES",
    "BuildSummary",
    "ViewBuildSummary",
    "build",
    "build_view",
    "collect_garbage",
    "database_lock",
    "drop_table",
    "read_manifest_or_empty",
    "write_manifest",
]
