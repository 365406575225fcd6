"""The three model families: DeepSeek Engram (demo, V4.1), Qwen4-Exp PLE, Gemma 3n PLE.

Each class reads the model's own config field names, derives the constants by the rules of
``docs/keygen.md`` (frozen constants given by the caller win), and supplies the boundary
rules the shared kernel in ``_core`` needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, ShapeMismatch, TokenIdOutOfRange
from engramdb.keygen._arith import (
    consecutive_primes,
    deepseek_primes,
    qwen_multipliers,
)
from engramdb.keygen._config import (
    MULT_KEYS,
    OFFSET_KEYS,
    PRIME_KEYS,
    Config,
    check_constant_layers,
    compressed_vocab,
    deepseek_mult,
    frozen_constants,
    identity,
    oov_message,
    pick,
    range_checked,
)
from engramdb.keygen._core import Hasher
from engramdb.keygen._tables import (
    LayerTables,
    RowMode,
    as_mask,
    as_token_array,
    check_range,
    prepare_out,
    readonly_int64,
    to_int64,
)
from engramdb.keygen.stream import History
from engramdb.keygen.tokenmap import TokenMap


# --- DeepSeek Engram ------------------------------------------------------------------------
class DeepSeekHasher(Hasher):
    """DeepSeek Engram row ids: compressed ids, pad fill, sticky dead tokens.

    Layer ids are the 0-based decoder indices of ``layer_ids`` / ``engram_layer_ids``.
    ``mask`` marks dead positions (image spans): a dead position and everything older is
    replaced by the compressed pad id in later look-backs, and the dead position itself hashes
    the all-pad n-grams. Reference behaviour (``strict=False``) for ids outside the vocabulary:
    compressed ids are hashed as given with int64 wrap; raw ids are clamped into the map.
    """

    def __init__(
        self,
        *,
        kind: str,
        token_map: TokenMap | None,
        pad_id: int,
        unready: str | None,
        **kwargs: Any,
    ) -> None:
        self.kind = kind
        super().__init__(**kwargs)
        self.token_map = token_map
        self.pad_id = pad_id
        self._unready = unready

    def _ready(self) -> None:
        if self._unready:
            raise InvalidArgument(self._unready)

    def multipliers(self, layer: int | None = None) -> np.ndarray:
        lt = self.layer_tables(layer)
        self._ready()
        return lt.multipliers

    def _ext(self, *args: Any, **kwargs: Any) -> Any:
        self._ready()
        return super()._ext(*args, **kwargs)

    def hash_keys(self, keys: Any, **kwargs: Any) -> np.ndarray:
        self._ready()
        return super().hash_keys(keys, **kwargs)

    def stream(self, layer: int | None = None, **kwargs: Any) -> Any:
        self._ready()
        return super().stream(layer, **kwargs)

    def _check_encodable(self, compressed: bool, strict: bool) -> None:
        if compressed and strict and self.id_bound is None:
            raise InvalidArgument(
                "the compressed vocabulary size is unknown, so compressed ids cannot be "
                "checked: give compressed_vocab_size or a token map, or strict=False"
            )
        if not compressed and self.token_map is None:
            raise InvalidArgument(
                f"{self.kind} hasher has no tokenizer compression map: build it with "
                f"token_map=... or pass compressed=True with compressed ids"
            )

    def _encode(self, arr: np.ndarray, compressed: bool, strict: bool) -> np.ndarray:
        self._check_encodable(compressed, strict)
        if compressed:
            if strict and self.id_bound is not None:
                check_range(arr, 0, self.id_bound, "compressed vocabulary")
            return to_int64(arr)
        assert self.token_map is not None
        return self.token_map.apply(arr, strict=strict)

    def _apply_mask(
        self, ids2: np.ndarray, mask2: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        return ids2, mask2, mask2

    def step_bound(self, compressed: bool, strict: bool) -> tuple[bool, int | None]:
        """Whether a decode step of unmasked ids is hashed as given after one range check
        (`engramdb.keygen.native.native_step`), and that check's exclusive upper bound
        (None: none). Raises what `_encode` raises for an unusable combination."""
        self._check_encodable(compressed, strict)
        if not compressed:
            return False, None  # the tokenizer map runs first
        return True, self.id_bound if strict else None

    def _encode_fn(self, compressed: bool, strict: bool) -> Callable[[int], int]:
        self._check_encodable(compressed, strict)
        if compressed:
            if not strict or self.id_bound is None:
                return identity
            return range_checked(self.id_bound, "compressed vocabulary")
        assert self.token_map is not None
        table = self.token_map.table.tolist()
        size = len(table)

        def encode(tid: int) -> int:
            if 0 <= tid < size:
                return table[tid]
            if strict:
                raise TokenIdOutOfRange(oov_message(tid, size, "tokenizer vocabulary"))
            return table[min(max(tid, 0), size - 1)]

        return encode


def build_deepseek(
    kind: str,
    config: Mapping[str, Any],
    *,
    token_map: Any = None,
    compressed_pad_id: int | None = None,
    constants: Mapping[Any, Any] | None = None,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> DeepSeekHasher:
    """A DeepSeek hasher from the demo's ``EngramConfig`` or the V4.1 HF ``text_config`` fields."""
    cfg = Config(kind, config)
    if kind == "deepseek-demo":
        layer_ids = cfg.int_list("layer_ids")
        max_ngram = cfg.integer("max_ngram_size", minimum=2)
        heads = cfg.integer("n_head_per_ngram", minimum=1)
        bases = cfg.int_list("engram_vocab_size")
        pad_raw = cfg.integer("pad_id", "pad_id_raw", minimum=0)
        seed = cfg.integer("seed", default=0)
        cfg_vc = cfg.integer("compressed_vocab_size", default=None, minimum=1)
        cfg_pad_c = cfg.integer("compressed_pad_id", "pad_id_compressed", default=None, minimum=0)
        embed = cfg.integer("n_embed_per_ngram", default=None, minimum=1)
        row_dim = embed // heads if embed else None
        num_embeddings = None
    else:
        layer_ids = cfg.int_list("engram_layer_ids")
        max_ngram = cfg.integer("engram_max_ngram_size", minimum=2)
        heads = cfg.integer("engram_n_heads", minimum=1)
        bases = cfg.int_list("engram_vocab_size")
        pad_raw = cfg.integer("engram_pad_id", "engram_pad_token_id", minimum=0)
        seed = cfg.integer("engram_seed", default=0)  # V4.1 has no seed field: 0
        cfg_vc = cfg.integer("engram_compressed_vocab_size", default=None, minimum=1)
        cfg_pad_c = cfg.integer("engram_compressed_pad_id", default=None, minimum=0)
        row_dim = cfg.integer("engram_head_dim", default=None, minimum=1)
        raw_rows = cfg.get("engram_num_embeddings", default=None)
        num_embeddings = None if raw_rows is None else cfg.int_list("engram_num_embeddings")
    if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
        raise InvalidArgument(f"{kind} layer ids must be distinct and non-empty, got {layer_ids}")
    if len(bases) == 1:
        bases = bases * (max_ngram - 1)
    if len(bases) != max_ngram - 1 or min(bases) < 2:
        raise InvalidArgument(
            f"{kind} engram_vocab_size needs one base >= 2 per order 2..{max_ngram}, got {bases}"
        )
    check_constant_layers(constants, layer_ids)

    pad_c = compressed_pad_id if compressed_pad_id is not None else cfg_pad_c
    tmap, vocab_c, pad_c = compressed_vocab(token_map, cfg_vc, pad_raw, pad_c)

    derived_primes = deepseek_primes(layer_ids, bases, heads)
    tables: dict[int, LayerTables] = {}
    missing_mult = False
    for i, layer in enumerate(layer_ids):
        entry = frozen_constants(constants, layer)
        mult = deepseek_mult(entry, seed, layer, max_ngram, vocab_c)
        if mult is None:
            missing_mult = True
            mult = [1] * max_ngram  # placeholder; multipliers() refuses until V_c is known
        primes = pick(entry, PRIME_KEYS)
        lt = LayerTables.build(
            layer,
            max_ngram,
            heads,
            mult,
            derived_primes[layer] if primes is None else primes,
            pick(entry, OFFSET_KEYS),
            entry.get("table_rows"),
        )
        if num_embeddings is not None and len(num_embeddings) == len(layer_ids):
            if num_embeddings[i] != lt.table_rows:
                raise InvalidArgument(
                    f"layer {layer}: buckets sum to {lt.table_rows} rows but the config's "
                    f"engram_num_embeddings says {num_embeddings[i]}"
                )
        tables[layer] = lt
    unready = None
    if missing_mult:
        unready = (
            f"{kind}: the multipliers derive from the compressed vocabulary size, which depends "
            f"on the tokenizer: pass compressed_vocab_size (config) or token_map="
        )
    elif pad_c is None:
        unready = f"{kind}: the compressed pad id is unknown: pass token_map= or compressed_pad_id="
    full_info = {"row_dim": row_dim, "compressed_vocab_size": vocab_c, "pad_id": pad_raw}
    full_info.update(info or {})
    return DeepSeekHasher(
        kind=kind,
        token_map=tmap,
        pad_id=pad_raw,
        unready=unready,
        name=name,
        tables=tables,
        max_ngram=max_ngram,
        heads_per_ngram=heads,
        fill_id=-1 if pad_c is None else pad_c,
        id_bound=vocab_c,
        info=full_info,
    )


