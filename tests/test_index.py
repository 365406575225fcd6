"""``engramdb index``: counts and keys against a brute-force reference, files, errors, CLI."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from engramdb import keygen
from engramdb.build.index import KeyCounter, build_index
from engramdb.cli.index_cmd import index_cmd as index_command
from engramdb.disk.publish import write_manifest
from engramdb.errors import (
    ChecksumMismatch,
    CorruptManifest,
    DatabaseNotFound,
    IndexNotFound,
    InvalidArgument,
    SourceError,
    TableNotFound,
    TokenIdOutOfRange,
    TruncatedFile,
)
from engramdb.layouts.geometry import plan_geometry
from engramdb.layouts.manifest import EMPTY, ShardInfo, TableInfo
from engramdb.read.index import load_index

QWEN_TINY = {
    "vocab_size": 64,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 17,
    "make_ngram_vocab_size_divisible_by": 4,
    "eos_token_id": 1,
    "ple_layer_ids": [1],
}
# Four 17-bit ids do not pack into one int64: exercises the hashed-key path.
DEEPSEEK_WIDE = {
    "layer_ids": [0, 2],
    "max_ngram_size": 4,
    "n_head_per_ngram": 2,
    "engram_vocab_size": [40, 50, 60],
    "pad_id": 2,
    "compressed_vocab_size": 70_000,
}


def make_db(
    path: Path, tables: dict[str, int], h: keygen.Hasher | None = None, layer: int = 0
) -> Path:
    """A database whose manifest names tables of ``n_rows`` rows of 160 B without writing
    their shards (indexing reads only the manifest): one head per table, or ``h``'s heads of
    ``layer`` plus one head of the padding rows up to ``n_rows`` if any."""
    path.mkdir(parents=True, exist_ok=True)
    manifest = EMPTY
    for name, n_rows in tables.items():
        heads = (n_rows,) if h is None else tuple(int(r) for r in h.head_rows(layer))
        if sum(heads) < n_rows:
            heads += (n_rows - sum(heads),)
        geo = plan_geometry(n_rows, 160)
        shards = tuple(
            ShardInfo(
                path=f"{name}/g-0/shard-{i:05d}.edb",
                first_row=i * geo.rows_per_shard,
                rows=geo.shard_rows(i),
                bytes=geo.shard_rows(i) * 160,
                xxh3_64="0" * 16,
            )
            for i in range(geo.n_shards)
        )
        manifest = manifest.with_table(TableInfo(name, 160, heads, geo, shards))
    write_manifest(path, manifest)
    return path


def brute_force(
    h: keygen.Hasher, layer: int, sequences: list[np.ndarray], hot: int, **kw: Any
) -> dict[str, Any]:
    """Row and key statistics by hashing every sequence whole and counting in Python."""
    rows = [h.row_ids(s, layer=layer, **kw) for s in sequences]
    keys = [h.keys(s, **kw) for s in sequences]
    all_rows = np.concatenate(rows) if rows else np.zeros((0, h.n_heads), np.int64)
    row_counts = Counter(all_rows.reshape(-1).tolist())
    key_counts: dict[tuple[int, ...], int] = {}
    for k in np.concatenate(keys).tolist() if keys else []:
        key_counts[tuple(k)] = key_counts.get(tuple(k), 0) + 1
    ranked = sorted(row_counts.items(), key=lambda rc: (-rc[1], rc[0]))[:hot]
    return {
        "hot_rows": [r for r, _ in ranked],
        "hot_counts": [c for _, c in ranked],
        "keys": [list(k) for k in key_counts],
        "key_counts": list(key_counts.values()),
        "per_head": [len(set(all_rows[:, j].tolist())) for j in range(h.n_heads)],
        "tokens": int(all_rows.shape[0]),
    }


def assert_matches(ix: Any, want: dict[str, Any]) -> None:
    assert ix.hot_rows.tolist() == want["hot_rows"]
    assert ix.hot_counts.tolist() == want["hot_counts"]
    assert ix.keys.tolist() == want["keys"]
    assert ix.key_counts.tolist() == want["key_counts"]
    assert ix.meta["distinct_rows_per_head"] == want["per_head"]
    assert ix.meta["corpus"]["tokens"] == want["tokens"]
    assert ix.meta["lookups"] == want["tokens"] * len(want["per_head"])


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_qwen_round_trip_equals_brute_force(
    tmp_path: Path, rng: np.random.Generator, chunk: int
) -> None:
    h = keygen.hasher("qwen4exp", QWEN_TINY, name="qwen-tiny")
    db = make_db(tmp_path / "db", {"ple": h.table_rows(1)}, h, layer=1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seqs = [rng.integers(0, 12, size=n) for n in (300, 1, 0, 77)]
    np.save(corpus / "a.npy", seqs[0].astype(np.uint32))
    seqs[1].astype("<i4").tofile(corpus / "b.bin")
    np.save(corpus / "c.npy", np.zeros(0, np.int64))
    np.save(corpus / "d.npy", np.stack([seqs[3], seqs[3][::-1]]))  # [S, T]: two sequences
    (corpus / "notes.txt").write_text("ignored")
    seqs = [seqs[0], seqs[1], seqs[2], seqs[3], seqs[3][::-1]]
    summary = build_index(
        corpus, db, preset=h, table="ple", hot_rows=25, bin_dtype="int32", chunk_tokens=chunk
    )
    assert (summary.tokens, summary.sequences, summary.files) == (455, 5, 4)
    assert summary.preset == "qwen-tiny" and summary.layer == 1
    assert "455 tokens" in summary.line() and "tokens/s" in summary.line()
    ix = load_index(db, "ple")
    assert_matches(ix, brute_force(h, 1, seqs, 25))
    assert ix.keys.dtype == np.int64 and ix.hot_counts.dtype == np.uint64
    assert sorted(p.name for p in (db / "ple" / "index").iterdir()) == [
        "hot.zst",
        "index.json",
        "keys.zst",
    ]


def test_deepseek_hashed_keys_doc_separator_and_collisions(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = keygen.hasher("deepseek-demo", DEEPSEEK_WIDE, compressed_pad_id=2)
    assert not KeyCounter(4, 70_000).packed
    db = make_db(tmp_path / "db", {"l0": h.table_rows(0), "l2": h.table_rows(2) + 5})
    ids = rng.integers(0, 9, size=500)
    ids[[0, 40, 41, 300]] = 7  # 7 starts a new document (at the very start too)
    np.save(tmp_path / "c.npy", ids)
    pieces = np.split(ids, np.flatnonzero(ids == 7)[1:])
    build_index(
        tmp_path / "c.npy",
        db,
        preset=h,
        table="l2",
        layer=2,
        hot_rows=1000,
        doc_separator=7,
        compressed=True,
        chunk_tokens=33,
    )
    want = brute_force(h, 2, pieces, 1000, compressed=True)
    assert_matches(load_index(db, "l2"), want)
    # without the separator it is one sequence
    build_index(tmp_path / "c.npy", db, preset=h, table="l0", layer=0, compressed=True)
    assert_matches(load_index(db, "l0"), brute_force(h, 0, [ids], 1 << 20, compressed=True))

    # every key hashes to the same code: grouping must fall back to exact rows
    monkeypatch.setattr(KeyCounter, "_codes", lambda self, keys: np.zeros(keys.shape[0], np.int64))
    build_index(
        tmp_path / "c.npy",
        db,
        preset=h,
        table="l2",
        layer=2,
        hot_rows=1000,
        doc_separator=7,
        compressed=True,
        chunk_tokens=50,
    )
    assert_matches(load_index(db, "l2"), want)


def test_key_counter_merges_many_runs(rng: np.random.Generator) -> None:
    counter = KeyCounter(3, 20)
    chunks = [rng.integers(0, 4, size=(n, 3)) for n in (50, 0, 1, 200, 3)]
    expected: dict[tuple[int, ...], int] = {}
    for c in chunks:
        counter.add(c)
        for k in c.tolist():
            expected[tuple(k)] = expected.get(tuple(k), 0) + 1
        counter.merge()  # force the log-structured merge path every time
    keys, counts = counter.result()
    assert [tuple(k) for k in keys.tolist()] == list(expected)
    assert counts.tolist() == list(expected.values())


def test_gemma_index(tmp_path: Path) -> None:
    h = keygen.hasher(
        "gemma3n", {"vocab_size_per_layer_input": 10, "num_hidden_layers": 3, "vocab_size": 14}
    )
    db = make_db(tmp_path / "db", {"ple": 10})
    ids = np.array([1, 2, 2, 11, 3, 2, 13, 9])
    np.save(tmp_path / "c.npy", ids)
    build_index(tmp_path / "c.npy", db, preset=h, hot_rows=3)
    ix = load_index(db, "ple")
    assert ix.hot_rows.tolist() == [2, 0, 1] and ix.hot_counts.tolist() == [3, 2, 1]
    assert ix.keys.tolist() == [[1], [2], [0], [3], [9]]
    assert ix.key_counts.tolist() == [1, 3, 2, 1, 1]


def test_real_preset_on_a_small_corpus(tmp_path: Path, rng: np.random.Generator) -> None:
    h = keygen.preset("qwen3.8-flash-next")
    db = make_db(tmp_path / "db", {"ple": 320_001_536}, h, layer=2)
    ids = rng.integers(0, 300, size=3000)
    ids[::97] = 248_044
    np.save(tmp_path / "c.npy", ids)
    build_index(tmp_path / "c.npy", db, preset="qwen3.8-flash-next", hot_rows=500)
    assert_matches(load_index(db, "ple"), brute_force(h, 2, [ids], 500))


def test_errors(tmp_path: Path) -> None:
    h = keygen.hasher("qwen4exp", QWEN_TINY)
    np.save(tmp_path / "c.npy", np.array([3, 4, 5]))
    corpus = tmp_path / "c.npy"
    with pytest.raises(DatabaseNotFound):
        build_index(corpus, tmp_path / "nodb", preset=h)
    db = make_db(tmp_path / "db", {"a": 88, "b": 87})
    with pytest.raises(TableNotFound, match="'zz'.*\\['a', 'b'\\]"):
        build_index(corpus, db, preset=h, table="zz")
    with pytest.raises(InvalidArgument, match="pass table="):
        build_index(corpus, db, preset=h)
    with pytest.raises(InvalidArgument, match="88 rows but table 'b' has 87"):
        build_index(corpus, db, preset=h, table="b")
    other = keygen.hasher("qwen4exp", {**QWEN_TINY, "seed": 1, "ngram_vocab_size_base": 19})
    rows = int(sum(other.head_rows(1)))  # exactly its heads: the table lists n_heads heads
    bad_heads = make_db(tmp_path / "db2", {"a": rows}, other, layer=1)
    with pytest.raises(InvalidArgument, match="head 0"):
        build_index(corpus, bad_heads, preset=h)
    with pytest.raises(InvalidArgument, match="doc_separator"):
        build_index(corpus, db, preset=h, table="a", doc_separator=1)
    with pytest.raises(InvalidArgument, match="hot_rows"):
        build_index(corpus, db, preset=h, table="a", hot_rows=-1)
    np.save(tmp_path / "oov.npy", np.array([3, 64]))
    with pytest.raises(TokenIdOutOfRange, match="oov.npy.*64"):
        build_index(tmp_path / "oov.npy", db, preset=h, table="a")
    (tmp_path / "c.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(InvalidArgument, match="bin_dtype"):
        build_index(tmp_path / "c.bin", db, preset=h, table="a")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(SourceError, match="whole number"):
        build_index(tmp_path / "odd.bin", db, preset=h, table="a", bin_dtype="uint32")
    np.save(tmp_path / "f.npy", np.zeros(3))
    with pytest.raises(SourceError, match="integers"):
        build_index(tmp_path / "f.npy", db, preset=h, table="a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no .npy"):
        build_index(tmp_path / "empty", db, preset=h, table="a")
    with pytest.raises(IndexNotFound, match="no index"):
        load_index(db, "a")
    (tmp_path / "db3").mkdir()
    (tmp_path / "db3" / "manifest.json").write_text("{nope")
    with pytest.raises(CorruptManifest):
        build_index(corpus, tmp_path / "db3", preset=h)
    assert not (db / "a").exists()  # nothing written on failure


def test_load_detects_damage(tmp_path: Path) -> None:
    h = keygen.hasher("qwen4exp", QWEN_TINY)
    db = make_db(tmp_path / "db", {"ple": 88})
    np.save(tmp_path / "c.npy", np.arange(40) % 9)
    build_index(tmp_path / "c.npy", db, preset=h)
    keys = db / "ple" / "index" / "keys.zst"
    blob = bytearray(keys.read_bytes())
    blob[-5] ^= 0xFF
    keys.write_bytes(bytes(blob))
    with pytest.raises(ChecksumMismatch):
        load_index(db, "ple")
    keys.write_bytes(bytes(blob[:-1]))
    with pytest.raises(TruncatedFile):
        load_index(db, "ple")


def test_cli(tmp_path: Path) -> None:
    db = make_db(tmp_path / "db", {"l1": 384_006_168, "l14": 384_016_682})
    ids = np.arange(2000, dtype=np.uint32) % 50
    ids.tofile(tmp_path / "c.bin")
    runner = CliRunner()
    args = [str(tmp_path / "c.bin"), str(db), "--preset", "deepseek-v4.1-flash", "--table", "l14"]
    ok = runner.invoke(
        index_command,
        [*args, "--layer", "14", "--bin-dtype", "uint32", "--compressed", "--hot-rows", "10"],
    )
    assert ok.exit_code == 0, ok.output
    assert "indexed 2,000 tokens" in ok.output and "M tokens/s" in ok.output
    ix = load_index(db, "l14")
    assert ix.meta["preset"] == "deepseek-v4.1-flash" and ix.hot_rows.shape == (10,)
    bad = runner.invoke(index_command, [*args, "--bin-dtype", "uint32", "--compressed"])
    assert bad.exit_code == 1 and "InvalidArgument" in bad.output and "layer" in bad.output
    raw = runner.invoke(index_command, [*args, "--layer", "14", "--bin-dtype", "uint32"])
    assert raw.exit_code == 1 and "compression map" in raw.output
    tmap = keygen.TokenMap(np.arange(99_092))
    tmap.save(tmp_path / "map.npy")
    mapped = runner.invoke(
        index_command,
        [
            *args,
            "--layer",
            "14",
            "--bin-dtype",
            "uint32",
            "--token-map",
            str(tmp_path / "map.npy"),
            "-q",
        ],
    )
    assert mapped.exit_code == 0, mapped.output
    assert load_index(db, "l14").keys.tolist() == ix.keys.tolist()
    assert runner.invoke(index_command, ["--help"]).exit_code == 0
