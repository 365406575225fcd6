"""The engram-peft keygen kind against the installed engram-peft 1.2.7 ``NgramHashMapping``."""

from __future__ import annotations

import json
import sys
import typing
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engramdb import keygen
from engramdb.errors import InvalidArgument, TokenIdOutOfRange


@pytest.fixture(scope="module")
def peft() -> Any:
    """engram-peft's hashing module and config class (3.11 lacks ``typing.override``)."""
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hashing = pytest.importorskip("engram_peft.hashing")
        from engram_peft.config import EngramConfig
    return hashing, EngramConfig


def _pair(peft: Any, **cfg: Any) -> tuple[Any, keygen.Hasher]:
    hashing, _ = peft
    ref = hashing.create_hash_mapping(**cfg)
    ours_cfg = dict(cfg)
    ours_cfg["target_layers"] = ours_cfg.pop("layer_ids")
    ours_cfg["enable_tokenizer_compression"] = False  # the ids given are the hashed ids
    return ref, keygen.hasher("engram-peft", ours_cfg)


CONFIGS = [
    # engram-peft's default orders, two layers given out of order (primes follow sorted ids)
    dict(
        compressed_vocab_size=50_000,
        engram_vocab_size_per_ngram=[40_000, 60_000],
        ngram_sizes=[2, 3],
        n_head_per_ngram=4,
        layer_ids=[14, 1],
        pad_id=3,
        seed=0,
    ),
    # orders listed out of order, three of them, another seed
    dict(
        compressed_vocab_size=129_280,
        engram_vocab_size_per_ngram=[90_000, 30_000, 50_000],
        ngram_sizes=[4, 2, 3],
        n_head_per_ngram=2,
        layer_ids=[5],
        pad_id=0,
        seed=7,
    ),
    # a unigram order (the oldest id of the window only) and a gap in the orders
    dict(
        compressed_vocab_size=1000,
        engram_vocab_size_per_ngram=[400, 600],
        ngram_sizes=[1, 3],
        n_head_per_ngram=2,
        layer_ids=[2, 9],
        pad_id=7,
        seed=1,
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "orders-4-2-3", "unigram"])
def test_ids_equal_engram_peft_on_random_streams(peft: Any, cfg: dict[str, Any]) -> None:
    ref, ours = _pair(peft, **cfg)
    rng = np.random.default_rng(11)
    vc = cfg["compressed_vocab_size"]
    # 4 x 3000 = 12,000 positions per order and head; small-alphabet rows repeat n-grams.
    tok = rng.integers(0, vc, size=(4, 3000), dtype=np.int64)
    tok[1] = rng.integers(0, 5, size=3000)
    tok[2, :50] = cfg["pad_id"]
    want = ref.hash(tok)
    for layer in cfg["layer_ids"]:
        got = ours.local_ids(tok, layer=layer)
        assert got.shape == want[layer].shape
        assert np.array_equal(got, want[layer]), f"layer {layer}"
        flat_primes = [p for head in ref.prime_tables[layer] for p in head]
        assert ours.primes(layer).tolist() == flat_primes
        assert ours.multipliers(layer).tolist() == ref.all_multipliers[layer].tolist()
        # global ids = local + the layer table's offsets (MultiHeadEmbedding's buffer)
        offsets = np.concatenate([[0], np.cumsum(flat_primes)[:-1]])
        assert np.array_equal(ours.row_ids(tok, layer=layer), want[layer] + offsets)
        assert ours.table_rows(layer) == sum(flat_primes)


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["default", "orders-4-2-3"])
def test_chunked_and_one_token_streams_equal_full(peft: Any, cfg: dict[str, Any]) -> None:
    ref, ours = _pair(peft, **cfg)
    rng = np.random.default_rng(5)
    tok = rng.integers(0, cfg["compressed_vocab_size"], size=(3, 700), dtype=np.int64)
    want = ref.hash(tok)
    layer = cfg["layer_ids"][0]
    st = ours.stream(layer=layer, local=True)
    parts, t0 = [], 0
    while t0 < tok.shape[1]:
        n = int(rng.integers(1, 40))
        parts.append(st.push(tok[:, t0 : t0 + n]))
        t0 += n
    assert np.array_equal(np.concatenate(parts, axis=1), want[layer])
    one = ours.stream(layer=layer, local=True)
    seq = np.stack([one.push(int(t)) for t in tok[0]])
    assert one.fast_steps == tok.shape[1]  # the pure-Python one-token path served every step
    assert np.array_equal(seq, want[layer][0])
    # contexts then hash_keys: the path views and `engramdb index` take
    keys = ours.keys(tok)
    assert np.array_equal(ours.hash_keys(keys, layer=layer, local=True), want[layer])


