"""Property tests: the vectorised kernel and the one-token path against a per-token oracle.

The oracle below is a literal transcription of the spec's rules (one position at a time,
Python ints, explicit int64 wrap), sharing no code with ``engramdb.keygen``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engramdb import keygen

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _wrap(v: int) -> int:
    return ((v + (1 << 63)) % (1 << 64)) - (1 << 63)


def oracle_rows(
    ids: list[int],
    *,
    rule: str,
    fill: int,
    mult: list[int],
    primes: list[int],
    offsets: list[int],
    heads: int,
    dead: list[bool] | None = None,
) -> list[list[int]]:
    """Global row ids of one sequence, position by position (spec sections 1, 2.3, 3.4)."""
    n = len(mult)
    dead = dead or [False] * len(ids)
    seq = list(ids)
    if rule == "qwen":  # masked positions become EOS before hashing
        seq = [fill if d else t for t, d in zip(seq, dead, strict=True)]
    out = []
    for p in range(len(seq)):
        toks = []
        if rule == "qwen":
            last_eos = max((q for q in range(p) if seq[q] == fill), default=-1)
            seg_start = last_eos + 1
            for k in range(n):
                ok = p - k >= 0 and p - seg_start >= k
                toks.append(seq[p - k] if ok else fill)
        else:  # deepseek: sticky blocking at sequence start or a dead position
            blocked = False
            for k in range(n):
                if p - k < 0 or dead[p - k]:
                    blocked = True
                toks.append(fill if blocked else seq[p - k])
        row = []
        mix = 0
        for k in range(n):
            mix = _wrap(mix ^ _wrap(toks[k] * mult[k]))
            if k == 0:
                continue
            for j in range(heads):
                col = (k - 1) * heads + j
                row.append(mix % primes[col] + offsets[col])
        out.append(row)
    return out


def _oracle_for(h: keygen.Hasher, ids: list[int], layer: int, dead: Any = None) -> list[list[int]]:
    return oracle_rows(
        ids,
        rule="qwen" if h.kind == "qwen4exp" else "deepseek",
        fill=h.fill_id,
        mult=h.multipliers(layer).tolist(),
        primes=h.primes(layer).tolist(),
        offsets=h.offsets(layer).tolist(),
        heads=h.heads_per_ngram,
        dead=None if dead is None else list(dead),
    )


# --- small random geometries ----------------------------------------------------------------
@st.composite
def geometries(draw: st.DrawFn) -> tuple[keygen.Hasher, int]:
    """A small DeepSeek-demo or Qwen hasher (tiny buckets so every id is inspectable)."""
    order = draw(st.integers(2, 4))
    heads = draw(st.integers(1, 3))
    vocab = draw(st.integers(3, 40))
    if draw(st.booleans()):
        layers = draw(st.lists(st.integers(0, 30), min_size=1, max_size=2, unique=True))
        cfg = {
            "layer_ids": layers,
            "max_ngram_size": order,
            "n_head_per_ngram": heads,
            "engram_vocab_size": draw(
                st.lists(st.integers(2, 60), min_size=order - 1, max_size=order - 1)
            ),
            "pad_id": draw(st.integers(0, vocab - 1)),
            "seed": draw(st.integers(0, 5)),
            "compressed_vocab_size": vocab,
        }
        h = keygen.hasher("deepseek-demo", cfg, compressed_pad_id=cfg["pad_id"])
    else:
        cfg = {
            "vocab_size": vocab,
            "ngram_size": order,
            "heads_per_ngram": heads,
            "ngram_vocab_size_base": draw(st.integers(2, 60)),
            "make_ngram_vocab_size_divisible_by": draw(st.sampled_from([1, 4, 128])),
            "eos_token_id": draw(st.integers(0, vocab - 1)),
            "ple_layer_ids": draw(
                st.lists(st.integers(1, 30), min_size=1, max_size=2, unique=True)
            ),
            "seed": draw(st.integers(0, 5)),
        }
        h = keygen.hasher("qwen4exp", cfg)
    return h, draw(st.sampled_from(h.layers))


def _tokens(h: keygen.Hasher, draw: st.DrawFn, max_len: int = 40) -> list[int]:
    bound = h.id_bound
    assert bound is not None
    pool = st.integers(0, bound - 1) | st.just(h.fill_id)  # fill / EOS often
    return draw(st.lists(pool, max_size=max_len))


@given(st.data())
@SETTINGS
def test_row_ids_equal_oracle(data: st.DataObject) -> None:
    h, layer = data.draw(geometries())
    ids = _tokens(h, data.draw)
    dead = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    mask = np.array(dead, dtype=bool)
    kw = {"compressed": True} if h.kind.startswith("deepseek") else {}
    got = h.row_ids(np.array(ids, dtype=np.int64), layer=layer, mask=mask, **kw)
    assert got.shape == (len(ids), h.n_heads)
    assert got.tolist() == _oracle_for(h, ids, layer, dead)
    local = h.local_ids(np.array(ids, dtype=np.int64), layer=layer, mask=mask, **kw)
    assert (local + h.offsets(layer)).tolist() == got.tolist()
    assert bool(np.all((local >= 0) & (local < h.primes(layer))))
    keys = h.keys(np.array(ids, dtype=np.int64), mask=mask, **kw)
    assert h.hash_keys(keys, layer=layer).tolist() == got.tolist()


@given(st.data())
@SETTINGS
def test_out_of_range_ids_wrap_like_int64(data: st.DataObject) -> None:
    """strict=False: huge and negative ids hash with int64 wrap + floor modulo (HF behaviour)."""
    h, layer = data.draw(geometries())
    big = st.integers(-(1 << 63), (1 << 63) - 1)
    ids = data.draw(st.lists(big | st.integers(0, 5), min_size=1, max_size=12))
    kw = {"compressed": True} if h.kind.startswith("deepseek") else {}
    arr = np.array(ids, dtype=np.int64)
    want = _oracle_for(h, ids, layer)
    assert h.row_ids(arr, layer=layer, strict=False, **kw).tolist() == want
    s = h.stream(layer=layer, strict=False, **kw)
    assert [s.push(t).tolist() for t in ids] == want


@given(st.data())
@SETTINGS
def test_chunked_and_streamed_equal_full(data: st.DataObject) -> None:
    h, layer = data.draw(geometries())
    ids = _tokens(h, data.draw, max_len=60)
    dead = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    mask = np.array(dead, dtype=bool)
    kw = {"compressed": True} if h.kind.startswith("deepseek") else {}
    full = h.row_ids(np.array(ids, dtype=np.int64), layer=layer, mask=mask, **kw)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    bounds = [0, *cuts, len(ids)]
    s = h.stream(layer=layer, **kw)
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b - a == 1 and data.draw(st.booleans()):  # a bare int takes the one-token path
            parts.append(s.push(int(ids[a]), mask=bool(dead[a]))[None, :])
        else:
            parts.append(s.push(np.array(ids[a:b], dtype=np.int64), mask=mask[a:b]))
    got = np.concatenate(parts) if parts else np.zeros((0, h.n_heads), np.int64)
    assert got.tolist() == full.tolist()
    assert s.position == len(ids)


@given(st.data())
@SETTINGS
def test_batched_rows_are_independent_sequences(data: st.DataObject) -> None:
    h, layer = data.draw(geometries())
    n_seq = data.draw(st.integers(1, 4))
    length = data.draw(st.integers(0, 20))
    bound = h.id_bound
    assert bound is not None
    batch = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(0, bound - 1), min_size=length, max_size=length),
                min_size=n_seq,
                max_size=n_seq,
            )
        ),
        dtype=np.int64,
    ).reshape(n_seq, length)
    kw = {"compressed": True} if h.kind.startswith("deepseek") else {}
    got = h.row_ids(batch, layer=layer, **kw)
    assert got.shape == (n_seq, length, h.n_heads)
    for b in range(n_seq):
        assert got[b].tolist() == h.row_ids(batch[b], layer=layer, **kw).tolist()
    # the same in chunks through a batched stream, one token per push at the end
    s = h.stream(layer=layer, **kw)
    cut = data.draw(st.integers(0, length))
    parts = [s.push(batch[:, :cut])] + [s.push(batch[:, t : t + 1]) for t in range(cut, length)]
    assert np.concatenate(parts, axis=1).tolist() == got.tolist()


def test_kernel_block_boundaries_and_uint32_input(rng: np.random.Generator) -> None:
    """Sequences longer than a kernel block, with EOS / dead runs straddling block edges."""
    h = keygen.hasher(
        "qwen4exp",
        {
            "vocab_size": 50,
            "ngram_size": 4,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 30,
            "eos_token_id": 7,
            "ple_layer_ids": [3],
        },
    )
    n = 2 * keygen.BLOCK_TOKENS + 17
    ids = rng.integers(0, 50, size=n)
    ids[keygen.BLOCK_TOKENS - 1] = 7
    want = _oracle_for(h, ids.tolist(), 3)
    assert h.row_ids(ids.astype(np.uint32)).tolist() == want
    batch = np.stack([ids, ids[::-1].copy()])
    got = h.row_ids(batch)
    assert got[1].tolist() == _oracle_for(h, ids[::-1].tolist(), 3)
    ds = keygen.preset("deepseek-v4.1-flash")
    cids = rng.integers(0, 99_092, size=n)
    dead = rng.random(n) < 0.01
    dead[keygen.BLOCK_TOKENS - 2 : keygen.BLOCK_TOKENS + 1] = True
    for layer in ds.layers:
        full = ds.row_ids(cids, layer=layer, compressed=True, mask=dead)
        assert full.tolist() == _oracle_for(ds, cids.tolist(), layer, dead.tolist())


def test_out_buffer_is_used(rng: np.random.Generator) -> None:
    h = keygen.preset("qwen3.8-flash-next")
    ids = rng.integers(0, 248_320, size=(3, 50))
    out = np.empty((3, 50, 16), dtype=np.int64)
    res = h.row_ids(ids, out=out)
    assert res is out
    assert out.tolist() == h.row_ids(ids).tolist()


@pytest.mark.parametrize(
    "push",
    [
        lambda s, t: s.push(t),
        lambda s, t: s.push(np.int32(t)),
        lambda s, t: s.push(np.array(t)),
        lambda s, t: s.push(np.array([t]))[0],
        lambda s, t: s.push([t])[0],
    ],
)
def test_one_token_input_forms(push: Any, rng: np.random.Generator) -> None:
    h = keygen.preset("deepseek-v4.1-flash")
    ids = rng.integers(0, 99_092, size=10).tolist()
    want = h.row_ids(ids, layer=14, compressed=True)
    s = h.stream(layer=14, compressed=True)
    got = np.stack([push(s, t) for t in ids])
    assert got.tolist() == want.tolist()
    assert s.fast_steps == 10 and s.batched_pushes == 0
    ids_hist, bar_hist = s.history
    assert ids_hist.tolist() == ids[-3:] and not bar_hist.any()
