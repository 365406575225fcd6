"""Row ids of one token sequence, the published EngramDB API's ``rowids_for_seq``.

``rowids_for_seq(tokens)`` gives the Qwen PLE (``PLE_QWEN_V1``, the preset
``"qwen3.8-flash-next"``: 16 heads, 320,001,446 rows) global row ids ``[T, 16]`` of a fresh
sequence; ``rowids_for_seq_with_history(history, tokens)`` continues one. Both are one
vectorised keygen pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.keygen._core import Hasher
from engramdb.keygen.presets import preset

__all__ = ["PLE_QWEN_V1", "rowids_for_seq", "rowids_for_seq_with_history"]

#: The published name of the Qwen PLE table spec, and the preset that implements it.
PLE_QWEN_V1 = "PLE_QWEN_V1"
_SPECS = {PLE_QWEN_V1: "qwen3.8-flash-next"}
_cache: dict[str, Hasher] = {}


def _hasher(ple_spec: Any, multipliers: Any) -> Hasher:
    if isinstance(ple_spec, Hasher):
        if multipliers is not None:
            raise InvalidArgument("multipliers= applies to a spec name, not to a Hasher")
        return ple_spec
    if not isinstance(ple_spec, str):
        raise InvalidArgument(f"ple_spec must be a spec or preset name or a Hasher: {ple_spec!r}")
    name = _SPECS.get(ple_spec, ple_spec)
    if multipliers is not None:
        m = np.asarray(multipliers, dtype=np.int64)
        if m.ndim != 1 or m.size == 0:
            raise InvalidArgument(f"multipliers must be one non-empty list, got shape {m.shape}")
        base = preset(name)
        return preset(name, constants={int(base.layers[0]): {"multipliers": m.tolist()}})
    h = _cache.get(name)
    if h is None:
        h = _cache[name] = preset(name)
    return h


def rowids_for_seq(
    tokens: Sequence[int] | np.ndarray,
    ple_spec: Any = PLE_QWEN_V1,
    multipliers: Any = None,
    info: Any = None,
    *,
    layer: int | None = None,
) -> np.ndarray:
    """Global row ids (int64 ``[T, n_heads]``) of every position of the token sequence
    ``tokens`` (raw token ids, a fresh sequence).

    ``ple_spec``: ``"PLE_QWEN_V1"`` (default), any keygen preset name, or a keygen `Hasher`.
    ``multipliers``: the first layer's per-order multipliers, overriding the preset's frozen
    ones. ``info``: accepted for the published signature (it carried the table geometry
    there); the geometry here comes from the spec, so it is not used. ``layer``: the layer of
    a multi-layer spec (default its first). ``.tolist()`` gives the published ``[T][16]``
    lists. Raises `TokenIdOutOfRange` for ids outside the vocabulary."""
    del info
    seq = np.asarray(tokens)
    if seq.ndim != 1:
        raise InvalidArgument(f"tokens must be one sequence (1-D), got shape {seq.shape}")
    return _hasher(ple_spec, multipliers).row_ids(seq, layer=layer)


def rowids_for_seq_with_history(
    history: Sequence[int] | np.ndarray,
    tokens: Sequence[int] | np.ndarray,
    ple_spec: Any = PLE_QWEN_V1,
    multipliers: Any = None,
    *,
    layer: int | None = None,
) -> np.ndarray:
    """`rowids_for_seq` of ``tokens`` continuing a sequence that began with ``history``:
    the rows of the last ``len(tokens)`` positions of ``history + tokens``."""
    h = np.asarray(history).reshape(-1)
    t = np.asarray(tokens).reshape(-1)
    both = np.concatenate([h, t]).astype(np.int64, copy=False)
    return rowids_for_seq(both, ple_spec, multipliers, layer=layer)[h.size :]
