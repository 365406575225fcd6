"""Config plumbing shared by the model families of `engramdb.keygen.kinds`: field lookup in a
HF config (with its ``text_config``), frozen-constant lookup, and out-of-vocabulary checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, TokenIdOutOfRange
from engramdb.keygen._arith import deepseek_multipliers
from engramdb.keygen.tokenmap import TokenMap

__all__ = [
    "MISSING",
    "MULT_KEYS",
    "OFFSET_KEYS",
    "PRIME_KEYS",
    "Config",
    "check_constant_layers",
    "compressed_vocab",
    "deepseek_mult",
    "frozen_constants",
    "identity",
    "oov_message",
    "pick",
    "range_checked",
]

MISSING = object()


def identity(tid: int) -> int:
    return tid


def oov_message(tid: int, bound: int, what: str) -> str:
    return (
        f"token id {tid} is outside [0, {bound}) ({what}); "
        f"pass strict=False for the reference engine's behaviour"
    )


def range_checked(bound: int, what: str) -> Callable[[int], int]:
    def encode(tid: int) -> int:
        if 0 <= tid < bound:
            return tid
        raise TokenIdOutOfRange(oov_message(tid, bound, what))

    return encode


# Aliases under which checkpoints ship frozen constants (Qwen's buffer names included).
MULT_KEYS = ("multipliers", "layer_multipliers")
PRIME_KEYS = ("primes", "ngram_heads_vocab_sizes", "head_rows")
OFFSET_KEYS = ("offsets", "ngram_heads_offsets")


# Defaults of the model's own config class for fields a checkpoint's config.json may omit
# (``transformers`` writes only values that differ from the class defaults). Checked against
# the classes in tests (``Gemma3nTextConfig()``). ``num_hidden_layers`` stays required: it
# is the table's shape, and a wrong guess would give a wrong table rather than an error.
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3n": {
        "vocab_size": 262_400,
        "vocab_size_per_layer_input": 262_144,
        "hidden_size_per_layer_input": 256,
        "pad_token_id": 0,
    },
}


class Config:
    """Field lookup in a HF config dict, falling back to its ``text_config``, then to the
    model config class's defaults (`CLASS_DEFAULTS`) for omitted fields."""

    def __init__(self, kind: str, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise InvalidArgument(f"{kind} config must be a dict, got {type(config).__name__}")
        self.kind = kind
        self.top = config
        text = config.get("text_config")
        self.text = text if isinstance(text, Mapping) else {}
        self.defaults = CLASS_DEFAULTS.get(kind, {})

    def get(self, *names: str, default: Any = MISSING) -> Any:
        for src in (self.top, self.text):
            for name in names:
                if name in src and src[name] is not None:
                    return src[name]
        for name in names:
            if name in self.defaults:
                return self.defaults[name]
        if default is MISSING:
            raise InvalidArgument(f"{self.kind} config lacks {' / '.join(repr(n) for n in names)}")
        return default

    def integer(self, *names: str, default: Any = MISSING, minimum: int | None = None) -> Any:
        value = self.get(*names, default=default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidArgument(
                f"{self.kind} config {names[0]!r} must be an integer, got {value!r}"
            )
        if minimum is not None and value < minimum:
            raise InvalidArgument(
                f"{self.kind} config {names[0]!r} must be >= {minimum}, got {value}"
            )
        return int(value)

    def int_list(self, *names: str) -> list[int]:
        value = self.get(*names)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return [int(value)]
        if (
            not isinstance(value, Sequence)
            or isinstance(value, (str, bytes))
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
        ):
            raise InvalidArgument(
                f"{self.kind} config {names[0]!r} must list integers, got {value!r}"
            )
        return [int(v) for v in value]


def frozen_constants(constants: Mapping[Any, Any] | None, layer: int) -> Mapping[str, Any]:
    if not constants:
        return {}
    for key in (layer, str(layer)):
        if key in constants:
            entry = constants[key]
            if not isinstance(entry, Mapping):
                raise InvalidArgument(f"constants[{layer!r}] must be a dict, got {entry!r}")
            return entry
    return {}


def pick(entry: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        if key in entry and entry[key] is not None:
            return entry[key]
    return None


def check_constant_layers(constants: Mapping[Any, Any] | None, layers: Sequence[int]) -> None:
    for key in constants or {}:
        try:
            ok = int(key) in layers
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidArgument(f"constants given for layer {key!r}, layers are {list(layers)}")


def compressed_vocab(
    token_map: Any,
    cfg_vc: int | None,
    pad_raw: int,
    pad_c: int | None,
    *,
    compress: bool = True,
) -> tuple[TokenMap | None, int | None, int | None]:
    """``(token map, V_c, compressed pad id)`` from the caller's token map and pad id and the
    config's ``compressed_vocab_size``: the map decides V_c and the pad (a config or caller
    value that disagrees is refused); with ``compress`` off the pad is hashed raw."""
    tmap = None if token_map is None else TokenMap.coerce(token_map)
    vocab_c = cfg_vc
    if tmap is not None:
        if cfg_vc is not None and cfg_vc != tmap.compressed_vocab_size:
            # The multipliers derive from V_c; every reference refuses to start on a mismatch.
            raise InvalidArgument(
                f"token map compresses to {tmap.compressed_vocab_size} ids but the config says "
                f"compressed_vocab_size {cfg_vc}"
            )
        vocab_c = tmap.compressed_vocab_size
        if pad_raw >= len(tmap):
            raise InvalidArgument(f"pad id {pad_raw} is outside the token map ({len(tmap)} ids)")
        mapped = int(tmap.table[pad_raw])
        if pad_c is not None and pad_c != mapped:
            raise InvalidArgument(
                f"compressed pad id {pad_c} differs from the token map's {mapped} for pad {pad_raw}"
            )
        pad_c = mapped
    elif not compress:
        if pad_c is not None and pad_c != pad_raw:
            raise InvalidArgument(
                f"compression is off, so the pad is hashed raw ({pad_raw}), not {pad_c}"
            )
        pad_c = pad_raw
    if pad_c is not None and vocab_c is not None and not 0 <= pad_c < vocab_c:
        raise InvalidArgument(f"compressed pad id {pad_c} is outside [0, {vocab_c})")
    return tmap, vocab_c, pad_c


def deepseek_mult(
    entry: Mapping[str, Any], seed: int, layer: int, n_max: int, vocab_c: int | None
) -> Any:
    """A layer's multipliers: the frozen ones, else the DeepSeek derivation from V_c; None
    while V_c is unknown (the hasher then refuses until it is)."""
    mult = pick(entry, MULT_KEYS)
    if mult is None and vocab_c is not None:
        mult = deepseek_multipliers(seed, layer, n_max, vocab_c)
    return mult
