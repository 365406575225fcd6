"""Keygen: bit-exact table row ids of DeepSeek Engram, engram-peft, Qwen4-Exp PLE and Gemma 3n PLE.

>>> from engramdb import keygen
>>> h = keygen.preset("qwen3.8-flash-next")
>>> h.row_ids([[9707, 11, 1879]]).shape       # [B, T, 16] global row ids
(1, 3, 16)

The rules and file formats are in ``docs/keygen.md``.
"""

from __future__ import annotations

from engramdb.keygen._core import BLOCK_TOKENS, Hasher, LayerTables, kernel_stats
from engramdb.keygen._tables import column_mixes
from engramdb.keygen.kinds import DeepSeekHasher, GemmaHasher, QwenHasher
from engramdb.keygen.peft import PeftHasher, build_peft
from engramdb.keygen.presets import KINDS, PRESETS, as_hasher, from_config_file, hasher, preset
from engramdb.keygen.seq import PLE_QWEN_V1, rowids_for_seq, rowids_for_seq_with_history
from engramdb.keygen.stream import KeyStream, Step, StepSource
from engramdb.keygen.tokenmap import (
    TokenMap,
    build_token_map,
    compression_normalizer,
    file_sha256,
    load_token_map,
)

__all__ = [
    "BLOCK_TOKENS",
    "KINDS",
    "PRESETS",
    "DeepSeekHasher",
    "GemmaHasher",
    "Hasher",
    "KeyStream",
    "LayerTables",
    "PLE_QWEN_V1",
    "PeftHasher",
    "QwenHasher",
    "Step",
    "StepSource",
    "TokenMap",
    "as_hasher",
    "build_peft",
    "build_token_map",
    "column_mixes",
    "compression_normalizer",
    "file_sha256",
    "from_config_file",
    "hasher",
    "kernel_stats",
    "load_token_map",
    "preset",
    "rowids_for_seq",
    "rowids_for_seq_with_history",
]
