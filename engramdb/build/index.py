"""``engramdb index`` (the writer side): row frequencies, the hot set and access-ordered n-gram keys of a corpus.

One streaming pass over a token corpus computes every position's *key* (the fill-resolved
context that determines all of its row ids, see :meth:`engramdb.keygen.Hasher.keys`) and
counts distinct keys with vectorised sort-and-reduce per chunk, merged log-structured. Row
frequencies then follow from the distinct keys alone (every occurrence of a key reads the
same rows), one head at a time, so memory is bounded by the number of distinct keys plus one
head's bucket count -- never by the corpus or the whole table.

Outputs, under ``DB/<table>/index/`` (format in ``docs/keygen.md``): ``hot.zst`` (the
``hot_rows`` most frequent rows with counts), ``keys.zst`` (distinct keys in order of first
access, with counts) and ``index.json`` (what was indexed, sizes, xxh3-64 checksums),
each published atomically, ``index.json`` last. `engramdb.read.index` reads them back.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import zstandard

from engramdb.corpus import corpus_files, open_tokens
from engramdb.disk.checksum import HashingFile
from engramdb.disk.files import atomic_writer, fsync_dir
from engramdb.disk.publish import (
    collect_garbage,
    database_lock,
    new_generation_id,
    new_staging_dir,
    publish_dir,
    read_manifest,
)
from engramdb.errors import InvalidArgument, TokenIdOutOfRange
from engramdb.keygen import Hasher, LayerTables, column_mixes
from engramdb.keygen.presets import is_preset_name, preset_for_table
from engramdb.layouts.manifest import TableInfo
from engramdb.read.index import FORMAT, VERSION, pick_table
from engramdb.units import per_second, progress_phase

__all__ = ["DEFAULT_CHUNK_TOKENS", "DEFAULT_HOT_ROWS", "IndexSummary", "KeyCounter", "build_index"]

DEFAULT_HOT_ROWS = 1 << 20
DEFAULT_CHUNK_TOKENS = 1 << 20
#: Mode of the index files (the mode of the table's shards).
INDEX_FILE_MODE = 0o644
_ZSTD_LEVEL = 3

# Odd 64-bit constants for hashing keys that do not pack into 63 bits (e.g. four 17-bit ids).
_KEY_MULT = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
    0xFF51AFD7ED558CCD,
    0xC4CEB9FE1A85EC53,
)


@dataclass(frozen=True)
class IndexSummary:
    """What one :func:`build_index` run did. Times in seconds."""

    table: str
    layer: int
    preset: str
    tokens: int
    sequences: int
    files: int
    distinct_keys: int
    distinct_rows: int
    hot_rows: int
    seconds: float
    path: Path

    @property
    def tokens_per_s(self) -> float:
        return per_second(self.tokens, self.seconds)

    def line(self) -> str:
        """One-line human summary with units."""
        return (
            f"indexed {self.tokens:,} tokens ({self.sequences:,} sequences in {self.files:,} "
            f"files) for table {self.table!r} layer {self.layer} in {self.seconds:.2f} s "
            f"({self.tokens_per_s / 1e6:.2f} M tokens/s): {self.distinct_keys:,} keys, "
            f"{self.distinct_rows:,} rows touched, hot set {self.hot_rows:,} rows -> {self.path}"
        )


def _check_fit(info: TableInfo, lt: LayerTables, table: str) -> None:
    n_rows = info.n_rows
    if lt.table_rows > n_rows:
        raise InvalidArgument(
            f"layer {lt.layer} addresses {lt.table_rows:,} rows but table {table!r} has "
            f"{n_rows:,} (a table built with `build --preset` has the preset's heads, pad head "
            f"included; a table built with --scale needs the same scale)"
        )
    if len(info.heads) == lt.n_heads:
        offsets = info.head_offsets.tolist()
        for j, rows in enumerate(info.heads):
            want = (int(lt.primes[j]), int(lt.offsets[j]))
            got = (int(rows), int(offsets[j]))
            if got != want:
                raise InvalidArgument(
                    f"table {table!r} head {j} is (rows, offset) {got}, layer {lt.layer} "
                    f"needs {want}"
                )


# --- keys of a corpus -----------------------------------------------------------------------
class KeyCounter:
    """Exact counts and first positions of distinct keys, fed chunk by chunk.

    Keys pack losslessly into one int64 code when ``width * bits <= 63``; otherwise the code
    is a 64-bit hash and every grouping verifies that equal codes hold equal keys (a
    collision switches to exact row-wise grouping, so results never depend on luck).
    Each chunk costs one argsort; runs are merged when they outgrow the merged set, so the
    total is O(n log n) and memory O(distinct keys).
    """

    def __init__(self, width: int, id_bound: int) -> None:
        self.width = width
        self.bits = max(1, (max(id_bound, 1) - 1).bit_length())
        self.packed = width * self.bits <= 63
        # Unpackable keys ride along with their runs; ids below 2^32 halve that traffic.
        self.key_dtype = np.dtype(np.uint32) if self.bits <= 32 else np.dtype(np.int64)
        self.exact_rows = False  # set after a hash collision
        self._main: tuple[np.ndarray, ...] | None = None
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._pending_size = 0
        self.positions = 0

    def _codes(self, keys: np.ndarray) -> np.ndarray:
        if self.packed:
            code = keys[:, 0].copy()
            for k in range(1, self.width):
                code |= keys[:, k] << (self.bits * k)
            return code
        acc = np.zeros(keys.shape[0], dtype=np.uint64)
        tmp = np.empty_like(acc)
        for k in range(self.width):
            column = keys[:, k].astype(np.uint64)
            np.multiply(column, np.uint64(_KEY_MULT[k % len(_KEY_MULT)]), out=tmp)
            acc ^= tmp
            acc ^= acc >> np.uint64(29)
        return acc.view(np.int64)

    def _group(self, run: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        code, first, count, keys = run
        if self.exact_rows:
            _, code = np.unique(keys, axis=0, return_inverse=True)
            code = code.reshape(-1).astype(np.int64)
        # Stable: merged runs arrive as sorted runs, which timsort merges ~2x faster than
        # introsort sorts them.
        order = np.argsort(code, kind="stable")
        sorted_code = code[order]
        n = sorted_code.shape[0]
        new = np.empty(n, dtype=np.bool_)
        new[:1] = True
        np.not_equal(sorted_code[1:], sorted_code[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        if not self.packed and not self.exact_rows:
            # Each repeat of a code must hold the same key as its predecessor in sorted order
            # (equality then chains through the group); only repeats are gathered.
            repeat = np.flatnonzero(~new)
            if repeat.shape[0] and not np.array_equal(keys[order[repeat]], keys[order[repeat - 1]]):
                self.exact_rows = True
                return self._group(run)
        first_out = np.minimum.reduceat(first[order], starts) if n else first[:0]
        count_out = np.add.reduceat(count[order], starts) if n else count[:0]
        # Packed codes are the keys themselves, so packed runs carry no key rows.
        keys_out = keys[:0] if self.packed else keys[order[starts]]
        code_out = sorted_code[starts]
        if self.exact_rows:
            code_out = self._codes(keys_out)
        return code_out, first_out, count_out, keys_out

    def add(self, keys: np.ndarray) -> None:
        """Count the keys of ``keys`` (int64 ``[n, width]``), positions continuing the corpus."""
        n = keys.shape[0]
        if n == 0:
            return
        first = np.arange(self.positions, self.positions + n, dtype=np.int64)
        self.positions += n
        stored = keys[:0] if self.packed else keys.astype(self.key_dtype)
        run = self._group((self._codes(keys), first, np.ones(n, dtype=np.int64), stored))
        self._pending.append(run)
        self._pending_size += run[0].shape[0]
        main_size = 0 if self._main is None else self._main[0].shape[0]
        if self._pending_size > max(main_size, 1 << 22):
            self.merge()

    def merge(self) -> None:
        """Merge the pending runs into the main run now (``add`` and ``result`` do it when
        due; calling it early changes no result, only when the merge work happens)."""
        runs = ([] if self._main is None else [self._main]) + self._pending
        self._pending, self._pending_size = [], 0
        if not runs:
            return
        joined = tuple(np.concatenate([r[i] for r in runs]) for i in range(4))
        self._main = self._group(joined)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys int64 [K, width], counts int64 [K])`` ordered by first occurrence."""
        self.merge()
        if self._main is None:
            return np.zeros((0, self.width), dtype=np.int64), np.zeros(0, dtype=np.int64)
        code, first, count, keys = self._main
        self._main = None  # the caller owns the result; do not hold a second copy
        order = np.argsort(first)
        if self.packed:
            mask = (1 << self.bits) - 1
            code = code[order]
            keys = np.empty((code.shape[0], self.width), dtype=np.int64)
            for k in range(self.width):
                np.bitwise_and(code >> (self.bits * k), mask, out=keys[:, k])
        else:
            keys = keys[order].astype(np.int64)
        return keys, count[order]


