"""Every executed reference vector of ``shared/vectors/keygen.json``, bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engramdb import keygen
from engramdb.errors import TokenIdOutOfRange


def _vector_file() -> Path | None:
    env = os.environ.get("ENGRAMDB_KEYGEN_VECTORS")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "vectors" / "keygen.json" for p in here.parents]
    # a copy travels with the tests, so a checkout without shared/ still runs every vector
    candidates.append(here.parent / "data" / "keygen.json")
    return next((c for c in candidates if c.is_file()), None)


VECTOR_FILE = _vector_file()
pytestmark = pytest.mark.skipif(VECTOR_FILE is None, reason="shared/vectors/keygen.json not found")


@pytest.fixture(scope="module")
def vectors() -> dict[str, Any]:
    assert VECTOR_FILE is not None
    return json.loads(VECTOR_FILE.read_text())


def _by_name(vectors: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in vectors["vectors"] if v["name"] == name)


def _demo_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The vector file's config under the demo's own ``EngramConfig`` field names."""
    keep = ["layer_ids", "max_ngram_size", "n_head_per_ngram", "engram_vocab_size", "seed"]
    return {**{k: cfg[k] for k in keep}, "pad_id": cfg["pad_id_raw"]}


def _check_layer_constants(h: keygen.Hasher, layers: dict[str, Any]) -> None:
    for name, lv in layers.items():
        layer = int(name)
        orders = sorted(lv["primes_by_order"], key=int)
        primes = [p for o in orders for p in lv["primes_by_order"][o]]
        assert h.primes(layer).tolist() == primes
        assert h.offsets(layer).tolist() == lv["column_offsets"]
        assert h.table_rows(layer) == lv["table_rows"]
        assert h.multipliers(layer).tolist() == lv["multipliers"]
        assert h.primes(layer).dtype == np.int64 and h.offsets(layer).dtype == np.int64


def _stream_all(h: keygen.Hasher, ids: list[int], **kw: Any) -> np.ndarray:
    s = h.stream(**kw)
    return np.stack([s.push(t) for t in ids])


def test_deepseek_demo_tiny(vectors: dict[str, Any]) -> None:
    v = _by_name(vectors, "deepseek_demo_tiny")
    cfg = v["config"]
    h = keygen.hasher(
        "deepseek-demo",
        {**_demo_config(cfg), "compressed_vocab_size": cfg["compressed_vocab_size"]},
        compressed_pad_id=cfg["pad_id_compressed"],
    )
    assert h.layers == (1, 3)
    _check_layer_constants(h, v["layers"])
    # The same geometry fed raw ids through the stand-in compression map.
    tmap = keygen.TokenMap(vectors["compression_standin"]["lookup_table"])
    raw = keygen.hasher("deepseek-demo", _demo_config(cfg), token_map=tmap)
    assert raw.multipliers(1).tolist() == v["layers"]["1"]["multipliers"]
    for case in v["cases"]:
        assert tmap.apply(case["input_token_ids"]).tolist() == case["compressed_ids"]
        for name, want in case["rowids"].items():
            layer = int(name)
            ids = case["compressed_ids"]
            assert h.row_ids(ids, layer=layer, compressed=True).tolist() == want["global"]
            assert h.local_ids(ids, layer=layer, compressed=True).tolist() == want["local"]
            assert raw.row_ids(case["input_token_ids"], layer=layer).tolist() == want["global"]
            got = _stream_all(raw, case["input_token_ids"], layer=layer)
            assert got.tolist() == want["global"]
            local = _stream_all(h, ids, layer=layer, compressed=True, local=True)
            assert local.tolist() == want["local"]


def test_deepseek_demo_default_geometry_preset() -> None:
    h = keygen.preset("deepseek-engram-demo")
    assert h.layers == (1, 15)
    p1, p15 = h.primes(1).tolist(), h.primes(15).tolist()
    assert (p1[0], p1[-1], sum(p1)) == (646_403, 646_619, 10_344_164)
    assert (p15[0], p15[-1], sum(p15)) == (646_631, 646_879, 10_348_242)
    assert h.table_rows(1) == 10_344_164 and h.table_rows(15) == 10_348_242


