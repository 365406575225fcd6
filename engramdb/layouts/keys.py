"""Key math of Store-P views, pure numpy: the key hash, deduplication and key matching.

A key view (``docs/view.md``) finds a key's slot by its XXH64 (`default_key_hash`, computed
column by column with `xxh64_keys`, or one C call per key for a handful: `hash_keys`), a
``searchsorted`` in the sorted hashes and a key comparison (`match_keys`). A build dedupes
its keys (`dedupe_keys`) and records a fingerprint of the hasher that maps keys to rows
(`hasher_fingerprint`), which a reader checks before serving misses. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import xxhash

from engramdb.errors import InvalidArgument

__all__ = [
    "PROBE_KEYS",
    "SMALL_HASH_BATCH",
    "KeyHash",
    "default_key_hash",
    "dedupe_keys",
    "hash_keys",
    "hasher_fingerprint",
    "match_keys",
    "slot_size",
    "xxh64_keys",
    "xxh64_small",
]

#: A replacement key hash (tests): int64 ``[K, W]`` keys -> one integer per key.
KeyHash = Callable[[np.ndarray], np.ndarray]
#: Keys hashed one by one (the xxhash C call) below this batch size: the vectorised hash
#: costs ~30 us of numpy call overhead however few keys there are.
SMALL_HASH_BATCH = 16
#: Fixed keys for the hasher fingerprint (hashed with strict=False, any kind accepts them).
#: Plain arithmetic rather than a random generator, so the fingerprint can never depend on
#: the numpy version.
PROBE_KEYS = (np.arange(32 * 16, dtype=np.int64).reshape(32, 16) * 2_654_435_761) % 32_749


class RowHasher(Protocol):
    """What `hasher_fingerprint` needs of a keygen `Hasher`."""

    def hash_keys(self, keys: Any, *, layer: int | None = ..., strict: bool = ...) -> Any: ...


# --- XXH64 of fixed-width int64 keys, vectorised --------------------------------------------
_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4, _P5 = (
    0x9E3779B185EBCA87,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5,
)
_U = np.uint64


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U(r)) | (x >> _U(64 - r))


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    acc = acc + lane * _U(_P2)
    return _rotl(acc, 31) * _U(_P1)


def xxh64_keys(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """XXH64 (``seed``) of each row's little-endian int64 bytes: uint64 ``[K]`` for ``[K, W]``.

    Bit-identical to ``xxhash.xxh64_intdigest(row.astype("<i8").tobytes(), seed)``; computed
    column by column with wrapping uint64 numpy arithmetic (uint64 array ops wrap without a
    warning), so the cost is ~20 passes over ``K`` values for ``W <= 4``: ~15 ns per key.
    """
    k = np.ascontiguousarray(keys, dtype="<i8")
    if k.ndim != 2:
        raise InvalidArgument(f"keys must be 2-D [K, W], got shape {k.shape}")
    n, width = k.shape
    lanes = k.view(np.uint64)
    seed &= _M64
    length = 8 * width
    col = 0
    if length >= 32:
        v1 = np.full(n, (seed + _P1 + _P2) & _M64, dtype=np.uint64)
        v2 = np.full(n, (seed + _P2) & _M64, dtype=np.uint64)
        v3 = np.full(n, seed, dtype=np.uint64)
        v4 = np.full(n, (seed - _P1) & _M64, dtype=np.uint64)
        while width - col >= 4:
            v1 = _round(v1, lanes[:, col])
            v2 = _round(v2, lanes[:, col + 1])
            v3 = _round(v3, lanes[:, col + 2])
            v4 = _round(v4, lanes[:, col + 3])
            col += 4
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        for v in (v1, v2, v3, v4):
            h = (h ^ _round(np.zeros_like(v), v)) * _U(_P1) + _U(_P4)
    else:
        h = np.full(n, (seed + _P5) & _M64, dtype=np.uint64)
    h = h + _U(length)
    zero = np.zeros(n, dtype=np.uint64)
    while col < width:
        h = h ^ _round(zero, lanes[:, col])
        h = _rotl(h, 27) * _U(_P1) + _U(_P4)
        col += 1
    h ^= h >> _U(33)
    h *= _U(_P2)
    h ^= h >> _U(29)
    h *= _U(_P3)
    h ^= h >> _U(32)
    return h


def default_key_hash(keys: np.ndarray) -> np.ndarray:
    """The format's key hash: XXH64, seed 0, of each key's ``<i8`` bytes."""
    return xxh64_keys(keys, 0)


# --- key matching ---------------------------------------------------------------------------
def match_keys(
    sorted_hashes: np.ndarray,
    sorted_keys: np.ndarray,
    slot_of: np.ndarray,
    query_keys: np.ndarray,
    query_hashes: np.ndarray,
) -> np.ndarray:
    """Slot of every query key (int64, -1 for a miss), by hash search confirmed by the key.

    One ``searchsorted`` finds each query's first index entry with an equal hash; the stored
    key at that entry must equal the query in every column. A query whose hash equals a
    stored hash but whose key differs moves on to the next entry of the same hash, so a
    collision costs one more vectorised round over the colliding queries only; a key is never
    given the slot of another key.
    """
    m = query_hashes.shape[0]
    result = np.full(m, -1, dtype=np.int64)
    k = sorted_hashes.shape[0]
    if k == 0 or m == 0:
        return result
    pos = np.searchsorted(sorted_hashes, query_hashes)
    active = np.flatnonzero(pos < k)
    p = pos[active]
    while active.shape[0]:
        same = np.asarray(sorted_hashes[p]) == query_hashes[active]
        active, p = active[same], p[same]
        if not active.shape[0]:
            break
        eq = (np.asarray(sorted_keys[p]) == query_keys[active]).all(axis=1)
        result[active[eq]] = slot_of[p[eq]]
        miss = ~eq
        active, p = active[miss], p[miss] + 1
        inside = p < k
        active, p = active[inside], p[inside]
    return result


# --- the hash of a batch of keys -----------------------------------------------------------
def xxh64_small(keys: np.ndarray) -> np.ndarray:
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


def hash_keys(key_hash: KeyHash | None, keys: np.ndarray) -> np.ndarray:
    """uint64 hash of every key of int64 ``[K, W]`` ``keys``: the format's XXH64 (one C call
    per key up to `SMALL_HASH_BATCH` keys, vectorised above), or ``key_hash`` when given
    (checked to return one integer per key)."""
    if key_hash is None:
        if keys.shape[0] <= SMALL_HASH_BATCH:
            return xxh64_small(keys)
        return default_key_hash(keys)
    h = np.asarray(key_hash(keys))
    if h.shape != (keys.shape[0],) or h.dtype.kind not in "iu":
        raise InvalidArgument(
            f"key_hash must return one integer per key ({keys.shape[0]}), got {h.dtype} {h.shape}"
        )
    return h.astype(np.uint64, copy=False)


def hasher_fingerprint(h: RowHasher, layer: int | None, width: int) -> str:
    """xxh3-64 (hex) of the row ids ``h`` gives the fixed `PROBE_KEYS` (``width`` columns) at
    ``layer``: equal fingerprints mean the hasher maps keys to the same rows."""
    rows = h.hash_keys(PROBE_KEYS[:, :width], layer=layer, strict=False)
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(rows, dtype="<i8").tobytes())


# --- building a key index ------------------------------------------------------------------
def dedupe_keys(
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


def slot_size(slot_bytes: int | None, record: int) -> int:
    """The slot size of a view of ``record``-byte records: ``slot_bytes`` (checked: an
    integer no smaller than a record), or the record size when None."""
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
