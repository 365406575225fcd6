"""Store-P views published in a Mooncake store: whole records in access order, read in runs.

A ranged read through the store costs the reading client tens of microseconds per byte range
(docs/distributed.md), so a lookup of ``N`` scattered rows costs ``N`` of them whatever the
batching. A view (docs/view.md) stores, for every n-gram of a corpus, the concatenation of
the rows it selects, in the order the corpus first reaches them. Published next to its table,
it turns a batch of a training stream (workload A) into a few long ranges:

* `publish_view` uploads a view's records compactly (``record_bytes`` each, no slot padding)
  as objects of whole records, and a **row index**: the records' row tuples (one global row
  id per head) sorted by their XXH64, with the record of each — the key index of a view,
  keyed by what ``lookup_into`` receives (per-head row ids) instead of n-gram tokens;
* `ViewReader` (``MooncakeTable.use_view``) matches each ``[H]`` id tuple of a batch against
  that index (vectorised hash, ``searchsorted``, tuple comparison: a tuple is never given the
  record of another), merges the records the batch needs into runs (gaps up to
  ``merge_gap_bytes`` are read through, so two nearby runs cost one range), and reads the
  runs into a registered staging buffer and the rows of unmatched positions into the output
  in **one** ``get_into_ranges``; the staged records are then copied to their positions.

The bytes returned are the table's, hit or miss: a record is the concatenation of its rows,
and the index holds the exact tuple of every record.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from engramdb.database import Database
from engramdb.errors import CorruptFile, CorruptManifest, InvalidArgument
from engramdb.integrations.mooncake._store import Counters, raise_code, read_many, read_object
from engramdb.integrations.mooncake.layout import ObjectLayout, RangePlan
from engramdb.layouts.view import default_key_hash, match_keys
from engramdb.view import View

#: Gaps between needed records up to this many bytes are read through: one range costs the
#: reading client ~30-40 us, the TCP transport moves ~64 KiB in about that time.
DEFAULT_MERGE_GAP_BYTES = 64 * 1024
#: Records read earlier are kept in a direct-mapped cache of this size per table, so the
#: n-grams a stream repeats are not read again (0 turns it off).
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PublishedView:
    """A view's entry in a publication manifest (``tables[t]["views"][name]``)."""

    name: str
    records: int
    record_bytes: int
    rows_per_record: int
    records_per_object: int
    objects: list[str]
    index: str
    index_bytes: int
    index_xxh3: str
    build_id: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, name: str, d: Any, where: str) -> PublishedView:
        try:
            pv = cls(
                name=str(d["name"]),
                records=int(d["records"]),
                record_bytes=int(d["record_bytes"]),
                rows_per_record=int(d["rows_per_record"]),
                records_per_object=int(d["records_per_object"]),
                objects=[str(k) for k in d["objects"]],
                index=str(d["index"]),
                index_bytes=int(d["index_bytes"]),
                index_xxh3=str(d["index_xxh3"]),
                build_id=str(d["build_id"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptManifest(f"{where}: view {name!r} entry is malformed: {e!r}") from None
        if pv.name != name or min(pv.records, pv.record_bytes, pv.rows_per_record) <= 0:
            raise CorruptManifest(f"{where}: view {name!r} entry has impossible geometry")
        if pv.records_per_object <= 0 or len(pv.objects) != -(-pv.records // pv.records_per_object):
            raise CorruptManifest(
                f"{where}: view {name!r} names {len(pv.objects)} objects for {pv.records} "
                f"records of {pv.records_per_object} per object"
            )
        if pv.index_bytes != index_bytes(pv.records, pv.rows_per_record):
            raise CorruptManifest(f"{where}: view {name!r} index size disagrees with its records")
        return pv


def index_bytes(records: int, heads: int) -> int:
    """Size of a row index: hashes ``<u8[K]``, tuples ``<i8[K, H]``, records ``<u4[K]``."""
    return records * (8 + 8 * heads + 4)


def _check_rows(name: str, rows: np.ndarray, heads: np.ndarray, offsets: np.ndarray) -> None:
    local = rows - offsets
    bad = np.flatnonzero(((local < 0) | (local >= heads)).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(
            f"view {name!r}: record {i} holds rows {rows[i].tolist()}, not one row of each "
            "head in head order, so it cannot serve lookup_into"
        )


def publish_view(
    client: Any,
    database: Database,
    table: str,
    view_name: str,
    key_prefix: str,
    object_bytes: int,
    stage: np.ndarray,
    put: Callable[[list[str], list[int], list[int]], None],
    progress: Callable[[int], None] | None = None,
) -> tuple[PublishedView, int]:
    """Upload view ``view_name`` of ``table``: record objects through the registered
    ``stage`` buffer (``put(keys, ptrs, sizes)`` writes a batch), then the row index.
    Returns the manifest entry and the payload bytes written."""
    info = database.manifest.tables[table]
    heads = np.asarray(info.heads, dtype=np.int64)
    offsets = np.asarray(info.head_offsets, dtype=np.int64)
    view = View(database.path, table=table, name=view_name)
    try:
        if view.rows_per_record != len(heads):
            raise InvalidArgument(
                f"view {view_name!r} of {table!r} cannot serve lookup_into: its records hold "
                f"{view.rows_per_record} rows, the table has {len(heads)} heads"
            )
        n = view.n_records
        rb = view.record_bytes
        rows = view.record_rows(np.arange(n, dtype=np.int64))
        _check_rows(view_name, rows, heads, offsets)
        per_object = max(1, min(int(object_bytes), stage.nbytes) // rb)
        keys = [f"{key_prefix}:p{k}" for k in range(-(-n // per_object))]
        total = 0
        batch: list[tuple[str, int, int]] = []
        used = 0

        def flush() -> None:
            nonlocal used, total
            if batch:
                put(
                    [k for k, _, _ in batch],
                    [stage.ctypes.data + o for _, o, _ in batch],
                    [size for _, _, size in batch],
                )
                written = sum(size for _, _, size in batch)
                total += written
                if progress is not None:
                    progress(written)
                batch.clear()
            used = 0

        for k, key in enumerate(keys):
            lo, hi = k * per_object, min(n, (k + 1) * per_object)
            size = (hi - lo) * rb
            if used + size > stage.nbytes:
                flush()
            dst = stage[used : used + size].reshape(hi - lo, rb)
            view.read_records(np.arange(lo, hi, dtype=np.int64), out=dst)
            batch.append((key, used, size))
            used += size
        flush()
        # the row index, through the same staging buffer
        hashes = default_key_hash(rows)
        order = np.argsort(hashes, kind="stable")
        nbytes = index_bytes(n, len(heads))
        if nbytes > stage.nbytes:
            raise InvalidArgument(
                f"view {view_name!r}: its row index ({nbytes:,} B) is larger than the "
                f"staging buffer ({stage.nbytes:,} B); raise staging_bytes"
            )
        blob = stage[:nbytes]
        a, b = 8 * n, 8 * n * (1 + len(heads))
        blob[:a].view("<u8")[:] = hashes[order]
        blob[a:b].view("<i8").reshape(n, len(heads))[:] = rows[order]
        blob[b:nbytes].view("<u4")[:] = order.astype(np.uint32)
        digest = xxhash.xxh3_64_hexdigest(blob.data)
        put([f"{key_prefix}:index"], [blob.ctypes.data], [nbytes])
        total += nbytes
        entry = PublishedView(
            name=view_name,
            records=n,
            record_bytes=rb,
            rows_per_record=len(heads),
            records_per_object=per_object,
            objects=keys,
            index=f"{key_prefix}:index",
            index_bytes=nbytes,
            index_xxh3=digest,
            build_id=str(view.entry.build_id),
        )
        return entry, total
    finally:
        view.close()


class ViewTable(Protocol):
    """What a `ViewReader` needs of its table (a `MooncakeTable`): the schema, the object
    layout of its rows, and the client reads go through."""

    name: str
    row_bytes: int
    head_offsets: np.ndarray
    layout: ObjectLayout

    @property
    def n_heads(self) -> int: ...

    def live_client(self) -> Any:
        """The store client; `StoreClosed` once the table is closed."""


class ViewReader:
    """A published view attached to a `MooncakeTable`: its row index in memory, and the
    planning of a batch into record runs and unmatched rows (module docstring)."""

    def __init__(
        self,
        table: ViewTable,
        pv: PublishedView,
        *,
        merge_gap_bytes: int = DEFAULT_MERGE_GAP_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        if (
            pv.rows_per_record != table.n_heads
            or pv.record_bytes != table.n_heads * table.row_bytes
        ):
            raise CorruptManifest(
                f"view {pv.name!r} records ({pv.rows_per_record} rows, {pv.record_bytes} B) "
                f"do not match table {table.name!r} ({table.n_heads} heads x {table.row_bytes} B)"
            )
        if merge_gap_bytes < 0:
            raise InvalidArgument(f"merge_gap_bytes must be >= 0, got {merge_gap_bytes}")
        self.table = table
        self.view = pv
        self.gap = int(merge_gap_bytes) // pv.record_bytes
        if cache_bytes < 0:
            raise InvalidArgument(f"cache_bytes must be >= 0, got {cache_bytes}")
        lines = int(cache_bytes) // pv.record_bytes
        # a direct-mapped cache of records read earlier: a stream's repeated n-grams
        self._tag = np.full(lines, -1, dtype=np.int64) if lines else None
        self._data = np.empty((lines, pv.record_bytes), dtype=np.uint8) if lines else None
        raw = read_object(table.live_client(), pv.index, pv.index_bytes)
        if xxhash.xxh3_64_hexdigest(raw.data) != pv.index_xxh3:
            raise CorruptFile(f"view {pv.name!r}: row index object {pv.index!r} fails its checksum")
        n, h = pv.records, pv.rows_per_record
        a, b = 8 * n, 8 * n * (1 + h)
        self.hashes = raw[:a].view("<u8")
        self.tuples = raw[a:b].view("<i8").reshape(n, h)
        self.record_of = raw[b:].view("<u4").astype(np.int64)
        if n and int(self.record_of.max()) >= n:
            raise CorruptFile(f"view {pv.name!r}: row index points past its {n} records")
        self._stage: np.ndarray | None = None
        # one batch at a time: the staging buffer is shared by the table's callers
        self._lock = threading.Lock()
        self.counters = {
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "cache_hits": 0,
            "records_read": 0,
            "runs": 0,
        }

    def close(self) -> None:
        with self._lock:
            stage, self._stage = self._stage, None
        if stage is not None:
            self.table.live_client().unregister_buffer(stage.ctypes.data)

    def _staging(self, nbytes: int) -> np.ndarray:
        stage = self._stage
        if stage is None or stage.nbytes < nbytes:
            client = self.table.live_client()
            if stage is not None:
                client.unregister_buffer(stage.ctypes.data)
                self._stage = None
            stage = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            rc = client.register_buffer(stage.ctypes.data, stage.nbytes)
            if rc != 0:
                raise_code(f"register_buffer of a {stage.nbytes} B view staging buffer", rc)
            self._stage = stage
        return stage

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray, counters: Counters) -> None:
        """Validated per-head local ids ``[..., H]`` into the registered ``out``. Calls from
        several threads take turns (they share the staging buffer)."""
        with self._lock:
            self._lookup_into(row_ids, out, counters)

    def _lookup_into(self, row_ids: np.ndarray, out: np.ndarray, counters: Counters) -> None:
        table = self.table
        pv = self.view
        h = table.n_heads
        rec = pv.record_bytes
        g = row_ids.reshape(-1, h) + table.head_offsets
        slots = match_keys(self.hashes, self.tuples, self.record_of, g, default_key_hash(g))
        hit = slots >= 0
        pos = np.flatnonzero(hit)
        c = self.counters
        c["lookups"] += 1
        c["hits"] += pos.size
        c["misses"] += g.shape[0] - pos.size
        parts: list[tuple[RangePlan, np.ndarray]] = []
        if pos.size < g.shape[0]:
            parts.append((table.layout.plan_positions(row_ids, np.flatnonzero(~hit)), out))
        if pos.size == 0:
            read_many(table.live_client(), parts, counters)
            return
        need, inv = np.unique(slots[pos], return_inverse=True)
        out2 = out.reshape(-1, rec)
        fetch, fetch_of = need, inv  # records to read; each hit position's index into them
        pos_f = pos
        if self._tag is not None:
            assert self._data is not None
            line = need % self._tag.size
            cached = self._tag[line] == need
            if cached.any():
                sel = cached[inv]
                out2[pos[sel]] = self._data[line[inv[sel]]]
                c["cache_hits"] += int(sel.sum())
                rank = np.cumsum(~cached) - 1
                fetch = need[~cached]
                pos_f = pos[~sel]
                fetch_of = rank[inv[~sel]]
        if fetch.size == 0:
            read_many(table.live_client(), parts, counters)
            return
        rpo = pv.records_per_object
        obj = fetch // rpo
        brk = np.flatnonzero((np.diff(fetch) > self.gap + 1) | (np.diff(obj) != 0)) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [fetch.size]])
        first = fetch[starts]
        lens = fetch[ends - 1] - first + 1
        base = np.concatenate([[0], np.cumsum(lens)[:-1]])
        run_obj = obj[starts]
        staged = int(lens.sum())
        stage = self._staging(staged * rec)
        # runs are in record order, so each object's runs are adjacent
        cut = np.flatnonzero(np.diff(run_obj)) + 1
        bounds = np.concatenate([[0], cut, [run_obj.size]]).tolist()
        dst = (base * rec).tolist()
        src = ((first - run_obj * rpo) * rec).tolist()
        sizes = (lens * rec).tolist()
        spans = list(zip(bounds[:-1], bounds[1:]))
        plan = RangePlan(
            keys=[pv.objects[int(run_obj[a])] for a, _ in spans],
            dst=[dst[a:b] for a, b in spans],
            src=[src[a:b] for a, b in spans],
            sizes=[sizes[a:b] for a, b in spans],
            n_ranges=int(lens.size),
            nbytes=staged * rec,
            uniform=False,
        )
        parts.append((plan, stage))
        read_many(table.live_client(), parts, counters)
        c["records_read"] += staged
        c["runs"] += int(lens.size)
        run_of = np.repeat(np.arange(lens.size), ends - starts)
        where = base[run_of] + (fetch - first[run_of])  # staging record of each fetched one
        records = stage[: staged * rec].reshape(staged, rec)
        out2[pos_f] = records[where[fetch_of]]
        if self._tag is not None:
            assert self._data is not None
            # direct-mapped: each record has one line; one record per line per batch
            lines, pick = np.unique(fetch % self._tag.size, return_index=True)
            self._tag[lines] = fetch[pick]
            self._data[lines] = records[where[pick]]


def parse_views(entry: dict[str, Any], where: str) -> dict[str, PublishedView]:
    """The ``views`` of a publication's table entry (absent: none)."""
    raw = entry.get("views") or {}
    if not isinstance(raw, dict):
        raise CorruptManifest(f"{where}: 'views' must be an object")
    return {str(k): PublishedView.parse(str(k), v, where) for k, v in raw.items()}


__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MERGE_GAP_BYTES",
    "PublishedView",
    "ViewReader",
    "ViewTable",
    "index_bytes",
    "parse_views",
    "publish_view",
]
