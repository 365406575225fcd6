"""Publish a local EngramDB database into a Mooncake store, and remove a publication.

`publish` streams each table head by head as store objects of whole rows (an
`ObjectLayout`), staged through one registered buffer: the rows of each object are read
from the table's shards with one read per shard it crosses (`shard_reads`, run by an
`engramdb.io` backend), then written several objects per ``batch_put_from``. The tables'
Store-P views go along (`views.publish_view`), and the manifest object is written last, so
a reader sees a publication whole or not at all. `unpublish` removes the manifest first.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.database import Database
from engramdb.disk.files import open_shards
from engramdb.errors import EngramDBError, InvalidArgument, StaleView, TableExists, TableNotFound
from engramdb.integrations.mooncake._store import (
    DEFAULT_CONNECT_TIMEOUT,
    connect,
    get_bytes,
    put_batch,
    put_bytes,
    registered,
    remove,
    replicate_config,
)
from engramdb.integrations.mooncake.layout import ObjectLayout
from engramdb.integrations.mooncake.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    check_name,
    manifest_key,
    parse_manifest,
)
from engramdb.integrations.mooncake.views import publish_view
from engramdb.io.preadv import PreadvBackend
from engramdb.layouts.manifest import TableInfo
from engramdb.layouts.view import parse_views as local_views
from engramdb.layouts.view import source_hash
from engramdb.read.attached import SourceSegments
from engramdb.units import Summary

#: Default size of one store object when a head is split (``publish``): an object must fit
#: in one storage segment, and smaller objects spread a table over more storage hosts.
DEFAULT_OBJECT_BYTES = 64 * 1024 * 1024
#: Bytes staged per ``batch_put_from`` call while publishing (bounds publish memory).
DEFAULT_STAGING_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class PublishSummary(Summary):
    """What `publish` wrote: the publication name, its tables, store objects and payload
    bytes, the time it took, and the views published or skipped."""

    name: str
    tables: list[str]
    objects: int
    bytes: int
    seconds: float
    #: published views as ``table/view``; views skipped (stale, or records that are not
    #: one row per head) with the reason
    views: tuple[str, ...] = ()
    skipped_views: tuple[str, ...] = ()

    def line(self) -> str:
        views = f" and {len(self.views)} view(s)" if self.views else ""
        skipped = f"; skipped views: {', '.join(self.skipped_views)}" if self.skipped_views else ""
        return (
            f"published {len(self.tables)} table(s){views} as {self.name!r}: {self.objects} "
            f"objects, {self.size_and_rate()}{skipped}"
        )


def shard_reads(
    info: TableInfo, first: int, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The reads that bring global rows ``[first, first + rows)`` of table ``info`` into a
    buffer: ``(shard index, file offset, length, buffer offset)`` arrays (bytes), one read
    per shard the range crosses. Pure: no I/O."""
    rb = info.row_bytes
    start = np.asarray([s.first_row for s in info.shards], dtype=np.int64)
    end = start + np.asarray([s.rows for s in info.shards], dtype=np.int64)
    lo = np.maximum(start, first)
    hi = np.minimum(end, first + rows)
    hit = np.flatnonzero(hi > lo)
    lo, hi = lo[hit], hi[hit]
    return hit, (lo - start[hit]) * rb, (hi - lo) * rb, (lo - first) * rb


def _stream_table(
    client: Any,
    db_path: Path,
    info: TableInfo,
    layout: ObjectLayout,
    stage: np.ndarray,
    cfg: Any,
    written: list[str],
    progress: Callable[[int], None] | None,
) -> int:
    """Write every object of one table through the registered ``stage`` buffer, several
    objects per ``batch_put_from``; returns payload bytes. ``written`` collects the keys."""
    rb = info.row_bytes
    batch: list[tuple[str, int, int]] = []
    used = 0
    total = 0

    def flush() -> None:
        nonlocal used, total
        if not batch:
            return
        sizes = [n for _, _, n in batch]
        ptrs = [stage.ctypes.data + o for _, o, _ in batch]
        written.extend(put_batch(client, [k for k, _, _ in batch], ptrs, sizes, cfg))
        total += sum(sizes)
        if progress is not None:
            progress(sum(sizes))
        batch.clear()
        used = 0

    fds = open_shards(db_path, info)  # attached tables: their source files, identity checked
    segments = SourceSegments(info, fds) if info.attached is not None else None
    # A few long reads per object: the pool-less path of the preadv backend (the caller's
    # thread), continuing short reads and naming the file of a failed one.
    reader = PreadvBackend(threads=1)
    try:
        fd_array = np.asarray(fds, dtype=np.int32)
        for key, h, first, rows in layout.objects():
            nbytes = rows * rb
            if used + nbytes > stage.nbytes:
                flush()
            g = int(info.head_offsets[h]) + first
            if segments is not None:
                segments.read_range(g, rows, stage[used : used + nbytes].reshape(rows, rb))
            else:
                shard, offset, length, dest = shard_reads(info, g, rows)
                reader.read(fd_array[shard], offset, length, stage, dest + used)
            batch.append((key, used, nbytes))
            used += nbytes
        flush()
    finally:
        reader.close()
        if segments is not None:
            segments.close()
        for fd in fds:
            os.close(fd)
    return total


