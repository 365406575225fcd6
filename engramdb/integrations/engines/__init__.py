"""Installers against the engines' real model classes (the ``[engines]`` extra).

`vllm`: Gemma 4 and Gemma 3n per-layer embeddings (``embed_tokens_per_layer``), Qwen4-Exp
PLE n-gram tables (``Qwen4ExpNGramEmbedding.ngram_embedding``), DeepSeek V4.1 Engram tables
(``ParallelEngramEmbedding``, ``--engram-config``). What is and is
not supported, and why, is in ``docs/engines.md``. Importing this package imports no engine;
each installer imports its engine module when called.
"""

from engramdb.integrations.engines._env import hide_broken_torch_extensions
from engramdb.integrations.engines.vllm import (
    DiskTableEmbedding,
    install_vllm_gemma3n,
    install_vllm_gemma4,
    install_vllm_qwen4exp,
)
from engramdb.integrations.engines.vllm_deepseek import install_vllm_deepseek_v41

__all__ = [
    "DiskTableEmbedding",
    "hide_broken_torch_extensions",
    "install_vllm_deepseek_v41",
    "install_vllm_gemma3n",
    "install_vllm_gemma4",
    "install_vllm_qwen4exp",
]
