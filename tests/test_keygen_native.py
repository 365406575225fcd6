"""keygen's compiled loop (``engramdb.keygen._native``): the same row ids and look-back as the
numpy kernel for every hashed kind, barriers and dead positions included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_keygen_props import SETTINGS, _oracle_for, geometries

from engramdb import keygen
from engramdb.errors import ShapeMismatch, TokenIdOutOfRange
from engramdb.keygen import _core, native

built = pytest.mark.skipif(native._native is None, reason="keygen's compiled loop not built")

QWEN_EOS = 248_044

PEFT_CFG = dict(
    compressed_vocab_size=1000,
    engram_vocab_size_per_ngram=[400, 600, 900],
    ngram_sizes=[1, 3, 2],
    n_head_per_ngram=3,
    target_layers=[2, 9],
    pad_id=7,
    seed=1,
    enable_tokenizer_compression=False,
)


def hashers() -> Iterator[tuple[str, keygen.Hasher, bool, int]]:
    """(name, hasher, compressed, token id bound) for every hashed kind."""
    yield (
        "deepseek-demo",
        keygen.preset("deepseek-engram-demo", compressed_vocab_size=500, compressed_pad_id=2),
        True,
        500,
    )
    v41 = keygen.preset("deepseek-v4.1-flash")
    yield "deepseek-v4.1", v41, True, int(v41.id_bound or 0)
    qwen = keygen.preset("qwen3.8-flash-next")
    yield "qwen", qwen, False, int(qwen.id_bound or 0)
    yield "engram-peft", keygen.hasher("engram-peft", PEFT_CFG), False, 1000


KINDS = list(hashers())


def tokens(rng: np.random.Generator, bound: int, shape: tuple[int, ...], eos: bool) -> np.ndarray:
    # a small alphabet part repeats n-grams; Qwen's EOS ends segments mid-batch
    tok = rng.integers(0, bound, size=shape)
    tok[..., ::3] = rng.integers(0, 4, size=tok[..., ::3].shape)
    if eos:
        tok[rng.random(shape) < 0.1] = QWEN_EOS
    return tok


def pushes(
    h: keygen.Hasher, layer: int, compressed: bool, local: bool, toks: np.ndarray, sizes: list[int],
    mask: np.ndarray | None,
) -> tuple[list[np.ndarray], tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    st = h.stream(layer=layer, compressed=compressed, local=local)
    out, t0 = [], 0
    for n in sizes:
        m = None if mask is None else mask[:, t0 : t0 + n]
        out.append(st.push(toks[:, t0 : t0 + n], mask=m))
        t0 += n
    return out, st.history


@built
@pytest.mark.parametrize(("name", "h", "compressed", "bound"), KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "dead"])
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
def test_pushes_equal_the_numpy_kernel_and_the_full_pass(
    name: str,
    h: keygen.Hasher,
    compressed: bool,
    bound: int,
    masked: bool,
    local: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(3)
    sizes = [1, 1, 4, 1, 32, 2, 1, 7, 1]
    for b in (1, 8, 5):
        toks = tokens(rng, bound, (b, sum(sizes)), eos=name == "qwen")
        mask = rng.random(toks.shape) < 0.15 if masked else None
        for layer in h.layers[:2]:
            before = _core.kernel_stats["native_positions"]
            got, hist = pushes(h, layer, compressed, local, toks, sizes, mask)
            # it ran for every position (one-token pushes of a bound batch: its decode step);
            # Qwen (barriers: no decode step) takes the pure-Python step for one sequence's
            ran = sum(n for n in sizes if n > 1) if b == 1 and name == "qwen" else toks.size
            assert _core.kernel_stats["native_positions"] - before == ran
            monkeypatch.setattr(native, "_enabled", False)
            want, want_hist = pushes(h, layer, compressed, local, toks, sizes, mask)
            full = (h.local_ids if local else h.row_ids)(
                toks, layer=layer, compressed=compressed, mask=mask
            )
            monkeypatch.setattr(native, "_enabled", None)
            for g, w in zip(got, want):
                assert g.dtype == np.int64 and np.array_equal(g, w), (b, layer)
            assert np.array_equal(hist[0], want_hist[0]) and np.array_equal(hist[1], want_hist[1])
            assert np.array_equal(np.concatenate(got, axis=1), full), (b, layer)


@built
@pytest.mark.parametrize(("name", "h", "compressed", "bound"), KINDS, ids=[k[0] for k in KINDS])
def test_row_ids_and_long_pushes_equal_the_numpy_kernel(
    name: str, h: keygen.Hasher, compressed: bool, bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(9)
    toks = tokens(rng, bound, (3, 9000), eos=name == "qwen")
    mask = rng.random(toks.shape) < 0.05
    layer = h.layers[-1]
    before = dict(_core.kernel_stats)
    got = h.row_ids(toks, layer=layer, compressed=compressed, mask=mask)
    local = h.local_ids(toks[0], layer=layer, compressed=compressed)
    st = h.stream(layer=layer, compressed=compressed)
    pushed = np.concatenate([st.push(toks[:, :5000]), st.push(toks[:, 5000:])], axis=1)
    served = _core.kernel_stats["native_positions"] - before["native_positions"]
    assert served == 2 * toks.size + toks.shape[1]
    assert _core.kernel_stats["blocks"] == before["blocks"]  # the numpy kernel never ran
    monkeypatch.setattr(native, "_enabled", False)
    want = h.row_ids(toks, layer=layer, compressed=compressed, mask=mask)
    assert _core.kernel_stats["blocks"] > before["blocks"]
    assert np.array_equal(got, want)
    assert np.array_equal(local, h.local_ids(toks[0], layer=layer, compressed=compressed))
    assert np.array_equal(pushed, h.row_ids(toks, layer=layer, compressed=compressed))
    out = np.empty_like(want)
    monkeypatch.setattr(native, "_enabled", None)
    assert h.row_ids(toks, layer=layer, compressed=compressed, mask=mask, out=out) is out
    assert np.array_equal(out, want)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "numpy"])
def test_out_of_range_tokens_raise_before_any_state_changes(
    use_native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_enabled", None if use_native else False)
    h = keygen.preset("deepseek-v4.1-flash")
    st = h.stream(layer=1, compressed=True)
    first = st.push(np.array([[5], [6]]))
    hist = st.history
    bound = int(h.id_bound or 0)
    with pytest.raises(TokenIdOutOfRange, match=str(bound)):
        st.push(np.array([[5], [bound]]))
    assert np.array_equal(st.history[0], hist[0])  # the failed push left the look-back alone
    again = h.stream(layer=1, compressed=True)
    assert np.array_equal(again.push(np.array([[5], [6]])), first)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_install_builds_the_compiled_loop() -> None:
    assert native._native is not None


def test_turned_off_by_environment() -> None:
    code = "from engramdb.keygen import native; print(native.native_enabled())"
    env = {**os.environ, native.NATIVE_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


@built
@given(st.data())
@SETTINGS
def test_wrapping_ids_through_the_loop_equal_the_oracle(data: st.DataObject) -> None:
    """strict=False: huge and negative ids pushed as chunks of a few sequences (the compiled
    loop) hash with int64 wrap and floor modulo, as the spec's per-token oracle says."""
    h, layer = data.draw(geometries())
    big = st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(0, 5) | st.just(h.fill_id)
    n_seq = data.draw(st.integers(1, 3))
    length = data.draw(st.integers(2, 12))
    seqs = [data.draw(st.lists(big, min_size=length, max_size=length)) for _ in range(n_seq)]
    kw = {"compressed": True} if h.kind.startswith("deepseek") else {}
    s = h.stream(layer=layer, strict=False, **kw)
    arr = np.array(seqs, dtype=np.int64)
    cut = data.draw(st.integers(1, length - 1))
    before = _core.kernel_stats["native_positions"]
    got = np.concatenate([s.push(arr[:, :cut]), s.push(arr[:, cut:])], axis=1)
    # every push the loop (one-token pushes of the bound batch: its decode step), except one
    # sequence's one-token pushes of a kind without the decode step (Qwen: the Python step)
    if hasattr(h, "step_bound") or n_seq > 1:
        ran = arr.size
    else:
        ran = sum(n for n in (cut, length - cut) if n > 1)
    assert _core.kernel_stats["native_positions"] - before == ran
    for i, seq in enumerate(seqs):
        assert got[i].tolist() == _oracle_for(h, seq, layer)


