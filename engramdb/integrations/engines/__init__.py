"""Installers against the engines' real model classes (the ``[engines]`` extra).

`vllm`: Gemma 4 and Gemma 3n per-layer embeddings (``embed_tokens_per_layer``), Qwen4-Exp
PLE n-gram tables (``Qwen4ExpNGramEmbedding.ngram_embedding``). What is and is
not supported, and why, is in ``docs/engines.md``. Importing this package imports no engine;
each installer imports its engine module when called.
"""

from engramdb.integrations.engines.vllm import (
    DiskTableEmbedding,
    install_vllm_gemma3n,
    install_vllm_gemma4,
    install_vllm_qwen4exp,
)

__all__ = [
    "DiskTableEmbedding",
    "install_vllm_gemma3n",
    "install_vllm_gemma4",
    "install_vllm_qwen4exp",
]