# --- Qwen4-Exp PLE --------------------------------------------------------------------------
class QwenHasher(Hasher):
    """Qwen4-Exp / Qwen3.8-Flash-Next PLE row ids: raw ids, EOS fill, segment reset at EOS.

    Layer ids are the config's 1-based ``ple_layer_ids``. ``mask`` marks positions the model
    replaces by EOS before hashing (masked by attention), which then also end the segment.
    Reference behaviour (``strict=False``): ids outside the vocabulary are hashed with int64
    wrap and floor modulo, as the HF model does.
    """

    kind = "qwen4exp"

    _dead_blocks_self = False  # a masked position becomes EOS (and so ends the segment)

    def __init__(self, *, eos_id: int, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self._barrier_id = eos_id

    def _encode(self, arr: np.ndarray, compressed: bool, strict: bool) -> np.ndarray:
        if compressed:
            raise InvalidArgument(f"{self.kind} takes raw token ids: it has no compressed form")
        if strict:
            check_range(arr, 0, self.vocab_size, "vocabulary")
        return to_int64(arr)

    def _apply_mask(
        self, ids2: np.ndarray, mask2: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        if mask2 is not None:
            ids2 = np.where(mask2, self.eos_id, ids2)
        return ids2, ids2 == self.eos_id, None

    def _encode_fn(self, compressed: bool, strict: bool) -> Callable[[int], int]:
        if compressed:
            raise InvalidArgument(f"{self.kind} takes raw token ids: it has no compressed form")
        return range_checked(self.vocab_size, "vocabulary") if strict else identity


def build_qwen(
    config: Mapping[str, Any],
    *,
    constants: Mapping[Any, Any] | None = None,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> QwenHasher:
    """A Qwen PLE hasher from ``Qwen4ExpTextConfig`` fields (``text_config`` accepted)."""
    kind = "qwen4exp"
    cfg = Config(kind, config)
    vocab = cfg.integer("vocab_size", minimum=1)
    max_ngram = cfg.integer("ngram_size", minimum=2)
    heads = cfg.integer("heads_per_ngram", minimum=1)
    base = cfg.integer("ngram_vocab_size_base", minimum=2)
    divisor = cfg.integer("make_ngram_vocab_size_divisible_by", default=1, minimum=1)
    seed = cfg.integer("seed", default=1234)
    eos_raw = cfg.get("eos_token_id")
    if isinstance(eos_raw, Sequence) and not isinstance(eos_raw, str) and len(eos_raw) == 1:
        eos_raw = eos_raw[0]
    if isinstance(eos_raw, bool) or not isinstance(eos_raw, (int, np.integer)):
        raise InvalidArgument(f"qwen4exp eos_token_id must be one integer, got {eos_raw!r}")
    eos = int(eos_raw)
    if not 0 <= eos < vocab:
        raise InvalidArgument(f"qwen4exp eos_token_id {eos} is outside [0, {vocab})")
    layer_ids = sorted(cfg.int_list("ple_layer_ids"))
    if not layer_ids or len(set(layer_ids)) != len(layer_ids):
        raise InvalidArgument(f"qwen4exp ple_layer_ids must be distinct and non-empty: {layer_ids}")
    n_cols = (max_ngram - 1) * heads
    declared = cfg.integer("ngram_heads", default=None)
    if declared is not None and declared != n_cols:
        raise InvalidArgument(
            f"qwen4exp ngram_heads {declared} differs from (ngram_size-1)*heads_per_ngram {n_cols}"
        )
    check_constant_layers(constants, layer_ids)
    all_primes = consecutive_primes(base, n_cols * len(layer_ids))
    tables: dict[int, LayerTables] = {}
    for k, layer in enumerate(layer_ids):
        entry = frozen_constants(constants, layer)
        mult = pick(entry, MULT_KEYS)
        if mult is None:
            mult = qwen_multipliers(seed, k, max_ngram, vocab)
        primes = pick(entry, PRIME_KEYS)
        if primes is None:
            primes = all_primes[k * n_cols : (k + 1) * n_cols]
        offsets = pick(entry, OFFSET_KEYS)
        plain = LayerTables.build(layer, max_ngram, heads, mult, primes, offsets)
        padded = entry.get("table_rows")
        if padded is None:
            padded = math.ceil(plain.table_rows / divisor) * divisor
        tables[layer] = LayerTables.build(
            layer, max_ngram, heads, mult, primes, offsets, int(padded)
        )
    embed = cfg.integer("ple_embed_dim", default=None, minimum=1)
    parts = cfg.integer("split_ngram_parts", default=None, minimum=1)
    full_info: dict[str, Any] = {
        "row_dim": embed // n_cols if embed else None,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "split_ngram_parts": parts,
    }
    full_info.update(info or {})
    return QwenHasher(
        eos_id=eos,
        vocab_size=vocab,
        name=name,
        tables=tables,
        max_ngram=max_ngram,
        heads_per_ngram=heads,
        fill_id=eos,
        id_bound=vocab,
        info=full_info,
    )


# --- Gemma 3n PLE ---------------------------------------------------------------------------
class GemmaHasher(Hasher):
    """Gemma 3n per-layer embeddings: row id = token id; one table shared by every layer.

    Ids outside the table (vision / audio ids, up to ``vocab_size``) read row 0, as the
    reference does. Ids outside ``[0, vocab_size)`` raise unless ``strict=False`` (row 0).
    ``mask`` positions also read row 0 (the pad row).
    """

    kind = "gemma3n"

    def __init__(self, *, table_ids: int, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table_ids = table_ids
        self.vocab_size = vocab_size

    def multipliers(self, layer: int | None = None) -> np.ndarray:
        self.layer_tables(layer)
        return readonly_int64([])

    def primes(self, layer: int | None = None) -> np.ndarray:
        self.layer_tables(layer)
        return readonly_int64([])

    def _rowmap(self, arr: np.ndarray, mask: Any, strict: bool) -> np.ndarray:
        if strict:
            check_range(arr, 0, self.vocab_size, "vocabulary incl. multimodal ids")
        ids = to_int64(arr)
        inside = (ids >= 0) & (ids < self.table_ids)
        if mask is not None:
            inside &= ~as_mask(mask, arr.shape)
        return np.where(inside, ids, 0)

    def _rows(
        self, token_ids: Any, layer: int | None, mode: RowMode, mask: Any, out: np.ndarray | None
    ) -> np.ndarray:
        self.layer_tables(layer)
        if mode.compressed:
            raise InvalidArgument(f"{self.kind} takes raw token ids: it has no compressed form")
        arr = as_token_array(token_ids)
        res = prepare_out(out, (*arr.shape, 1))
        res[..., 0] = self._rowmap(arr, mask, mode.strict)
        return res

    def keys(
        self, token_ids: Any, *, compressed: bool = False, mask: Any = None, strict: bool = True
    ) -> np.ndarray:
        return self._rows(token_ids, None, RowMode(compressed, strict), mask, None)

    def _hash_keys(
        self, lt: LayerTables, arr: np.ndarray, local: bool, strict: bool, out: np.ndarray | None
    ) -> np.ndarray:
        if arr.shape[-1] != 1:
            raise ShapeMismatch(f"gemma3n keys must be [..., 1], got shape {arr.shape}")
        res = prepare_out(out, arr.shape)
        if strict:
            check_range(arr, 0, self.table_ids, "table rows")
        res[...] = np.where((arr >= 0) & (arr < self.table_ids), to_int64(arr), 0)
        return res

    def _encode(self, arr: np.ndarray, compressed: bool, strict: bool) -> np.ndarray:
        if compressed:
            raise InvalidArgument(f"{self.kind} takes raw token ids: it has no compressed form")
        return self._rowmap(arr, None, strict)

    def _apply_mask(
        self, ids2: np.ndarray, mask2: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        if mask2 is not None:
            ids2 = np.where(mask2, 0, ids2)
        return ids2, None, None

    def make_step(
        self, lt: LayerTables, *, compressed: bool, local: bool, strict: bool
    ) -> Callable[[int, bool, list[int], list[bool]], np.ndarray]:
        if compressed:
            raise InvalidArgument(f"{self.kind} takes raw token ids: it has no compressed form")
        vocab, table_ids = self.vocab_size, self.table_ids

        def step(tid: int, dead: bool, ids: list[int], bars: list[bool]) -> np.ndarray:
            if strict and not 0 <= tid < vocab:
                raise TokenIdOutOfRange(oov_message(tid, vocab, "vocabulary incl. multimodal ids"))
            row = tid if 0 <= tid < table_ids and not dead else 0
            return np.array([row], dtype=np.int64)

        return step

    def stream_rows(
        self, lt: LayerTables, arr: np.ndarray, mask: Any, mode: RowMode, hist: History
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = self._rows(arr, None, mode, mask, None)
        return rows, *hist


def build_gemma(
    config: Mapping[str, Any],
    *,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> GemmaHasher:
    """A Gemma 3n PLE hasher from ``Gemma3nTextConfig`` fields (``text_config`` accepted)."""
    cfg = Config("gemma3n", config)
    table_ids = cfg.integer("vocab_size_per_layer_input", minimum=1)
    n_layers = cfg.integer("num_hidden_layers", minimum=1)
    width = cfg.integer("hidden_size_per_layer_input", default=None, minimum=1)
    vocab = cfg.integer("vocab_size", default=table_ids, minimum=1)
    if vocab < table_ids:
        raise InvalidArgument(
            f"gemma3n vocab_size {vocab} is smaller than vocab_size_per_layer_input {table_ids}"
        )
    table = LayerTables(
        layer=0,
        max_ngram=1,
        heads_per_ngram=1,
        multipliers=readonly_int64([]),
        primes=readonly_int64([table_ids]),
        offsets=readonly_int64([0]),
        table_rows=table_ids,
    )
    full_info: dict[str, Any] = {
        "row_dim": None if width is None else width * n_layers,
        "layer_slice": None if width is None else width,
        "vocab_size": vocab,
    }
    full_info.update(info or {})
    return GemmaHasher(
        table_ids=table_ids,
        vocab_size=vocab,
        name=name,
        tables=dict.fromkeys(range(n_layers), table),
        max_ngram=1,
        heads_per_ngram=1,
        fill_id=0,
        id_bound=vocab,
        info=full_info,
    )


__all__ = [
    "DeepSeekHasher",
    "GemmaHasher",
    "QwenHasher",
    "as_token_array",
    "build_deepseek",
    "build_gemma",
    "build_qwen",
]