@built
def test_layers_past_the_loops_bounds_take_the_numpy_kernel() -> None:
    cfg = {
        "layer_ids": [1],
        "max_ngram_size": native.MAX_NGRAM + 1,
        "n_head_per_ngram": 1,
        "engram_vocab_size": [50] * native.MAX_NGRAM,
        "pad_id": 0,
        "compressed_vocab_size": 40,
    }
    h = keygen.hasher("deepseek-demo", cfg, compressed_pad_id=0)
    toks = np.arange(2 * 40).reshape(2, 40) % 40
    st = h.stream(layer=1, compressed=True)
    before = _core.kernel_stats["native_positions"]
    got = np.concatenate([st.push(toks[:, :3]), st.push(toks[:, 3:])], axis=1)
    assert _core.kernel_stats["native_positions"] == before
    assert np.array_equal(got, h.row_ids(toks, layer=1, compressed=True))


STEP_KINDS = [k for k in KINDS if k[0] != "qwen"]  # Qwen's barriers: no decode step


@built
@pytest.mark.parametrize(
    ("name", "h", "compressed", "bound"), STEP_KINDS, ids=[k[0] for k in STEP_KINDS]
)
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("b", [1, 8])
def test_decode_steps_take_the_compiled_step(
    name: str, h: keygen.Hasher, compressed: bool, bound: int, local: bool, b: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """One-token pushes of a bound batch (contiguous int64 ``[B, 1]``) go to the compiled
    decode step, which advances the look-back in place: rows and look-back equal the numpy
    kernel's and the full pass's; other dtypes and strided ids take the general path."""
    rng = np.random.default_rng(11)
    toks = rng.integers(0, bound, (b, 40))
    layer = h.layers[-1]

    def run() -> tuple[keygen.KeyStream, list[np.ndarray]]:
        st = h.stream(layer=layer, compressed=compressed, local=local)
        got = [st.push(toks[:, :5])]  # a prefill chunk binds the batch
        for t in range(5, 30):
            got.append(st.push(np.ascontiguousarray(toks[:, t : t + 1])))
        for t in range(30, 35):  # int32: the general path
            got.append(st.push(toks[:, t : t + 1].astype(np.int32)))
        wide = np.repeat(toks[:, 35:], 2, axis=1)[:, ::2]  # strided [B, 1] views (B > 1)
        for t in range(wide.shape[1]):
            got.append(st.push(wide[:, t : t + 1]))
        return st, got

    st, got = run()
    assert st.native_steps == (30 if b == 1 else 25) and st.position == 40  # [1, 1]: contiguous
    monkeypatch.setattr(native, "_enabled", False)
    ref, want = run()
    assert ref.native_steps == 0
    full = (h.local_ids if local else h.row_ids)(toks, layer=layer, compressed=compressed)
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and g.shape == w.shape and np.array_equal(g, w)
    assert np.array_equal(np.concatenate(got, axis=1), full)
    assert all(np.array_equal(x, y) for x, y in zip(st.history, ref.history))


@pytest.mark.parametrize("name", [k[0] for k in KINDS])
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
def test_a_push_also_gives_the_local_ids(
    name: str, compiled: bool, local: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``push(..., local_out=)`` writes the per-head local ids (the rows less each head's
    offset) into ``local_out``: in the compiled decode step's own pass where it serves,
    else by a subtraction (a prefill chunk, a scalar, another dtype, the numpy kernel),
    equal to `Hasher.local_ids` of the whole stream; the rows are unchanged."""
    _, h, compressed, bound = next(k for k in KINDS if k[0] == name)
    if not compiled:
        monkeypatch.setattr(native, "_enabled", False)
    rng = np.random.default_rng(5)
    b, layer = 4, h.layers[-1]
    toks = rng.integers(0, bound, (b, 20))
    full_rows = h.row_ids(toks, layer=layer, compressed=compressed)
    full_local = h.local_ids(toks, layer=layer, compressed=compressed)
    st = h.stream(layer=layer, compressed=compressed, local=local)
    lo = np.full((b, 5, st.n_heads), -7, np.int64)
    rows = st.push(toks[:, :5], local_out=lo)  # a prefill chunk
    assert np.array_equal(lo, full_local[:, :5])
    assert np.array_equal(rows, (full_local if local else full_rows)[:, :5])
    step = np.full((b, st.n_heads), -7, np.int64)
    for t in range(5, 15):
        tok = np.ascontiguousarray(toks[:, t : t + 1])
        if t >= 12:
            tok = tok.astype(np.int32)  # the general path
        rows = st.push(tok, local_out=step)
        assert np.array_equal(step, full_local[:, t]), t
        assert np.array_equal(rows[:, 0], (full_local if local else full_rows)[:, t])
    step_kind = name != "qwen"
    assert st.native_steps == (7 if compiled and step_kind and native._native else 0)
    one = h.stream(layer=layer, compressed=compressed)  # one sequence, scalar pushes
    lo1 = np.empty(st.n_heads, np.int64)
    for t in range(4):
        one.push(int(toks[0, t]), local_out=lo1)
        assert np.array_equal(lo1, full_local[0, t])


@pytest.mark.parametrize("compiled", [True, False])
def test_a_bad_local_out_is_refused_before_the_stream_moves(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = keygen.preset("deepseek-engram-demo", compressed_vocab_size=500, compressed_pad_id=2)
    if not compiled:
        monkeypatch.setattr(native, "_enabled", False)
    layer = h.layers[0]
    st = h.stream(layer=layer, compressed=True)
    st.push(np.array([[3, 4], [5, 6]]))
    n = st.n_heads
    ro = np.zeros((2, n), np.int64)
    ro.flags.writeable = False
    bad = [
        np.zeros((2, n), np.int32),  # dtype
        np.zeros((2, n + 1), np.int64),  # size
        np.zeros((2, 2 * n), np.int64)[:, ::2],  # strided
        ro,  # read-only
        [0] * (2 * n),  # not an array
    ]
    for out in bad:
        before, pos = st.history, st.position
        with pytest.raises(ShapeMismatch, match="local_out"):
            st.push(np.array([[7], [8]]), local_out=out)  # type: ignore[arg-type]
        assert st.position == pos
        assert all(np.array_equal(x, y) for x, y in zip(st.history, before))


@built
@pytest.mark.parametrize("bad", [-1, 500, 1 << 40])
def test_a_decode_step_out_of_range_raises_and_changes_nothing(bad: int) -> None:
    h = keygen.preset("deepseek-engram-demo", compressed_vocab_size=500, compressed_pad_id=2)
    st = h.stream(layer=h.layers[0], compressed=True)
    st.push(np.array([[3, 4], [5, 6]]))
    st.push(np.array([[7], [8]]))
    before = st.history
    with pytest.raises(TokenIdOutOfRange, match=str(bad)):
        st.push(np.array([[9], [bad]]))
    assert all(np.array_equal(x, y) for x, y in zip(st.history, before))
    nxt = st.push(np.array([[9], [10]]))
    ref = h.stream(layer=h.layers[0], compressed=True)
    want = ref.push(np.array([[3, 4, 7, 9], [5, 6, 8, 10]]))[:, -1:]
    assert np.array_equal(nxt, want) and st.native_steps == 2


@built
@pytest.mark.parametrize(("name", "h", "compressed", "bound"), KINDS, ids=[k[0] for k in KINDS])
def test_push_native_equals_push_and_declines_without_moving(
    name: str, h: keygen.Hasher, compressed: bool, bound: int
) -> None:
    """`KeyStream.push_native` (the decoder's keygen call, its checks done by the caller):
    rows and local ids equal `push`'s on a twin stream; None, the stream unmoved, before a
    batch is bound, for a shape other than `native_shape`, for an id outside the
    vocabulary (which `push` then raises), and for a kind without a compiled step."""
    rng = np.random.default_rng(3)
    b, layer = 3, h.layers[-1]
    toks = rng.integers(0, bound, (b, 12))
    a = h.stream(layer=layer, compressed=compressed)
    ref = h.stream(layer=layer, compressed=compressed)
    assert a.push_native(np.ascontiguousarray(toks[:, :1]), None) is None and a.position == 0
    a.push(toks[:, :4])
    ref.push(toks[:, :4])
    if name == "qwen":  # no compiled decode step for this kind: the decoder calls `push`
        assert a.native_shape == () and a.push_native(toks[:, 4:5].copy(), None) is None
        return
    assert a.native_shape == (b, 1)
    assert a.push_native(np.ascontiguousarray(toks[:, 4:6]), None) is None and a.position == 4
    lo, lo_ref = np.empty((2, b, a.n_heads), np.int64)
    for t in range(4, 12):
        tok = np.ascontiguousarray(toks[:, t : t + 1])
        got = a.push_native(tok, lo)
        want = ref.push(tok, local_out=lo_ref)
        assert got is not None and np.array_equal(got, want) and np.array_equal(lo, lo_ref)
    assert a.position == ref.position == 12 and a.native_steps == 8
    before = a.history
    bad = np.array([[1], [bound], [2]], np.int64)
    assert a.push_native(bad, None) is None and a.position == 12
    assert all(np.array_equal(x, y) for x, y in zip(a.history, before))
    with pytest.raises(TokenIdOutOfRange, match=str(bound)):
        a.push(bad)
