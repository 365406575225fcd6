"""Store-P view format as pure math and schemas: headers, slot offsets, key index, no I/O.

A view is up to three files under ``DB/<table>/views/`` (spec: ``docs/view.md``):

* ``<name>-<id>.edv`` — a 4096 B header page, then ``n_slots`` fixed-size slots back to back
  in access order. Slot ``i`` starts at byte ``HEADER_BYTES + i * slot_bytes``; its first
  ``record_bytes`` bytes are the record (the concatenation of the key's rows), the rest zeros.
* ``<name>-<id>.keys`` — the key index: a header page, the sorted XXH64 of every key (``<u8``),
  the keys in that order (``<i8[K, W]``), and each key's slot (``<u4``).
* ``<name>-<id>.rows`` — views built from explicit row ids only: the ids (``<i8[K, H]``).

Everything here is vectorised numpy or struct packing; `engramdb.view` does the I/O.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from engramdb.errors import CorruptFile, CorruptManifest, InvalidArgument

# The key math moved to `engramdb.layouts.keys`; these names stay importable from here.
from engramdb.layouts.keys import (  # noqa: F401
    KeyHash,
    default_key_hash,
    match_keys,
    xxh64_keys,
)
from engramdb.layouts.manifest import CHECK_BLOCK_BYTES, FileEntry, TableInfo, check_rel_path

VIEW_FORMAT_VERSION = 1
#: Every view file starts with one header page; data starts page-aligned after it.
HEADER_BYTES = 4096
VIEW_MAGIC = b"EDBVIEW\x00"
KEYS_MAGIC = b"EDBVKEY\x00"
ROWS_MAGIC = b"EDBVROW\x00"
VIEW_SUFFIX, KEYS_SUFFIX, ROWS_SUFFIX = ".edv", ".keys", ".rows"
#: Key hash kinds recorded in the key index header.
HASH_XXH64 = 1
HASH_CUSTOM = 255
#: Slot numbers are stored as ``<u4``.
MAX_SLOTS = (1 << 32) - 1
MAX_KEY_WIDTH = 16
MAX_NAME_BYTES = 128
MAX_PRESET_BYTES = 64
#: The header checksum (xxh3-64 of bytes ``[0, CHECKSUM_AT)``) sits in the page's last 8 bytes.
CHECKSUM_AT = HEADER_BYTES - 8

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")


def check_view_name(name: str) -> str:
    """Return ``name`` if it is a valid view name (same rule as table names)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(
            f"invalid view name {name!r}: use 1-128 characters from [A-Za-z0-9_.-], "
            "not starting with '.' or '-'"
        )
    return name


