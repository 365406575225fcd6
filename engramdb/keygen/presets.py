"""Model layout presets: published configs plus frozen constants, and ``hasher(kind, config)``.

Frozen values come from the published checkpoints / configs (``docs/keygen.md`` lists the
sources); they are stored here so that a change in numpy's random streams can never move a
row id. Pure data and construction; `from_config_file` reads one JSON file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from engramdb.errors import InvalidArgument
from engramdb.keygen._core import Hasher
from engramdb.keygen.kinds import build_deepseek, build_gemma, build_qwen
from engramdb.keygen.peft import KIND as PEFT_KIND
from engramdb.keygen.peft import build_peft
from engramdb.keygen.tokenmap import TokenMap

KINDS = ("deepseek-demo", "deepseek-v41", "qwen4exp", "gemma3n", PEFT_KIND)


def hasher(
    kind: str,
    config: Any,
    *,
    token_map: Any = None,
    compressed_pad_id: int | None = None,
    constants: Mapping[Any, Mapping[str, Any]] | None = None,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> Hasher:
    """A row-id hasher for ``kind`` built from the model's own config fields.

    * ``"deepseek-demo"``: the Engram demo's ``EngramConfig`` (``layer_ids``,
      ``max_ngram_size``, ``n_head_per_ngram``, ``engram_vocab_size``, ``pad_id``, ``seed``),
      plus ``compressed_vocab_size`` when no ``token_map`` is given.
    * ``"deepseek-v41"``: the HF ``text_config`` ``engram_*`` fields.
    * ``"qwen4exp"``: ``Qwen4ExpTextConfig`` (``ple_layer_ids``, ``ngram_size``, ...).
    * ``"gemma3n"``: ``Gemma3nTextConfig`` (``vocab_size_per_layer_input``, ...).
    * ``"engram-peft"``: engram-peft's ``EngramConfig`` (the object or its dict:
      ``ngram_sizes``, ``engram_vocab_size_per_ngram``, ``target_layers``, ...).

    ``token_map`` (DeepSeek): a :class:`TokenMap`, a frozen ``.npy`` path or an int table;
    ``compressed_pad_id``: the pad's compressed id when no map is given. ``constants``:
    ``{layer: {"multipliers"|"layer_multipliers", "primes"|"ngram_heads_vocab_sizes",
    "offsets"|"ngram_heads_offsets", "table_rows"}}`` read from a checkpoint; they win over
    derived values. Cost: prime search, ~1 ms per 100 columns.
    """
    if kind == PEFT_KIND:
        return build_peft(
            config,
            token_map=token_map,
            compressed_pad_id=compressed_pad_id,
            constants=constants,
            name=name,
            info=info,
        )
    if kind in ("deepseek-demo", "deepseek-v41"):
        return build_deepseek(
            kind,
            config,
            token_map=token_map,
            compressed_pad_id=compressed_pad_id,
            constants=constants,
            name=name,
            info=info,
        )
    if token_map is not None or compressed_pad_id is not None:
        raise InvalidArgument(
            f"{kind} has no tokenizer compression: drop token_map / compressed_pad_id"
        )
    if kind == "qwen4exp":
        return build_qwen(config, constants=constants, name=name, info=info)
    if kind == "gemma3n":
        if constants:
            raise InvalidArgument("gemma3n has no hash constants to freeze")
        return build_gemma(config, name=name, info=info)
    raise InvalidArgument(f"unknown keygen kind {kind!r}; kinds are {list(KINDS)}")


# --- published layouts ----------------------------------------------------------------------
_DEEPSEEK_V41_FLASH = {
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_vocab_size": 16_000_000,
    "engram_head_dim": 256,
    "engram_num_embeddings": [384_006_168, 384_016_682],
    "engram_compressed_vocab_size": 99_092,
    "engram_pad_id": 2,
}
# Multipliers of default_rng(10007 * layer) as published with the V4.1 constants.
_DEEPSEEK_V41_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}

_DEEPSEEK_DEMO = {
    "layer_ids": [1, 15],
    "max_ngram_size": 3,
    "n_head_per_ngram": 8,
    "n_embed_per_ngram": 512,
    "engram_vocab_size": [646_400, 646_400],
    "pad_id": 2,
    "seed": 0,
}

_QWEN_FLASH_NEXT = {
    "vocab_size": 248_320,
    "ple_layer_ids": [2],
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128,
    "ple_embed_dim": 2560,
    "seed": 1234,
    "eos_token_id": 248_044,
}
# The checkpoint's ``layer_multipliers`` buffer (equal to splitmix64 with seed 1234).
_QWEN_FLASH_NEXT_MULTIPLIERS = {2: [23703573157769, 20109073645365, 8052911324071]}

_GEMMA3N = {
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "vocab_size": 262_400,
    "pad_token_id": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-engram-demo": {
        "kind": "deepseek-demo",
        "config": _DEEPSEEK_DEMO,
        "info": {"row_dim": 64},
    },
    "deepseek-v4.1-flash": {
        "kind": "deepseek-v41",
        "config": _DEEPSEEK_V41_FLASH,
        "constants": {k: {"multipliers": v} for k, v in _DEEPSEEK_V41_MULTIPLIERS.items()},
        # Raw pad 2 compresses to 2 with the V4.1 tokenizer (its specials come first).
        "compressed_pad_id": 2,
        "info": {"row_dim": 256, "row_bytes": 264, "row_format": "fp8_e4m3[256]+ue8m0[8]"},
    },
    "qwen3.8-flash-next": {
        "kind": "qwen4exp",
        "config": _QWEN_FLASH_NEXT,
        "constants": {k: {"multipliers": v} for k, v in _QWEN_FLASH_NEXT_MULTIPLIERS.items()},
        "info": {"row_dim": 160, "row_bytes": 160, "row_format": "fp8_e4m3[160]"},
    },
    "gemma3n-e2b": {
        "kind": "gemma3n",
        "config": {**_GEMMA3N, "num_hidden_layers": 30},
        "info": {"row_bytes": 15_360, "row_format": "bf16[7680]"},
    },
    "gemma3n-e4b": {
        "kind": "gemma3n",
        "config": {**_GEMMA3N, "num_hidden_layers": 35},
        "info": {"row_bytes": 17_920, "row_format": "bf16[8960]"},
    },
}


#: Reduced scales: every table-size base of a preset divided by this factor (same rules).
SCALES: dict[str, int] = {"full": 1, "small": 100, "tiny": 1_000}

# The config fields that size a preset's tables (the bases its primes are searched from), per
# kind; fields set to None are derived again at a reduced scale (V4.1's published row counts).
_SCALED_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "deepseek-demo": (("engram_vocab_size",), ()),
    "deepseek-v41": (("engram_vocab_size",), ("engram_num_embeddings",)),
    "qwen4exp": (("ngram_vocab_size_base",), ()),
    "gemma3n": (("vocab_size_per_layer_input",), ()),
}


def split_scale(name: str, scale: str | None = None) -> tuple[str, str]:
    """``(preset, scale)`` of ``"qwen3.8-flash-next@tiny"`` (or of a bare name and ``scale``).
    A scale given both ways must agree; unknown scales raise `InvalidArgument`."""
    base, at, suffix = name.rpartition("@")
    if at and base in PRESETS:
        if scale is not None and scale != suffix:
            raise InvalidArgument(f"preset {name!r} names scale {suffix!r} but scale={scale!r}")
        name, scale = base, suffix
    scale = "full" if scale is None else scale
    if scale not in SCALES:
        raise InvalidArgument(f"unknown scale {scale!r}; scales are {list(SCALES)}")
    return name, scale


def _scaled(kind: str, config: Mapping[str, Any], scale: str) -> dict[str, Any]:
    """The preset's config with its table-size bases divided by ``SCALES[scale]`` (floor, at
    least 2): every other field (vocabulary, orders, heads, seed, EOS, pad, divisor) stays."""
    out = dict(config)
    div = SCALES[scale]
    if div == 1:
        return out
    sized, derived = _SCALED_FIELDS[kind]
    for key in sized:
        value = out[key]
        if isinstance(value, list):
            out[key] = [max(2, int(v) // div) for v in value]
        else:
            out[key] = max(2, int(value) // div)
    for key in derived:
        out[key] = None
    return out


def preset(
    name: str,
    *,
    scale: str | None = None,
    token_map: Any = None,
    compressed_pad_id: int | None = None,
    constants: Mapping[Any, Mapping[str, Any]] | None = None,
    **config_overrides: Any,
) -> Hasher:
    """The hasher of a published layout, e.g. ``preset("qwen3.8-flash-next")``.

    ``scale`` (``"full"`` (default), ``"small"``, ``"tiny"``; also spelled
    ``"qwen3.8-flash-next@tiny"``) keeps the preset's algorithm (multipliers, orders, heads,
    EOS / pad / dead-token rules, padding divisor) and divides its table-size bases by
    `SCALES`: the tables are 100x / 1,000x smaller, for trying the chain without a checkpoint.
    A reduced scale's row ids are NOT the checkpoint's. Its hasher is named ``"<preset>@<scale>"``.
    Keyword config fields override the preset's (``preset("deepseek-engram-demo",
    compressed_vocab_size=...)``); ``token_map`` / ``compressed_pad_id`` / ``constants`` as in
    :func:`hasher`, with given constants winning over the preset's frozen ones.
    """
    if name not in PRESETS and name.endswith(".json") and os.path.isfile(name):
        if config_overrides or scale is not None:
            raise InvalidArgument(
                "config overrides and scale apply to named presets, not config files"
            )
        return from_config_file(
            name, token_map=token_map, compressed_pad_id=compressed_pad_id, constants=constants
        )
    name, scale = split_scale(name, scale)
    try:
        spec = PRESETS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown preset {name!r}; presets are {sorted(PRESETS)} (or a .json config file)"
        ) from None
    config = {**_scaled(spec["kind"], spec["config"], scale), **config_overrides}
    info = dict(spec.get("info") or {})
    if scale != "full":
        info["scale"] = scale
        name = f"{name}@{scale}"
    frozen: dict[Any, dict[str, Any]] = {k: dict(v) for k, v in spec.get("constants", {}).items()}
    for layer, entry in (constants or {}).items():
        frozen.setdefault(int(layer), {}).update(entry)
    pad = compressed_pad_id
    if pad is None and token_map is None:
        pad = spec.get("compressed_pad_id")
    kind = spec["kind"]
    if kind.startswith("deepseek"):
        return hasher(
            kind,
            config,
            token_map=token_map,
            compressed_pad_id=pad,
            constants=frozen or None,
            name=name,
            info=info,
        )
    return hasher(
        kind,
        config,
        token_map=token_map,
        compressed_pad_id=compressed_pad_id,
        constants=frozen or None,
        name=name,
        info=info,
    )


def from_config_file(
    path: str | os.PathLike[str],
    *,
    token_map: Any = None,
    compressed_pad_id: int | None = None,
    constants: Mapping[Any, Mapping[str, Any]] | None = None,
) -> Hasher:
    """The hasher a JSON config file describes: ``{"kind": KIND, "config": {...}}`` (plus
    optional ``"constants"``, ``"compressed_pad_id"``, ``"token_map"`` (a path)), or an
    engram-peft ``config.json`` as `EngramConfig.to_dict` writes it (kind ``engram-peft``).
    Reads the one file (and the token map it names, if any)."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read keygen config {os.fspath(path)!r}: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"keygen config {os.fspath(path)!r} must hold a JSON object")
    label = os.path.basename(os.fspath(path))
    if "kind" in doc:
        kind, config = doc["kind"], doc.get("config", {})
        frozen: Mapping[Any, Mapping[str, Any]] | None = {
            **doc.get("constants", {}),
            **(constants or {}),
        } or None
        if token_map is None and doc.get("token_map") is not None:
            tm = os.path.join(os.path.dirname(os.fspath(path)), doc["token_map"])
            token_map = TokenMap.coerce(tm)
        pad = compressed_pad_id if compressed_pad_id is not None else doc.get("compressed_pad_id")
    elif "ngram_sizes" in doc and "engram_vocab_size_per_ngram" in doc:
        kind, config, frozen, pad = PEFT_KIND, doc, constants, compressed_pad_id
    else:
        raise InvalidArgument(
            f"keygen config {os.fspath(path)!r} has no 'kind' and is not an engram-peft config"
        )
    return hasher(
        kind, config, token_map=token_map, compressed_pad_id=pad, constants=frozen, name=label
    )


