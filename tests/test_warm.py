"""`engramdb warm`: page-cache warming, hot-set pinning into the RAM tier, residency checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner

import engramdb
from engramdb import keygen
from engramdb.build.index import build_index
from engramdb.cli import main
from engramdb.read.index import load_index
from engramdb.warm import warm_hot


def run(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def indexed_db(tmp_path: Path) -> tuple[Path, keygen.Hasher]:
    h = keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000)
    rows = h.table_rows(2)
    db = tmp_path / "db"
    engramdb.build(
        db, "ple", 160, [np.random.default_rng(3).integers(0, 256, (rows, 160), np.uint8)]
    )
    zipf = np.random.default_rng(4).zipf(1.3, 20_000) % 5000
    np.save(tmp_path / "corpus.npy", zipf)
    build_index(tmp_path / "corpus.npy", db, preset=h, table="ple", hot_rows=4000)
    return db, h


def test_warm_hot_pins_the_index_hot_set(tmp_path: Path) -> None:
    db, _ = indexed_db(tmp_path)
    hot = load_index(db, "ple").hot_rows
    with engramdb.open(db, ram_budget="256K") as d:
        (summary,) = warm_hot(d)
        s = d["ple"]
        assert s.cache is not None and summary.rows == s.cache.n_hot > 0
        pinned = hot[: summary.rows]
        assert s.cache.contains(pinned).all()
        hits = s.stats()["cache"]["hits"]
        for chunk in np.array_split(pinned, -(-pinned.size // 100)):  # decode-sized batches
            s.fetch(chunk)
        assert s.stats()["cache"]["hits"] == hits + pinned.size
    code, out = run("warm", db, "--hot", "--ram-budget", "256K", "--table", "ple")
    assert code == 0 and "pinned" in out and "hot rows" in out, out


def test_warm_page_cache_and_check(tmp_path: Path) -> None:
    db, _ = indexed_db(tmp_path)
    code, out = run("warm", db, "-q")
    assert code == 0 and "GB/s" in out and "-> 100%" in out, out
    code, out = run("warm", db, "--check")
    assert code == 0 and "ple: 100.0% resident" in out, out


def test_warm_rejects_inconsistent_options(tmp_path: Path) -> None:
    db, _ = indexed_db(tmp_path)
    for args in (["--hot"], ["--ram-budget", "1M"], ["--hot", "--ram-budget", "1M", "--check"]):
        code, out = run("warm", db, *args)
        assert code != 0 and "Error" in out, (args, out)


def test_warm_a_view(tmp_path: Path) -> None:
    from engramdb.build.view import build_view

    db, h = indexed_db(tmp_path)
    keys = h.keys(np.random.default_rng(5).integers(0, 248_320, 3000))
    build_view(db, table="ple", name="v", keys=keys, hasher=h)
    code, out = run("warm", db, "--table", "ple", "--view", "v")
    assert code == 0 and "warmed 'ple/v'" in out and "-> 100%" in out, out
    code, out = run("warm", db, "--table", "ple", "--view", "v", "--check")
    assert code == 0 and "ple/v: 100.0% resident" in out, out
    code, out = run("warm", db, "--view", "v")
    assert code != 0 and "--view needs exactly one --table" in out, out