# --- the source table's identity -----------------------------------------------------------
def source_hash(info: TableInfo) -> str:
    """xxh3-64 (16 hex digits) of the table's geometry and shard checksums.

    Any rebuild that changes a row changes a shard checksum, hence this hash; a rebuild with
    identical bytes and geometry keeps it (the view is then still exact). Shard paths are
    left out on purpose: they name the generation, not the content.
    """
    doc = {
        "row_bytes": info.row_bytes,
        "n_rows": info.n_rows,
        "heads": list(info.heads),
        "rows_per_badge": info.geometry.rows_per_badge,
        "rows_per_shard": info.geometry.rows_per_shard,
        "shards": [s.xxh3_64 for s in info.shards],
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(text.encode())


# --- headers --------------------------------------------------------------------------------
def _fixed_str(text: str, size: int, what: str) -> bytes:
    raw = text.encode()
    if len(raw) > size or b"\x00" in raw:
        raise InvalidArgument(f"{what} {text!r} does not fit {size} bytes of UTF-8 without NUL")
    return raw


def _read_str(raw: bytes) -> str:
    return raw.rstrip(b"\x00").decode("utf-8", errors="replace")


def _seal(body: bytes) -> bytes:
    page = body.ljust(CHECKSUM_AT, b"\x00")
    return page + struct.pack("<Q", xxhash.xxh3_64_intdigest(page))


def _open_page(page: bytes, magic: bytes, what: str) -> None:
    if len(page) < HEADER_BYTES:
        raise CorruptFile(f"{what}: header page is {len(page)} bytes, expected {HEADER_BYTES}")
    if page[:8] != magic:
        raise CorruptFile(f"{what}: bad magic {page[:8]!r}, expected {magic!r}")
    (version,) = struct.unpack_from("<I", page, 8)
    if version != VIEW_FORMAT_VERSION:
        raise CorruptFile(
            f"{what}: format version {version} is not supported (this engine reads "
            f"{VIEW_FORMAT_VERSION})"
        )
    (stored,) = struct.unpack_from("<Q", page, CHECKSUM_AT)
    actual = xxhash.xxh3_64_intdigest(page[:CHECKSUM_AT])
    if stored != actual:
        raise CorruptFile(
            f"{what}: header checksum {actual:016x} differs from stored {stored:016x}"
        )


_VIEW_HDR = struct.Struct("<8sIIQQQIIQQqII128s64s")


@dataclass(frozen=True)
class ViewHeader:
    """The first page of a ``.edv`` file. ``layer`` is -1 when the view has no key hasher."""

    slot_bytes: int
    record_bytes: int
    n_slots: int
    rows_per_record: int
    row_bytes: int
    source_hash: int
    build_id: int
    layer: int
    key_width: int  # 0: built from explicit row ids (no key index)
    table: str
    preset: str

    def pack(self) -> bytes:
        return _seal(
            _VIEW_HDR.pack(
                VIEW_MAGIC,
                VIEW_FORMAT_VERSION,
                HEADER_BYTES,
                self.slot_bytes,
                self.record_bytes,
                self.n_slots,
                self.rows_per_record,
                self.row_bytes,
                self.source_hash,
                self.build_id,
                self.layer,
                self.key_width,
                0,
                _fixed_str(self.table, MAX_NAME_BYTES, "table name"),
                _fixed_str(self.preset, MAX_PRESET_BYTES, "preset name"),
            )
        )

    @classmethod
    def unpack(cls, page: bytes, what: str) -> ViewHeader:
        """Parse and check a header page; `CorruptFile` names ``what`` and the violation."""
        _open_page(page, VIEW_MAGIC, what)
        f = _VIEW_HDR.unpack_from(page, 0)
        h = cls(
            slot_bytes=f[3],
            record_bytes=f[4],
            n_slots=f[5],
            rows_per_record=f[6],
            row_bytes=f[7],
            source_hash=f[8],
            build_id=f[9],
            layer=f[10],
            key_width=f[11],
            table=_read_str(f[13]),
            preset=_read_str(f[14]),
        )
        if f[2] != HEADER_BYTES:
            raise CorruptFile(f"{what}: header_bytes is {f[2]}, expected {HEADER_BYTES}")
        if h.row_bytes <= 0 or h.rows_per_record <= 0:
            raise CorruptFile(f"{what}: row_bytes and rows_per_record must be positive")
        if h.record_bytes != h.rows_per_record * h.row_bytes or h.slot_bytes < h.record_bytes:
            raise CorruptFile(
                f"{what}: record_bytes {h.record_bytes} != {h.rows_per_record} rows x "
                f"{h.row_bytes} B, or slot_bytes {h.slot_bytes} is smaller"
            )
        if h.n_slots > MAX_SLOTS or h.key_width > MAX_KEY_WIDTH:
            raise CorruptFile(f"{what}: {h.n_slots} slots / key width {h.key_width} out of range")
        return h

    @property
    def file_bytes(self) -> int:
        return view_file_bytes(self.n_slots, self.slot_bytes)


_KEYS_HDR = struct.Struct("<8sIIQIIQQQ")


@dataclass(frozen=True)
class KeyIndexHeader:
    """The first page of a ``.keys`` file."""

    n_keys: int
    key_width: int
    hash_kind: int
    hash_seed: int
    build_id: int
    n_slots: int

    def pack(self) -> bytes:
        return _seal(
            _KEYS_HDR.pack(
                KEYS_MAGIC,
                VIEW_FORMAT_VERSION,
                HEADER_BYTES,
                self.n_keys,
                self.key_width,
                self.hash_kind,
                self.hash_seed,
                self.build_id,
                self.n_slots,
            )
        )

    @classmethod
    def unpack(cls, page: bytes, what: str) -> KeyIndexHeader:
        _open_page(page, KEYS_MAGIC, what)
        f = _KEYS_HDR.unpack_from(page, 0)
        h = cls(
            n_keys=f[3], key_width=f[4], hash_kind=f[5], hash_seed=f[6], build_id=f[7], n_slots=f[8]
        )
        if f[2] != HEADER_BYTES or not 1 <= h.key_width <= MAX_KEY_WIDTH:
            raise CorruptFile(f"{what}: bad header_bytes {f[2]} or key width {h.key_width}")
        if h.hash_kind not in (HASH_XXH64, HASH_CUSTOM):
            raise CorruptFile(f"{what}: unknown key hash kind {h.hash_kind}")
        if h.n_keys > h.n_slots:
            raise CorruptFile(f"{what}: {h.n_keys} keys for {h.n_slots} slots")
        return h

    @property
    def file_bytes(self) -> int:
        return key_index_bytes(self.n_keys, self.key_width)


_ROWS_HDR = struct.Struct("<8sIIQIIQQ")


@dataclass(frozen=True)
class RowsHeader:
    """The first page of a ``.rows`` file (views built from explicit row ids)."""

    n_records: int
    rows_per_record: int
    build_id: int
    table_rows: int

    def pack(self) -> bytes:
        return _seal(
            _ROWS_HDR.pack(
                ROWS_MAGIC,
                VIEW_FORMAT_VERSION,
                HEADER_BYTES,
                self.n_records,
                self.rows_per_record,
                0,
                self.build_id,
                self.table_rows,
            )
        )

    @classmethod
    def unpack(cls, page: bytes, what: str) -> RowsHeader:
        _open_page(page, ROWS_MAGIC, what)
        f = _ROWS_HDR.unpack_from(page, 0)
        if f[2] != HEADER_BYTES or f[4] <= 0:
            raise CorruptFile(f"{what}: bad header_bytes {f[2]} or rows per record {f[4]}")
        return cls(n_records=f[3], rows_per_record=f[4], build_id=f[6], table_rows=f[7])

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + 8 * self.n_records * self.rows_per_record


# --- sizes and offsets ----------------------------------------------------------------------
def view_file_bytes(n_slots: int, slot_bytes: int) -> int:
    return HEADER_BYTES + n_slots * slot_bytes


def key_index_bytes(n_keys: int, key_width: int) -> int:
    return HEADER_BYTES + n_keys * (8 + 8 * key_width + 4)


def key_index_sections(n_keys: int, key_width: int) -> tuple[int, int, int]:
    """Byte offsets of the hashes, keys and slots sections. Hashes and keys come first so
    both stay 8-byte aligned whatever ``n_keys`` is."""
    hashes = HEADER_BYTES
    keys = hashes + 8 * n_keys
    slots = keys + 8 * n_keys * key_width
    return hashes, keys, slots


def bytes_per_key(slot_bytes: int, key_width: int) -> int:
    """Disk bytes one key costs in a key view: its slot plus its key-index entry."""
    return slot_bytes + 8 + 8 * key_width + 4


def budget_keys(budget: int, slot_bytes: int, key_width: int) -> int:
    """How many keys fit ``budget`` bytes of view + key index (both header pages included)."""
    return max(0, (budget - 2 * HEADER_BYTES) // bytes_per_key(slot_bytes, key_width))


def keep_most_frequent(counts: np.ndarray | None, n_keys: int, keep: int) -> np.ndarray:
    """Indices (ascending, i.e. still in access order) of the ``keep`` most frequent keys.

    Ties go to the earlier key (a stable sort). Without counts, the first ``keep`` keys.
    Cost: one stable argsort of the counts.
    """
    if keep >= n_keys:
        return np.arange(n_keys, dtype=np.int64)
    if counts is None:
        return np.arange(keep, dtype=np.int64)
    order = np.argsort(-np.asarray(counts, dtype=np.int64), kind="stable")[:keep]
    return np.sort(order)


# --- slot reads -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SlotReadPlan:
    """Reads that fetch a batch of slots from a ``.edv`` file with the fewest requests.

    ``unique`` are the distinct slots in ascending order; ``inverse[i]`` is the position in
    ``unique`` of request ``i`` (``None`` when the batch is already strictly ascending, so the
    reads can land in the output directly). Request ``j`` reads ``lengths[j]`` bytes at file
    offset ``offsets[j]`` into byte ``dest_offsets[j]`` of a ``[len(unique), slot_bytes]``
    buffer.
    """

    unique: np.ndarray
    inverse: np.ndarray | None
    offsets: np.ndarray
    lengths: np.ndarray
    dest_offsets: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def plan_slot_reads(slots: np.ndarray, slot_bytes: int, *, max_request: int) -> SlotReadPlan:
    """Coalesce runs of consecutive slots into single reads of at most ``max_request`` bytes.

    Only exactly adjacent slots merge: reading across a gap would raise the bytes read per
    byte returned above 1 (on these disks merging nearby rows gained ~9 %, not worth it).
    Cost: an ``np.unique`` of the batch when it is not already strictly ascending.
    """
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    n = s.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return SlotReadPlan(empty, None, empty, empty, empty)
    d = np.diff(s)
    if n == 1 or int(d.min()) > 0:
        unique, inverse = s, None
        step = d
    else:
        unique, inverse = np.unique(s, return_inverse=True)
        step = np.diff(unique)
    starts = np.flatnonzero(step != 1) + 1
    run_first = np.concatenate([np.zeros(1, np.int64), starts])
    run_len = np.diff(np.concatenate([run_first, np.array([unique.shape[0]], np.int64)]))
    per_req = max(1, max_request // slot_bytes)
    if int(run_len.max()) > per_req:
        # Split long runs so a cold backend can keep several large reads in flight.
        pieces = -(-run_len // per_req)
        first = np.repeat(run_first, pieces)
        k = np.arange(first.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        first = first + k * per_req
        end = np.repeat(run_first + run_len, pieces)
        run_first, run_len = first, np.minimum(end - first, per_req)
    offsets = HEADER_BYTES + unique[run_first] * slot_bytes
    return SlotReadPlan(
        unique=unique,
        inverse=inverse,
        offsets=offsets,
        lengths=run_len * slot_bytes,
        dest_offsets=run_first * slot_bytes,
    )


# --- the manifest entry ---------------------------------------------------------------------
def _tname(v: Any) -> str:
    return f"{type(v).__name__} {str(v)[:60]!r}"


#: The fields of a view's ``hasher`` object, each a string, an int or absent / null.
_HASHER_FIELDS = dict.fromkeys(("preset", "name", "kind", "fingerprint"), str) | dict.fromkeys(
    ("layer", "max_ngram", "n_heads"), int
)


def _typed(d: dict[str, Any], key: str, typ: type, where: str, default: Any = None) -> Any:
    """Optional field ``d[key]``: absent or null, or of type ``typ`` (a bool is no int)."""
    v = d.get(key, default)
    if v is not None and (not isinstance(v, typ) or (typ is int and isinstance(v, bool))):
        raise CorruptManifest(
            f"manifest: {where}.{key} must be {typ.__name__} or null, got {_tname(v)}"
        )
    return v


#: One file of a view as the manifest names it: the one file-entry type (like a shard entry).
ViewFile = FileEntry


def parse_view_file(d: Any, where: str, table: str) -> FileEntry:
    """The `FileEntry` of manifest object ``d`` (``where`` names it in errors), a file of a
    view of ``table``: checked to lie under ``<table>/views/``, at least a header page long,
    with a valid xxh3-64 and one block checksum per `CHECK_BLOCK_BYTES` (or none)."""
    if not isinstance(d, dict):
        raise CorruptManifest(f"manifest: {where} is not an object")
    path, size, digest = d.get("path"), d.get("bytes"), d.get("xxh3_64")
    blocks = d.get("blocks", [])
    if not isinstance(path, str):
        raise CorruptManifest(f"manifest: {where}.path must be a string, got {_tname(path)}")
    check_rel_path(path, f"{where}.path")
    parts = path.split("/")
    if len(parts) != 3 or parts[:2] != [table, "views"]:
        raise CorruptManifest(
            f"manifest: {where}.path {path!r} is not a file directly under {table}/views/"
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < HEADER_BYTES:
        raise CorruptManifest(f"manifest: {where}.bytes {size!r} is not a valid size")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise CorruptManifest(f"manifest: {where}.xxh3_64 is not 16 hex digits")
    n_blocks = -(-size // CHECK_BLOCK_BYTES)
    if not isinstance(blocks, list) or (
        blocks
        and (
            len(blocks) != n_blocks
            or not all(isinstance(b, str) and _HEX64.match(b) for b in blocks)
        )
    ):
        raise CorruptManifest(f"manifest: {where}.blocks does not hold {n_blocks} checksums")
    return FileEntry(path=path, bytes=size, xxh3_64=digest, blocks=tuple(blocks))


@dataclass(frozen=True)
class ViewEntry:
    """A view as recorded in its table's ``"views"`` field of ``manifest.json``."""

    name: str
    data: FileEntry
    index: FileEntry | None
    rows: FileEntry | None
    slots: int
    slot_bytes: int
    record_bytes: int
    rows_per_record: int
    source: str  # "keys" or "rows"
    source_hash: str
    build_id: str
    key_width: int
    key_hash: str  # "xxh64" or "custom"
    hasher: dict[str, Any] | None
    keys_total: int
    budget_bytes: int | None
    provenance: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.data.to_dict(),
            "index": None if self.index is None else self.index.to_dict(),
            "rows": None if self.rows is None else self.rows.to_dict(),
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "record_bytes": self.record_bytes,
            "rows_per_record": self.rows_per_record,
            "source": self.source,
            "source_hash": self.source_hash,
            "build_id": self.build_id,
            "key_width": self.key_width,
            "key_hash": self.key_hash,
            "hasher": self.hasher,
            "keys_total": self.keys_total,
            "budget_bytes": self.budget_bytes,
            "provenance": dict(self.provenance),
        }

    @property
    def files(self) -> list[FileEntry]:
        return [f for f in (self.data, self.index, self.rows) if f is not None]

    @classmethod
    def parse(cls, table: str, name: str, d: Any) -> ViewEntry:
        """Validate one entry of ``tables[table]["views"]``; violations raise `CorruptManifest`."""
        where = f"table {table!r} view {name!r}"
        try:
            check_view_name(name)
        except InvalidArgument as e:
            raise CorruptManifest(f"manifest: {e}") from None
        if not isinstance(d, dict):
            raise CorruptManifest(f"manifest: {where} is not an object")

        def num(key: str, lo: int = 0) -> int:
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise CorruptManifest(f"manifest: {where}.{key} is {v!r}, need an int >= {lo}")
            return v

        source = d.get("source")
        if source not in ("keys", "rows"):
            raise CorruptManifest(f"manifest: {where}.source {source!r} is not 'keys' or 'rows'")
        key_hash = d.get("key_hash", "xxh64")
        if key_hash not in ("xxh64", "custom"):
            raise CorruptManifest(f"manifest: {where}.key_hash {key_hash!r} is unknown")
        data = parse_view_file(d.get("file"), f"{where}.file", table)
        index = (
            None if d.get("index") is None else parse_view_file(d["index"], f"{where}.index", table)
        )
        rows = None if d.get("rows") is None else parse_view_file(d["rows"], f"{where}.rows", table)
        if (source == "keys") != (index is not None) or (source == "rows") != (rows is not None):
            raise CorruptManifest(f"manifest: {where} lacks the file its source needs")
        hasher = _typed(d, "hasher", dict, where)
        for key, typ in _HASHER_FIELDS.items():
            _typed(hasher or {}, key, typ, f"{where}.hasher")
        if source == "keys" and hasher is None:
            raise CorruptManifest(f"manifest: {where}.hasher is missing (a key view needs it)")
        budget = _typed(d, "budget_bytes", int, where)
        provenance = _typed(d, "provenance", dict, where, {}) or {}
        for key in ("source_hash", "build_id"):
            if not isinstance(d.get(key), str) or not _HEX64.match(d[key]):
                raise CorruptManifest(f"manifest: {where}.{key} is not 16 hex digits")
        entry = cls(
            name=name,
            data=data,
            index=index,
            rows=rows,
            slots=num("slots"),
            slot_bytes=num("slot_bytes", 1),
            record_bytes=num("record_bytes", 1),
            rows_per_record=num("rows_per_record", 1),
            source=source,
            source_hash=d["source_hash"],
            build_id=d["build_id"],
            key_width=num("key_width"),
            key_hash=key_hash,
            hasher=hasher,
            keys_total=num("keys_total"),
            budget_bytes=budget,
            provenance=dict(provenance),
        )
        for key, value, cap in (
            ("slots", entry.slots, MAX_SLOTS),
            ("record_bytes", entry.record_bytes, entry.slot_bytes),
        ):
            if value > cap:
                raise CorruptManifest(f"manifest: {where}.{key} {value} exceeds {cap}")
        lo, hi = (1, MAX_KEY_WIDTH) if source == "keys" else (0, 0)
        if not lo <= entry.key_width <= hi:
            raise CorruptManifest(
                f"manifest: {where}.key_width {entry.key_width} is out of range for a "
                f"{source!r} view (1..{MAX_KEY_WIDTH} for keys, 0 for rows)"
            )
        if entry.data.bytes != view_file_bytes(entry.slots, entry.slot_bytes):
            raise CorruptManifest(
                f"manifest: {where}.file.bytes {entry.data.bytes} != {HEADER_BYTES} + "
                f"{entry.slots} slots x {entry.slot_bytes} B"
            )
        if entry.index is not None and entry.index.bytes != key_index_bytes(
            entry.slots, entry.key_width
        ):
            raise CorruptManifest(f"manifest: {where}.index.bytes disagrees with its slots")
        return entry


def parse_views(info: TableInfo) -> dict[str, ViewEntry]:
    """Every view of a table, from its ``extra["views"]`` (an empty dict when it has none)."""
    raw = info.extra.get("views")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CorruptManifest(f"manifest: table {info.name!r} views is not an object")
    views = {name: ViewEntry.parse(info.name, name, d) for name, d in raw.items()}
    for e in views.values():
        if e.record_bytes != e.rows_per_record * info.row_bytes:
            raise CorruptManifest(
                f"manifest: table {info.name!r} view {e.name!r}.record_bytes {e.record_bytes} "
                f"!= rows_per_record {e.rows_per_record} x the table's {info.row_bytes} B rows"
            )
    return views