def test_built_from_engram_config_and_token_map(peft: Any) -> None:
    hashing, EngramConfig = peft
    rng = np.random.default_rng(2)
    lookup = rng.integers(0, 300, size=1000)
    lookup[:300] = np.arange(300)  # every compressed id is used
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = EngramConfig(
            engram_vocab_size_per_ngram=[4000, 4000],
            n_head_per_ngram=2,
            target_layers=[1, 3],
            pad_id=17,
            compressed_vocab_size=300,
            embedding_dim=64,
        )
    ref = hashing.create_hash_mapping(
        compressed_vocab_size=300,
        engram_vocab_size_per_ngram=[4000, 4000],
        ngram_sizes=[2, 3],
        n_head_per_ngram=2,
        layer_ids=[1, 3],
        pad_id=int(lookup[17]),  # engram-peft hashes the compressed pad
        seed=0,
    )
    raw = rng.integers(0, 1000, size=(2, 2500))
    want = ref.hash(lookup[raw])
    for source in (cfg, cfg.to_dict()):
        h = keygen.hasher("engram-peft", source, token_map=lookup)
        assert h.info["row_dim"] == 16
        for layer in (1, 3):
            assert np.array_equal(h.local_ids(raw, layer=layer), want[layer])
            assert np.array_equal(
                h.local_ids(lookup[raw], layer=layer, compressed=True), want[layer]
            )


def test_config_file_works_as_a_preset(peft: Any, tmp_path: Path) -> None:
    cfg = dict(CONFIGS[0])
    ref, ours = _pair(peft, **cfg)
    doc = dict(cfg)
    doc["target_layers"] = doc.pop("layer_ids")
    doc["enable_tokenizer_compression"] = False
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    from_file = keygen.preset(str(path))
    assert isinstance(from_file, keygen.PeftHasher)
    tok = np.random.default_rng(3).integers(0, 50_000, size=(1, 400))
    assert np.array_equal(from_file.row_ids(tok, layer=14), ours.row_ids(tok, layer=14))
    assert np.array_equal(
        keygen.as_hasher(str(path)).row_ids(tok, layer=1), ours.row_ids(tok, layer=1)
    )
    spec = tmp_path / "keygen.json"
    spec.write_text(json.dumps({"kind": "engram-peft", "config": doc}))
    assert np.array_equal(keygen.preset(str(spec)).local_ids(tok, layer=1), ref.hash(tok)[1])


def test_bad_configs_raise_typed_errors(peft: Any) -> None:
    base = dict(
        compressed_vocab_size=1000,
        engram_vocab_size_per_ngram=[400, 600],
        ngram_sizes=[2, 3],
        n_head_per_ngram=2,
        target_layers=[1],
        pad_id=7,
    )
    with pytest.raises(InvalidArgument, match="engram_vocab_size_per_ngram"):
        keygen.hasher("engram-peft", {**base, "engram_vocab_size_per_ngram": [400]})
    with pytest.raises(InvalidArgument, match="qwen"):
        keygen.hasher("engram-peft", {**base, "engine": "qwen_ple"})
    with pytest.raises(InvalidArgument, match="target_layers"):
        keygen.hasher("engram-peft", {**base, "target_layers": [1, 1]})
    no_vc = {k: v for k, v in base.items() if k != "compressed_vocab_size"}
    h = keygen.hasher("engram-peft", no_vc, compressed_pad_id=7)
    with pytest.raises(InvalidArgument, match="compressed_vocab_size"):
        h.row_ids([[1, 2]], compressed=True)
    off = keygen.hasher("engram-peft", {**base, "enable_tokenizer_compression": False})
    with pytest.raises(TokenIdOutOfRange):
        off.row_ids([[1, 1000]])
    with pytest.raises(InvalidArgument, match="compression map"):
        # compression on, no map: only compressed ids can be hashed
        keygen.hasher("engram-peft", base, compressed_pad_id=7).row_ids([[1, 2]])