# --- rows from keys -------------------------------------------------------------------------
def _count_ids(ids: np.ndarray, counts: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct ids ascending, summed counts)`` of ``ids`` weighted by ``counts``.

    Few ids against many buckets: sort and reduce (O(n log n), no bucket array). Otherwise a
    weighted bincount over the buckets (O(n + buckets)); float64 weights are exact for
    counts below 2^53.
    """
    if ids.shape[0] * 16 < buckets:
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        new = np.empty(sorted_ids.shape[0], dtype=np.bool_)
        new[:1] = True
        np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        if not starts.shape[0]:
            return sorted_ids, counts[:0]
        return sorted_ids[starts], np.add.reduceat(counts[order], starts)
    dense = np.bincount(ids, weights=counts.astype(np.float64), minlength=buckets)
    nz = np.flatnonzero(dense > 0)  # a bool mask scans ~3x faster than float nonzero
    return nz, dense[nz].astype(np.int64)


def _head_counts(
    lt: LayerTables, keys: np.ndarray, counts: np.ndarray
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per column: ``(column, local ids with a non-zero count ascending, their counts)``.

    One column at a time keeps memory at one head's worth of buckets.
    """
    if lt.max_ngram == 1:  # Gemma: the key is the row
        yield (0, *_count_ids(keys[:, 0], counts, lt.table_rows))
        return
    local = np.empty(keys.shape[0], dtype=np.int64)
    for col, mix in column_mixes(lt, keys):  # the kind's windows (DeepSeek, engram-peft, Qwen)
        p = int(lt.primes[col])
        # floor_divide by a scalar is SIMD; mix - q*p is the exact floor modulo.
        np.floor_divide(mix, p, out=local)
        np.multiply(local, -p, out=local)
        np.add(local, mix, out=local)
        yield (col, *_count_ids(local, counts, p))


