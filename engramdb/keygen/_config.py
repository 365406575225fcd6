"""Config plumbing shared by the model families of `engramdb.keygen.kinds`: field lookup in a
HF config (with its ``text_config``), frozen-constant lookup, and out-of-vocabulary checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, TokenIdOutOfRange

__all__ = [
    "MISSING",
    "MULT_KEYS",
    "OFFSET_KEYS",
    "PRIME_KEYS",
    "Config",
    "check_constant_layers",
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
