"""engram-peft row ids: its ``NgramHashMapping`` (``engine="deepseek"``), bit for bit.

engram-peft shares the DeepSeek demo's multipliers, primes and floor modulo but not its
windows (``docs/keygen.md``, "engram-peft"):

* the order-``n`` window at position ``t`` is ``c[t-N+1 .. t-N+n]`` (``N = max(ngram_sizes)``):
  the ``n`` *oldest* ids of the last ``N`` positions, so with ``N = 3`` the 2-gram at ``t`` is
  ``(c[t-2], c[t-1])``;
* the oldest id of a window gets ``m[0]``: ``mix_n(t) = XOR_{k=N-n}^{N-1} c[t-k] * m[N-1-k]``;
* ``engram_vocab_size_per_ngram[i]`` is the total of order ``ngram_sizes[i]``: each of its
  ``H`` heads starts the prime search at ``total // H``; primes are distinct over the layers
  taken in sorted order;
* columns are ordered as ``ngram_sizes`` lists the orders (head-minor), ids before the start
  read the compressed pad id.

`build_peft` reads an ``EngramConfig`` (the object, its ``to_dict()`` or its ``config.json``);
the hasher it returns serves everywhere a preset does (``Decoder``, ``db.stream``,
``prefetch_tokens``, ``engramdb index --preset config.json``). Layer ids are engram-peft's
``target_layers``; the model-level mapping (all target layers) is the one its tables use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.keygen._arith import INT64_MAX, deepseek_primes, wrap_int64
from engramdb.keygen._config import (
    OFFSET_KEYS,
    PRIME_KEYS,
    Config,
    check_constant_layers,
    compressed_vocab,
    deepseek_mult,
    frozen_constants,
    identity,
    pick,
    range_checked,
)
from engramdb.keygen._tables import LayerTables, check_range, to_int64
from engramdb.keygen.kinds import DeepSeekHasher

__all__ = ["KIND", "PeftHasher", "build_peft", "config_dict"]

KIND = "engram-peft"


class PeftHasher(DeepSeekHasher):
    """engram-peft row ids (``NgramHashMapping``): compressed ids, pad fill before the start.

    With tokenizer compression off (``enable_tokenizer_compression=False``) raw ids are the
    hashed ids, as in engram-peft, so ``compressed=False`` needs no token map. ``mask`` (an
    EngramDB extension; engram-peft has none) blanks dead positions as the DeepSeek kinds do.
    """

    def __init__(self, *, raw_is_compressed: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raw_is_compressed = raw_is_compressed
        self.ngram_sizes = next(iter(self._tables.values())).peft_orders

    def _check_encodable(self, compressed: bool, strict: bool) -> None:
        super()._check_encodable(compressed or self.raw_is_compressed, strict)

    def _encode(self, arr: np.ndarray, compressed: bool, strict: bool) -> np.ndarray:
        if self.raw_is_compressed and not compressed:
            if strict and self.id_bound is not None:
                check_range(arr, 0, self.id_bound, "vocabulary")
            return to_int64(arr)
        return super()._encode(arr, compressed, strict)

    def step_bound(self, compressed: bool, strict: bool) -> tuple[bool, int | None]:
        if self.raw_is_compressed and not compressed:
            return True, self.id_bound if strict else None
        return super().step_bound(compressed, strict)

    def _encode_fn(self, compressed: bool, strict: bool) -> Callable[[int], int]:
        if self.raw_is_compressed and not compressed:
            if not strict or self.id_bound is None:
                return identity
            return range_checked(self.id_bound, "vocabulary")
        return super()._encode_fn(compressed, strict)

    def make_step(
        self, lt: LayerTables, *, compressed: bool, local: bool, strict: bool
    ) -> Callable[[int, bool, list[int], list[bool]], np.ndarray]:
        """The one-token step (see `Hasher.make_step`) with engram-peft's windows."""
        self._ready()
        encode = self._encode_fn(compressed, strict)
        n_max = lt.max_ngram
        orders = lt.peft_orders
        assert orders is not None
        mult = [int(m) for m in lt.multipliers]
        heads = lt.heads_per_ngram
        buf = np.empty(lt.n_heads, dtype=np.int64)
        # After j+1 terms (oldest first) the mix is the order-(j+1) window: these views take it.
        emits = [
            [buf[g * heads : (g + 1) * heads] for g, n in enumerate(orders) if n == j + 1]
            for j in range(n_max)
        ]
        plan = tuple(zip(mult, emits, strict=True))
        primes, offsets = lt.primes, lt.offsets
        remainder, add = np.remainder, np.add
        fill = self.fill_id
        lo, hi = -(1 << 63), INT64_MAX

        def step(tid: int, dead: bool, ids: list[int], bars: list[bool]) -> np.ndarray:
            cid = encode(tid)
            # Look-backs, current token first: a dead token and everything older read the fill.
            ctx = [fill if dead else cid]
            blocked = dead
            for k in range(1, n_max):
                blocked = blocked or bars[-k]
                ctx.append(fill if blocked else ids[-k])
            mix = 0
            for j, (mj, views) in enumerate(plan):
                mix ^= ctx[n_max - 1 - j] * mj
                if views:
                    v = mix if lo <= mix <= hi else wrap_int64(mix)
                    for view in views:
                        view.fill(v)
            rows = remainder(buf, primes)
            if not local:
                add(rows, offsets, out=rows)
            if ids:
                del ids[0], bars[0]
                ids.append(cid)
                bars.append(dead)
            return rows

        return step


