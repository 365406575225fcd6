"""Store-P format math (engramdb.layouts.view): key hash, headers, read plans, key matching."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from engramdb.errors import CorruptFile, CorruptManifest, InvalidArgument
from engramdb.layouts.view import (
    HEADER_BYTES,
    KeyIndexHeader,
    RowsHeader,
    ViewEntry,
    ViewHeader,
    budget_keys,
    bytes_per_key,
    check_view_name,
    keep_most_frequent,
    key_index_bytes,
    match_keys,
    plan_slot_reads,
    xxh64_keys,
)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("seed", [0, 7, (1 << 64) - 1])
def test_xxh64_keys_matches_xxhash(width: int, seed: int, rng: np.random.Generator) -> None:
    keys = rng.integers(-(1 << 63), (1 << 63) - 1, size=(40, width), dtype=np.int64)
    keys[0] = 0
    want = [xxhash.xxh64_intdigest(k.astype("<i8").tobytes(), seed) for k in keys]
    assert xxh64_keys(keys, seed).tolist() == want


def test_xxh64_keys_rejects_non_matrix() -> None:
    with pytest.raises(InvalidArgument, match="2-D"):
        xxh64_keys(np.zeros(3, np.int64))


def _header() -> ViewHeader:
    return ViewHeader(
        slot_bytes=2560,
        record_bytes=2560,
        n_slots=12,
        rows_per_record=16,
        row_bytes=160,
        source_hash=0x1234,
        build_id=0xABCD,
        layer=2,
        key_width=3,
        table="ple",
        preset="qwen3.8-flash-next",
    )


def test_headers_round_trip() -> None:
    h = _header()
    page = h.pack()
    assert len(page) == HEADER_BYTES
    assert ViewHeader.unpack(page, "x") == h
    assert h.file_bytes == HEADER_BYTES + 12 * 2560
    k = KeyIndexHeader(n_keys=5, key_width=3, hash_kind=1, hash_seed=0, build_id=9, n_slots=5)
    assert KeyIndexHeader.unpack(k.pack(), "k") == k
    assert k.file_bytes == key_index_bytes(5, 3) == HEADER_BYTES + 5 * (8 + 24 + 4)
    r = RowsHeader(n_records=4, rows_per_record=7, build_id=9, table_rows=100)
    assert RowsHeader.unpack(r.pack(), "r") == r


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p: b"NOTAVIEW" + p[8:], "bad magic"),
        (lambda p: p[:8] + (2).to_bytes(4, "little") + p[12:], "version 2"),
        (lambda p: p[:100] + b"\x01" + p[101:], "header checksum"),
        (lambda p: p[:1000], "header page"),
    ],
)
def test_header_violations_are_corrupt_file(mutate: object, match: str) -> None:
    page = _header().pack()
    with pytest.raises(CorruptFile, match=match):
        ViewHeader.unpack(mutate(page), "view x")  # type: ignore[operator]


def test_header_rejects_unfitting_names() -> None:
    with pytest.raises(InvalidArgument, match="does not fit"):
        ViewHeader(1, 1, 0, 1, 1, 0, 0, -1, 0, "t" * 200, "").pack()


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "a/b", "x" * 129, 5])
def test_bad_view_names(name: object) -> None:
    with pytest.raises(InvalidArgument, match="invalid view name"):
        check_view_name(name)  # type: ignore[arg-type]


def _execute(plan: object, file: np.ndarray, slot_bytes: int) -> np.ndarray:
    """Run a plan against an in-memory 'file' the way a backend would."""
    u = plan.unique.shape[0]  # type: ignore[attr-defined]
    buf = np.zeros(u * slot_bytes, np.uint8)
    for o, n, d in zip(plan.offsets, plan.lengths, plan.dest_offsets):  # type: ignore[attr-defined]
        buf[d : d + n] = file[o : o + n]
    return buf.reshape(u, slot_bytes)


@pytest.mark.parametrize("seed", range(6))
def test_plan_slot_reads_reads_exactly_the_slots(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_slots, slot = 300, 24
    file = rng.integers(0, 256, HEADER_BYTES + n_slots * slot, dtype=np.uint8)
    slots_view = file[HEADER_BYTES:].reshape(n_slots, slot)
    kind = seed % 3
    if kind == 0:
        ids = rng.integers(0, n_slots, 200)
    elif kind == 1:
        start = int(rng.integers(0, 100))
        ids = np.arange(start, start + 150)
    else:
        ids = np.sort(rng.choice(n_slots, 120, replace=False))
    plan = plan_slot_reads(ids, slot, max_request=10 * slot)
    got = _execute(plan, file, slot)
    inv = plan.inverse if plan.inverse is not None else np.arange(ids.shape[0])
    assert (got[inv] == slots_view[ids]).all()
    # Never more bytes than the distinct slots, never a request above max_request.
    assert plan.nbytes == np.unique(ids).shape[0] * slot
    assert int(plan.lengths.max()) <= 10 * slot
    if kind == 1:
        assert plan.inverse is None and plan.offsets.shape[0] == 15  # 150 slots / 10 per read


def test_plan_slot_reads_empty_and_single() -> None:
    assert plan_slot_reads(np.zeros(0, np.int64), 8, max_request=64).offsets.shape == (0,)
    p = plan_slot_reads(np.array([5]), 8, max_request=64)
    assert p.offsets.tolist() == [HEADER_BYTES + 40] and p.lengths.tolist() == [8]


def test_match_keys_resolves_collisions_by_the_stored_key() -> None:
    stored = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], np.int64)
    # Every key hashes alike: the search must walk the run and compare keys.
    hashes = np.zeros(5, np.uint64)
    slot_of = np.array([4, 3, 2, 1, 0], np.uint32)
    queries = np.array([[7, 8], [1, 2], [2, 1], [9, 10], [0, 0]], np.int64)
    got = match_keys(hashes, stored, slot_of, queries, np.zeros(5, np.uint64))
    assert got.tolist() == [1, 4, -1, 0, -1]
    # A query hashing differently from every entry misses without comparing keys.
    other = match_keys(hashes, stored, slot_of, queries[:1], np.ones(1, np.uint64))
    assert other.tolist() == [-1]
    assert (
        match_keys(hashes[:0], stored[:0], slot_of[:0], queries, np.zeros(5, np.uint64)).tolist()
        == [-1] * 5
    )


def test_budget_and_frequency_selection() -> None:
    per = bytes_per_key(2560, 3)
    assert per == 2560 + 8 + 24 + 4
    assert budget_keys(2 * HEADER_BYTES + 10 * per + per - 1, 2560, 3) == 10
    assert budget_keys(100, 2560, 3) == 0
    counts = np.array([5, 1, 9, 5, 2, 9])
    assert keep_most_frequent(counts, 6, 3).tolist() == [0, 2, 5]  # ties: earlier key first
    assert keep_most_frequent(counts, 6, 4).tolist() == [0, 2, 3, 5]
    assert keep_most_frequent(None, 6, 2).tolist() == [0, 1]
    assert keep_most_frequent(counts, 6, 10).tolist() == list(range(6))


def test_view_entry_rejects_bad_manifest_fields() -> None:
    good = {
        "file": {"path": "t/views/v-1.edv", "bytes": HEADER_BYTES + 2 * 8, "xxh3_64": "0" * 16},
        "index": None,
        "rows": {"path": "t/views/v-1.rows", "bytes": HEADER_BYTES + 16, "xxh3_64": "1" * 16},
        "slots": 2,
        "slot_bytes": 8,
        "record_bytes": 8,
        "rows_per_record": 1,
        "source": "rows",
        "source_hash": "a" * 16,
        "build_id": "b" * 16,
        "key_width": 0,
        "hasher": None,
        "keys_total": 2,
    }
    assert ViewEntry.parse("t", "v", good).slots == 2
    for key, value, match in [
        ("source", "x", "source"),
        ("slots", 3, "file.bytes"),
        ("file", {**good["file"], "path": "../x.edv"}, "leaves the database"),
        ("file", {**good["file"], "path": "u/views/x.edv"}, "is not a file directly under"),
        ("file", {**good["file"], "path": "t/views/../../x"}, "leaves the database"),
        ("rows", None, "lacks the file"),
        ("build_id", "zz", "build_id"),
    ]:
        with pytest.raises(CorruptManifest, match=match):
            ViewEntry.parse("t", "v", {**good, key: value})
