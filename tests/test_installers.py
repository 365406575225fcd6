"""Installers: vLLM / SGLang stand-in classes, and the real engram-peft package on CPU torch."""

from __future__ import annotations

import sys
import typing
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import engramdb  # noqa: E402
from engramdb.errors import ShapeMismatch  # noqa: E402
from engramdb.integrations import (  # noqa: E402
    install_disk_multi_head_embedding,
    install_sglang_ple,
    install_vllm_ple,
)

VOCAB, LAYERS, PER_LAYER = 300, 3, 16


class StandInPleModel(nn.Module):
    """Same attribute names and constructor flow as the Gemma-3n-style PLE text models of the
    engines: builds ``embed_tokens_per_layer`` in ``__init__`` and loads it in
    ``load_weights``; forward scales the looked-up rows."""

    def __init__(self, vocab: int = VOCAB, hidden_per_layer: int = PER_LAYER, layers: int = LAYERS):
        super().__init__()
        self.layers = layers
        self.embed_tokens_per_layer = nn.Embedding(
            vocab, layers * hidden_per_layer, dtype=torch.bfloat16
        )
        self.proj = nn.Linear(4, 4)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            params[name].data.copy_(w)
            loaded.add(name)
        return loaded

    def get_per_layer_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed_tokens_per_layer(ids) * 16.0
        return rows.reshape(*ids.shape, self.layers, -1)


def _ple_table(tmp_path: Path) -> tuple[torch.Tensor, engramdb.Store]:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, LAYERS * PER_LAYER, generator=g).to(torch.bfloat16)
    engramdb.build(
        tmp_path, "ple", weight.shape[1] * 2, [weight.view(torch.uint8).numpy()], dtype="bf16"
    )
    return weight, engramdb.open(tmp_path)["ple"]


@pytest.mark.parametrize("install", [install_vllm_ple, install_sglang_ple])
def test_ple_installers_swap_and_undo(tmp_path: Path, install) -> None:  # type: ignore[no-untyped-def]
    weight, store = _ple_table(tmp_path)
    reference = StandInPleModel()
    reference.load_weights(
        [("embed_tokens_per_layer.weight", weight), ("proj.weight", torch.ones(4, 4))]
    )
    undo = install(StandInPleModel, store, embedding_dim=LAYERS * PER_LAYER)
    try:
        model = StandInPleModel()
        from engramdb.torch import DiskEmbedding

        assert isinstance(model.embed_tokens_per_layer, DiskEmbedding)
        loaded = model.load_weights(
            [("embed_tokens_per_layer.weight", weight), ("proj.weight", torch.ones(4, 4))]
        )
        assert loaded == {"proj.weight"}, "the table tensor is never loaded into RAM"
        ids = torch.randint(0, VOCAB, (2, 9))
        assert torch.equal(model.get_per_layer_inputs(ids), reference.get_per_layer_inputs(ids))
        with pytest.raises(Exception, match="already patched"):
            install(StandInPleModel, store)
    finally:
        undo()
    assert not undo.active
    plain = StandInPleModel()
    assert isinstance(plain.embed_tokens_per_layer, nn.Embedding)
    assert (
        "load_weights" in StandInPleModel.__dict__ and "__setattr__" not in StandInPleModel.__dict__
    )
    undo()  # idempotent


def test_ple_installer_checks_dimensions(tmp_path: Path) -> None:
    _, store = _ple_table(tmp_path)
    with pytest.raises(ShapeMismatch):
        install_vllm_ple(StandInPleModel, store, embedding_dim=999)
    with install_vllm_ple(StandInPleModel, store):
        with pytest.raises(ShapeMismatch):
            StandInPleModel(hidden_per_layer=8)  # the engine's module would be 24 wide


@pytest.fixture
def engram_peft_layer():  # type: ignore[no-untyped-def]
    """Import the real engram-peft. Its 1.2.7 release imports ``typing.override`` (Python
    3.12+); on 3.11 the test environment supplies it from typing_extensions."""
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = pytest.importorskip("engram_peft.layer")
        from engram_peft.config import EngramConfig
        from engram_peft.hashing import create_hash_mapping
    return layer, EngramConfig, create_hash_mapping


