"""Store-P views end to end: build, read, lookups with fallback, staleness, integrity, CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import engramdb
from engramdb import keygen
from engramdb.build.index import build_index
from engramdb.build.view import build_view
from engramdb.cli.bench import measure_latency, measure_throughput
from engramdb.cli.view_cmd import view as view_cli
from engramdb.errors import (
    CorruptFile,
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    RowIdOutOfRange,
    ShapeMismatch,
    StaleView,
    StoreClosed,
    TableExists,
    TableNotFound,
    TokenIdOutOfRange,
    TruncatedFile,
)
from engramdb.io import IoUringBackend
from engramdb.layouts.view import parse_views
from engramdb.testing.dbs import SMALL_BADGE, TableSpec, make_db, random_rows
from engramdb.verify import verify_views
from engramdb.view import View, open_view

# A small Qwen-style layout: 3-grams, 2 orders x 3 heads = 6 rows per key, ~1,900 rows.
QWEN_SMALL = {
    "vocab_size": 50,
    "ngram_size": 3,
    "heads_per_ngram": 3,
    "ngram_vocab_size_base": 300,
    "make_ngram_vocab_size_divisible_by": 4,
    "eos_token_id": 1,
    "ple_layer_ids": [1],
}
BACKENDS = ["mmap", "preadv", "auto"] + (["io_uring"] if IoUringBackend.availability()[0] else [])


def small_hasher(**overrides: Any) -> keygen.Hasher:
    return keygen.hasher("qwen4exp", {**QWEN_SMALL, **overrides}, name="qwen-small")


def make_table(
    db: Path, h: keygen.Hasher, row_bytes: int, seed: int, *, table: str = "t", force: bool = False
) -> np.ndarray:
    """A table laid out for ``h`` (one head per column, a padding head for the rest), with
    several shards; returns its rows. ``force`` rebuilds an existing table in place."""
    heads = [int(r) for r in h.head_rows()]
    pad = h.table_rows() - sum(heads)
    heads += [pad] if pad else []
    badge = SMALL_BADGE[row_bytes]
    spec = TableSpec(row_bytes, heads, rows_per_badge=badge, shard_bytes=3 * badge * row_bytes)
    if not force:
        return make_db(db.parent, {table: spec}, seed=seed, name=db.name)[1][table]
    data = random_rows(np.random.default_rng(seed), sum(heads), row_bytes)  # make_db's rows
    engramdb.build(
        db,
        table,
        row_bytes,
        [data],
        heads=heads,
        rows_per_badge=badge,
        shard_bytes=spec.shard_bytes,
        force=True,
    )
    return data


def corpus_keys(h: keygen.Hasher, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys of ``tokens`` in first-access order and their counts (reference)."""
    keys = h.keys(tokens).reshape(-1, h.max_ngram)
    uniq, first, counts = np.unique(keys, axis=0, return_index=True, return_counts=True)
    order = np.argsort(first)
    return uniq[order], counts[order]


def expected(data: np.ndarray, h: keygen.Hasher, keys: np.ndarray) -> np.ndarray:
    rows = h.hash_keys(keys)
    return data[rows].reshape(keys.shape[:-1] + (-1,))


@pytest.fixture
def built(tmp_path: Path) -> dict[str, Any]:
    h = small_hasher()
    db = tmp_path / "db"
    data = make_table(db, h, 160, seed=1)
    tokens = np.random.default_rng(2).integers(0, 50, (6, 80))
    keys, counts = corpus_keys(h, tokens)
    build_view(db, table="t", name="v", keys=keys, counts=counts, hasher=h)
    return {"db": db, "h": h, "data": data, "tokens": tokens, "keys": keys, "counts": counts}


