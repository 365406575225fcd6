"""CLI consistency: DB first, one option name per concept, errors in CLI flags, help with an
example per command and a glossary, info listing views / index / residency, py.typed, reprs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import engramdb
from engramdb.cli import main


def run(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def _commands() -> list[list[str]]:
    out: list[list[str]] = []
    for name, cmd in main.commands.items():
        sub = getattr(cmd, "commands", None)
        out += [[name, s] for s in sub] if sub else [[name]]
    return out


@pytest.mark.parametrize("cmd", _commands(), ids=" ".join)
def test_every_command_has_an_example_and_db_first(cmd: list[str]) -> None:
    code, out = run(*cmd, "--help")
    assert code == 0 and "Example: engramdb " + " ".join(cmd) in out, out
    if "DB" in out.split("\n")[0]:
        assert out.split("\n")[0].split(" ".join(cmd))[1].split()[0].startswith(("DB", "[OPTIONS]"))


def test_top_level_help_has_the_glossary() -> None:
    code, out = run("--help")
    for word in ("Store-I", "Store-P", "head", "badge", "Glossary", "--json"):
        assert word in out, word
    code, out = run("serve", "--help")
    assert "[auto|mmap|preadv|io_uring]" in out.replace("\n", "").replace(" ", "") or all(
        b in out for b in ("auto", "mmap", "preadv", "io_uring")
    )
    assert "Records per View.read_records call" in run("view", "bench", "--help")[1]
    assert "Single-record reads to time" in run("view", "lat", "--help")[1]
    # one name per concept: a view is --view everywhere; --name survives hidden
    for cmd in (["view", "build"], ["view", "bench"], ["view", "lat"], ["warm"]):
        out = run(*cmd, "--help")[1]
        assert "--view" in out and "--name" not in out, cmd
    out = run("publish", "--help")[1]
    assert "--publication" in out and "--name" not in out


def test_index_db_first_and_the_old_order(tmp_path: Path) -> None:
    from tests.test_index import make_db

    db = make_db(tmp_path / "db", {"l14": 384_016_682})
    (np.arange(500, dtype=np.uint32) % 50).tofile(tmp_path / "c.bin")
    opts = ["--preset", "deepseek-v4.1-flash", "--layer", "14", "--compressed", "--bin-dtype", "uint32", "-q"]
    r = CliRunner().invoke(main, ["index", str(db), str(tmp_path / "c.bin"), *opts])
    assert r.exit_code == 0 and "indexed 500 tokens" in r.stdout and "deprecated" not in r.output
    r = CliRunner().invoke(main, ["index", str(tmp_path / "c.bin"), str(db), *opts])
    assert r.exit_code == 0 and "indexed 500 tokens" in r.stdout
    assert "deprecated" in r.stderr and "the database comes first" in r.stderr
    # a raw corpus without --bin-dtype: the error names the flag, not the keyword
    code, out = run("index", db, tmp_path / "c.bin", "--preset", "deepseek-v4.1-flash", "--layer", "14")
    assert code == 1 and "--bin-dtype" in out and "bin_dtype" not in out


def test_errors_speak_in_flags(db_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    db, _ = db_factory({"a": (8, (64,)), "b": (8, (64,))})
    np.save(tmp_path / "x.npy", np.zeros((4, 8), np.uint8))
    code, out = run("build", db, tmp_path / "x.npy", "-t", "c", "--row-bytes", "0")
    assert code == 2 and "--row-bytes" in out and "row_bytes" not in out
    code, out = run("build", db, tmp_path / "x.npy", "-t", "c", "--row-bytes", "4")
    assert code == 1 and "expected --row-bytes 4" in out and "row_bytes=" not in out
    np.save(tmp_path / "k.npy", np.zeros((4, 3), np.int64))
    code, out = run("view", "build", db, "-t", "a", "--view", "v", "--keys", tmp_path / "k.npy")
    assert code == 1 and "--preset" in out and "hasher=" not in out
    code, out = run("view", "build", db, "-t", "a", "--view", "v", "--from-index")
    assert code == 1 and "IndexNotFound" in out and "TableNotFound" not in out
    with pytest.raises(engramdb.IndexNotFound):
        engramdb.load_index(db, "a") if hasattr(engramdb, "load_index") else _load(db)


def _load(db: Path) -> None:
    from engramdb.read.index import load_index

    load_index(db, "a")


def test_info_lists_views_index_residency_leftovers(db_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    db, _ = db_factory({"t": (64, (500,))})
    code, out = run("info", db)
    assert "index: none" in out and "views: none" in out
    np.save(tmp_path / "rows.npy", np.arange(20).reshape(10, 2))
    r = CliRunner().invoke(main, ["view", "build", str(db), "-t", "t", "--name", "old", "--rows", str(tmp_path / "rows.npy")])
    assert r.exit_code == 0 and "--name is deprecated; use --view" in r.stderr
    code, out = run("info", db)
    assert code == 0
    for part in ("built, 1 shard(s)", "page cache: ", "% resident", "view old: 10 records x 128 B (rows)", "leftovers: none"):
        assert part in out, (part, out)


def test_info_lists_the_index(db_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from engramdb.build.index import build_index

    h = _small_hasher()
    heads = [int(r) for r in h.head_rows()]
    pad = h.table_rows() - sum(heads)
    db, _ = db_factory({"t": (16, tuple(heads + ([pad] if pad else [])))})
    np.save(tmp_path / "c.npy", np.arange(300) % 40)
    build_index(tmp_path / "c.npy", db, preset=h)
    code, out = run("info", db)
    assert code == 0 and "index: preset qwen-small layer 1, 300 tokens" in out, out


def test_py_typed_ships_and_reprs() -> None:
    root = Path(engramdb.__file__).parent
    assert (root / "py.typed").is_file()
    text = (root.parent / "pyproject.toml").read_text()
    assert 'engramdb = ["py.typed"]' in text and "plots = [" in text
    from engramdb.client.remote import RemoteView
    from engramdb.decode import Decoder
    from engramdb.keygen.stream import KeyStream

    for cls in (Decoder, KeyStream, RemoteView):
        assert cls.__repr__ is not object.__repr__, cls


def test_decoder_and_keystream_repr(db_factory) -> None:  # type: ignore[no-untyped-def]
    h = _small_hasher()
    heads = [int(r) for r in h.head_rows()]
    pad = h.table_rows() - sum(heads)
    db, _ = db_factory({"t": (16, tuple(heads + ([pad] if pad else [])))})
    with engramdb.open(db) as d:
        dec = engramdb.Decoder(d["t"], preset=h)
        assert repr(dec).startswith("Decoder(preset='qwen-small', tables=[t@1]") and "row_bytes=16" in repr(dec)
    ks = h.stream(1)
    assert repr(ks).startswith("KeyStream(") and "n_heads=6" in repr(ks)


def _small_hasher():  # type: ignore[no-untyped-def]
    from engramdb import keygen

    return keygen.hasher(
        "qwen4exp",
        {"vocab_size": 50, "ngram_size": 3, "heads_per_ngram": 3, "ngram_vocab_size_base": 300,
         "make_ngram_vocab_size_divisible_by": 4, "eos_token_id": 1, "ple_layer_ids": [1]},
        name="qwen-small",
    )  # fmt: skip


def test_cli_words_rewrites_keywords_not_prose() -> None:
    from engramdb.cli._common import cli_words

    assert cli_words("the database has tables ['a', 'b']: pass table=") .endswith("pass --table")
    assert cli_words("a key view needs hasher= (a preset)") == "a key view needs --preset (a preset)"
    assert cli_words("give exactly one of keys=, from_index=True or rows=") == (
        "give exactly one of --keys, --from-index or --rows"
    )
    assert cli_words("hot_rows must be >= 0, got -1") == "--hot-rows must be >= 0, got -1"
    assert "strict=False" not in cli_words("x; pass strict=False for the reference engine's behaviour") or (
        "Python API" in cli_words("x; pass strict=False for the reference engine's behaviour")
    )
    for prose in ("table 'x' of 'db' needs a shard", "the attached table needs x", "layer must be set"):
        assert cli_words(prose) == prose
