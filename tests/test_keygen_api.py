"""Presets, configs, frozen constants and the typed errors of the keygen surface."""

from __future__ import annotations

import numpy as np
import pytest

from engramdb import keygen
from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    ShapeMismatch,
    TokenIdOutOfRange,
)

QWEN_TINY = {
    "vocab_size": 64,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 17,
    "make_ngram_vocab_size_divisible_by": 4,
    "eos_token_id": 1,
    "ple_layer_ids": [1],
}


def test_published_table_sizes() -> None:
    v41 = keygen.preset("deepseek-v4.1-flash")
    assert [int(v41.primes(layer).sum()) for layer in v41.layers] == [384_006_168, 384_016_682]
    assert [v41.table_rows(layer) for layer in v41.layers] == [384_006_168, 384_016_682]
    assert v41.n_heads == 24 and v41.max_ngram == 4 and v41.heads_per_ngram == 8
    assert v41.primes(1).min() >= 16_000_000
    assert len(set(v41.primes(1).tolist()) | set(v41.primes(14).tolist())) == 48
    assert v41.info["row_bytes"] == 264
    qwen = keygen.preset("qwen3.8-flash-next")
    assert int(qwen.primes(2).sum()) == 320_001_446
    assert qwen.table_rows(2) == 320_001_536 == 128 * 2_500_012
    assert qwen.n_heads == 16 and qwen.info["row_bytes"] == 160
    assert keygen.preset("gemma3n-e2b").table_rows(0) == 262_144
    assert set(keygen.PRESETS) == {
        "deepseek-engram-demo",
        "deepseek-v4.1-flash",
        "qwen3.8-flash-next",
        "gemma3n-e2b",
        "gemma3n-e4b",
    }


def test_constants_are_readonly_int64() -> None:
    h = keygen.preset("qwen3.8-flash-next")
    for arr in (h.primes(2), h.offsets(2), h.multipliers(2), h.head_rows(2)):
        assert arr.dtype == np.int64
        with pytest.raises(ValueError):
            arr[0] = 1


def test_hf_config_nesting_and_list_eos() -> None:
    nested = {"text_config": {**QWEN_TINY, "eos_token_id": [1]}, "model_type": "qwen4_exp"}
    a = keygen.hasher("qwen4exp", nested)
    b = keygen.hasher("qwen4exp", QWEN_TINY)
    ids = [5, 6, 7, 1, 8, 9]
    assert a.row_ids(ids).tolist() == b.row_ids(ids).tolist()


def test_qwen_layers_continue_primes_across_ple_layers() -> None:
    h = keygen.hasher("qwen4exp", {**QWEN_TINY, "ple_layer_ids": [4, 2]})
    assert h.layers == (2, 4)
    assert h.primes(2).tolist() == [17, 19, 23, 29]
    assert h.primes(4).tolist() == [31, 37, 41, 43]  # PLE index 1 continues the prime walk
    assert h.multipliers(2).tolist() != h.multipliers(4).tolist()


def test_frozen_constants_win() -> None:
    frozen = {1: {"layer_multipliers": [3, 5, 7], "ngram_heads_vocab_sizes": [11, 13, 17, 19]}}
    h = keygen.hasher("qwen4exp", QWEN_TINY, constants=frozen)
    assert h.multipliers(1).tolist() == [3, 5, 7]
    assert h.primes(1).tolist() == [11, 13, 17, 19]
    assert h.offsets(1).tolist() == [0, 11, 24, 41]
    assert h.table_rows(1) == 60  # 60 = ceil(60 / 4) * 4
    # position 0 of [5]: tokens (5, EOS=1, EOS=1)
    mix2 = 5 * 3 ^ 1 * 5
    mix3 = mix2 ^ 1 * 7
    assert h.row_ids([5]).tolist() == [[mix2 % 11, 11 + mix2 % 13, 24 + mix3 % 17, 41 + mix3 % 19]]
    offsets = {1: {"offsets": [100, 0, 50, 200]}}
    h2 = keygen.hasher("qwen4exp", QWEN_TINY, constants=offsets)
    assert h2.offsets(1).tolist() == [100, 0, 50, 200]
    assert h2.table_rows(1) >= 229
    v41 = keygen.preset("deepseek-v4.1-flash", constants={14: {"multipliers": [1, 3, 5, 7]}})
    assert v41.multipliers(14).tolist() == [1, 3, 5, 7]
    assert v41.multipliers(1).tolist()[0] == 76632096046245