# --- records equal Store-I gathers ------------------------------------------------------------
@pytest.mark.parametrize("row_bytes, seed", [(160, 0), (264, 1), (160, 2), (264, 3)])
def test_records_equal_store_gathers(tmp_path: Path, row_bytes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    h = small_hasher(ngram_vocab_size_base=int(rng.integers(100, 400)))
    db = tmp_path / "db"
    data = make_table(db, h, row_bytes, seed)
    tokens = rng.integers(0, 50, (int(rng.integers(1, 5)), int(rng.integers(10, 200))))
    keys, _ = corpus_keys(h, tokens)
    keys = keys[rng.permutation(keys.shape[0])]  # any access order
    summary = build_view(db, table="t", name="v", keys=keys, hasher=h, batch_bytes=3000)
    assert summary.records == keys.shape[0] and "built view 'v'" in summary.line()
    want = expected(data, h, keys)
    with engramdb.open(db) as d, open_view(db, d["t"], "v", hasher=h) as v:
        assert v.n_records == keys.shape[0] and v.record_bytes == 6 * row_bytes
        assert (v.read_records(np.arange(v.n_records)) == want).all()
        ids = rng.integers(0, v.n_records, (3, 7))
        assert (v.read_records(ids) == want[ids]).all()
        for i in rng.integers(0, v.n_records, 5).tolist():
            assert v.read_record(i) == want[i].tobytes()
        assert (v.slot_keys() == keys).all()  # slots in the order the keys came
        assert (v.find(keys) == np.arange(keys.shape[0])).all()
        assert (v.lookup(keys[::-1]) == want[::-1]).all()
        # Misses gathered from Store-I and hits from the view agree with the model's rows.
        assert (v.lookup_tokens(tokens) == data[h.row_ids(tokens)].reshape(*tokens.shape, -1)).all()
        assert v.stats()["misses"] == 0
        assert verify_views(db, hashers={"t/v": h}, full=True) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_returns_the_same_bytes(built: dict[str, Any], backend: str) -> None:
    want = expected(built["data"], built["h"], built["keys"])
    n = want.shape[0]
    rng = np.random.default_rng(5)
    with View(built["db"], table="t", name="v", backend=backend, hasher=built["h"]) as v:
        # Evicted (where the filesystem allows it), auto's first batches take the syscall path.
        cold = v.evict() < 0.5 if backend == "auto" else backend != "mmap"
        for ids in (
            np.arange(n),
            rng.integers(0, n, 300),  # unsorted with repeats
            np.arange(n)[::-1].copy(),
            np.array([n - 1]),
            np.zeros(0, np.int64),
        ):
            out = np.full((ids.shape[0], v.record_bytes), 7, np.uint8)
            v.read_records(ids, out=out)
            assert (out == want[ids]).all()
        assert (v.lookup(built["keys"][rng.integers(0, n, 50)]) >= 0).all()
        s = v.stats()
        if cold:
            assert s["io_batches"] > 0
        if backend in ("preadv", "io_uring"):
            assert s["mmap_batches"] == 0
        # Never asks for more bytes than it returns.
        assert s["bytes_requested"] <= s["bytes_returned"]


def test_padded_slots(tmp_path: Path) -> None:
    h = small_hasher()
    db = tmp_path / "db"
    data = make_table(db, h, 160, seed=3)
    keys, _ = corpus_keys(h, np.random.default_rng(4).integers(0, 50, (2, 60)))
    build_view(db, table="t", name="p", keys=keys, hasher=h, slot_bytes=1024)
    want = expected(data, h, keys)
    for backend in ("mmap", "preadv"):
        with View(db, table="t", name="p", backend=backend) as v:
            assert (v.slot_bytes, v.record_bytes) == (1024, 960)
            assert (v.read_records(np.arange(v.n_records)) == want).all()
            assert v.read_record(2) == want[2].tobytes()
    assert verify_views(db, hashers={"t/p": h}, full=True) == []
    with pytest.raises(InvalidArgument, match="smaller than a record"):
        build_view(db, table="t", name="q", keys=keys, hasher=h, slot_bytes=959)


def test_rows_view_is_concatenation_of_fetches(tmp_path: Path) -> None:
    h = small_hasher()
    db = tmp_path / "db"
    data = make_table(db, h, 264, seed=6)
    rng = np.random.default_rng(7)
    rows = rng.integers(0, data.shape[0], (40, 5))
    np.save(tmp_path / "rows.npy", rows)
    build_view(db, table="t", name="r", rows=tmp_path / "rows.npy")
    with engramdb.open(db) as d, d["t"] as store, open_view(db, store, "r") as v:
        assert v.source == "rows" and v.rows_per_record == 5
        want = store.fetch(rows).reshape(40, -1)
        assert (v.read_records(np.arange(40)) == want).all()
        assert (v.record_rows([3, 0]) == rows[[3, 0]]).all()
        with pytest.raises(InvalidArgument, match="no key index"):
            v.lookup(np.zeros((1, 3), np.int64))
        with pytest.raises(InvalidArgument, match="takes no hasher"):
            View(db, table="t", name="r", hasher=h)
    assert verify_views(db, full=True) == []
    bad = rows.copy()
    bad[3, 2] = data.shape[0]
    with pytest.raises(RowIdOutOfRange, match=r"\(3, 2\)"):
        build_view(db, table="t", name="r2", rows=bad)
    with pytest.raises(InvalidArgument, match="disk_budget"):
        build_view(db, table="t", name="r2", rows=rows, disk_budget="1M")


# --- partial views, lookups mixing hits and misses ---------------------------------------------
def test_partial_view_keeps_the_most_frequent_keys_in_access_order(built: dict[str, Any]) -> None:
    db, h, keys, counts = built["db"], built["h"], built["keys"], built["counts"]
    per_key = 6 * 160 + 8 + 24 + 4
    budget = 2 * 4096 + 25 * per_key
    s = build_view(
        db, table="t", name="part", keys=keys, counts=counts, hasher=h, disk_budget=budget
    )
    assert s.records == 25 and "most frequent" in s.line()
    keep = np.sort(np.argsort(-counts, kind="stable")[:25])
    with View(db, table="t", name="part", hasher=h) as v:
        assert (v.slot_keys() == keys[keep]).all()
        tokens = built["tokens"]
        got = v.lookup_tokens(tokens)
        want = built["data"][h.row_ids(tokens)].reshape(*tokens.shape, -1)
        assert (got == want).all()
        st = v.stats()
        hit_positions = int(counts[keep].sum())
        assert (st["hits"], st["misses"]) == (hit_positions, tokens.size - hit_positions)
        assert st["store_rows"] == 6 * st["misses"]
    with pytest.raises(InvalidArgument, match="holds no record"):
        build_view(db, table="t", name="tiny", keys=keys, hasher=h, disk_budget="8K")


def test_lookups_mixing_hits_and_misses(built: dict[str, Any]) -> None:
    db, h, data = built["db"], built["h"], built["data"]
    rng = np.random.default_rng(9)
    present = built["keys"][rng.integers(0, built["keys"].shape[0], 64)]
    absent = rng.integers(0, 50, (64, 3))
    absent = absent[View(db, table="t", name="v", hasher=h).find(absent) < 0]
    mixed = np.concatenate([present, absent])[rng.permutation(64 + absent.shape[0])]
    mixed = mixed.reshape(-1, 2, 3) if mixed.shape[0] % 2 == 0 else mixed[None]
    for backend in BACKENDS:
        with View(db, table="t", name="v", hasher=h, backend=backend) as v:
            out = np.zeros(mixed.shape[:-1] + (v.record_bytes,), np.uint8)
            v.lookup(mixed, out=out)
            assert (out == expected(data, h, mixed)).all()
            st = v.stats()
            assert st["hits"] == 64 and st["misses"] == absent.shape[0] > 0
    # A view with no records serves every key from Store-I.
    build_view(db, table="t", name="empty", keys=np.zeros((0, 3), np.int64), hasher=h)
    with View(db, table="t", name="empty", hasher=h) as v:
        assert v.n_records == 0
        assert (v.lookup(present) == expected(data, h, present)).all()


def test_forced_hash_collisions_never_return_another_keys_rows(built: dict[str, Any]) -> None:
    db, h, data, keys = built["db"], built["h"], built["data"], built["keys"]

    def clash(k: np.ndarray) -> np.ndarray:
        return (k[:, 0] % 3).astype(np.uint64)  # three buckets for all keys

    half = keys[::2]
    build_view(db, table="t", name="c", keys=half, hasher=h, key_hash=clash)
    with View(db, table="t", name="c", hasher=h, key_hash=clash) as v:
        assert (v.find(half) == np.arange(half.shape[0])).all()
        assert (v.find(keys[1::2]) == -1).all()
        got = v.lookup(keys)
        assert (got == expected(data, h, keys)).all()
        assert v.stats()["misses"] == keys[1::2].shape[0]
    with pytest.raises(InvalidArgument, match="custom key hash"):
        View(db, table="t", name="c", hasher=h)
    with pytest.raises(InvalidArgument, match="must not be given"):
        View(db, table="t", name="v", key_hash=clash)


def test_repeated_keys_keep_their_first_position(built: dict[str, Any]) -> None:
    db, h, keys = built["db"], built["h"], built["keys"]
    dup = np.concatenate([keys[:10], keys[3:6], keys[10:20], keys[:2]])
    counts = np.ones(dup.shape[0], np.int64)
    build_view(db, table="t", name="d", keys=dup, counts=counts, hasher=h)
    with View(db, table="t", name="d", hasher=h) as v:
        assert (v.slot_keys() == keys[:20]).all()


def test_from_index(tmp_path: Path) -> None:
    h = small_hasher()
    db = tmp_path / "db"
    data = make_table(db, h, 160, seed=11)
    tokens = np.random.default_rng(12).integers(0, 50, (3, 300)).astype(np.int32)
    np.save(tmp_path / "corpus.npy", tokens)
    build_index(tmp_path / "corpus.npy", db, preset=h, table="t")
    # The index names a non-preset hasher: it has to be given.
    with pytest.raises(InvalidArgument, match="pass hasher="):
        build_view(db, table="t", name="ix", from_index=True)
    s = build_view(
        db, table="t", name="ix", from_index=True, hasher=h, disk_budget=2 * 4096 + 30 * 996
    )
    keys, counts = corpus_keys(h, tokens)
    keep = np.sort(np.argsort(-counts, kind="stable")[:30])
    assert s.keys_total == keys.shape[0] and s.records == 30
    with View(db, table="t", name="ix", hasher=h) as v:
        assert (v.slot_keys() == keys[keep]).all()
        assert (v.lookup_tokens(tokens) == data[h.row_ids(tokens)].reshape(3, 300, -1)).all()


# --- stale, truncated, corrupt --------------------------------------------------------------
def test_stale_view_rejected_at_open(built: dict[str, Any]) -> None:
    db, h = built["db"], built["h"]
    with View(db, table="t", name="v") as v:
        path = db / v.entry.data.path
        assert not v.stale
    manifest = json.loads((db / "manifest.json").read_text())
    views_field = manifest["tables"]["t"]["views"]
    make_table(db, h, 160, seed=99, force=True)  # same geometry, other bytes
    with pytest.raises(StaleView, match="another version of table 't'"):
        View(path)
    # A writer that carries the table's extra fields over keeps naming the view: still stale.
    doc = json.loads((db / "manifest.json").read_text())
    doc["tables"]["t"]["views"] = views_field
    (db / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(StaleView, match="rebuild it"):
        View(db, table="t", name="v")
    with engramdb.open(db) as d, pytest.raises(StaleView):
        open_view(db, d["t"], "v")
    problems = verify_views(db)
    assert [p.what for p in problems] == ["stale: built from another version of the table"]


def test_identical_rebuild_keeps_the_view_valid(built: dict[str, Any]) -> None:
    db, h = built["db"], built["h"]
    views_field = json.loads((db / "manifest.json").read_text())["tables"]["t"]["views"]
    make_table(db, h, 160, seed=1, force=True)  # the same bytes again, a new generation
    doc = json.loads((db / "manifest.json").read_text())
    doc["tables"]["t"].setdefault("views", views_field)
    (db / "manifest.json").write_text(json.dumps(doc))
    with View(db, table="t", name="v") as v:
        assert not v.stale
        assert (v.read_records([0, 1]) == expected(built["data"], h, built["keys"][:2])).all()


def _entry(db: Path, name: str = "v") -> dict[str, Any]:
    return json.loads((db / "manifest.json").read_text())["tables"]["t"]["views"][name]


def test_truncated_and_corrupt_files_detected_at_open(built: dict[str, Any]) -> None:
    db = built["db"]
    e = _entry(db)
    data_path, index_path = db / e["file"]["path"], db / e["index"]["path"]
    original = data_path.read_bytes()
    os.truncate(data_path, len(original) - 100)
    with pytest.raises(TruncatedFile, match=r"has \d+ bytes, the manifest says"):
        View(db, table="t", name="v")
    with data_path.open("ab") as f:
        f.write(b"\0" * 200)
    with pytest.raises(CorruptFile, match="manifest says"):
        View(db, table="t", name="v")
    data_path.write_bytes(original[:50] + b"\xff" + original[51:])  # header byte flipped
    with pytest.raises(CorruptFile, match="header checksum"):
        View(db, table="t", name="v")
    data_path.write_bytes(original)
    os.truncate(index_path, e["index"]["bytes"] - 4)
    with pytest.raises(TruncatedFile, match="keys"):
        View(db, table="t", name="v")
    index_path.unlink()
    with pytest.raises(TruncatedFile, match="missing"):
        View(db, table="t", name="v")


def test_verify_finds_corrupt_slots(built: dict[str, Any]) -> None:
    db, h = built["db"], built["h"]
    e = _entry(db)
    path = db / e["file"]["path"]
    raw = bytearray(path.read_bytes())
    slot = 7
    raw[4096 + slot * 960 + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    problems = verify_views(db, hashers={"t/v": h}, full=True)
    assert any("xxh3-64" in p.what or "block checksum" in p.what for p in problems)
    assert problems[0].line().startswith("table 't' view 'v' file")
    # The checksum in the manifest is what verify trusts; fix it and the slot check still
    # finds the bad bytes.
    import xxhash

    doc = json.loads((db / "manifest.json").read_text())
    f = doc["tables"]["t"]["views"]["v"]["file"]
    f["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(raw))
    f["blocks"] = [f["xxh3_64"]]
    (db / "manifest.json").write_text(json.dumps(doc))
    problems = verify_views(db, hashers={"t/v": h}, full=True)
    assert [p.what.split(" differs")[0] for p in problems] == [f"slot {slot}"]
    assert problems[0].start == 4096 + slot * 960
    notes: list[str] = []
    assert verify_views(db, notes=notes.append) == []  # no hasher: slots not compared...
    assert "not compared" in notes[0]  # ...and it says so


# --- publication --------------------------------------------------------------------------
def test_failed_build_leaves_previous_state(built: dict[str, Any]) -> None:
    db, h, keys = built["db"], built["h"], built["keys"]
    before = (db / "manifest.json").read_bytes()
    files_before = sorted(p.name for p in (db / "t" / "views").iterdir())

    def boom(done: int, total: int) -> None:
        if done > 20:
            raise KeyboardInterrupt  # a kill in the middle of the gather

    with pytest.raises(KeyboardInterrupt):
        build_view(
            db,
            table="t",
            name="v",
            keys=keys[:50],
            hasher=h,
            force=True,
            progress=boom,
            batch_bytes=4000,
        )
    assert (db / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in (db / "t" / "views").iterdir()) == files_before
    with View(db, table="t", name="v") as v:
        assert v.n_records == keys.shape[0]
    # Replacing a view publishes the new files and removes the old ones; other views stay.
    build_view(db, table="t", name="w", keys=keys[:5], hasher=h)
    build_view(db, table="t", name="v", keys=keys[:50], hasher=h, force=True)
    names = sorted(p.name for p in (db / "t" / "views").iterdir())
    assert len(names) == 4 and not any(n in names for n in files_before)
    with View(db, table="t", name="v") as v, View(db, table="t", name="w") as w:
        assert (v.n_records, w.n_records) == (50, 5)


def test_view_built_after_open_is_found(built: dict[str, Any]) -> None:
    db, h, keys = built["db"], built["h"], built["keys"]
    with engramdb.open(db) as d:
        store = d["t"]
        build_view(db, table="t", name="late", keys=keys[:9], hasher=h)
        with open_view(db, store, "late") as v:
            assert v.n_records == 9
        # Rebuilt after the snapshot (old files deleted): the database serves the generation
        # it opened (it holds the files' descriptors since open); a fresh open sees the new.
        before = parse_views(d.manifest.tables["t"])["v"].slots
        build_view(db, table="t", name="v", keys=keys[:4], hasher=h, force=True)
        with store.view("v") as v:
            assert v.n_records == before != 4
    with engramdb.open(db) as d, d["t"].view("v") as v:
        assert v.n_records == 4
        with pytest.raises(TableNotFound, match="no view 'nope'"):
            open_view(db, store, "nope")


# --- bad input ------------------------------------------------------------------------------
def test_bad_input_gets_typed_errors(built: dict[str, Any], tmp_path: Path) -> None:
    db, h, keys = built["db"], built["h"], built["keys"]
    v = View(db, table="t", name="v", hasher=h)
    n = v.n_records
    with pytest.raises(RowIdOutOfRange, match=f"record id {n} is out of range"):
        v.read_record(n)
    with pytest.raises(RowIdOutOfRange, match="record id -1"):
        v.read_record(-1)
    assert v.read_record(np.int64(2)) == v.read_record(2)
    with pytest.raises(InvalidDtype, match="1.5"):
        v.read_record(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidDtype, match="True"):
        v.read_record(True)
    with pytest.raises(RowIdOutOfRange, match=r"record id -3 at position \(1, 0\)"):
        v.read_records([[0, 1], [-3, 2]])
    with pytest.raises(InvalidDtype, match="float"):
        v.read_records(np.array([0.0, 1.0]))
    with pytest.raises(ShapeMismatch, match="expected"):
        v.read_records([0, 1], out=np.empty((3, v.record_bytes), np.uint8))
    with pytest.raises(InvalidDtype, match="uint8"):
        v.read_records([0], out=np.empty((1, v.record_bytes), np.int16))
    with pytest.raises(InvalidLayout, match="C-contiguous"):
        v.read_records([0, 1], out=np.empty((2, 2 * v.record_bytes), np.uint8)[:, ::2])
    with pytest.raises(ShapeMismatch, match=r"\[\.\.\., 3\]"):
        v.lookup(np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidDtype, match="integers"):
        v.lookup(np.zeros((2, 3)))
    out = np.full((2, v.record_bytes), 9, np.uint8)
    with pytest.raises(TokenIdOutOfRange):
        v.lookup(np.array([keys[0], [10**6, 0, 0]]), out=out)
    assert (out == 9).all()  # nothing written before the bad key was found
    with pytest.raises(InvalidArgument, match="does not reproduce"):
        View(db, table="t", name="v", hasher=small_hasher(seed=5))
    with pytest.raises(InvalidArgument, match="rows per"):
        View(db, table="t", name="v", hasher=small_hasher(heads_per_ngram=2))
    v.close()
    with pytest.raises(StoreClosed):
        v.read_record(0)
    with pytest.raises(StoreClosed):
        v.read_records([0])
    with pytest.raises(StoreClosed):
        v.lookup(keys[:1])
    # Build arguments.
    with pytest.raises(InvalidArgument, match="exactly one"):
        build_view(db, table="t", name="x", keys=keys, rows=np.zeros((1, 1), np.int64))
    with pytest.raises(InvalidArgument, match="exactly one"):
        build_view(db, table="t", name="x")
    with pytest.raises(TableExists, match="already exists"):
        build_view(db, table="t", name="v", keys=keys, hasher=h)
    with pytest.raises(TableNotFound, match="no table 'zz'"):
        build_view(db, table="zz", name="x", keys=keys, hasher=h)
    with pytest.raises(InvalidArgument, match="invalid view name"):
        build_view(db, table="t", name="../x", keys=keys, hasher=h)
    with pytest.raises(ShapeMismatch, match=r"\[K, 3\]"):
        build_view(db, table="t", name="x", keys=keys[:, :2], hasher=h)
    with pytest.raises(InvalidDtype, match="float"):
        build_view(db, table="t", name="x", keys=keys.astype(float), hasher=h)
    with pytest.raises(TokenIdOutOfRange, match=r"key \[50, 0, 0\] at position 1"):
        build_view(db, table="t", name="x", keys=[[1, 2, 3], [50, 0, 0]], hasher=h)
    with pytest.raises(ShapeMismatch, match="one per key"):
        build_view(db, table="t", name="x", keys=keys, counts=[1, 2], hasher=h)
    with pytest.raises(InvalidArgument, match="needs hasher"):
        build_view(db, table="t", name="x", keys=keys)
    with pytest.raises(InvalidArgument, match="addresses"):
        build_view(
            db, table="t", name="x", keys=keys, hasher=small_hasher(ngram_vocab_size_base=900)
        )
    with pytest.raises(InvalidArgument, match="cannot parse size"):
        build_view(db, table="t", name="x", keys=keys, hasher=h, disk_budget="lots")
    with pytest.raises(InvalidArgument, match=".npy"):
        build_view(db, table="t", name="x", keys=tmp_path / "keys.txt", hasher=h)
    with pytest.raises(TableNotFound, match="no view 'nope'"):
        View(db, table="t", name="nope")
    with pytest.raises(InvalidArgument, match="needs a .edv file"):
        View(db)


def test_missing_preset_hasher_is_explained(built: dict[str, Any]) -> None:
    with View(built["db"], table="t", name="v") as v:
        hits = v.lookup(built["keys"][:3])  # hits need no hasher
        assert (hits == expected(built["data"], built["h"], built["keys"][:3])).all()
        candidates = np.random.default_rng(0).integers(0, 50, (200, 3))
        absent = candidates[v.find(candidates) < 0][:1]
        assert absent.shape == (1, 3)
        with pytest.raises(InvalidArgument, match="not a preset"):
            v.lookup(absent)


# --- measurement and CLI ----------------------------------------------------------------------
def test_measurements_run(built: dict[str, Any]) -> None:
    with View(built["db"], table="t", name="v", backend="auto") as v:
        warm = measure_throughput(v, order="random", batch=64, seconds=0.05)
        assert warm.records >= v.n_records and warm.api_amplification == pytest.approx(1.0)
        cold = measure_throughput(v, order="access", batch=64, cold=True)
        assert cold.records == v.n_records and cold.api_amplification == pytest.approx(1.0)
        assert "k records/s" in cold.line()
        lat = measure_latency(v, steps=200, warmup=10)
        assert 0 < lat.p50_us <= lat.p99_us and "p50" in lat.line()
        with pytest.raises(InvalidArgument, match="order"):
            measure_throughput(v, order="sideways")


def test_cli_build_bench_lat(built: dict[str, Any], tmp_path: Path) -> None:
    db, keys = built["db"], built["keys"]
    runner = CliRunner()
    np.save(tmp_path / "rows.npy", np.arange(30).reshape(10, 3))
    r = runner.invoke(
        view_cli,
        ["build", str(db), "-t", "t", "-n", "r", "--rows", str(tmp_path / "rows.npy"), "-q"],
    )
    assert r.exit_code == 0, r.output
    assert "built view 'r' of table 't': 10 records x 480 B" in r.output
    np.save(tmp_path / "keys.npy", keys)
    r = runner.invoke(
        view_cli,
        ["build", str(db), "-t", "t", "-n", "k", "--keys", str(tmp_path / "keys.npy"), "-q"],
    )
    assert r.exit_code == 1 and "Error: InvalidArgument" in r.output  # no preset for this layout
    r = runner.invoke(
        view_cli, ["bench", str(db), "-t", "t", "-n", "r", "--seconds", "0.05", "--batch", "4"]
    )
    assert r.exit_code == 0, r.output
    assert "access / random order" in r.output
    r = runner.invoke(
        view_cli, ["bench", str(db), "-t", "t", "-n", "v", "--cold", "--order", "random", "--json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)[0]["mode"] == "cold"
    r = runner.invoke(view_cli, ["lat", str(db), "-t", "t", "-n", "v", "--steps", "100", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["steps"] == 100
    r = runner.invoke(view_cli, ["lat", str(db), "-t", "t", "-n", "nope"])
    assert r.exit_code == 1 and "TableNotFound" in r.output
    for cmd in ("build", "bench", "lat"):
        assert runner.invoke(view_cli, [cmd, "--help"]).exit_code == 0


def test_auto_backend_cold_paths(tmp_path: Path) -> None:
    """Cold batches: runs through buffered preadv, single slots through io_uring (O_DIRECT
    when nothing is cached), here with 1,584 B slots that are not sector multiples."""
    h = small_hasher(ngram_vocab_size_base=600)
    db = tmp_path / "db"
    data = make_table(db, h, 264, seed=21)
    keys, _ = corpus_keys(h, np.random.default_rng(22).integers(0, 50, (4, 300)))
    build_view(db, table="t", name="v", keys=keys, hasher=h)
    want = expected(data, h, keys)
    rng = np.random.default_rng(23)
    with View(db, table="t", name="v", backend="auto") as v:
        n = v.n_records
        assert n > 600
        for ids in (rng.permutation(n)[:400], np.arange(n), rng.integers(0, n, 300)):
            evicted = v.evict() < 0.5
            assert (v.read_records(ids) == want[ids]).all()
            if evicted:
                assert v.stats()["io_batches"] > 0
        st = v.stats()
        assert st["bytes_requested"] <= st["bytes_returned"]
        if IoUringBackend.availability()[0] and st["io_batches"]:
            assert st["direct_batches"] > 0  # the random batch after an eviction