def _kth_largest(cnts: np.ndarray, n: int) -> int:
    """The ``n``-th largest value of non-negative ``cnts`` (1 <= n <= len) in O(len).

    Counts are mostly small, so a histogram of values clipped at 2^16 finds the threshold;
    ``np.partition`` measured 30x slower on such tie-heavy data. Only when the threshold is
    above the clip does a partition run, on the few large counts.
    """
    cap = 1 << 16
    hist = np.bincount(np.minimum(cnts, cap), minlength=cap + 1)
    at_least = np.cumsum(hist[::-1])[::-1]  # at_least[v] = #{cnts >= v} (clipped)
    v = int(np.flatnonzero(at_least >= n)[-1])
    if v < cap:
        return v
    big = cnts[cnts >= cap]
    return int(np.partition(big, big.shape[0] - n)[big.shape[0] - n])


def _top(rows: np.ndarray, cnts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` largest counts, ties broken by smaller row id. ``rows`` must be ascending."""
    if rows.shape[0] <= n:
        return rows, cnts
    if n == 0:
        return rows[:0], cnts[:0]
    kth = _kth_largest(cnts, n)
    keep = cnts > kth
    tied = np.flatnonzero(cnts == kth)  # ascending rows: the smallest ids win the ties
    keep[tied[: n - int(np.count_nonzero(keep))]] = True
    return rows[keep], cnts[keep]


# --- files ----------------------------------------------------------------------------------
def _write_arrays(path: Path, arrays: list[np.ndarray]) -> dict[str, Any]:
    """zstd-compress the arrays' bytes, back to back, into ``path`` atomically."""
    raw = sum(a.nbytes for a in arrays)
    cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True, threads=-1)
    with atomic_writer(path) as fh:
        out = HashingFile(fh)
        with cctx.stream_writer(cast(IO[bytes], out), size=raw, closefd=False) as zw:
            for arr in arrays:
                flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                for s in range(0, flat.shape[0], 1 << 24):
                    zw.write(flat[s : s + (1 << 24)].data)
    return {
        "file": path.name,
        "raw_bytes": raw,
        "bytes": out.size,
        "xxh3_64": out.hexdigest(),
    }


# --- public API -----------------------------------------------------------------------------
def _resolve_hasher(spec: str | Hasher, token_map: Any, info: TableInfo) -> tuple[Hasher, str]:
    h = preset_for_table(spec, info.extra.get("keygen"), token_map=token_map)
    if isinstance(spec, str) and is_preset_name(h.name):
        return h, str(h.name)  # with its scale: "qwen3.8-flash-next@tiny"
    return h, (spec if isinstance(spec, str) else h.name or h.kind)


def build_index(
    corpus: str | os.PathLike[str],
    db_path: str | os.PathLike[str],
    *,
    preset: str | Hasher,
    table: str | None = None,
    layer: int | None = None,
    hot_rows: int = DEFAULT_HOT_ROWS,
    bin_dtype: str | None = None,
    doc_separator: int | None = None,
    compressed: bool = False,
    token_map: Any = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    progress: Callable[[int, int], None] | None = None,
) -> IndexSummary:
    """Index ``corpus`` for ``table`` of the database at ``db_path``; see the module doc.

    ``corpus``: a ``.npy`` (``[T]`` one sequence, ``[S, T]`` S sequences), a raw ``.bin``
    (``bin_dtype`` ``"uint32"``/``"int32"``, one sequence) or a directory of them (one or more
    sequences per file, by file name). ``preset``: a preset name or a :class:`Hasher`;
    ``layer`` picks its table when it has several. ``doc_separator`` (DeepSeek): a token id
    that starts a new sequence (it is that sequence's first token); Qwen separates documents
    by EOS itself. ``compressed`` / ``token_map``: DeepSeek ids already compressed, or the map
    to compress them. ``progress(done_tokens, total_tokens)`` is called after every chunk
    (about 200 times over the corpus); a callback with a ``phase`` method (the CLI's
    display, `engramdb.units.progress_phase`) also hears the later phases (merging keys,
    counting rows per head: ``progress(heads_done, n_heads)``, writing).

    Cost: ~1 s per 10 M tokens for the keys plus one bincount per head over the distinct
    keys; memory ~40 B per distinct key plus 8 B per bucket of one head.
    """
    started = time.perf_counter()
    db = Path(db_path)
    info = pick_table(read_manifest(db), table, db)
    table_name = info.name
    h, label = _resolve_hasher(preset, token_map, info)
    lt = h.layer_tables(layer)
    _check_fit(info, lt, table_name)
    if hot_rows < 0:
        raise InvalidArgument(f"hot_rows must be >= 0, got {hot_rows}")
    if chunk_tokens < 1:
        raise InvalidArgument(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if doc_separator is not None and h.kind not in ("deepseek-demo", "deepseek-v41"):
        raise InvalidArgument(
            f"doc_separator applies to DeepSeek corpora; {h.kind} separates documents "
            f"{'by EOS' if h.kind == 'qwen4exp' else 'not at all (no context)'}"
        )
    if h.id_bound is None:
        raise InvalidArgument(
            f"{label}: the id space is unknown (give the token map or vocab size)"
        )
    files = corpus_files(corpus)
    arrays = [open_tokens(p, bin_dtype) for p in files]
    total = sum(int(a.size) for a in arrays)

    counter = KeyCounter(h.max_ngram, h.id_bound if h.max_ngram > 1 else lt.table_rows)
    done = sequences = 0
    if progress is not None:
        # ~200 reports over the corpus (a smooth bar), never chunks under 64 Ki tokens;
        # the keys do not depend on the chunk size
        chunk_tokens = min(chunk_tokens, max(1 << 16, -(-total // 200)))
        progress_phase(progress, "hashing", total, "tokens")
        progress(0, total)
    for path, arr in zip(files, arrays, strict=True):
        for s in range(arr.shape[0]):
            sequences += 1
            seq = arr[s]
            try:
                for keys in h.iter_keys(
                    seq, chunk_tokens, compressed=compressed, doc_separator=doc_separator
                ):
                    counter.add(keys)
                    done += keys.shape[0]
                    if progress is not None:
                        progress(done, total)
            except TokenIdOutOfRange as exc:
                raise TokenIdOutOfRange(f"{path} sequence {s}: {exc}") from None
    progress_phase(progress, "merging keys", None, "keys")
    keys, key_counts = counter.result()
    del counter
    progress_phase(progress, "counting rows per head", lt.n_heads, "heads")

    # Running top: at most 2 x hot_rows candidates are alive at any time.
    all_r = np.zeros(0, np.int64)
    all_c = np.zeros(0, np.int64)
    per_head: list[int] = []
    for col, local, cnts in _head_counts(lt, keys, key_counts):
        per_head.append(int(local.shape[0]))
        if progress is not None and hasattr(progress, "phase"):  # the CLI's display only
            progress(len(per_head), lt.n_heads)
        r, c = _top(local + int(lt.offsets[col]), cnts, hot_rows)
        merged_r, merged_c = np.concatenate([all_r, r]), np.concatenate([all_c, c])
        if all_r.shape[0] and r.shape[0] and merged_r[all_r.shape[0] - 1] > r[0]:
            by_row = np.argsort(merged_r, kind="stable")  # columns need not be in row order
            merged_r, merged_c = merged_r[by_row], merged_c[by_row]
        all_r, all_c = _top(merged_r, merged_c, hot_rows)
    order = np.lexsort((all_r, -all_c))
    top_rows, top_counts = all_r[order].astype("<i8"), all_c[order].astype("<u8")

    def meta_of(hot_meta: dict[str, Any], keys_meta: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "table": table_name,
            "preset": label,
            "kind": h.kind,
            "layer": lt.layer,
            "table_rows": lt.table_rows,
            "n_heads": lt.n_heads,
            "max_ngram": h.max_ngram,
            "fill_id": h.fill_id,
            "key_ids": "compressed" if h.kind.startswith("deepseek") else "raw",
            "corpus": {
                "path": str(corpus),
                "files": len(files),
                "sequences": sequences,
                "tokens": done,
                "bin_dtype": bin_dtype,
                "doc_separator": doc_separator,
            },
            "lookups": done * lt.n_heads,
            "distinct_keys": int(keys.shape[0]),
            "distinct_rows": int(sum(per_head)),
            "distinct_rows_per_head": per_head,
            "hot": hot_meta,
            "keys": keys_meta,
        }

    out_dir = db / table_name / "index"
    progress_phase(progress, "writing index", None, "B")
    asked = time.perf_counter()
    with database_lock(db):
        started += time.perf_counter() - asked  # a wait for the writer lock is not index time
        # the whole set is written into a staging directory and published in one atomic
        # switch (`publish_dir`), under the writer lock: a kill at any moment leaves the
        # previous index intact and a staging directory that the next writer (or
        # `engramdb gc`) removes
        staging = new_staging_dir(db / table_name, f"index-{new_generation_id()}")
        try:
            _write_index_files(staging, meta_of, top_rows, top_counts, keys, key_counts, h)
            publish_dir(staging, out_dir)
        except BaseException:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        # leftovers of killed writers (index staging directories among them)
        collect_garbage(db, read_manifest(db), views=False)
    return IndexSummary(
        table=table_name,
        layer=lt.layer,
        preset=label,
        tokens=done,
        sequences=sequences,
        files=len(files),
        distinct_keys=int(keys.shape[0]),
        distinct_rows=int(sum(per_head)),
        hot_rows=int(top_rows.shape[0]),
        seconds=time.perf_counter() - started,
        path=out_dir,
    )


def _write_index_files(
    out_dir: Path,
    meta_of: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
    top_rows: np.ndarray,
    top_counts: np.ndarray,
    keys: np.ndarray,
    key_counts: np.ndarray,
    h: Hasher,
) -> None:
    hot_meta = _write_arrays(out_dir / "hot.zst", [top_rows, top_counts])
    keys_meta = _write_arrays(out_dir / "keys.zst", [keys.astype("<i8"), key_counts.astype("<u8")])
    hot_meta["rows"] = int(top_rows.shape[0])
    keys_meta["keys"] = int(keys.shape[0])
    keys_meta["width"] = h.max_ngram
    meta = meta_of(hot_meta, keys_meta)
    with atomic_writer(out_dir / "index.json") as fh:
        fh.write((json.dumps(meta, indent=1) + "\n").encode())
    for name in ("hot.zst", "keys.zst", "index.json"):
        os.chmod(out_dir / name, INDEX_FILE_MODE)  # as the shards: readable by every reader
    fsync_dir(out_dir, strict=False)