def as_hasher(spec: Any, *, token_map: Any = None) -> Hasher:
    """The `Hasher` ``spec`` names: a preset name goes through `preset` (with ``token_map``,
    coerced by `TokenMap.coerce`, if given); a `Hasher` (or any object with ``row_ids``) is
    returned as it is, and then ``token_map`` must be None. Anything else raises
    `InvalidArgument` (as an unknown preset name does). No I/O beyond loading a map file."""
    if isinstance(spec, Hasher) or (not isinstance(spec, str) and hasattr(spec, "row_ids")):
        if token_map is not None:
            raise InvalidArgument("token_map goes into the Hasher when one is passed")
        return spec  # type: ignore[no-any-return]
    if token_map is not None:
        return preset(spec, token_map=TokenMap.coerce(token_map))
    return preset(spec)


def is_preset_name(name: Any) -> bool:
    """Whether ``name`` names a preset, at any scale (``"qwen3.8-flash-next@tiny"``)."""
    if not isinstance(name, str):
        return False
    base, at, suffix = name.rpartition("@")
    return name in PRESETS or (bool(at) and base in PRESETS and suffix in SCALES)


def table_heads(h: Hasher, layer: int | None = None) -> list[int]:
    """The head sizes of a table that ``h`` addresses for ``layer``: one head per column (its
    prime), then one pad head for the rows the layout pads its table with and never addresses
    (Qwen rounds its table up to a multiple of 128), so the table has ``h.table_rows(layer)``
    rows. Columns must sit back to back (`InvalidArgument` otherwise)."""
    lt = h.layer_tables(layer)
    heads = [int(p) for p in lt.primes]
    starts = [0]
    for rows in heads[:-1]:
        starts.append(starts[-1] + rows)
    if [int(o) for o in lt.offsets] != starts:
        raise InvalidArgument(
            f"layer {lt.layer} of {h!r} has columns that are not back to back "
            f"(offsets {lt.offsets.tolist()}): it has no head list"
        )
    pad = int(lt.table_rows) - sum(heads)
    if pad > 0:
        heads.append(pad)
    return heads


def preset_for_table(spec: Any, record: Mapping[str, Any] | None, *, token_map: Any = None) -> Any:
    """The hasher ``spec`` names for a table whose manifest records ``record`` (the
    ``"keygen"`` entry `build` writes for ``--preset``): a bare preset name the table was built
    with at a reduced scale means that scale (``"qwen3.8-flash-next"`` on a table built with
    ``--scale tiny`` is ``"qwen3.8-flash-next@tiny"``); anything else as `as_hasher` does."""
    if isinstance(spec, str) and isinstance(record, Mapping):
        built = record.get("preset")
        if isinstance(built, str) and is_preset_name(built) and spec in PRESETS:
            if split_scale(built)[0] == spec:
                spec = built
    return as_hasher(spec, token_map=token_map)


def table_record(table: Any) -> Mapping[str, Any] | None:
    """The ``"keygen"`` entry of a table's manifest (``table.info.extra``), or None: any
    object without one (a remote or foreign table) has none."""
    extra = getattr(getattr(table, "info", None), "extra", None)
    record = extra.get("keygen") if isinstance(extra, Mapping) else None
    return record if isinstance(record, Mapping) else None
