"""Store-P: materialized views of a Store-I table, one fixed-size record per n-gram key.

A token's Engram / PLE lookup reads 16-24 rows scattered over a table. A view stores, for
every key of a corpus, the concatenation of those rows as one record (16 x 160 B = 2560 B),
so a lookup becomes one fixed-size read. Records are laid out in access order (first
occurrence in the corpus), so replaying that corpus reads the view sequentially. The format
is in ``docs/view.md`` and `engramdb.layouts.view`.

* `build_view` gathers every key's rows from Store-I in batches and publishes the view
  atomically (the same protocol as table builds: staging, fsync, manifest rename under the
  database lock). A killed build leaves the previous state.
* `View` reads records (`read_record`, `read_records`) and serves keys (`lookup`,
  `lookup_tokens`): hits from the view, misses from Store-I in the same call, same bytes.
* `verify_views` checks files against the manifest and slots against Store-I.
* `measure_throughput` / `measure_latency` are the library side of ``engramdb view
  bench|lat``.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import operator
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from engramdb import __version__
from engramdb.build import database_lock, read_manifest_or_empty, write_manifest
from engramdb.database import read_manifest
from engramdb.errors import (
    CorruptFile,
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    RowIdOutOfRange,
    ShapeMismatch,
    StaleView,
    StoreClosed,
    TableExists,
    TableNotFound,
    TokenIdOutOfRange,
    TruncatedFile,
)
from engramdb.io.gather import take_rows
from engramdb.io.mapping import (
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    MADV_WILLNEED,
    ShardMapping,
    madvise,
)
from engramdb.keygen import PRESETS, Hasher
from engramdb.keygen import preset as keygen_preset
from engramdb.layouts.manifest import CHECK_BLOCK_BYTES, Manifest, TableInfo, check_table_name
from engramdb.layouts.view import (
    HASH_CUSTOM,
    HASH_XXH64,
    HEADER_BYTES,
    KEYS_SUFFIX,
    ROWS_SUFFIX,
    VIEW_SUFFIX,
    KeyHash,
    KeyIndexHeader,
    RowsHeader,
    ViewEntry,
    ViewFile,
    ViewHeader,
    budget_keys,
    bytes_per_key,
    check_view_name,
    default_key_hash,
    keep_most_frequent,
    key_index_sections,
    match_keys,
    parse_views,
    plan_slot_reads,
    source_hash,
)
from engramdb.store import Store
from engramdb.units import parse_size
from engramdb.validate import as_rowids, check_bounds, check_output

__all__ = [
    "LatencyResult",
    "ThroughputResult",
    "View",
    "ViewBuildSummary",
    "ViewProblem",
    "build_view",
    "measure_latency",
    "measure_throughput",
    "open_view",
    "verify_views",
]

#: Bytes gathered per build step: bounds build memory whatever the view's size.
BUILD_BATCH_BYTES = 64 * 1024 * 1024
#: Largest single read of a cold batch. Long runs of adjacent slots are split into reads of
#: this size so a syscall backend keeps several in flight (measured: see docs/view.md).
MAX_READ_BYTES = 16 * 1024 * 1024
#: Bounce buffer of the O_DIRECT backend (one per reading thread, allocated on first use):
#: a batch's reads are only in flight together if their spans fit it. 64 MiB holds a whole
#: 16,384 x 2560 B batch; 8 MiB read cold in-order batches ~15 % slower.
DIRECT_BOUNCE_BYTES = 64 * 1024 * 1024
#: Keys hashed one by one (the xxhash C call) below this batch size: the vectorised hash
#: costs ~30 us of numpy call overhead however few keys there are.
_SMALL_HASH_BATCH = 16
#: Fixed keys for the hasher fingerprint (hashed with strict=False, any kind accepts them).
#: Plain arithmetic rather than a random generator, so the fingerprint can never depend on
#: the numpy version.
_PROBE_KEYS = (np.arange(32 * 16, dtype=np.int64).reshape(32, 16) * 2_654_435_761) % 32_749


def _xxh64_small(keys: np.ndarray) -> np.ndarray:
    """`default_key_hash` for a handful of keys (the same XXH64, one C call per key)."""
    k = np.ascontiguousarray(keys, dtype="<i8")
    raw = k.tobytes()
    step = 8 * k.shape[1]
    digest = xxhash.xxh64_intdigest
    return np.fromiter(
        (digest(raw[i : i + step]) for i in range(0, len(raw), step)),
        dtype=np.uint64,
        count=k.shape[0],
    )


def _hash_keys(key_hash: KeyHash | None, keys: np.ndarray) -> np.ndarray:
    if key_hash is None:
        if keys.shape[0] <= _SMALL_HASH_BATCH:
            return _xxh64_small(keys)
        return default_key_hash(keys)
    h = np.asarray(key_hash(keys))
    if h.shape != (keys.shape[0],) or h.dtype.kind not in "iu":
        raise InvalidArgument(
            f"key_hash must return one integer per key ({keys.shape[0]}), got {h.dtype} {h.shape}"
        )
    return h.astype(np.uint64, copy=False)


def _hasher_fingerprint(h: Hasher, layer: int | None, width: int) -> str:
    rows = h.hash_keys(_PROBE_KEYS[:, :width], layer=layer, strict=False)
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(rows, dtype="<i8").tobytes())


def _load_array(value: Any, what: str) -> np.ndarray:
    """An ndarray from an array or a ``.npy`` path (memory-mapped: no copy at load)."""
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if path.suffix != ".npy":
            raise InvalidArgument(f"{what} file {str(path)!r} must be a .npy file")
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise InvalidArgument(f"{what} file {str(path)!r} does not exist") from None
        except ValueError as e:
            raise InvalidArgument(f"{what} file {str(path)!r} is not a plain .npy: {e}") from None
    return np.asarray(value)


def _int64_matrix(arr: np.ndarray, what: str, width: int | None = None) -> np.ndarray:
    if arr.size == 0 and arr.dtype.kind == "f":
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise InvalidDtype(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 2 or (width is not None and arr.shape[1] != width):
        want = f"[K, {width}]" if width is not None else "[K, H]"
        raise ShapeMismatch(f"{what} must be {want}, got shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgument(f"{what} hold {int(arr.max())}, beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --- writing --------------------------------------------------------------------------------
class _HashedFile:
    """A new file written front to back, hashed as it goes (whole file + 64 MiB blocks)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._whole = xxhash.xxh3_64()
        self._block = xxhash.xxh3_64()
        self._block_left = CHECK_BLOCK_BYTES
        self.blocks: list[str] = []
        self.size = 0

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self._whole.update(mv)
        while len(mv):
            n = min(len(mv), self._block_left)
            self._block.update(mv[:n])
            self._block_left -= n
            if self._block_left == 0:
                self.blocks.append(self._block.hexdigest())
                self._block = xxhash.xxh3_64()
                self._block_left = CHECK_BLOCK_BYTES
            done = 0
            while done < n:
                done += os.write(self._fd, mv[done:n])
            mv = mv[n:]
            self.size += n

    def finish(self, rel_path: str) -> ViewFile:
        """fsync and close; the manifest entry for the file once it is at ``rel_path``."""
        if self._block_left != CHECK_BLOCK_BYTES:
            self.blocks.append(self._block.hexdigest())
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        return ViewFile(rel_path, self.size, self._whole.hexdigest(), tuple(self.blocks))

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class ViewBuildSummary:
    """What one `build_view` did. Sizes in bytes, time in seconds."""

    table: str
    name: str
    records: int
    keys_total: int
    record_bytes: int
    slot_bytes: int
    bytes: int
    rows_fetched: int
    seconds: float
    budget_bytes: int | None

    def line(self) -> str:
        kept = (
            f" (budget {self.budget_bytes / 2**30:.2f} GiB kept the {self.records:,} most "
            f"frequent of {self.keys_total:,} keys)"
            if self.budget_bytes is not None and self.records < self.keys_total
            else ""
        )
        rate = self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"built view {self.name!r} of table {self.table!r}: {self.records:,} records x "
            f"{self.record_bytes} B{kept}, {self.bytes / 1e9:.3f} GB written, "
            f"{self.rows_fetched:,} rows gathered in {self.seconds:.2f} s ({rate:.2f} GB/s)"
        )


def _collect_view_garbage(db: Path, manifest: Manifest) -> None:
    """Delete view files and staging directories the manifest does not name (lock held)."""
    for name, info in manifest.tables.items():
        vdir = db / name / "views"
        if not vdir.is_dir():
            continue
        try:
            named = {f.path for e in parse_views(info).values() for f in e.files}
        except EngramDBError:
            continue  # never delete on the word of a manifest we cannot read
        for p in vdir.iterdir():
            rel = f"{name}/views/{p.name}"
            if p.is_dir() and p.name.startswith(".staging-"):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file() and rel not in named:
                p.unlink(missing_ok=True)