def config_dict(config: Any) -> Mapping[str, Any]:
    """The fields of an ``EngramConfig`` (object with ``to_dict``, plain attributes or a dict)."""
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        if isinstance(d, Mapping):
            return d
    fields = getattr(config, "__dict__", None)
    if isinstance(fields, Mapping):
        return fields
    raise InvalidArgument(
        f"{KIND} config must be an EngramConfig or its dict, got {type(config).__name__}"
    )


def build_peft(
    config: Any,
    *,
    token_map: Any = None,
    compressed_pad_id: int | None = None,
    constants: Mapping[Any, Any] | None = None,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> PeftHasher:
    """A `PeftHasher` from an engram-peft ``EngramConfig`` (or its dict).

    Reads ``ngram_sizes``, ``n_head_per_ngram``, ``engram_vocab_size_per_ngram``,
    ``target_layers``, ``seed``, ``pad_id`` (raw), ``compressed_vocab_size`` and
    ``enable_tokenizer_compression``. With compression on, give the tokenizer map
    (``token_map=compressor.lookup.numpy()``) or ``compressed_vocab_size`` plus
    ``compressed_pad_id`` (engram-peft's ``compressor.map_id(pad_id)``).
    """
    cfg = Config(KIND, config_dict(config))
    engine = cfg.get("engine", default="deepseek")
    if engine != "deepseek" or cfg.get("table_spec", default=None) == "PLE_QWEN_V1":
        raise InvalidArgument(
            f"{KIND} config has engine {engine!r}: its qwen_ple mapping is the qwen4exp kind"
        )
    orders = cfg.int_list("ngram_sizes")
    heads = cfg.integer("n_head_per_ngram", minimum=1)
    totals = cfg.int_list("engram_vocab_size_per_ngram")
    layer_ids = cfg.int_list("target_layers", "layer_ids")
    seed = cfg.integer("seed", default=0)
    pad_raw = cfg.integer("pad_id", minimum=0)
    cfg_vc = cfg.integer("compressed_vocab_size", default=None, minimum=1)
    compress = bool(cfg.get("enable_tokenizer_compression", default=True))
    embed = cfg.integer("embedding_dim", default=None, minimum=1)
    if not orders or min(orders) < 1:
        raise InvalidArgument(f"{KIND} ngram_sizes must be orders >= 1, got {orders}")
    if len(totals) != len(orders) or min(totals) // heads < 2:
        raise InvalidArgument(
            f"{KIND} engram_vocab_size_per_ngram {totals} needs one total >= 2 * "
            f"n_head_per_ngram ({heads}) per order of ngram_sizes {orders}"
        )
    if not layer_ids or len(set(layer_ids)) != len(layer_ids):
        raise InvalidArgument(f"{KIND} target_layers must be distinct and non-empty: {layer_ids}")
    check_constant_layers(constants, layer_ids)
    n_max = max(orders)

    if token_map is not None and not compress:
        raise InvalidArgument(
            f"{KIND} config has enable_tokenizer_compression=False: drop token_map"
        )
    tmap, vocab_c, pad_c = compressed_vocab(
        token_map, cfg_vc, pad_raw, compressed_pad_id, compress=compress
    )

    derived = deepseek_primes(sorted(layer_ids), [t // heads for t in totals], heads)
    tables: dict[int, LayerTables] = {}
    missing_mult = False
    for layer in layer_ids:
        entry = frozen_constants(constants, layer)
        mult = deepseek_mult(entry, seed, layer, n_max, vocab_c)
        if mult is None:
            missing_mult = True
            mult = [1] * n_max  # placeholder; the hasher refuses until V_c is known
        primes = pick(entry, PRIME_KEYS)
        tables[layer] = LayerTables.build(
            layer,
            n_max,
            heads,
            mult,
            derived[layer] if primes is None else primes,
            pick(entry, OFFSET_KEYS),
            entry.get("table_rows"),
            peft_orders=orders,
        )
    unready = None
    if missing_mult:
        unready = (
            f"{KIND}: the multipliers derive from compressed_vocab_size: put it in the config "
            f"or pass token_map="
        )
    elif pad_c is None:
        unready = f"{KIND}: the compressed pad id is unknown: pass token_map= or compressed_pad_id="
    row_dim = embed // (len(orders) * heads) if embed else None
    full_info = {"row_dim": row_dim, "compressed_vocab_size": vocab_c, "pad_id": pad_raw}
    full_info.update(info or {})
    return PeftHasher(
        raw_is_compressed=not compress,
        kind=KIND,
        token_map=tmap,
        pad_id=pad_raw,
        unready=unready,
        name=name,
        tables=tables,
        max_ngram=n_max,
        heads_per_ngram=heads,
        fill_id=-1 if pad_c is None else pad_c,
        id_bound=vocab_c,
        info=full_info,
    )