def test_engram_peft_layer_on_disk_table_equals_memory(tmp_path: Path, engram_peft_layer) -> None:  # type: ignore[no-untyped-def]
    layer_mod, EngramConfig, create_hash_mapping = engram_peft_layer
    kw = dict(engram_vocab_size_per_ngram=[400, 400], ngram_sizes=[2, 3], n_head_per_ngram=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = EngramConfig(
            **kw,
            embedding_dim=32,
            hidden_size=16,
            hc_mult=1,
            compressed_vocab_size=100,
            pad_id=0,
            gating_zero_init=False,
            conv_zero_init=False,
            target_layers=[1],
            use_sparse_embeddings=False,
        )
        mapping = create_hash_mapping(
            compressed_vocab_size=100, layer_ids=[1], pad_id=0, seed=cfg.seed, **kw
        )
    primes = [p for row in mapping.prime_tables[1] for p in row]
    torch.manual_seed(0)
    in_memory = layer_mod.EngramLayer(cfg, 1, primes)
    weight = in_memory.multi_head_embedding.embedding.weight.detach()
    engramdb.build(
        tmp_path,
        "engram_l1",
        weight.shape[1] * 4,
        [weight.contiguous().view(torch.uint8).numpy()],
        heads=primes,
        dtype="f32",
    )
    original_cls = layer_mod.MultiHeadEmbedding
    with install_disk_multi_head_embedding(tmp_path) as undo:
        disk_layer = layer_mod.EngramLayer(cfg, 1, primes)
        assert type(disk_layer.multi_head_embedding).__name__ == "DiskBackedMultiHeadEmbedding"
        assert torch.equal(
            disk_layer.multi_head_embedding.offsets, in_memory.multi_head_embedding.offsets
        )
        state = {
            k: v
            for k, v in in_memory.state_dict().items()
            if not k.startswith("multi_head_embedding.")
        }
        missing, unexpected = disk_layer.load_state_dict(state, strict=False)
        assert not unexpected
        ids = torch.randint(0, 100, (3, 11))
        hashes = torch.from_numpy(np.asarray(in_memory.hash_mapping.hash(ids)[1]))
        hidden = torch.randn(3, 11, 16)
        with torch.no_grad():
            want = in_memory(hidden_states=hidden, engram_hash_indices=hashes)
            got = disk_layer(hidden_states=hidden, engram_hash_indices=hashes)
        assert torch.equal(got, want)
        assert undo.active
    assert layer_mod.MultiHeadEmbedding is original_cls


# --- SGLang's own embedding class, from the sglang 0.5.23 wheel -----------------------------
SGLANG = "sglang==0.5.23"


def _sglang_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sglang wheel (not installable here: it requires torch 2.14.1), downloaded without
    dependencies; ``ENGRAMDB_SGLANG_WHEEL`` names a local copy."""
    import os
    import subprocess

    local = os.environ.get("ENGRAMDB_SGLANG_WHEEL")
    if local:
        return Path(local)
    d = tmp_path_factory.mktemp("sglang")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", SGLANG, "--no-deps", "-q", "-d", str(d)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {SGLANG} timed out")
    wheels = sorted(d.glob("sglang-*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"pip download {SGLANG} failed: {proc.stderr[-300:]}")
    return wheels[0]


@pytest.fixture(scope="module")
def sglang_embedding(tmp_path_factory: pytest.TempPathFactory) -> type:
    """SGLang's ``Gemma4TextScaledWordEmbedding``: the class source from the wheel, executed
    alone (the module it lives in imports torchvision and SGLang's CUDA kernels)."""
    import ast
    import zipfile

    with zipfile.ZipFile(_sglang_wheel(tmp_path_factory)) as z:
        gemma3 = z.read("sglang/srt/models/gemma3_causal.py").decode()
        gemma4 = z.read("sglang/srt/models/gemma4_causal.py").decode()
    # Gemma 4's per-layer table class is Gemma 3's scaled embedding
    assert "Gemma4TextScaledWordEmbedding = Gemma3TextScaledWordEmbedding" in gemma4
    assert "embed_scale=self.hidden_size_per_layer_input**0.5" in gemma4
    tree = ast.parse(gemma3)
    (cls,) = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "Gemma3TextScaledWordEmbedding"
    ]
    ns: dict[str, object] = {"nn": nn, "torch": torch, "Optional": typing.Optional}
    exec(compile(ast.Module([cls], []), "sglang/srt/models/gemma3_causal.py", "exec"), ns)
    return ns["Gemma3TextScaledWordEmbedding"]  # type: ignore[return-value]


def test_sglang_gemma4_scaled_embedding_keeps_its_scale(
    sglang_embedding: type, tmp_path: Path
) -> None:
    hidden_per_layer = PER_LAYER

    class Gemma4PleModel(nn.Module):
        """The one statement of SGLang's ``Gemma4TextModel.__init__`` that builds the table."""

        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens_per_layer = sglang_embedding(
                VOCAB, LAYERS * hidden_per_layer, 0, embed_scale=hidden_per_layer**0.5
            )

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(VOCAB, LAYERS * PER_LAYER, generator=g)
    engramdb.build(
        tmp_path, "ple", weight.shape[1] * 4, [weight.numpy().view(np.uint8)], dtype="f32"
    )
    ref = Gemma4PleModel()
    ref.embed_tokens_per_layer.weight.data.copy_(weight)
    ids = torch.tensor([[0, 5, 299, 17]])
    with install_sglang_ple(Gemma4PleModel, engramdb.open(tmp_path)["ple"]):
        m = Gemma4PleModel()
    emb = m.embed_tokens_per_layer
    assert float(emb.embed_scale) == 4.0  # sqrt(hidden_size_per_layer_input), the module's own
    assert not [n for n, _ in m.named_parameters()]  # no table parameter kept
    got, want = emb(ids), ref.embed_tokens_per_layer(ids)
    assert got.dtype == want.dtype and torch.equal(got, want)  # not 4x too small
    assert torch.equal(got[0, 1], weight[5] * 4.0)


def test_ple_load_filter_is_anchored(tmp_path: Path) -> None:
    """Only ``[prefix.]embed_tokens_per_layer.weight`` is the table: companions still load."""
    seen: list[str] = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens_per_layer = nn.Embedding(VOCAB, LAYERS * PER_LAYER)

        def load_weights(self, weights):  # type: ignore[no-untyped-def]
            seen.extend(n for n, _ in weights)
            return set(seen)

    weight = torch.randn(VOCAB, LAYERS * PER_LAYER)
    engramdb.build(
        tmp_path, "ple", weight.shape[1] * 4, [weight.numpy().view(np.uint8)], dtype="f32"
    )
    names = [
        "model.embed_tokens_per_layer.weight",
        "embed_tokens_per_layer.weight",
        "embed_tokens_per_layer.weight_scale",
        "xembed_tokens_per_layer.weight",
        "model.embed_tokens_per_layer.weight.extra",
    ]
    with install_sglang_ple(Model, engramdb.open(tmp_path)["ple"]):
        Model().load_weights((n, None) for n in names)
    assert seen == names[2:]