def test_db_stream_drives_an_engram_peft_table_bit_identically(peft: Any, tmp_path: Path) -> None:
    """`db.stream` with the engram-peft kind yields exactly engram-peft's own lookup:
    ``MultiHeadEmbedding(hash(tokens))`` of the real module, over a chunked corpus."""
    import engramdb

    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer_mod = pytest.importorskip("engram_peft.layer")
    cfg = dict(CONFIGS[0])
    ref, ours = _pair(peft, **cfg)
    primes = [p for head in ref.prime_tables[14] for p in head]
    torch.manual_seed(0)
    mhe = layer_mod.MultiHeadEmbedding(primes, 4, sparse=False)
    w = mhe.embedding.weight.detach().contiguous()
    engramdb.build(tmp_path, "l14", 16, [w.view(torch.uint8).numpy()], heads=primes, dtype="f32")
    corpus = np.random.default_rng(8).integers(0, 50_000, size=(3, 500))
    with engramdb.open(tmp_path) as db:
        got = [e.copy() for _, e in db.stream(corpus, preset=ours, layer=14, batch_tokens=700)]
    e_t = np.concatenate(got).reshape(3, 500, len(primes), 16)
    with torch.no_grad():
        want = mhe(torch.from_numpy(ref.hash(corpus)[14])).numpy()
    assert np.array_equal(e_t.view(np.float32).reshape(want.shape), want)


def test_engramdb_index_takes_an_engram_peft_config_file(peft: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    import engramdb
    from engramdb.cli import main
    from engramdb.read.index import load_index

    doc = dict(CONFIGS[2])
    ref, ours = _pair(peft, **doc)
    doc["target_layers"] = doc.pop("layer_ids")
    doc["enable_tokenizer_compression"] = False
    conf = tmp_path / "config.json"
    conf.write_text(json.dumps(doc))
    db = tmp_path / "db"
    engramdb.build(
        db, "t", 8, [np.zeros((ours.table_rows(9), 8), np.uint8)], heads=ours.primes(9).tolist()
    )
    corpus = np.random.default_rng(4).integers(0, 1000, (3, 200))
    np.save(tmp_path / "c.npy", corpus)
    res = CliRunner().invoke(
        main, ["index", str(tmp_path / "c.npy"), str(db), "--preset", str(conf), "--layer", "9"]
    )
    assert res.exit_code == 0, res.output
    ix = load_index(db, "t")
    offsets = ours.offsets(9)
    want = np.unique(ref.hash(corpus)[9] + offsets)
    assert np.array_equal(np.sort(ix.hot_rows), want)  # every touched row, from engram-peft's ids
    bad = CliRunner().invoke(main, ["index", str(tmp_path / "c.npy"), str(db), "--preset", "nope"])
    assert bad.exit_code != 0 and "neither a preset" in bad.output


@pytest.mark.parametrize("cfg", CONFIGS)
def test_decode_sized_blocks_equal_long_blocks_and_engram_peft(
    peft: Any, cfg: dict[str, Any], rng: np.random.Generator
) -> None:
    """A block of at most 64 positions (a decode step, a short prefill) is hashed with one
    broadcast modulo per order instead of three calls per head: its ids equal engram-peft's
    own hashing and the long-block kernel, position by position, for B = 1 and 8."""
    ref, h = _pair(peft, **cfg)
    vocab = cfg["compressed_vocab_size"]
    toks = rng.integers(0, vocab, (8, 150))
    for layer in h.layers:
        full = h.local_ids(toks, layer=layer, compressed=True)  # 150 positions: long blocks
        want = np.asarray(ref.hash(toks)[layer])  # engram-peft's [B, T, H]
        assert np.array_equal(full, want)
        for b in (1, 8):
            s = h.stream(layer=layer, compressed=True, local=True)
            got = [s.push(toks[:b, :5])] + [s.push(toks[:b, t : t + 1]) for t in range(5, 150)]
            assert np.array_equal(np.concatenate(got, axis=1), full[:b])