@pytest.mark.parametrize(
    ("constants", "match"),
    [
        ({1: {"multipliers": [1, 2]}}, "multipliers"),
        ({1: {"primes": [11, 13]}}, "bucket sizes"),
        ({1: {"primes": [11, 13, 0, 19]}}, "positive"),
        ({1: {"offsets": [0, 5, 40, 60]}}, "overlaps"),
        ({1: {"multipliers": [1 << 64, 1, 1]}}, "int64"),
        ({9: {"multipliers": [1, 3, 5]}}, "layer 9"),
        ({1: {"table_rows": 10}}, "table_rows"),
    ],
)
def test_bad_frozen_constants(constants: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        keygen.hasher("qwen4exp", QWEN_TINY, constants=constants)


def test_deepseek_num_embeddings_checked() -> None:
    cfg = {
        "engram_layer_ids": [1],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_vocab_size": 100,
        "engram_compressed_vocab_size": 50,
        "engram_pad_id": 2,
        "engram_num_embeddings": [999],
    }
    with pytest.raises(InvalidArgument, match="engram_num_embeddings"):
        keygen.hasher("deepseek-v41", cfg, compressed_pad_id=2)
    cfg["engram_num_embeddings"] = [None]
    with pytest.raises(InvalidArgument):
        keygen.hasher("deepseek-v41", cfg, compressed_pad_id=2)


def test_demo_preset_needs_the_tokenizer_size() -> None:
    h = keygen.preset("deepseek-engram-demo")
    assert h.primes(1).shape == (16,)  # tokenizer-independent geometry is available
    with pytest.raises(InvalidArgument, match="compressed_vocab_size"):
        h.multipliers(1)
    with pytest.raises(InvalidArgument, match="compressed_vocab_size"):
        h.row_ids([1, 2], layer=1, compressed=True)
    ready = keygen.preset("deepseek-engram-demo", compressed_vocab_size=249, compressed_pad_id=2)
    assert ready.multipliers(1).tolist() == [
        2 * int(r) + 1
        for r in np.random.default_rng(10007).integers(0, ((2**63 - 1) // 249) // 2, size=3)
    ]
    assert ready.row_ids([1, 2], layer=15, compressed=True).shape == (2, 16)
    no_pad = keygen.preset("deepseek-engram-demo", compressed_vocab_size=249)
    with pytest.raises(InvalidArgument, match="pad"):
        no_pad.stream(layer=1, compressed=True)


def test_token_map_in_hasher() -> None:
    table = np.array([0, 1, 2, 3, 3, 4, 1, 5])
    cfg = {
        "layer_ids": [0],
        "max_ngram_size": 2,
        "n_head_per_ngram": 1,
        "engram_vocab_size": [10],
        "pad_id": 6,
    }
    h = keygen.hasher("deepseek-demo", cfg, token_map=table)
    assert h.fill_id == 1  # raw pad 6 compresses to 1
    assert h.info["compressed_vocab_size"] == 6
    raw = [3, 4, 7, 6]
    assert (
        h.row_ids(raw, layer=0).tolist() == h.row_ids(table[raw], layer=0, compressed=True).tolist()
    )
    with pytest.raises(TokenIdOutOfRange, match="8"):
        h.row_ids([1, 8], layer=0)
    clamped = h.row_ids([1, 8, -3], layer=0, strict=False)
    assert clamped.tolist() == h.row_ids([1, 7, 0], layer=0).tolist()
    s = h.stream(layer=0, strict=False)
    assert np.stack([s.push(t) for t in [1, 8, -3]]).tolist() == clamped.tolist()
    with pytest.raises(InvalidArgument, match="compresses to 6"):
        keygen.hasher("deepseek-demo", {**cfg, "compressed_vocab_size": 7}, token_map=table)
    with pytest.raises(InvalidArgument, match="differs"):
        keygen.hasher("deepseek-demo", cfg, token_map=table, compressed_pad_id=0)
    v41 = keygen.preset("deepseek-v4.1-flash")
    with pytest.raises(InvalidArgument, match="compression map"):
        v41.row_ids([1, 2], layer=1)
    with pytest.raises(InvalidArgument, match="compression map"):
        v41.stream(layer=1).push(5)


@pytest.mark.parametrize(
    ("kind", "config", "match"),
    [
        ("nope", {}, "unknown keygen kind"),
        ("qwen4exp", {"vocab_size": 10}, "ngram_size"),
        ("qwen4exp", [], "dict"),
        ("qwen4exp", {**QWEN_TINY, "ngram_size": 1}, ">= 2"),
        ("qwen4exp", {**QWEN_TINY, "ngram_size": "3"}, "integer"),
        ("qwen4exp", {**QWEN_TINY, "eos_token_id": [1, 2]}, "eos_token_id"),
        ("qwen4exp", {**QWEN_TINY, "eos_token_id": 64}, "eos_token_id"),
        ("qwen4exp", {**QWEN_TINY, "ple_layer_ids": []}, "ple_layer_ids"),
        ("qwen4exp", {**QWEN_TINY, "ngram_heads": 5}, "ngram_heads"),
        ("deepseek-demo", {"layer_ids": [1]}, "max_ngram_size"),
        ("gemma3n", {"vocab_size_per_layer_input": 10}, "num_hidden_layers"),
        (
            "gemma3n",
            {"vocab_size_per_layer_input": 10, "num_hidden_layers": 2, "vocab_size": 5},
            "smaller",
        ),
    ],
)
def test_bad_configs(kind: str, config: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        keygen.hasher(kind, config)  # type: ignore[arg-type]


def test_bad_inputs_raise_typed_errors() -> None:
    h = keygen.preset("qwen3.8-flash-next")
    with pytest.raises(InvalidArgument, match="unknown preset"):
        keygen.preset("qwen9")
    with pytest.raises(TokenIdOutOfRange, match=r"248320 at index \(0, 1\)"):
        h.row_ids([[3, 248_320]])
    with pytest.raises(TokenIdOutOfRange, match="-1"):
        h.stream().push(-1)
    with pytest.raises(TokenIdOutOfRange):
        h.row_ids(np.array([2**63 + 5], dtype=np.uint64))
    with pytest.raises(InvalidDtype, match="float"):
        h.row_ids(np.array([1.0, 2.0]))
    with pytest.raises(InvalidDtype):
        h.row_ids(np.array([True, False]))
    with pytest.raises(ShapeMismatch, match="scalar"):
        h.row_ids(5)
    with pytest.raises(ShapeMismatch, match="mask shape"):
        h.row_ids([1, 2, 3], mask=np.zeros(2, bool))
    with pytest.raises(InvalidDtype, match="mask"):
        h.row_ids([1, 2, 3], mask=np.zeros(3, np.int8))
    with pytest.raises(InvalidArgument, match="no compressed form"):
        h.row_ids([1, 2], compressed=True)
    with pytest.raises(InvalidArgument, match="layer 7"):
        h.row_ids([1], layer=7)
    with pytest.raises(InvalidArgument, match="pass layer="):
        keygen.preset("deepseek-v4.1-flash").row_ids([1], compressed=True)
    with pytest.raises(ShapeMismatch):
        h.row_ids([1, 2], out=np.empty((2, 15), np.int64))
    with pytest.raises(InvalidDtype):
        h.row_ids([1, 2], out=np.empty((2, 16), np.int32))
    with pytest.raises(InvalidLayout):
        h.row_ids([1, 2], out=np.empty((16, 2), np.int64).T)
    with pytest.raises(ShapeMismatch, match=r"\[\.\.\., 3\]"):
        h.hash_keys(np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidArgument, match="no tokenizer compression"):
        keygen.hasher("qwen4exp", QWEN_TINY, token_map=[0])
    assert issubclass(TokenIdOutOfRange, IndexError) and issubclass(
        TokenIdOutOfRange, EngramDBError
    )


def test_stream_shapes_and_reset() -> None:
    h = keygen.hasher("qwen4exp", QWEN_TINY)
    s = h.stream()
    first = s.push(np.array([[5, 6], [7, 8]]))
    assert first.shape == (2, 2, 4) and s.batch_shape == (2,)
    with pytest.raises(ShapeMismatch, match="batch shape"):
        s.push([5, 6])
    with pytest.raises(ShapeMismatch, match="batch shape"):
        s.push(5)
    s.reset()
    assert s.push(5).shape == (4,)
    assert s.push([]).shape == (0, 4)
    with pytest.raises(ShapeMismatch, match="scalar"):
        s.push(6, mask=np.array([True]))
    with pytest.raises(InvalidDtype):
        s.push(6, mask=np.int8(1))
    ids, bars = s.history
    assert ids.shape == (2,) and bars.dtype == np.bool_


def test_gemma_surface() -> None:
    h = keygen.preset("gemma3n-e4b")
    assert h.n_heads == 1 and h.primes(0).size == 0 and h.multipliers(0).size == 0
    assert h.offsets(0).tolist() == [0] and h.head_rows(0).tolist() == [262_144]
    ids = np.array([[5, 262_200, 7]])
    assert h.row_ids(ids, layer=34).tolist() == [[[5], [0], [7]]]
    assert h.row_ids(ids, mask=np.array([[True, False, False]])).tolist() == [[[0], [0], [7]]]
    assert h.keys(ids).tolist() == h.row_ids(ids).tolist()
    assert h.hash_keys(np.array([[3], [9]])).tolist() == [[3], [9]]
    s = h.stream()
    assert s.push(9).tolist() == [9] and s.push(9, mask=True).tolist() == [0]
    assert s.push(np.array([1, 262_144])).tolist() == [[1], [0]]
    with pytest.raises(InvalidArgument, match="no compressed form"):
        h.row_ids([1], compressed=True)
    with pytest.raises(InvalidArgument, match="layer 35"):
        h.row_ids([1], layer=35)
    with pytest.raises(InvalidArgument, match="freeze"):
        keygen.hasher(
            "gemma3n", {"vocab_size_per_layer_input": 4, "num_hidden_layers": 1}, constants={0: {}}
        )


def test_keys_are_layer_independent_contexts() -> None:
    h = keygen.preset("deepseek-v4.1-flash")
    ids = np.array([11, 12, 13, 14, 15])
    keys = h.keys(ids, compressed=True, mask=np.array([False, False, True, False, False]))
    assert keys.tolist() == [
        [11, 2, 2, 2],
        [12, 11, 2, 2],
        [2, 2, 2, 2],  # dead: all pad
        [14, 2, 2, 2],  # the dead token blocks everything older
        [15, 14, 2, 2],
    ]
    for layer in h.layers:
        want = h.row_ids(ids, layer=layer, compressed=True, mask=keys[:, 0] == 2)
        assert h.hash_keys(keys, layer=layer).tolist() == want.tolist()


# --- presets at reduced scale ---------------------------------------------------------------
def _wrap(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _qwen_reference(tokens: list[int], h: keygen.Hasher, layer: int) -> np.ndarray:
    """docs/keygen.md's Qwen rule, in plain Python ints, from the hasher's constants."""
    mult = [int(m) for m in h.multipliers(layer)]
    primes, offsets = h.primes(layer).tolist(), h.offsets(layer).tolist()
    eos, n_max, heads = h.info["eos_token_id"], h.max_ngram, h.heads_per_ngram
    out = []
    for t in range(len(tokens)):
        back, blocked = [], False
        for k in range(n_max):
            if not blocked and t - k >= 0 and (k == 0 or tokens[t - k] != eos):
                back.append(tokens[t - k])
            else:
                blocked = True
                back.append(eos)
        row = []
        for n in range(2, n_max + 1):
            mix = 0
            for k in range(n):
                mix ^= _wrap(back[k] * mult[k])
            for j in range(heads):
                col = (n - 2) * heads + j
                row.append(mix % primes[col] + offsets[col])
        out.append(row)
    return np.array(out, dtype=np.int64)


def test_tiny_qwen_keeps_the_algorithm() -> None:
    full = keygen.preset("qwen3.8-flash-next")
    tiny = keygen.preset("qwen3.8-flash-next", scale="tiny")
    assert tiny.name == "qwen3.8-flash-next@tiny" and tiny.info["scale"] == "tiny"
    assert keygen.preset("qwen3.8-flash-next@tiny").primes(2).tolist() == tiny.primes(2).tolist()
    assert tiny.multipliers(2).tolist() == full.multipliers(2).tolist()
    assert (tiny.layers, tiny.max_ngram, tiny.heads_per_ngram, tiny.n_heads) == (
        full.layers,
        full.max_ngram,
        full.heads_per_ngram,
        full.n_heads,
    )
    assert tiny.info["eos_token_id"] == full.info["eos_token_id"] == 248_044
    primes = tiny.primes(2).tolist()
    assert primes[0] == 20_011 and len(primes) == 16 and primes == sorted(set(primes))
    assert tiny.table_rows(2) % 128 == 0 and 0 < tiny.table_rows(2) - sum(primes) < 128
    small = keygen.preset("qwen3.8-flash-next", scale="small")
    assert small.primes(2).min() >= 200_000 and small.table_rows(2) % 128 == 0
    eos = 248_044
    tokens = [9707, 11, 1879, eos, 5, 248_319, 0, eos, eos, 77]
    got = tiny.row_ids(np.array(tokens), layer=2)
    assert np.array_equal(got, _qwen_reference(tokens, tiny, 2))
    assert np.array_equal(full.row_ids(np.array(tokens), layer=2), _qwen_reference(tokens, full, 2))
    stream = tiny.stream(layer=2)
    assert np.array_equal(np.stack([stream.push(t) for t in tokens]), got)
    with pytest.raises(TokenIdOutOfRange):
        tiny.row_ids([248_320])  # the vocabulary is not scaled


def test_tiny_deepseek_and_gemma_keep_their_rules() -> None:
    full = keygen.preset("deepseek-v4.1-flash")
    tiny = keygen.preset("deepseek-v4.1-flash", scale="tiny")
    assert tiny.layers == (1, 14) and tiny.n_heads == 24 and tiny.info["row_bytes"] == 264
    for layer in (1, 14):
        assert tiny.multipliers(layer).tolist() == full.multipliers(layer).tolist()
        assert tiny.primes(layer).min() > 16_000 - 1
    assert len(set(tiny.primes(1).tolist()) | set(tiny.primes(14).tolist())) == 48
    ids = np.array([[5, 17, 993, 42, 0, 42]])
    dead = np.array([[False, False, True, False, False, False]])
    # the sticky dead-token rule: after a dead position the look-back sees the pad only
    a = tiny.row_ids(ids, layer=1, compressed=True, mask=dead)
    b = tiny.row_ids(np.array([[2, 2, 2, 42, 0, 42]]), layer=1, compressed=True)
    assert np.array_equal(a[0, 3:], b[0, 3:])
    g = keygen.preset("gemma3n-e2b", scale="tiny")
    assert g.table_rows() == 262 and g.name == "gemma3n-e2b@tiny"
    assert g.row_ids([5, 261, 262, 100_000])[..., 0].tolist() == [5, 261, 0, 0]


def test_scale_errors_and_table_heads() -> None:
    from engramdb.keygen.presets import table_heads

    with pytest.raises(InvalidArgument, match="unknown scale 'huge'"):
        keygen.preset("qwen3.8-flash-next", scale="huge")
    with pytest.raises(InvalidArgument, match="names scale 'tiny'"):
        keygen.preset("qwen3.8-flash-next@tiny", scale="small")
    with pytest.raises(InvalidArgument, match="unknown preset"):
        keygen.preset("nope@tiny")
    heads = table_heads(keygen.preset("qwen3.8-flash-next"), 2)
    assert len(heads) == 17 and heads[-1] == 90 and sum(heads) == 320_001_536
    assert table_heads(keygen.preset("gemma3n-e4b")) == [262_144]


def test_build_preset_synthetic_then_index_view_decode_stream(tmp_path) -> None:
    import engramdb.database as database
    from engramdb.build import build_view
    from engramdb.build.index import build_index
    from engramdb.build.table import build, synthetic_bytes
    from engramdb.decode import Decoder

    db = tmp_path / "db"
    s = build(db, "ple", None, [], preset="qwen3.8-flash-next", scale="tiny", synthetic=7)
    tiny = keygen.preset("qwen3.8-flash-next@tiny")
    assert s.rows == tiny.table_rows(2) == 321_280
    raw = b"".join(p.read_bytes() for p in sorted((db / "ple").glob("g-*/*")) if p.is_file())
    assert raw[: s.bytes] == synthetic_bytes(7, 0, s.bytes).tobytes()
    build(db, "again", None, [], preset="qwen3.8-flash-next", scale="tiny", synthetic=7)
    build(db, "other", None, [], preset="qwen3.8-flash-next", scale="tiny", synthetic=8)
    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.random.default_rng(0).integers(0, 248_320, (2, 300)).astype(np.int32))
    ix = build_index(corpus, db, preset="qwen3.8-flash-next", table="ple")
    assert ix.distinct_keys > 0
    build_view(db, table="ple", name="corpus", from_index=True)
    tokens = np.load(corpus)
    with database.open(db) as d:
        ple = d["ple"]
        want = ple.fetch(tiny.row_ids(tokens[0, :3], layer=2).reshape(-1)).reshape(3, 16, 160)
        assert ple.fetch([5]).tobytes() == d["again"].fetch([5]).tobytes()
        assert ple.fetch([5]).tobytes() != d["other"].fetch([5]).tobytes()
        dec = Decoder(ple, "qwen3.8-flash-next", layer=2)
        out = np.empty((16, 160), np.uint8)
        for t in range(3):
            dec.push(int(tokens[0, t]))
            dec.fill(out)
            assert np.array_equal(out, want[t])
        got = list(d.stream(str(corpus), table="ple", preset="qwen3.8-flash-next", layer=2))
        assert np.array_equal(got[0][1][0, :3], want)
        assert ple.view("corpus").n_records == ix.distinct_keys
    with pytest.raises(InvalidArgument, match="addresses"):
        build_index(corpus, db, preset="qwen3.8-flash-next@small", table="ple")


def test_build_preset_refusals(tmp_path) -> None:
    from engramdb.build.table import build

    db = tmp_path / "db"
    with pytest.raises(InvalidArgument, match="layer"):
        build(db, "t", None, [], preset="deepseek-v4.1-flash", scale="tiny", synthetic=1)
    s = build(db, "t", None, [], preset="deepseek-v4.1-flash", scale="tiny", layer=14, synthetic=1)
    assert s.rows == keygen.preset("deepseek-v4.1-flash@tiny").table_rows(14)
    with pytest.raises(InvalidArgument, match="heads"):
        build(db, "u", 160, [], heads=[3], preset="qwen3.8-flash-next", synthetic=1)
    with pytest.raises(InvalidArgument, match="--preset"):
        build(db, "u", 160, [], heads=[3], scale="tiny", synthetic=1)
    with pytest.raises(InvalidArgument, match="no sources"):
        build(db, "u", 16, [np.zeros((3, 16), np.uint8)], heads=[3], synthetic=1)
    with pytest.raises(InvalidArgument, match="seed"):
        build(db, "u", 16, [], heads=[3], synthetic=-1)
    with pytest.raises(InvalidArgument, match="row_bytes"):
        build(db, "u", None, [], preset="deepseek-engram-demo", layer=1, synthetic=1)