def test_deepseek_v41_flash(vectors: dict[str, Any]) -> None:
    v = _by_name(vectors, "deepseek_v41_flash_geometry")
    h = keygen.preset("deepseek-v4.1-flash")
    assert h.layers == (1, 14)
    _check_layer_constants(h, v["layers"])
    cfg = v["config"]
    derived = keygen.hasher(
        "deepseek-v41",
        {
            "engram_layer_ids": cfg["layer_ids"],
            "engram_max_ngram_size": cfg["max_ngram_size"],
            "engram_n_heads": cfg["n_head_per_ngram"],
            "engram_vocab_size": cfg["engram_vocab_size"][0],
            "engram_compressed_vocab_size": cfg["compressed_vocab_size"],
            "engram_pad_id": cfg["pad_id_raw"],
            "engram_num_embeddings": v["check_table_rows_equal_config_engram_num_embeddings"][
                "config"
            ],
        },
        compressed_pad_id=cfg["pad_id_compressed"],
    )
    _check_layer_constants(derived, v["layers"])  # the numpy-derived multipliers equal the frozen
    for case in v["cases"]:
        ids = case["compressed_ids"]
        for name, want in case["rowids"].items():
            layer = int(name)
            assert h.row_ids(ids, layer=layer, compressed=True).tolist() == want["global"]
            assert h.local_ids(ids, layer=layer, compressed=True).tolist() == want["local"]
            got = _stream_all(h, ids, layer=layer, compressed=True)
            assert got.tolist() == want["global"]


def test_deepseek_v41_dead_tokens_full_chunked_and_decode(vectors: dict[str, Any]) -> None:
    case = _by_name(vectors, "deepseek_v41_flash_geometry")["dead_token_case"]
    h = keygen.preset("deepseek-v4.1-flash")
    ids, dead = case["compressed_ids"], np.array(case["dead"])
    for name, want in case["global_rowids"].items():
        layer = int(name)
        assert h.row_ids(ids, layer=layer, compressed=True, mask=dead).tolist() == want
        s = h.stream(layer=layer, compressed=True)
        first = s.push(ids[:5], mask=dead[:5])
        rest = s.push(ids[5:], mask=dead[5:])
        assert np.concatenate([first, rest]).tolist() == want
        s = h.stream(layer=layer, compressed=True)
        steps = [s.push(t, mask=bool(d)) for t, d in zip(ids, dead, strict=True)]
        assert np.stack(steps).tolist() == want
        assert s.fast_steps == len(ids)


@pytest.mark.parametrize("name", ["qwen3_8_flash_next_ple", "qwen4exp_tiny"])
def test_qwen(vectors: dict[str, Any], name: str) -> None:
    v = _by_name(vectors, name)
    cfg, derived = v["config"], v["derived"]
    h = keygen.hasher("qwen4exp", cfg)
    layer = cfg["ple_layer_ids"][0]
    assert h.layers == (layer,)
    assert h.multipliers(layer).tolist() == derived["layer_multipliers"]
    assert h.primes(layer).tolist() == derived["ngram_heads_vocab_sizes"]
    assert h.offsets(layer).tolist() == derived["ngram_heads_offsets"]
    assert int(h.primes(layer).sum()) == derived["sum_head_sizes"]
    assert h.table_rows(layer) == derived["padded_rows"]
    for case in v["cases"]:
        ids, want = case["input_token_ids"], case["global_rowids"]
        assert h.row_ids(ids).tolist() == want
        assert (h.local_ids(ids) + h.offsets(layer)).tolist() == want
        assert _stream_all(h, ids).tolist() == want
        for cut in range(len(ids) + 1):  # every two-chunk split (2-token raw history)
            s = h.stream()
            got = np.concatenate([s.push(ids[:cut]), s.push(ids[cut:])])
            assert got.tolist() == want


def test_qwen_preset_equals_vectors_and_shards(vectors: dict[str, Any]) -> None:
    v = _by_name(vectors, "qwen3_8_flash_next_ple")
    h = keygen.preset("qwen3.8-flash-next")
    d = v["derived"]
    assert h.table_rows(2) == d["padded_rows"] == d["split_ngram_parts"] * d["rows_per_shard"]
    assert h.info["split_ngram_parts"] == d["split_ngram_parts"]
    assert h.info["row_dim"] == v["config"]["head_dim"]
    for case in v["cases"]:
        assert h.row_ids(case["input_token_ids"]).tolist() == case["global_rowids"]


