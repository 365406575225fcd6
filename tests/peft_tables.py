"""Helpers of the torch tests: engram-peft's real modules and EngramDB tables built from their
weights (imported by the test modules, never collected)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import engramdb  # noqa: E402


def peft_modules():  # type: ignore[no-untyped-def]
    import sys
    import typing
    import warnings

    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = pytest.importorskip("engram_peft.layer")
        from engram_peft.config import EngramConfig
    return layer, EngramConfig


def peft_tables(tmp_path: Path, layers=(1, 3)):  # type: ignore[no-untyped-def]
    """An engram-peft config, its hasher, and one f32 table per layer (built from the
    layers' own in-RAM weights)."""
    import warnings

    from engramdb import keygen

    layer_mod, EngramConfig = peft_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = EngramConfig(
            engram_vocab_size_per_ngram=[800, 800],
            ngram_sizes=[2, 3],
            n_head_per_ngram=2,
            embedding_dim=32,
            hidden_size=16,
            hc_mult=1,
            compressed_vocab_size=100,
            pad_id=0,
            enable_tokenizer_compression=False,
            gating_zero_init=False,
            conv_zero_init=False,
            target_layers=list(layers),
            use_sparse_embeddings=False,
        )
    h = keygen.hasher("engram-peft", cfg)
    torch.manual_seed(0)
    mods = {}
    for lay in layers:
        mods[lay] = layer_mod.EngramLayer(cfg, lay, h.primes(lay).tolist()).eval()
        w = mods[lay].multi_head_embedding.embedding.weight.detach().contiguous()
        engramdb.build(
            tmp_path,
            f"l{lay}",
            32,
            [w.view(torch.uint8).numpy()],
            heads=h.primes(lay).tolist(),
            dtype="f32",
        )
    return h, mods
