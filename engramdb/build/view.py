"""`build_view`: build a Store-P view of a Store-I table and publish it atomically.

The publication protocol is the table builds' (``docs/format.md``): files are written and
hashed in a staging directory, fsynced, renamed into ``DB/<table>/views/``, and the manifest
that names them is written under the database lock; unreferenced view files are then
collected. A killed build leaves the previous state. The format is `engramdb.layouts.view`;
the key math is `engramdb.layouts.keys`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engramdb._version import __version__
from engramdb.disk.checksum import HashedWriter
from engramdb.disk.files import fsync_dir, mem_available
from engramdb.disk.publish import (
    collect_garbage,
    database_lock,
    new_staging_dir,
    read_manifest_or_empty,
    write_manifest,
)
from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    RowIdOutOfRange,
    ShapeMismatch,
    TableExists,
    TableNotFound,
    TokenIdOutOfRange,
)
from engramdb.keygen import Hasher
from engramdb.keygen.presets import is_preset_name, preset_for_table
from engramdb.layouts.keys import (
    KeyHash,
    dedupe_keys,
    hash_keys,
    hasher_fingerprint,
    slot_size,
)
from engramdb.layouts.manifest import FileEntry, Manifest, TableInfo, check_table_name
from engramdb.layouts.view import (
    HASH_CUSTOM,
    HASH_XXH64,
    HEADER_BYTES,
    KEYS_SUFFIX,
    ROWS_SUFFIX,
    VIEW_SUFFIX,
    KeyIndexHeader,
    RowsHeader,
    ViewEntry,
    ViewHeader,
    budget_keys,
    bytes_per_key,
    check_view_name,
    keep_most_frequent,
    parse_views,
    source_hash,
)
from engramdb.read.index import load_index
from engramdb.store import Store
from engramdb.units import (
    Summary,
    format_bytes,
    format_rate,
    parse_size,
    per_second,
    progress_phase,
)
from engramdb.validate import check_bounds

__all__ = ["BUILD_BATCH_BYTES", "ViewBuildSummary", "build_view"]

#: Bytes gathered per build step: bounds build memory whatever the view's size.
BUILD_BATCH_BYTES = 64 * 1024 * 1024


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


@dataclass(frozen=True)
class ViewBuildSummary(Summary):
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
            f" (budget {format_bytes(self.budget_bytes)} kept the {self.records:,} most "
            f"frequent of {self.keys_total:,} keys)"
            if self.budget_bytes is not None and self.records < self.keys_total
            else ""
        )
        return (
            f"built view {self.name!r} of table {self.table!r}: {self.records:,} records x "
            f"{self.record_bytes} B{kept}, {format_bytes(self.bytes)} written, "
            f"{self.rows_fetched:,} rows gathered in {self.seconds:.2f} s "
            f"({format_rate(per_second(self.bytes, self.seconds))})"
        )


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
    with database_lock(db):
        t0 = time.perf_counter()  # a wait for another writer's lock is not build time
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
        progress_phase(progress, "preparing keys", None, "keys")
        src = _prepare_source(
            db, info, keys, counts, from_index, rows, hasher, layer, budget, slot_bytes, key_hash
        )
        store = Store(db, info)
        try:
            if populate or (
                populate is None and info.n_rows * info.row_bytes * 2 <= mem_available()
            ):
                progress_phase(progress, "populating table", info.n_rows * info.row_bytes, "B")
                store.populate(progress=getattr(progress, "update", None))
            progress_phase(progress, "gathering", src.n_records, "records")
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
        collect_garbage(db, new, tables=False)
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


def _resolve_hasher(
    hasher: Hasher | str | None, fallback: str | None, record: Any = None
) -> Hasher:
    spec = hasher if hasher is not None else fallback
    if spec is None:
        raise InvalidArgument("a key view needs hasher= (a keygen Hasher or a preset name)")
    if isinstance(spec, Hasher):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgument(f"hasher must be a keygen Hasher or a preset name, got {spec!r}")
    try:
        return preset_for_table(spec, record)  # type: ignore[no-any-return]
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
            slot_bytes=slot_size(slot_bytes, record),
            keys_total=r.shape[0],
            budget=None,
            custom_hash=False,
            hasher_doc=None,
        )
    label = None
    key_arr: Any = keys
    if from_index:
        if counts is not None:
            raise InvalidArgument("counts= comes from the index with from_index=True")
        ix = load_index(db, info.name)
        key_arr, counts = ix.keys, ix.key_counts
        label = str(ix.meta.get("preset")) if ix.meta.get("preset") else None
        if layer is None and ix.meta.get("layer") is not None:
            layer = int(ix.meta["layer"])
    h = _resolve_hasher(hasher, label, info.extra.get("keygen"))
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
    slot = slot_size(slot_bytes, record)
    hashes = hash_keys(key_hash, k)
    k, c, hashes, order = dedupe_keys(k, c, hashes)
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
        "preset": h.name if is_preset_name(h.name) else None,
        "name": h.name or h.kind,
        "kind": h.kind,
        "layer": lt_layer,
        "max_ngram": h.max_ngram,
        "n_heads": h.n_heads,
        "fingerprint": hasher_fingerprint(h, layer, h.max_ngram),
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
    staging = new_staging_dir(vdir, f"{build_id:016x}")
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
        data = HashedWriter(staging / f"{tag}{VIEW_SUFFIX}")
        fetched = 0
        try:
            data.write(header.pack())
            per = max(1, batch_bytes // src.slot_bytes)
            if progress is not None:  # ~200 reports (a smooth bar), batches of >= 4096 records
                per = min(per, max(4096, -(-n // 200)))
                progress(0, n)
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
            f = HashedWriter(staging / f"{tag}{ROWS_SUFFIX}")
            try:
                f.write(RowsHeader(n, src.rows_per_record, build_id, info.n_rows).pack())
                f.write(np.ascontiguousarray(src.rows, dtype="<i8"))
                rows_file = f.finish(f"{rel}{ROWS_SUFFIX}")
            except BaseException:
                f.abort()
                raise
        fsync_dir(staging)
        for p in sorted(staging.iterdir()):
            target = vdir / p.name
            os.rename(p, target)
            moved.append(target)
        fsync_dir(vdir)
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


def _write_key_index(staging: Path, rel: str, tag: str, src: _Source, build_id: int) -> FileEntry:
    assert src.keys is not None and src.index_order is not None and src.hashes is not None
    n, width = src.keys.shape
    order = src.index_order
    f = HashedWriter(staging / f"{tag}{KEYS_SUFFIX}")
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