def test_qwen_out_of_vocab_reference_behaviour(vectors: dict[str, Any]) -> None:
    h = keygen.preset("qwen3.8-flash-next")
    edge = vectors["negative_mix_edge_case"]
    ids = edge["input_token_ids"]
    with pytest.raises(TokenIdOutOfRange, match="400000"):
        h.row_ids(ids)
    assert h.row_ids(ids, strict=False).tolist() == edge["hf_global_rowids"]
    assert _stream_all(h, ids, strict=False).tolist() == edge["hf_global_rowids"]
    # the bigram mix at position 1 wraps negative; the floor modulo still lands in [0, P)
    m = h.multipliers(2).tolist()
    mix = (ids[1] * m[0]) ^ (ids[0] * m[1])
    assert ((mix + (1 << 63)) % (1 << 64)) - (1 << 63) == edge["bigram_mix_at_position_1_int64"]


def test_engramdb_golden_crosscheck(vectors: dict[str, Any]) -> None:
    h = keygen.preset("qwen3.8-flash-next")
    inputs = vectors["engram_peft_1_2_7_comparison"]["qwen_ple_engine_vs_hf_qwen4_exp"]
    golden_input = next(c["input"] for c in inputs if 999999 in c["input"])
    rows = h.row_ids(golden_input, strict=False)
    assert rows[9:12].tolist() == vectors["engramdb_golden_crosscheck"]["hf_rows_9_to_11"]


def test_demo_ids_differ_from_engram_peft(vectors: dict[str, Any]) -> None:
    cmp_ = vectors["engram_peft_1_2_7_comparison"]["deepseek_engine_vs_demo"]
    v = _by_name(vectors, "deepseek_demo_tiny")
    cfg = v["config"]
    h = keygen.hasher(
        "deepseek-demo",
        {**_demo_config(cfg), "compressed_vocab_size": cfg["compressed_vocab_size"]},
        compressed_pad_id=cfg["pad_id_compressed"],
    )
    assert h.primes(1).tolist() == [p for order in cmp_["demo_primes"] for p in order]
    assert h.multipliers(1).tolist() == cmp_["demo_multipliers"]
    local = h.local_ids(v["cases"][0]["compressed_ids"], layer=1, compressed=True)
    assert local.tolist() == cmp_["demo_local_ids"] != cmp_["engram_peft_local_ids"]


@pytest.mark.parametrize("preset_name", ["gemma3n-e2b", "gemma3n-e4b"])
def test_gemma(vectors: dict[str, Any], preset_name: str) -> None:
    v = _by_name(vectors, "gemma3n_E2B_ple")
    h = keygen.preset(preset_name)
    n_layers = 30 if preset_name.endswith("e2b") else 35
    assert h.layers == tuple(range(n_layers))
    assert h.table_rows(0) == v["config"]["vocab_size_per_layer_input"]
    row_bytes = n_layers * v["config"]["hidden_size_per_layer_input"] * 2
    assert h.info["row_bytes"] == row_bytes
    if preset_name.endswith("e2b"):
        assert row_bytes == v["row_bytes_bf16"]
    from_config = keygen.hasher("gemma3n", v["config"])
    for case in v["cases"]:
        tid, want = case["input_token_id"], case["rowid"]
        assert h.row_ids([tid], strict=False).tolist() == [[want]]
        assert from_config.row_ids([tid], strict=False).tolist() == [[want]]
        assert h.stream(layer=3, strict=False).push(tid).tolist() == [want]
        if preset_name.endswith("e2b"):
            assert want * row_bytes == case["byte_offset_bf16"]
        in_vocab = 0 <= tid < 262_400
        if in_vocab:  # vision / audio ids are valid tokens that read row 0
            assert h.row_ids([tid]).tolist() == [[want]]
        else:
            with pytest.raises(TokenIdOutOfRange, match=str(tid)):
                h.row_ids([tid])


def test_compression_standin_table(vectors: dict[str, Any]) -> None:
    cs = vectors["compression_standin"]
    tmap = keygen.TokenMap(cs["lookup_table"])
    assert len(tmap) == cs["vocab_size"]
    assert tmap.compressed_vocab_size == cs["compressed_vocab_size"]
    for row in cs["selected_rows"]:
        assert int(tmap.table[row["token_id"]]) == row["compressed_id"]