def publish(
    db: Any,
    *,
    master: str | None = None,
    metadata: str | None = None,
    name: str | None = None,
    tables: Sequence[str] | None = None,
    object_bytes: int = DEFAULT_OBJECT_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    client: Any = None,
    config: Any = None,
    progress: Callable[[int], None] | None = None,
    local_hostname: str | None = None,
    protocol: str = "tcp",
    views: bool | Sequence[str] = True,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> PublishSummary:
    """Stream tables of the EngramDB database ``db`` (path or `Database`) into the store.

    Each head is cut into objects of at most ``object_bytes`` whole rows
    (``engramdb:{name}:{table}:h{h}:p{k}``), staged ``staging_bytes`` at a time through one
    registered buffer (bounded memory) and written with ``batch_put_from``; the manifest
    object ``engramdb:{name}:manifest`` is written last, so a reader sees a publication
    whole or not at all. Create-only: an existing manifest is `TableExists` (remove it
    with `unpublish`). A failure removes the objects this call wrote. ``progress(n)`` is
    called with payload bytes as they are written. Cost: one read of each table from
    disk and one copy over the transport.

    ``views``: also publish the tables' Store-P views (``True``: every view whose records
    hold one row of each head, in head order, skipping stale or other views; a list: those
    names, which must qualify), as record objects plus a row index
    (`engramdb.integrations.mooncake.views`); readers use them with
    ``MooncakeTable.use_view``."""
    own_db = not isinstance(db, Database)
    database = Database(db) if own_db else db
    own_client = client is None
    try:
        name = check_name(name or database.path.resolve().name)
        chosen = list(tables) if tables else database.tables
        for t in chosen:
            if t not in database:
                raise TableNotFound(f"no table {t!r} in {str(database.path)!r}")
        if own_client:
            if not master or not metadata:
                raise InvalidArgument("publish needs master= and metadata= (or client=)")
            client = connect(
                master,
                metadata,
                local_hostname=local_hostname,
                protocol=protocol,
                connect_timeout=connect_timeout,
            )
        cfg = replicate_config(client, config)
        if get_bytes(client, manifest_key(name)) is not None:
            raise TableExists(f"{name!r} is already published in this store; unpublish it first")
        doc: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "name": name,
            "source": str(database.path),
            "source_generation": database.manifest.generation,
            "tables": {},
        }
        written: list[str] = []
        published_views: list[str] = []
        skipped_views: list[str] = []
        t0 = time.perf_counter()
        total = 0
        stage = np.empty(max(int(staging_bytes), int(object_bytes)), dtype=np.uint8)

        def put(keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
            written.extend(put_batch(client, keys, ptrs, sizes, cfg))

        try:
            with registered(client, stage):
                for t in chosen:
                    info = database.manifest.tables[t]

                    def key_of(h: int, k: int, _n: int, t: str = t) -> str:
                        return f"engramdb:{name}:{t}:h{h}:p{k}"

                    layout = ObjectLayout.split(info.heads, info.row_bytes, object_bytes, key_of)
                    total += _stream_table(
                        client, database.path, info, layout, stage, cfg, written, progress
                    )
                    entry = info.to_dict()
                    for drop in ("shards", "sources", "layout"):
                        entry.pop(drop, None)
                    entry["rows_per_object"] = layout.rows_per_object
                    entry["objects"] = layout.keys
                    entry["views"] = {}
                    for v, why in _views_to_publish(database, t, views):
                        if why is not None:
                            skipped_views.append(f"{t}/{v} ({why})")
                            continue
                        pv, nbytes = publish_view(
                            client,
                            database,
                            t,
                            v,
                            f"engramdb:{name}:{t}:view:{v}",
                            object_bytes,
                            stage,
                            put,
                            progress,
                        )
                        total += nbytes
                        entry["views"][v] = pv.to_dict()
                        published_views.append(f"{t}/{v}")
                    doc["tables"][t] = entry
            put_bytes(client, manifest_key(name), json.dumps(doc).encode(), cfg)
        except BaseException:
            try:
                remove(client, written, True)
            except EngramDBError:
                pass
            raise
        return PublishSummary(
            name,
            chosen,
            len(written),
            total,
            time.perf_counter() - t0,
            tuple(published_views),
            tuple(skipped_views),
        )
    finally:
        if own_db:
            database.close()
        if own_client and client is not None:
            client.close()


def _views_to_publish(
    database: Any, table: str, views: bool | Sequence[str]
) -> list[tuple[str, str | None]]:
    """``(view, reason to skip or None)`` for the views of ``table`` that ``views`` asks for."""
    info = database.manifest.tables[table]
    have = local_views(info)
    if views is False:
        return []
    if views is True:
        names, strict = sorted(have), False
    else:
        names, strict = [str(v) for v in views], True
        for v in names:
            if v not in have:
                raise TableNotFound(f"table {table!r} has no view {v!r} (views: {sorted(have)})")
    out: list[tuple[str, str | None]] = []
    for v in names:
        e = have[v]
        why = None
        if e.rows_per_record != len(info.heads):
            why = f"records of {e.rows_per_record} rows, {len(info.heads)} heads"
        elif e.source_hash != source_hash(info):
            why = "stale"
        if why is not None and strict:
            err = StaleView if why == "stale" else InvalidArgument
            raise err(f"view {v!r} of {table!r} cannot be published: {why}")
        out.append((v, why))
    return out


def unpublish(name: str, *, client: Any, force: bool = True) -> int:
    """Remove a publication's manifest (first, so no new reader opens it) and objects;
    returns the number of objects removed."""
    raw = get_bytes(client, manifest_key(name))
    if raw is None:
        return 0
    doc = parse_manifest(raw, name)
    remove(client, [manifest_key(name)], force)
    keys = [k for t in doc["tables"].values() for ks in t["objects"] for k in ks]
    for t in doc["tables"].values():
        for v in (t.get("views") or {}).values():
            keys.extend(v.get("objects", []))
            keys.append(v.get("index", ""))
    return len(remove(client, [k for k in keys if k], force))


__all__ = [
    "DEFAULT_OBJECT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "PublishSummary",
    "publish",
    "shard_reads",
    "unpublish",
]