def _dedupe_keys(
    keys: np.ndarray, counts: np.ndarray | None, hashes: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Distinct keys in first-access order, their summed counts, hashes, and the order that
    sorts them by (hash, key). One argsort of the hashes; a lexsort of the keys only when
    two hashes are equal (a repeated key or a collision). No per-key Python work."""
    n, width = keys.shape
    order = np.argsort(hashes, kind="stable")
    if n < 2 or not bool((np.diff(hashes[order]) == 0).any()):
        return keys, counts, hashes, order  # distinct hashes: distinct keys
    order = np.lexsort(tuple(keys[:, c] for c in range(width - 1, -1, -1)) + (hashes,))
    hs, ks = hashes[order], keys[order]
    dup = np.zeros(n, dtype=bool)
    dup[1:] = (hs[1:] == hs[:-1]) & (ks[1:] == ks[:-1]).all(axis=1)
    if not dup.any():
        return keys, counts, hashes, order
    # lexsort is stable, so within a group of equal keys the first is the earliest access.
    starts = np.flatnonzero(~dup)
    firsts = order[starts]
    if counts is not None:
        counts = np.add.reduceat(counts[order], starts)
    by_access = np.argsort(firsts, kind="stable")
    sorted_pos = np.empty(firsts.shape[0], dtype=np.int64)
    sorted_pos[by_access] = np.arange(firsts.shape[0])
    keep = firsts[by_access]
    new_counts = None if counts is None else counts[by_access]
    # The (hash, key) order of the survivors, expressed in their new access-order positions.
    return keys[keep], new_counts, hashes[keep], sorted_pos


def build_view(
    db_path: str | os.PathLike[str],
    *,
    table: str,
    name: str,
    keys: Any = None,
    counts: Any = None,
    from_index: bool = False,
    rows: Any = None,
    hasher: Hasher | str | None = None,
    layer: int | None = None,
    disk_budget: int | str | None = None,
    slot_bytes: int | None = None,
    force: bool = False,
    key_hash: KeyHash | None = None,
    populate: bool | None = None,
    batch_bytes: int = BUILD_BATCH_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> ViewBuildSummary:
    """Build view ``name`` of ``table`` and publish it atomically.

    Exactly one source:

    * ``keys`` — int ``[K, max_ngram]`` n-gram keys (``Hasher.keys`` contexts) in access
      order, an array or a ``.npy`` path; ``counts`` (``[K]``, optional) rank them for a
      budget. Repeated keys keep their first position (counts are summed).
    * ``from_index=True`` — the keys and counts of ``engramdb index`` (``keys.zst``); the
      hasher defaults to the index's preset and layer.
    * ``rows`` — explicit int ``[K, H]`` global row ids: record ``i`` is the concatenation of
      ``Store.fetch(rows[i])``. No key index; no budget.

    ``hasher`` (a `Hasher` or preset name) and ``layer`` turn keys into row ids
    (``hash_keys``). ``disk_budget`` (bytes or ``"20G"``) caps view + key index: the most
    frequent keys are kept (ties: earlier first; without counts: the first keys), still laid
    out in access order. ``slot_bytes`` (default: the record size ``H * row_bytes``) may pad
    each slot with zeros, e.g. to a sector multiple for ``O_DIRECT``. ``key_hash`` replaces
    the XXH64 key hash (tests); such a view needs the same ``key_hash`` at open. ``populate``
    faults the table into memory first (default: when it fits in half the available memory):
    a cold mapping would otherwise fault once per row. ``progress(done, total)`` counts
    records.

    Cost: one vectorised ``hash_keys`` + ``Store.fetch_into`` per ``batch_bytes`` of slots,
    written with one buffer (peak memory ~``batch_bytes`` plus ~60 B per key); the key index
    is one argsort of the key hashes. The database lock is held throughout, so the table
    cannot change under the build.
    """
    check_table_name(table)
    check_view_name(name)
    given = [keys is not None, bool(from_index), rows is not None]
    if sum(given) != 1:
        raise InvalidArgument("give exactly one of keys=, from_index=True or rows=")
    if batch_bytes <= 0:
        raise InvalidArgument(f"batch_bytes must be positive, got {batch_bytes}")
    budget = None if disk_budget is None else parse_size(disk_budget)
    db = Path(db_path)
    t0 = time.perf_counter()
    with database_lock(db):
        current = read_manifest_or_empty(db)
        info = current.tables.get(table)
        if info is None:
            raise TableNotFound(
                f"no table {table!r} in {str(db)!r} (tables: {sorted(current.tables)})"
            )
        views = parse_views(info)
        if name in views and not force:
            raise TableExists(
                f"view {name!r} of table {table!r} already exists; use force=True / --force"
            )
        src = _prepare_source(
            db, info, keys, counts, from_index, rows, hasher, layer, budget, slot_bytes, key_hash
        )
        store = Store(db, info)
        try:
            if populate or (
                populate is None and info.n_rows * info.row_bytes * 2 <= _mem_available()
            ):
                store.populate()
            entry, fetched = _write_view(db, info, name, src, store, batch_bytes, progress, current)
        finally:
            store.close()
        new = current.with_table(
            dataclasses.replace(
                info,
                extra={
                    **info.extra,
                    "views": {
                        **{k: v.to_dict() for k, v in views.items() if k != name},
                        name: entry.to_dict(),
                    },
                },
            )
        )
        try:
            write_manifest(db, new)
        except BaseException:
            for f in entry.files:
                (db / f.path).unlink(missing_ok=True)
            raise
        _collect_view_garbage(db, new)
    return ViewBuildSummary(
        table=table,
        name=name,
        records=entry.slots,
        keys_total=src.keys_total,
        record_bytes=entry.record_bytes,
        slot_bytes=entry.slot_bytes,
        bytes=sum(f.bytes for f in entry.files),
        rows_fetched=fetched,
        seconds=time.perf_counter() - t0,
        budget_bytes=budget,
    )


@dataclass
class _Source:
    kind: str  # "keys" | "rows"
    keys: np.ndarray | None  # int64 [K, W], access order (kept keys only)
    index_order: np.ndarray | None  # permutation sorting the kept keys by (hash, key)
    hashes: np.ndarray | None  # uint64 [K], the kept keys' hashes
    rows: np.ndarray | None  # int64 [K, H] for row views
    hasher: Hasher | None
    layer: int | None
    rows_per_record: int
    record_bytes: int
    slot_bytes: int
    keys_total: int
    budget: int | None
    custom_hash: bool
    hasher_doc: dict[str, Any] | None

    @property
    def n_records(self) -> int:
        arr = self.keys if self.keys is not None else self.rows
        assert arr is not None
        return int(arr.shape[0])


def _resolve_hasher(hasher: Hasher | str | None, fallback: str | None) -> Hasher:
    spec = hasher if hasher is not None else fallback
    if spec is None:
        raise InvalidArgument("a key view needs hasher= (a keygen Hasher or a preset name)")
    if isinstance(spec, Hasher):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgument(f"hasher must be a keygen Hasher or a preset name, got {spec!r}")
    try:
        return keygen_preset(spec)
    except EngramDBError as e:
        raise InvalidArgument(
            f"cannot make the hasher of preset {spec!r} ({e}); pass hasher="
        ) from None


def _prepare_source(
    db: Path,
    info: TableInfo,
    keys: Any,
    counts: Any,
    from_index: bool,
    rows: Any,
    hasher: Hasher | str | None,
    layer: int | None,
    budget: int | None,
    slot_bytes: int | None,
    key_hash: KeyHash | None,
) -> _Source:
    if rows is not None:
        for what, v in (
            ("hasher", hasher),
            ("layer", layer),
            ("counts", counts),
            ("disk_budget", budget),
            ("key_hash", key_hash),
        ):
            if v is not None:
                raise InvalidArgument(
                    f"{what}= applies to key views; a view of explicit rows stores every record "
                    "as given (slice rows= to keep fewer)"
                )
        r = _int64_matrix(_load_array(rows, "rows"), "rows")
        if r.shape[1] == 0:
            raise ShapeMismatch("rows must have at least one column, got shape (K, 0)")
        if r.size:
            flat = r.reshape(-1)
            check_bounds(flat, info.n_rows, shape=r.shape)
        record = r.shape[1] * info.row_bytes
        return _Source(
            kind="rows",
            keys=None,
            index_order=None,
            hashes=None,
            rows=r,
            hasher=None,
            layer=None,
            rows_per_record=r.shape[1],
            record_bytes=record,
            slot_bytes=_slot_size(slot_bytes, record),
            keys_total=r.shape[0],
            budget=None,
            custom_hash=False,
            hasher_doc=None,
        )
    label = None
    key_arr: Any = keys
    if from_index:
        from engramdb.index import load_index

        if counts is not None:
            raise InvalidArgument("counts= comes from the index with from_index=True")
        ix = load_index(db, info.name)
        key_arr, counts = ix.keys, ix.key_counts
        label = str(ix.meta.get("preset")) if ix.meta.get("preset") else None
        if layer is None and ix.meta.get("layer") is not None:
            layer = int(ix.meta["layer"])
    h = _resolve_hasher(hasher, label)
    try:
        table_rows = h.table_rows(layer)
    except EngramDBError as e:
        raise InvalidArgument(f"hasher {h!r}: {e}") from None
    if table_rows > info.n_rows:
        raise InvalidArgument(
            f"layer {layer} of {h!r} addresses {table_rows:,} rows but table {info.name!r} has "
            f"{info.n_rows:,}"
        )
    k = _int64_matrix(_load_array(key_arr, "keys"), "keys", h.max_ngram)
    if h.id_bound is not None and k.size and int(k.view(np.uint64).max()) >= h.id_bound:
        # Checked up front so a bad key fails the build before the gather, not an hour in.
        pos = int(np.argmax((k.view(np.uint64) >= h.id_bound).any(axis=1)))
        raise TokenIdOutOfRange(
            f"key {k[pos].tolist()} at position {pos} holds an id outside [0, {h.id_bound})"
        )
    c = None
    if counts is not None:
        c = np.asarray(_load_array(counts, "counts"))
        if c.dtype.kind not in "iu":
            raise InvalidDtype(f"counts must hold integers, got dtype {c.dtype}")
        if c.shape != (k.shape[0],):
            raise ShapeMismatch(f"counts must be [{k.shape[0]}] (one per key), got {c.shape}")
        c = c.astype(np.int64)
    record = h.n_heads * info.row_bytes
    slot = _slot_size(slot_bytes, record)
    hashes = _hash_keys(key_hash, k)
    k, c, hashes, order = _dedupe_keys(k, c, hashes)
    total = int(k.shape[0])
    if budget is not None:
        keep = budget_keys(budget, slot, h.max_ngram)
        if keep < 1 and total:
            raise InvalidArgument(
                f"disk budget of {budget} bytes holds no record: one costs "
                f"{bytes_per_key(slot, h.max_ngram)} B plus {2 * HEADER_BYTES} B of headers"
            )
        sel = keep_most_frequent(c, total, keep)
        if sel.shape[0] < total:
            rank = np.empty(total, dtype=np.int64)
            rank[order] = np.arange(total)
            sub_rank = rank[sel]
            order = np.argsort(sub_rank, kind="stable")
            k, hashes = k[sel], hashes[sel]
    lt_layer = layer
    if lt_layer is None and len(h.layers) == 1:
        lt_layer = h.layers[0]
    doc = {
        "preset": h.name if h.name in PRESETS else None,
        "name": h.name or h.kind,
        "kind": h.kind,
        "layer": lt_layer,
        "max_ngram": h.max_ngram,
        "n_heads": h.n_heads,
        "fingerprint": _hasher_fingerprint(h, layer, h.max_ngram),
    }
    return _Source(
        kind="keys",
        keys=k,
        index_order=order,
        hashes=hashes,
        rows=None,
        hasher=h,
        layer=layer,
        rows_per_record=h.n_heads,
        record_bytes=record,
        slot_bytes=slot,
        keys_total=total,
        budget=budget,
        custom_hash=key_hash is not None,
        hasher_doc=doc,
    )


def _slot_size(slot_bytes: int | None, record: int) -> int:
    if slot_bytes is None:
        return record
    if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, (int, np.integer)):
        raise InvalidArgument(f"slot_bytes must be an integer, got {slot_bytes!r}")
    if slot_bytes < record:
        raise InvalidArgument(
            f"slot_bytes {slot_bytes} is smaller than a record ({record} B = rows per record x "
            "row_bytes)"
        )
    return int(slot_bytes)


def _write_view(
    db: Path,
    info: TableInfo,
    name: str,
    src: _Source,
    store: Store,
    batch_bytes: int,
    progress: Callable[[int, int], None] | None,
    current: Manifest,
) -> tuple[ViewEntry, int]:
    build_id = secrets.randbits(64)
    tag = f"{name}-{build_id:016x}"
    vdir = db / info.name / "views"
    vdir.mkdir(parents=True, exist_ok=True)
    staging = vdir / f".staging-{build_id:016x}"
    staging.mkdir()
    rel = f"{info.name}/views/{tag}"
    n = src.n_records
    header = ViewHeader(
        slot_bytes=src.slot_bytes,
        record_bytes=src.record_bytes,
        n_slots=n,
        rows_per_record=src.rows_per_record,
        row_bytes=info.row_bytes,
        source_hash=int(source_hash(info), 16),
        build_id=build_id,
        layer=-1 if src.layer is None else int(src.layer),
        key_width=0 if src.keys is None else int(src.keys.shape[1]),
        table=info.name,
        preset=(src.hasher_doc or {}).get("name") or "",
    )
    moved: list[Path] = []
    try:
        data = _HashedFile(staging / f"{tag}{VIEW_SUFFIX}")
        fetched = 0
        try:
            data.write(header.pack())
            per = max(1, batch_bytes // src.slot_bytes)
            buf = np.zeros((min(per, max(n, 1)), src.slot_bytes), dtype=np.uint8)
            padded = src.slot_bytes != src.record_bytes
            rec = np.empty((buf.shape[0], src.record_bytes), np.uint8) if padded else buf
            h_rows = src.rows_per_record
            for lo in range(0, n, per):
                hi = min(n, lo + per)
                kb = hi - lo
                if src.rows is not None:
                    ids = src.rows[lo:hi]
                else:
                    assert src.keys is not None and src.hasher is not None
                    ids = src.hasher.hash_keys(src.keys[lo:hi], layer=src.layer)
                    if ids.size and int(ids.view(np.uint64).max()) >= info.n_rows:
                        pos = int(np.argmax((ids.view(np.uint64) >= info.n_rows).any(axis=1)))
                        raise RowIdOutOfRange(
                            f"key {src.keys[lo + pos].tolist()} maps to rows {ids[pos].tolist()}, "
                            f"outside table {info.name!r} ({info.n_rows:,} rows)"
                        )
                out = rec[:kb].reshape(kb, h_rows, info.row_bytes)
                store.fetch_into(ids, out)
                if padded:
                    buf[:kb, : src.record_bytes] = rec[:kb]
                data.write(buf[:kb])
                fetched += ids.size
                if progress is not None:
                    progress(hi, n)
            data_file = data.finish(f"{rel}{VIEW_SUFFIX}")
        except BaseException:
            data.abort()
            raise
        index_file = rows_file = None
        if src.keys is not None:
            assert src.index_order is not None and src.hashes is not None
            index_file = _write_key_index(staging, rel, tag, src, build_id)
        else:
            assert src.rows is not None
            f = _HashedFile(staging / f"{tag}{ROWS_SUFFIX}")
            try:
                f.write(RowsHeader(n, src.rows_per_record, build_id, info.n_rows).pack())
                f.write(np.ascontiguousarray(src.rows, dtype="<i8"))
                rows_file = f.finish(f"{rel}{ROWS_SUFFIX}")
            except BaseException:
                f.abort()
                raise
        _fsync_dir(staging)
        for p in sorted(staging.iterdir()):
            target = vdir / p.name
            os.rename(p, target)
            moved.append(target)
        _fsync_dir(vdir)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in moved:
            p.unlink(missing_ok=True)
        raise
    entry = ViewEntry(
        name=name,
        data=data_file,
        index=index_file,
        rows=rows_file,
        slots=n,
        slot_bytes=src.slot_bytes,
        record_bytes=src.record_bytes,
        rows_per_record=src.rows_per_record,
        source=src.kind,
        source_hash=source_hash(info),
        build_id=f"{build_id:016x}",
        key_width=header.key_width,
        key_hash="custom" if src.custom_hash else "xxh64",
        hasher=src.hasher_doc,
        keys_total=src.keys_total,
        budget_bytes=src.budget,
        provenance={
            "engramdb_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "generation": current.generation + 1,
        },
    )
    return entry, fetched


def _write_key_index(staging: Path, rel: str, tag: str, src: _Source, build_id: int) -> ViewFile:
    assert src.keys is not None and src.index_order is not None and src.hashes is not None
    n, width = src.keys.shape
    order = src.index_order
    f = _HashedFile(staging / f"{tag}{KEYS_SUFFIX}")
    try:
        f.write(
            KeyIndexHeader(
                n_keys=n,
                key_width=width,
                hash_kind=HASH_CUSTOM if src.custom_hash else HASH_XXH64,
                hash_seed=0,
                build_id=build_id,
                n_slots=n,
            ).pack()
        )
        step = max(1, BUILD_BATCH_BYTES // (8 * width))
        f.write(np.ascontiguousarray(src.hashes[order], dtype="<u8"))
        for lo in range(0, n, step):  # keys in hash order, one bounded gather per step
            f.write(np.ascontiguousarray(src.keys[order[lo : lo + step]], dtype="<i8"))
        f.write(np.ascontiguousarray(order, dtype="<u4"))
        return f.finish(f"{rel}{KEYS_SUFFIX}")
    except BaseException:
        f.abort()
        raise


# --- reading --------------------------------------------------------------------------------
def _open_checked(db: Path, vf: ViewFile, what: str) -> int:
    """Open a view file read-only; its size must equal the manifest's."""
    path = db / vf.path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TruncatedFile(f"{what}: file {vf.path!r} is missing") from None
    size = os.fstat(fd).st_size
    if size != vf.bytes:
        os.close(fd)
        kind = TruncatedFile if size < vf.bytes else CorruptFile
        raise kind(f"{what}: file {vf.path!r} has {size} bytes, the manifest says {vf.bytes}")
    return fd


def _read_page(fd: int, what: str) -> bytes:
    page = os.pread(fd, HEADER_BYTES, 0)
    if len(page) < HEADER_BYTES:
        raise TruncatedFile(f"{what}: {len(page)} bytes, shorter than its header page")
    return page


class _Scratch(threading.local):
    buf: np.ndarray | None = None

    def get(self, nbytes: int) -> np.ndarray:
        if self.buf is None or self.buf.size < nbytes:
            # Fresh allocations fault page by page; keep one growing buffer per thread.
            self.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return self.buf[:nbytes]


class View:
    """An open Store-P view: fixed-size records in access order, plus a key index.

    ``View(path)`` opens a ``.edv`` file of a database (``DB/<table>/views/...``);
    ``View(db, table=..., name=...)`` opens a view by name; `open_view` is the form used by
    ``Store.view(name)``. Opening reads the manifest and the header pages only (no data) and
    raises `StaleView` when the table was rebuilt with other contents since the build,
    `TruncatedFile` / `CorruptFile` for a file whose size or header disagrees.

    Reads: `read_record` (one record as ``bytes``, from the mapping), `read_records` (a
    batch, vectorised), `lookup` / `lookup_tokens` (keys or tokens -> records; misses come
    from Store-I). ``backend`` picks how batches travel: ``"mmap"`` (copy out of the mapping:
    the warm path), ``"preadv"`` / ``"io_uring"`` (syscall reads, runs of adjacent slots
    coalesced into large reads), or ``"auto"`` (the reader layer's rule: the mapping while
    the pages are resident, else the cold backend). ``backend_options`` go to the backend.

    ``store`` serves misses (default: the view opens its own `Store` on the first miss).
    ``hasher`` turns keys into row ids for misses and tokens into keys (default: the preset
    recorded at build; a custom hasher must be passed). Thread-safe for concurrent reads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str | None = None,
        name: str | None = None,
        store: Store | None = None,
        info: TableInfo | None = None,
        hasher: Hasher | None = None,
        key_hash: KeyHash | None = None,
        backend: str = "auto",
        backend_options: dict[str, Any] | None = None,
    ):
        p = Path(path)
        if name is None:
            if table is not None or p.suffix != VIEW_SUFFIX:
                raise InvalidArgument(
                    f"View({str(path)!r}) needs a {VIEW_SUFFIX} file, or a database with "
                    "table= and name="
                )
            db, table = p.parent.parent.parent, p.parent.parent.name
        else:
            if table is None:
                raise InvalidArgument("View(db, name=...) also needs table=")
            db = p
            check_view_name(name)
        self._db = db
        self._fds: list[int] = []
        self._maps: list[ShardMapping] = []
        self._store = store
        self._own_store = False
        self._scratch = _Scratch()
        self._closed = True
        if store is not None:
            info = store.info
        snapshot = info if info is not None else read_manifest(db).tables.get(table)
        if snapshot is None:
            raise TableNotFound(f"no table {table!r} in {str(db)!r}")
        entry = self._find_entry(db, snapshot, name, p if name is None else None)
        self.table = snapshot.name
        self.name = entry.name
        self.info = snapshot
        self.entry = entry
        self.source = entry.source
        self._hasher = hasher
        self._hasher_checked = False
        self._key_hash = key_hash
        try:
            self._open_files(db, snapshot, entry)
            if entry.key_hash == "custom" and key_hash is None and entry.source == "keys":
                raise InvalidArgument(
                    f"view {self.name!r} was built with a custom key hash: pass the same key_hash="
                )
            if key_hash is not None and entry.key_hash != "custom":
                raise InvalidArgument(
                    f"view {self.name!r} uses the XXH64 key hash; key_hash= must not be given"
                )
            if hasher is not None:
                self._check_hasher(hasher)
            self._setup_backend(backend, backend_options or {})
        except BaseException:
            self._release()
            raise
        self._counters = {
            "records": 0,
            "mmap_batches": 0,
            "io_batches": 0,
            "direct_batches": 0,
            "io_requests": 0,
            "bytes_requested": 0,
            "bytes_returned": 0,
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "store_rows": 0,
        }
        self._closed = False

    # -- opening -------------------------------------------------------------------------------
    @staticmethod
    def _find_entry(db: Path, info: TableInfo, name: str | None, file: Path | None) -> ViewEntry:
        views = parse_views(info)
        current_hash = source_hash(info)
        if file is not None:
            rel = f"{info.name}/views/{file.name}"
            hit = [e for e in views.values() if e.data.path == rel]
            if hit:
                entry = hit[0]
            else:
                # Not (or no longer) named by the manifest: say why from its header.
                try:
                    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise TableNotFound(f"no view file {str(file)!r}") from None
                try:
                    hdr = ViewHeader.unpack(_read_page(fd, str(file)), str(file))
                finally:
                    os.close(fd)
                if f"{hdr.source_hash:016x}" != current_hash:
                    raise StaleView(
                        f"view file {str(file)!r} was built from another version of table "
                        f"{info.name!r} (source hash {hdr.source_hash:016x}, table now "
                        f"{current_hash}); rebuild the view"
                    )
                raise TableNotFound(
                    f"view file {str(file)!r} is not named by the manifest of {str(db)!r}"
                )
        else:
            assert name is not None
            entry_or_none = views.get(name)
            # The latest manifest wins while the table is unchanged: the view may have been
            # built (or rebuilt, its old files deleted) after this snapshot was taken.
            try:
                latest = read_manifest(db).tables.get(info.name)
            except EngramDBError:
                latest = None
            if latest is not None and source_hash(latest) == current_hash:
                entry_or_none = parse_views(latest).get(name, entry_or_none)
            if entry_or_none is None:
                raise TableNotFound(
                    f"no view {name!r} of table {info.name!r} (views: {sorted(views)})"
                )
            entry = entry_or_none
        if entry.source_hash != current_hash:
            raise StaleView(
                f"view {entry.name!r} was built from another version of table {info.name!r} "
                f"(source hash {entry.source_hash}, table now {current_hash}); rebuild it with "
                "`engramdb view build ... --force`"
            )
        return entry

    def _open_files(self, db: Path, info: TableInfo, entry: ViewEntry) -> None:
        what = f"view {entry.name!r} of table {info.name!r}"
        fd = _open_checked(db, entry.data, what)
        self._fds.append(fd)
        hdr = ViewHeader.unpack(_read_page(fd, f"{what} ({entry.data.path})"), what)
        expect = (
            entry.slots,
            entry.slot_bytes,
            entry.record_bytes,
            entry.build_id,
            entry.source_hash,
        )
        got = (
            hdr.n_slots,
            hdr.slot_bytes,
            hdr.record_bytes,
            f"{hdr.build_id:016x}",
            f"{hdr.source_hash:016x}",
        )
        if got != expect or hdr.table != info.name or hdr.row_bytes != info.row_bytes:
            raise CorruptFile(
                f"{what}: header (slots, slot_bytes, record_bytes, build id, source hash) {got} "
                f"disagrees with the manifest {expect}"
            )
        self.header = hdr
        self.n_records = hdr.n_slots
        self.slot_bytes = hdr.slot_bytes
        self.record_bytes = hdr.record_bytes
        self.rows_per_record = hdr.rows_per_record
        self.key_width = hdr.key_width
        self.layer: int | None = None if hdr.layer < 0 else hdr.layer
        data_map = ShardMapping([fd], [entry.data.bytes])
        self._maps.append(data_map)
        flat = data_map.array(1, entry.data.bytes).reshape(-1)
        self._flat = flat
        slots = flat[HEADER_BYTES:].reshape(hdr.n_slots, hdr.slot_bytes)
        self._records = slots[:, : hdr.record_bytes]
        # read_record slices a Python mmap of the same file: one C call returning bytes, ~0.1
        # us (8 %) faster than slicing a memoryview of the mapping and copying it out.
        self._pymm: mmap.mmap | None = mmap.mmap(fd, entry.data.bytes, prot=mmap.PROT_READ)
        self._pymm.madvise(mmap.MADV_RANDOM)
        probe = np.frombuffer(self._pymm, dtype=np.uint8, count=1)
        self._pymm_addr = int(probe.ctypes.data)
        del probe  # release the buffer export so the mmap can be closed
        self._fd = fd
        # Single-slot reads go through a second descriptor without read-ahead: measured on
        # random 2560 B records, read-ahead pulled 4.2x the returned bytes from the device,
        # 2.0x without it (the page-granularity minimum). Runs of adjacent slots keep
        # read-ahead on the first descriptor: without it 1 MiB sequential reads ran ~2x
        # slower on these disks.
        self._fd_random = os.open(db / entry.data.path, os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(self._fd_random)
        os.posix_fadvise(self._fd_random, 0, 0, os.POSIX_FADV_RANDOM)
        self._hashes = self._keys = self._slot_of = self._rows = None
        if entry.index is not None:
            ih, iflat = self._map_sidecar(db, entry.index, what, KeyIndexHeader)
            if (
                ih.n_keys != hdr.n_slots
                or ih.key_width != hdr.key_width
                or ih.build_id != hdr.build_id
            ):
                raise CorruptFile(
                    f"{what}: key index {entry.index.path!r} belongs to another build"
                )
            h_off, k_off, s_off = key_index_sections(ih.n_keys, ih.key_width)
            n, w = ih.n_keys, ih.key_width
            self._hashes = iflat[h_off:k_off].view("<u8")
            self._keys = iflat[k_off:s_off].view("<i8").reshape(n, w)
            self._slot_of = iflat[s_off : s_off + 4 * n].view("<u4")
        if entry.rows is not None:
            rh, rflat = self._map_sidecar(db, entry.rows, what, RowsHeader)
            if (
                rh.n_records != hdr.n_slots
                or rh.rows_per_record != hdr.rows_per_record
                or rh.build_id != hdr.build_id
            ):
                raise CorruptFile(f"{what}: rows file {entry.rows.path!r} belongs to another build")
            self._rows = rflat[HEADER_BYTES:].view("<i8").reshape(rh.n_records, rh.rows_per_record)

    def _map_sidecar(
        self, db: Path, vf: ViewFile, what: str, header_cls: Any
    ) -> tuple[Any, np.ndarray]:
        """Open a side file of the view (key index, rows), parse its header page and map it
        whole; returns the header and the file's bytes as a flat uint8 array."""
        fd = _open_checked(db, vf, what)
        self._fds.append(fd)
        header = header_cls.unpack(_read_page(fd, f"{what} ({vf.path})"), what)
        mapping = ShardMapping([fd], [vf.bytes])
        self._maps.append(mapping)
        return header, mapping.array(1, vf.bytes).reshape(-1)

    def _setup_backend(self, backend: str, options: dict[str, Any]) -> None:
        self.backend = backend
        self._io: Any = None  # "preadv" / "io_uring": every batch
        self._runs_io: Any = None  # "auto", cold: runs of adjacent slots
        self._single_io: Any = None  # "auto", cold: single slots, partly resident data
        self._direct_io: Any = None  # "auto", cold: single slots, nothing resident
        if backend not in ("auto", "mmap", "preadv", "io_uring"):
            raise InvalidArgument(
                f"unknown backend {backend!r}; choose one of auto, mmap, preadv, io_uring"
            )
        if backend == "mmap" and options:
            raise InvalidArgument(f"backend 'mmap' takes no options, got {sorted(options)}")
        if backend == "mmap":
            return
        from engramdb.io import IoUringBackend, make_backend

        if backend != "auto":
            self._io = make_backend(backend, **options)
            return
        direct = bool(options.pop("direct", True))
        if options:
            raise InvalidArgument(f"backend 'auto' takes only direct=, got {sorted(options)}")
        # Measured on cold 2560 B records (docs/view.md). Nothing of the batch cached: every
        # read through io_uring O_DIRECT (in-order replay 420-560 k records/s against
        # 190-240 k through buffered preadv once the page cache is full and every buffered
        # read must reclaim first; device bytes = payload bytes; no cache pollution). Partly
        # cached: buffered reads, runs through preadv with kernel read-ahead (585-745 k
        # records/s against 330-400 k through buffered io_uring, whose buffered reads are
        # punted to kernel workers), single slots through io_uring for its queue depth.
        self._runs_io = make_backend("preadv")
        if IoUringBackend.availability()[0]:
            self._single_io = make_backend("io_uring")
            if direct:
                self._direct_io = make_backend(
                    "io_uring", direct=True, direct_bounce_bytes=DIRECT_BOUNCE_BYTES
                )
        else:
            self._single_io = self._runs_io

    # -- properties ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n_records

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """Bytes of the slot area of the view file."""
        return self.n_records * self.slot_bytes

    @property
    def stale(self) -> bool:
        """Whether the database's current table differs from the one this view was built
        from (reads ``manifest.json``: ~0.1-1 ms). An open view keeps serving the old
        table's bytes consistently either way; reopen to see the rebuild."""
        try:
            now = read_manifest(self._db).tables.get(self.table)
        except EngramDBError:
            return True
        return now is None or source_hash(now) != self.entry.source_hash

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_records:,} records x {self.record_bytes} B"
        return f"<View {self.table!r}/{self.name!r} {state}, backend={self.backend}>"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"view {self.name!r} of table {self.table!r} is closed")

    # -- records -------------------------------------------------------------------------------
    def read_record(self, i: int) -> bytes:
        """Record ``i`` as ``record_bytes`` bytes: one slice of the mapping (no syscall when
        resident; warm ~0.5-1 us including the call). A cold record faults 1-2 pages in."""
        if i.__class__ is int and 0 <= i < self.n_records:
            mm = self._pymm
            if mm is not None:
                o = HEADER_BYTES + i * self.slot_bytes
                return mm[o : o + self.record_bytes]
        return self._read_record_slow(i)

    def _read_record_slow(self, i: Any) -> bytes:
        self._check_open()
        if isinstance(i, (bool, np.bool_)):
            raise InvalidDtype(f"record id must be an integer, got {i!r}")
        try:
            j = operator.index(i)
        except TypeError:
            raise InvalidDtype(f"record id must be an integer, got {i!r}") from None
        if not 0 <= j < self.n_records:
            raise RowIdOutOfRange(f"record id {j} is out of range [0, {self.n_records})")
        return self.read_record(j)

    def read_records(self, ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records ``ids`` (any integer array) as uint8 ``ids.shape + (record_bytes,)``.

        ``out`` (C-contiguous, writable) avoids the allocation. Validation happens before
        any byte is written. Warm: one parallel ``np.take`` from the mapping; cold (syscall
        backends): sorted, deduplicated, adjacent slots merged into reads of up to 16 MiB.
        """
        self._check_open()
        arr = as_rowids(ids)
        flat = arr.reshape(-1)
        check_bounds(flat, self.n_records, shape=arr.shape, what="record id")
        shape = arr.shape + (self.record_bytes,)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        else:
            check_output(out, shape)
        self._gather(flat, out.reshape(-1, self.record_bytes))
        return out

    def _resident_fraction(self, slots: np.ndarray) -> float:
        """Share of an evenly spread sample of the batch's slots whose first page is in the
        page cache: ``mincore`` on 4-16 pages (~2 us each)."""
        n = slots.shape[0]
        k = min(16, max(4, n // 64), n)
        pick = slots[(np.arange(k) * (n - 1)) // max(1, k - 1)]
        base = self._maps[0].address + HEADER_BYTES
        addrs = (pick * self.slot_bytes + base).tolist()
        from engramdb.io.residency import resident_count

        return resident_count(addrs) / k

    def _gather(self, slots: np.ndarray, out2d: np.ndarray) -> None:
        """Validated slots -> ``out2d`` rows, through the mapping or syscall reads."""
        n = slots.shape[0]
        if n == 0:
            return
        c = self._counters
        if self.backend == "mmap":
            cold = None
        elif self.backend != "auto":
            cold = 0.0
        elif n < 256:
            # A stray cold fault in a small batch costs less than checking for it.
            cold = None
        else:
            fraction = self._resident_fraction(slots)
            cold = None if fraction >= 1.0 else fraction
        if cold is None:
            take_rows(self._records, slots, out2d)
            c["mmap_batches"] += 1
            c["bytes_requested"] += n * self.record_bytes
        else:
            self._read_cold(slots, out2d, cold)
        c["records"] += n
        c["bytes_returned"] += n * self.record_bytes

    def _read_cold(self, slots: np.ndarray, out2d: np.ndarray, fraction: float) -> None:
        n = slots.shape[0]
        c = self._counters
        plan = plan_slot_reads(slots, self.slot_bytes, max_request=MAX_READ_BYTES)
        in_place = plan.inverse is None and self.slot_bytes == self.record_bytes
        if in_place:
            dest = out2d
        else:
            u = plan.unique.shape[0]
            dest = self._scratch.get(u * self.slot_bytes).reshape(u, self.slot_bytes)
        runs = plan.lengths > self.slot_bytes
        everything = self._io
        if everything is None and fraction <= 0.0 and self._direct_io is not None:
            everything = self._direct_io
            c["direct_batches"] += 1
        if everything is not None:
            fds = np.where(runs, self._fd, self._fd_random)
            everything.read(fds, plan.offsets, plan.lengths, dest, plan.dest_offsets)
        else:
            if bool(runs.any()):
                self._runs_io.read(
                    self._fd, plan.offsets[runs], plan.lengths[runs], dest, plan.dest_offsets[runs]
                )
            single = ~runs
            if bool(single.any()):
                self._single_io.read(
                    self._fd_random,
                    plan.offsets[single],
                    plan.lengths[single],
                    dest,
                    plan.dest_offsets[single],
                )
        if not in_place:
            inv = plan.inverse if plan.inverse is not None else np.arange(n)
            np.take(dest[:, : self.record_bytes], inv, axis=0, out=out2d, mode="clip")
        c["io_batches"] += 1
        c["io_requests"] += plan.offsets.shape[0]
        c["bytes_requested"] += plan.nbytes

    # -- keys ----------------------------------------------------------------------------------
    def _as_keys(self, keys: Any) -> np.ndarray:
        if self._hashes is None:
            raise InvalidArgument(
                f"view {self.name!r} was built from explicit row ids and has no key index; "
                "use read_records"
            )
        arr = np.asarray(keys)
        if arr.size == 0 and arr.dtype.kind == "f" and not isinstance(keys, np.ndarray):
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
            raise InvalidDtype(f"keys must hold integers, got dtype {arr.dtype}")
        if arr.ndim == 0 or arr.shape[-1] != self.key_width:
            raise ShapeMismatch(f"keys must be [..., {self.key_width}], got shape {arr.shape}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise InvalidArgument(f"key id {int(arr.max())} is beyond int64")
        return arr

    def find(self, keys: Any) -> np.ndarray:
        """Slot of every key (int64 ``keys.shape[:-1]``, -1 where the view lacks the key).
        Pure index work: hash, one ``searchsorted``, a key comparison (~0.1 us per key)."""
        self._check_open()
        arr = self._as_keys(keys)
        k2 = np.ascontiguousarray(arr.reshape(-1, self.key_width), dtype=np.int64)
        return self._find(k2).reshape(arr.shape[:-1])

    def _find(self, k2: np.ndarray) -> np.ndarray:
        assert self._hashes is not None and self._keys is not None and self._slot_of is not None
        slots = match_keys(
            self._hashes, self._keys, self._slot_of, k2, _hash_keys(self._key_hash, k2)
        )
        if slots.size and int(slots.max()) >= self.n_records:
            bad = int(slots.max())
            raise CorruptFile(
                f"view {self.name!r}: key index {self.entry.index.path if self.entry.index else ''!r} "
                f"points at slot {bad}, beyond its {self.n_records} slots"
            )
        return slots

    def lookup(self, keys: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records of n-gram ``keys`` (int ``[..., key_width]``, `Hasher.keys` contexts) as
        uint8 ``[..., record_bytes]``. Keys in the view come from it; the others are gathered
        from Store-I in the same call (``hash_keys`` then ``fetch_into``): the bytes are the
        same either way. Every miss is validated before ``out`` is written.
        Counters: ``hits``, ``misses``, ``store_rows``."""
        self._check_open()
        arr = self._as_keys(keys)
        shape = arr.shape[:-1] + (self.record_bytes,)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        else:
            check_output(out, shape)
        k2 = np.ascontiguousarray(arr.reshape(-1, self.key_width), dtype=np.int64)
        self._serve(k2, out.reshape(-1, self.record_bytes))
        return out

    def lookup_tokens(
        self,
        token_ids: Any,
        out: np.ndarray | None = None,
        *,
        compressed: bool = False,
        mask: Any = None,
        strict: bool = True,
    ) -> np.ndarray:
        """Records of every position of ``token_ids`` (``[..., T]``, sequences starting
        fresh) as uint8 ``[..., T, record_bytes]``: ``Hasher.keys`` then `lookup`. Options
        as in ``Hasher.keys``."""
        self._check_open()
        h = self.hasher()
        keys = h.keys(token_ids, compressed=compressed, mask=mask, strict=strict)
        return self.lookup(keys, out)

    def _serve(self, k2: np.ndarray, out2d: np.ndarray) -> None:
        m = k2.shape[0]
        if m == 0:
            return
        slots = self._find(k2)
        miss = np.flatnonzero(slots < 0)
        c = self._counters
        c["lookups"] += 1
        c["hits"] += m - miss.shape[0]
        c["misses"] += miss.shape[0]
        if miss.shape[0] == 0:
            self._gather(slots, out2d)
            return
        rows = self.hasher().hash_keys(k2[miss], layer=self.layer)
        store = self._miss_store()
        check_bounds(rows.reshape(-1), store.n_rows, shape=rows.shape)
        if miss.shape[0] < m:
            # Point the misses at a hit's slot so one gather fills every position (a cold
            # backend deduplicates it: no extra I/O), then overwrite them from Store-I.
            slots[miss] = slots[np.argmax(slots >= 0)]
            self._gather(slots, out2d)
        tmp = self._scratch.get(miss.shape[0] * self.record_bytes)
        store.fetch_into(rows, tmp.reshape(rows.shape + (store.row_bytes,)))
        out2d[miss] = tmp.reshape(-1, self.record_bytes)
        c["store_rows"] += rows.size

    def hasher(self) -> Hasher:
        """The keygen hasher of this view (given at open, or the recorded preset), checked
        against the build's fingerprint once."""
        self._check_open()
        h = self._hasher
        if h is None:
            doc = self.entry.hasher or {}
            name = doc.get("preset")
            if not name:
                raise InvalidArgument(
                    f"view {self.name!r} was built with the hasher {doc.get('name')!r}, which is "
                    "not a preset: open it with hasher= to serve misses and tokens"
                )
            h = keygen_preset(name)
            self._check_hasher(h)
            self._hasher = h
        elif not self._hasher_checked:
            self._check_hasher(h)
        return h

    def _check_hasher(self, h: Hasher) -> None:
        doc = self.entry.hasher
        if doc is None:
            raise InvalidArgument(f"view {self.name!r} has no keys; it takes no hasher")
        if h.max_ngram != self.key_width or h.n_heads != self.rows_per_record:
            raise InvalidArgument(
                f"hasher {h!r} makes {h.n_heads} rows from {h.max_ngram}-id keys; view "
                f"{self.name!r} holds {self.rows_per_record} rows per {self.key_width}-id key"
            )
        if _hasher_fingerprint(h, self.layer, self.key_width) != doc.get("fingerprint"):
            raise InvalidArgument(
                f"hasher {h!r} (layer {self.layer}) does not reproduce the row ids view "
                f"{self.name!r} was built with"
            )
        self._hasher_checked = True

    def _miss_store(self) -> Store:
        store = self._store
        if store is None:
            store = Store(self._db, self.info)
            self._store = store
            self._own_store = True
        return store

    def record_rows(self, ids: Any) -> np.ndarray:
        """Store-I global row ids of records ``ids``: int64 ``ids.shape + (rows_per_record,)``
        (the rows file, or ``hash_keys`` of the stored keys). Cost: O(n_records) once for a
        key view (the slot -> key inverse), then a gather."""
        self._check_open()
        arr = as_rowids(ids)
        flat = arr.reshape(-1)
        check_bounds(flat, self.n_records, shape=arr.shape, what="record id")
        if self._rows is not None:
            return np.take(self._rows, flat, axis=0).reshape(arr.shape + (self.rows_per_record,))
        keys = self.slot_keys()[flat]
        return (
            self.hasher()
            .hash_keys(keys, layer=self.layer)
            .reshape(arr.shape + (self.rows_per_record,))
        )

    def slot_keys(self) -> np.ndarray:
        """The stored keys in slot (= access) order: int64 ``[n_records, key_width]``, a new
        array (reads the whole key index)."""
        self._check_open()
        if self._keys is None or self._slot_of is None:
            raise InvalidArgument(f"view {self.name!r} was built from explicit row ids: no keys")
        inv = np.empty(self.n_records, dtype=np.int64)
        inv[self._slot_of.astype(np.int64)] = np.arange(self.n_records)
        return np.asarray(self._keys)[inv]

    # -- residency -----------------------------------------------------------------------------
    def populate(self, *, threads: int = 2) -> None:
        """Fault the view (and its key index) into the page tables: device speed when cold,
        ~0.1 s/GB when resident. Afterwards warm reads run at memory speed."""
        self._check_open()
        for m in self._maps:
            m.populate(threads=threads)
        self._advise_pymm(MADV_POPULATE_READ)

    def _advise_pymm(self, advice: int) -> None:
        if self._pymm is None:
            return
        try:
            madvise(self._pymm_addr, len(self._pymm), advice)
        except OSError as e:
            if e.errno != errno.EINVAL or advice != MADV_POPULATE_READ:
                raise
            madvise(self._pymm_addr, len(self._pymm), MADV_WILLNEED)  # kernel < 5.14

    def residency(self) -> float:
        """Fraction (0..1) of the view file's pages in the page cache (``mincore``)."""
        self._check_open()
        return self._maps[0].residency()

    def evict(self) -> float:
        """Drop this view's pages from this process's mappings (``MADV_DONTNEED``) and from
        the page cache (``posix_fadvise(DONTNEED)``); returns the residency afterwards. Pages
        other processes map stay cached."""
        self._check_open()
        # Pages a live mapping holds cannot be dropped: release ours first.
        for m in self._maps:
            m.advise(MADV_DONTNEED)
        self._advise_pymm(MADV_DONTNEED)
        for fd in self._fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return self.residency()

    # -- stats and lifetime ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since open (or `reset_stats`): records returned, batches per path,
        ``bytes_requested`` (what the view asked the mapping / backend for) and
        ``bytes_returned``, lookups with ``hits`` / ``misses`` (positions) and the
        ``store_rows`` misses cost."""
        doc: dict[str, Any] = {"table": self.table, "view": self.name, "backend": self.backend}
        doc.update(self._counters)
        return doc

    def reset_stats(self) -> None:
        for k in self._counters:
            self._counters[k] = 0

    def _release(self) -> None:
        pymm, self._pymm = getattr(self, "_pymm", None), None
        if pymm is not None:
            pymm.close()
        for attr in ("_io", "_runs_io", "_single_io", "_direct_io"):
            io = getattr(self, attr, None)
            if io is not None and not io.closed:
                io.close()
            setattr(self, attr, None)
        for m in self._maps:
            m.close()
        self._maps = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._own_store and self._store is not None:
            self._store.close()
        self._store = None

    def close(self) -> None:
        """Release mappings, descriptors, the backend and an owned miss `Store`. Later
        calls raise `StoreClosed`. Arrays returned earlier stay valid (they are copies)."""
        if self._closed:
            return
        self._closed = True
        self._records = self._flat = None  # type: ignore[assignment]
        self._hashes = self._keys = self._slot_of = self._rows = None
        self._release()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_view(
    db_path: str | os.PathLike[str],
    table: TableInfo | Store,
    name: str,
    **options: Any,
) -> View:
    """Open view ``name`` of a table given as the `Store` that serves its misses (what
    ``Store.view`` passes) or as the `TableInfo` of a manifest snapshot. ``options`` go to
    `View` (``hasher``, ``key_hash``, ``backend``, ``backend_options``)."""
    if isinstance(table, Store):
        return View(db_path, table=table.name, name=name, store=table, **options)
    if isinstance(table, TableInfo):
        return View(db_path, table=table.name, name=name, info=table, **options)
    raise InvalidArgument(f"table must be a Store or a TableInfo, got {type(table).__name__}")


# --- verify ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ViewProblem:
    """One thing `verify_views` found wrong, with the file's byte range ``[start, end)``."""

    table: str
    view: str
    file: str
    start: int
    end: int
    what: str

    def line(self) -> str:
        return (
            f"table {self.table!r} view {self.view!r} file {self.file!r} bytes "
            f"[{self.start}, {self.end}): {self.what}"
        )


_VERIFY_READ = 8 * 1024 * 1024


def _check_file(
    db: Path, table: str, view: str, vf: ViewFile, progress: Callable[[int], None] | None
) -> list[ViewProblem]:
    def problem(start: int, end: int, what: str) -> ViewProblem:
        return ViewProblem(table, view, vf.path, start, end, what)

    try:
        f = open(db / vf.path, "rb", buffering=0)
    except FileNotFoundError:
        return [problem(0, vf.bytes, "file is missing")]
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != vf.bytes:
            return [
                problem(
                    min(size, vf.bytes),
                    max(size, vf.bytes),
                    f"size is {size}, manifest says {vf.bytes}",
                )
            ]
        found: list[ViewProblem] = []
        whole, block = xxhash.xxh3_64(), xxhash.xxh3_64()
        buf = memoryview(bytearray(_VERIFY_READ))
        pos = block_start = index = 0
        while pos < size:
            want = min(_VERIFY_READ, size - pos, block_start + CHECK_BLOCK_BYTES - pos)
            n = f.readinto(buf[:want])
            if not n:
                return found + [problem(pos, size, "unexpected end of file")]
            whole.update(buf[:n])
            block.update(buf[:n])
            pos += n
            if progress is not None:
                progress(n)
            if pos - block_start == CHECK_BLOCK_BYTES or pos == size:
                if vf.blocks and index < len(vf.blocks) and block.hexdigest() != vf.blocks[index]:
                    found.append(problem(block_start, pos, "block checksum mismatch"))
                block, block_start, index = xxhash.xxh3_64(), pos, index + 1
        if whole.hexdigest() != vf.xxh3_64 and not found:
            found.append(
                problem(0, size, f"xxh3-64 is {whole.hexdigest()}, manifest says {vf.xxh3_64}")
            )
        return found


def _check_slots(
    view: View, store: Store, slots: np.ndarray, batch: int = 4096
) -> list[ViewProblem]:
    """Compare slots with the concatenation of their Store-I rows (vectorised per batch)."""
    found: list[ViewProblem] = []
    pad = view.slot_bytes - view.record_bytes
    keys = view.slot_keys() if view.source == "keys" else None
    path = view.entry.data.path
    for lo in range(0, slots.shape[0], batch):
        s = slots[lo : lo + batch]
        if keys is not None:
            rows = view.hasher().hash_keys(keys[s], layer=view.layer)
        else:
            rows = view.record_rows(s)
        want = store.fetch(rows).reshape(s.shape[0], view.record_bytes)
        got = view.read_records(s)
        bad = np.flatnonzero((got != want).any(axis=1))
        if pad:
            tail = np.asarray(view._flat[HEADER_BYTES:]).reshape(view.n_records, view.slot_bytes)
            bad = np.union1d(bad, np.flatnonzero(tail[s, view.record_bytes :].any(axis=1)))
        for b in bad[:16].tolist():  # name the first few; the count says the rest
            sl = int(s[b])
            start = HEADER_BYTES + sl * view.slot_bytes
            found.append(
                ViewProblem(
                    view.table,
                    view.name,
                    path,
                    start,
                    start + view.slot_bytes,
                    f"slot {sl} differs from its Store-I rows {rows[b].tolist()}",
                )
            )
        if bad.shape[0] > 16:
            found.append(
                ViewProblem(
                    view.table,
                    view.name,
                    path,
                    0,
                    0,
                    f"{bad.shape[0] - 16} more bad slots in this batch",
                )
            )
    return found


def _check_index(view: View, full: bool, sample: np.ndarray) -> list[ViewProblem]:
    assert view._hashes is not None and view._keys is not None and view._slot_of is not None
    vf = view.entry.index
    assert vf is not None
    path = vf.path
    found: list[ViewProblem] = []
    n = view.n_records
    h_off, k_off, s_off = key_index_sections(n, view.key_width)
    hashes = np.asarray(view._hashes)
    if n > 1 and bool((hashes[1:] < hashes[:-1]).any()):
        i = int(np.argmax(hashes[1:] < hashes[:-1]))
        found.append(
            ViewProblem(
                view.table,
                view.name,
                path,
                h_off + 8 * i,
                h_off + 8 * i + 16,
                "key hashes are not sorted",
            )
        )
    slot_of = np.asarray(view._slot_of).astype(np.int64)
    if n and (int(slot_of.max()) >= n or bool((np.bincount(slot_of, minlength=n) != 1).any())):
        found.append(
            ViewProblem(
                view.table,
                view.name,
                path,
                s_off,
                s_off + 4 * n,
                "slots are not a permutation of the view's slots",
            )
        )
    entries = np.arange(n) if full else sample[sample < n]
    if entries.size:
        keys = np.asarray(view._keys)[entries]
        recomputed = _hash_keys(view._key_hash, keys)
        bad = np.flatnonzero(recomputed != hashes[entries])
        for b in bad[:16].tolist():
            e = int(entries[b])
            found.append(
                ViewProblem(
                    view.table,
                    view.name,
                    path,
                    k_off + 8 * view.key_width * e,
                    k_off + 8 * view.key_width * (e + 1),
                    f"key {keys[b].tolist()} does not hash to its stored hash",
                )
            )
    return found


def verify_views(
    db_path: str | os.PathLike[str],
    *,
    tables: Sequence[str] | None = None,
    full: bool = False,
    sample: int = 1024,
    hashers: dict[str, Hasher] | None = None,
    progress: Callable[[int], None] | None = None,
    notes: Callable[[str], None] | None = None,
) -> list[ViewProblem]:
    """Check every view of ``tables`` (default all): file sizes and xxh3-64 (whole and per
    64 MiB block) against the manifest, headers, staleness, the key index (sorted hashes,
    slot permutation, stored hashes of ``sample`` keys or all with ``full``), and that
    ``sample`` slots (every slot with ``full``, plus the first and last) equal the
    concatenation of their Store-I rows. Returns the problems (empty: intact).

    ``hashers`` maps ``"table/view"`` to the `Hasher` of views built with a non-preset
    hasher; without one their slots are not compared and ``notes`` is told so. Cost: one
    sequential pass over every view file, plus the sampled (or full) gathers from Store-I.
    """
    db = Path(db_path)
    manifest = read_manifest(db)
    names = list(tables) if tables else sorted(manifest.tables)
    found: list[ViewProblem] = []
    rng = np.random.default_rng(0)
    for tname in names:
        info = manifest.tables.get(tname)
        if info is None:
            raise TableNotFound(f"no table {tname!r} in {str(db)!r}")
        entries = parse_views(info)
        if not entries:
            continue
        store = Store(db, info)
        try:
            for vname, entry in sorted(entries.items()):
                bad_files = False
                for vf in entry.files:
                    probs = _check_file(db, tname, vname, vf, progress)
                    found.extend(probs)
                    bad_files = bad_files or bool(probs)
                if entry.source_hash != source_hash(info):
                    found.append(
                        ViewProblem(
                            tname,
                            vname,
                            entry.data.path,
                            0,
                            HEADER_BYTES,
                            "stale: built from another version of the table",
                        )
                    )
                    continue
                if bad_files:
                    continue
                hasher = (hashers or {}).get(f"{tname}/{vname}")
                try:
                    view = View(
                        db, table=tname, name=vname, store=store, hasher=hasher, backend="mmap"
                    )
                except EngramDBError as e:
                    found.append(
                        ViewProblem(
                            tname,
                            vname,
                            entry.data.path,
                            0,
                            HEADER_BYTES,
                            f"cannot open: {type(e).__name__}: {e}",
                        )
                    )
                    continue
                with view:
                    n = view.n_records
                    if full or n <= sample:
                        slots = np.arange(n, dtype=np.int64)
                    else:
                        pick = rng.choice(n, size=sample, replace=False)
                        slots = np.unique(np.concatenate([pick, [0, n - 1]])).astype(np.int64)
                    if view.source == "keys":
                        found.extend(_check_index(view, full, slots))
                        try:
                            view.hasher()
                        except EngramDBError as e:
                            if notes is not None:
                                notes(f"view {tname}/{vname}: slots not compared with Store-I: {e}")
                            continue
                    found.extend(_check_slots(view, store, slots))
        finally:
            store.close()
    return found


def views_bytes(db_path: str | os.PathLike[str], tables: Sequence[str] | None = None) -> int:
    """Bytes `verify_views` hashes (for a progress bar)."""
    manifest = read_manifest(db_path)
    names = list(tables) if tables else list(manifest.tables)
    total = 0
    for n in names:
        if n in manifest.tables:
            total += sum(f.bytes for e in parse_views(manifest.tables[n]).values() for f in e.files)
    return total


# --- measurement (the library side of `engramdb view bench|lat`) ------------------------------
def _proc_read_bytes() -> int:
    """Bytes this process caused to be read from block devices (``/proc/self/io``)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


@dataclass(frozen=True)
class ThroughputResult:
    """One `measure_throughput` run. Rates per second; bytes are totals of the run."""

    mode: str  # "warm" | "cold"
    order: str  # "access" | "random"
    batch: int
    records: int
    seconds: float
    bytes_returned: int
    bytes_requested: int
    device_bytes: int  # -1 when /proc/self/io is unavailable
    residency_before: float
    backend: str
    batches: dict[str, int]  # batches per path: mmap, syscall (of which direct)

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mb_per_s(self) -> float:
        return self.bytes_returned / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    @property
    def api_amplification(self) -> float:
        """Bytes the view asked its mapping / backend for, per byte returned."""
        return self.bytes_requested / self.bytes_returned if self.bytes_returned else 0.0

    @property
    def device_amplification(self) -> float:
        """Bytes read from the device (``/proc/self/io``), per byte returned."""
        if self.device_bytes < 0 or not self.bytes_returned:
            return float("nan")
        return self.device_bytes / self.bytes_returned

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            records_per_s=self.records_per_s,
            mb_per_s=self.mb_per_s,
            api_amplification=self.api_amplification,
            device_amplification=self.device_amplification,
        )
        return d

    def line(self) -> str:
        dev = (
            f"device {self.device_amplification:.2f}x"
            if self.device_bytes >= 0
            else "device bytes unknown"
        )
        return (
            f"{self.mode} {self.order}-order read_records, batch {self.batch:,}: "
            f"{self.records_per_s / 1e3:,.1f} k records/s, {self.mb_per_s:,.0f} MB/s, "
            f"amplification api {self.api_amplification:.2f}x, {dev} "
            f"(resident before {self.residency_before:.0%}, backend {self.backend} "
            f"{self.batches})"
        )


def _batches(
    n: int, count: int, order: str, batch: int, rng: np.random.Generator
) -> list[np.ndarray]:
    if order == "access":
        start = int(rng.integers(0, max(1, n - count + 1)))
        ids = np.arange(start, start + count, dtype=np.int64)
    elif order == "random":
        ids = rng.permutation(n)[:count].astype(np.int64)
    else:
        raise InvalidArgument(f"order must be 'access' or 'random', got {order!r}")
    return [ids[i : i + batch] for i in range(0, count, batch)]


def measure_throughput(
    view: View,
    *,
    order: str = "random",
    batch: int = 16384,
    cold: bool = False,
    records: int | None = None,
    seconds: float = 1.0,
    seed: int = 0,
) -> ThroughputResult:
    """records/s of `View.read_records` in batches of ``batch`` ids.

    ``order="access"`` reads consecutive slots (a replay of the build corpus's first
    accesses); ``"random"`` a random permutation. Warm: populates the view, runs one untimed
    pass, then repeats passes for about ``seconds``. Cold: evicts the view (`View.evict`),
    then reads ``records`` records once (default: all, at most 262,144), each at most once.
    Device bytes come from ``/proc/self/io`` (other threads of this process count too).
    """
    if batch < 1:
        raise InvalidArgument(f"batch must be >= 1, got {batch}")
    n = view.n_records
    if n == 0:
        raise InvalidArgument(f"view {view.name!r} has no records to read")
    count = min(n, records if records is not None else (262_144 if cold else n))
    if count < 1:
        raise InvalidArgument(f"records must be >= 1, got {records}")
    rng = np.random.default_rng(seed)
    batches = _batches(n, count, order, batch, rng)
    out = np.empty((min(batch, count), view.record_bytes), dtype=np.uint8)

    def run_pass() -> int:
        for b in batches:
            view.read_records(b, out=out[: b.shape[0]])
        return count

    if cold:
        residency = view.evict()
    else:
        view.populate()
        run_pass()
        residency = view.residency()
    c0 = dict(view._counters)
    dev0 = _proc_read_bytes()
    t0 = time.perf_counter()
    done = run_pass()
    if not cold:
        while time.perf_counter() - t0 < seconds:
            done += run_pass()
    dt = time.perf_counter() - t0
    dev1 = _proc_read_bytes()
    c1 = view._counters
    paths = {
        "mmap": c1["mmap_batches"] - c0["mmap_batches"],
        "syscall": c1["io_batches"] - c0["io_batches"],
        "direct": c1["direct_batches"] - c0["direct_batches"],
    }
    return ThroughputResult(
        mode="cold" if cold else "warm",
        order=order,
        batch=batch,
        records=done,
        seconds=dt,
        bytes_returned=c1["bytes_returned"] - c0["bytes_returned"],
        bytes_requested=c1["bytes_requested"] - c0["bytes_requested"],
        device_bytes=dev1 - dev0 if dev0 >= 0 and dev1 >= 0 else -1,
        residency_before=residency,
        backend=view.backend,
        batches={k: v for k, v in paths.items() if v},
    )


@dataclass(frozen=True)
class LatencyResult:
    """Per-call latency of `View.read_record`, microseconds (timer overhead included)."""

    mode: str
    steps: int
    p50_us: float
    p99_us: float
    mean_us: float
    max_us: float
    residency_before: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return (
            f"{self.mode} read_record x {self.steps:,}: p50 {self.p50_us:.2f} us, p99 "
            f"{self.p99_us:.2f} us, mean {self.mean_us:.2f} us (resident before "
            f"{self.residency_before:.0%})"
        )


def measure_latency(
    view: View, *, steps: int = 10_000, cold: bool = False, warmup: int = 1000, seed: int = 0
) -> LatencyResult:
    """p50 / p99 of single `View.read_record` calls on random records, each call timed with
    ``perf_counter_ns`` (~0.05 us of the figure is the timer). Warm: the view is populated
    and ``warmup`` calls run first. Cold: the view is evicted first and every step reads a
    different record (so each is a fresh fault unless records share a page)."""
    if steps < 1:
        raise InvalidArgument(f"steps must be >= 1, got {steps}")
    n = view.n_records
    if n == 0:
        raise InvalidArgument(f"view {view.name!r} has no records to read")
    rng = np.random.default_rng(seed)
    if cold:
        steps = min(steps, n)
        ids = rng.permutation(n)[:steps].tolist()
        residency = view.evict()
    else:
        ids = rng.integers(0, n, size=steps).tolist()
        view.populate()
        for i in rng.integers(0, n, size=warmup).tolist():
            view.read_record(i)
        residency = view.residency()
    clock = time.perf_counter_ns
    read = view.read_record
    times = np.empty(len(ids), dtype=np.int64)
    # One Python loop around single calls is the thing being measured here.
    for j, i in enumerate(ids):
        t = clock()
        read(i)
        times[j] = clock() - t
    us = times / 1e3
    return LatencyResult(
        mode="cold" if cold else "warm",
        steps=len(ids),
        p50_us=float(np.percentile(us, 50)),
        p99_us=float(np.percentile(us, 99)),
        mean_us=float(us.mean()),
        max_us=float(us.max()),
        residency_before=residency,
    )
