"""`DecoderProcess`: a `Decoder` whose keygen and reads run in a companion process gives the
same ids and rows as keygen + fetch, raises each step's error at that step's wait, and never
outlives its engine."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_decode import _make_cold, build_for, small_qwen, tokens

import engramdb
from engramdb import decode_companion
from engramdb.decode_process import DecoderProcess
from engramdb.errors import (
    InvalidArgument,
    InvalidDtype,
    ProcessExited,
    ShapeMismatch,
    TokenIdOutOfRange,
)
from engramdb.io.sqpoll import step_compiled

LAYERS = (2, 5)


@pytest.fixture
def two_tables(tmp_path: Path) -> tuple[Path, Any, dict[int, np.ndarray]]:
    h = small_qwen(ple_layer_ids=list(LAYERS))
    fulls = {lay: build_for(tmp_path, h, lay, f"e{lay}", lay) for lay in LAYERS}
    return tmp_path, h, fulls


def _tok(toks: np.ndarray, t: int, batch: int | None) -> Any:
    return int(toks[0, t]) if batch is None else toks[:, t]


@pytest.mark.parametrize("batch", [None, 3])
def test_ids_and_rows_equal_keygen_plus_fetch(
    two_tables: Any, rng: np.random.Generator, batch: int | None, mode: str
) -> None:
    path, h, fulls = two_tables
    toks = tokens(rng, (1 if batch is None else batch, 30))
    with DecoderProcess(path, {lay: f"e{lay}" for lay in LAYERS}, h, batch=batch) as dec:
        assert dec.layers == list(LAYERS)
        rows = dec.prefill(toks[0, :4] if batch is None else toks[:, :4])
        for i, lay in enumerate(LAYERS):
            want = h.row_ids(toks[:, :4], layer=lay)
            assert np.array_equal(rows[i].reshape(want.shape), want)
            buf = np.empty(dec.layer_shape, np.uint8)
            dec.fill(buf, layer=lay)
            assert np.array_equal(buf.reshape(-1), fulls[lay][want].reshape(-1))
        bufs: dict[int, np.ndarray] = {}
        for t in range(4, 30):
            dec.push(_tok(toks, t, batch))
            if not bufs:
                bufs = {lay: np.empty(dec.layer_shape, np.uint8) for lay in LAYERS}
                whole = np.empty(dec.pending_shape, np.uint8)
                assert whole.shape == dec.out_shape
            for i, lay in enumerate(LAYERS):
                want = h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]  # [S, H]
                ids = dec.local_ids(lay)
                assert np.array_equal(ids.reshape(want.shape) + h.offsets(lay), want)
                assert np.array_equal(dec.row_ids(lay).reshape(want.shape), want)
                dec.fill(bufs[lay], layer=lay)
                assert np.array_equal(bufs[lay].reshape(-1), fulls[lay][want].reshape(-1))
                assert dec.filled_out[i] is bufs[lay]
                assert np.array_equal(dec.filled_rows[i].reshape(want.shape), want)  # type: ignore[union-attr]
            if t % 5 == 0:  # every layer into one [.., L, H, rb] buffer
                dec.fill(whole)
                for i, lay in enumerate(LAYERS):
                    part = whole[i] if batch is None else whole[:, i]
                    assert np.array_equal(part, bufs[lay])
        stats = dec.stats()
        assert stats["steps"] == 27  # the prefill and 26 steps
        dec.reset()  # new requests start fresh
        dec.push(_tok(toks, 0, batch))
        dec.fill(bufs[2], layer=2)
        want = h.row_ids(toks[:, :1], layer=2)[:, -1]
        assert np.array_equal(bufs[2].reshape(-1), fulls[2][want].reshape(-1))


def test_cold_rows_are_read_by_the_companion(two_tables: Any, rng: np.random.Generator) -> None:
    """Evicted tables: the companion's decoder prefetches (its step reader), the rows still
    equal the source, and the engine's own handles never read a row."""
    path, h, fulls = two_tables
    toks = tokens(rng, (4, 20))
    with engramdb.open(path) as db:
        if not _make_cold(path, *(db[f"e{lay}"] for lay in LAYERS)):
            pytest.skip("the file system keeps the tables' pages")
        names = {lay: f"e{lay}" for lay in LAYERS}
        opts = {"background_warm": False}
        with DecoderProcess(db, names, h, batch=4, prefetch=True, open_options=opts) as dec:
            dec.push(toks[:, 0])
            bufs = {lay: np.empty(dec.layer_shape, np.uint8) for lay in LAYERS}
            for t in range(20):
                if t:
                    dec.push(toks[:, t])
                for lay in LAYERS:
                    dec.fill(bufs[lay], layer=lay)
                    want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]]
                    assert np.array_equal(bufs[lay], want)
            stats = dec.stats()
        assert stats["prefetched"] == 2 * 20
        assert stats["held_submits"] == 20  # the first layer's reads, then the second's
        # every row came through the companion's step reader; the engine's handles read none
        assert sum(c["step_rows"] for c in stats["counters"]) == 2 * 20 * 4 * h.n_heads
        for n in names.values():
            assert db[n].counters()["step_rows"] == db[n].counters()["rows_fetched"] == 0


def test_a_steps_error_is_raised_at_its_waits_then_steps_go_on(
    two_tables: Any, rng: np.random.Generator, mode: str
) -> None:
    path, h, fulls = two_tables
    toks = tokens(rng, (2, 3))
    with DecoderProcess(path, {lay: f"e{lay}" for lay in LAYERS}, h, batch=2) as dec:
        dec.push(np.array([5, 10**9]))  # the second token is outside the vocabulary
        buf = np.empty(dec.layer_shape, np.uint8)
        for _ in range(2):  # every wait of that step raises it
            with pytest.raises(TokenIdOutOfRange, match="1000000000"):
                dec.fill(buf, layer=2)
        with pytest.raises(TokenIdOutOfRange):
            dec.local_ids(5)
        dec.reset()
        for t in range(3):
            dec.push(toks[:, t])
            dec.fill(buf, layer=5)
            want = fulls[5][h.row_ids(toks[:, : t + 1], layer=5)[:, -1]]
            assert np.array_equal(buf, want)


def test_hand_overs_in_a_row_each_reach_the_keygen(
    two_tables: Any, rng: np.random.Generator, mode: str
) -> None:
    """Two pushes without a fill (the second replaces the pending step; both tokens enter
    the look-back, as with a `Decoder`), and a control message right after a push: the
    companion takes every hand-over's tokens before the next may overwrite them."""
    path, h, fulls = two_tables
    toks = tokens(rng, (2, 40))
    with DecoderProcess(path, {2: "e2"}, h, batch=2) as dec:
        buf = None
        for t in range(0, 40, 2):
            dec.push(toks[:, t])
            dec.push(toks[:, t + 1])
            buf = np.empty(dec.layer_shape, np.uint8) if buf is None else buf
            dec.fill(buf, layer=2)
            want = fulls[2][h.row_ids(toks[:, : t + 2], layer=2)[:, -1]]
            assert np.array_equal(buf, want), t
        assert dec.stats()["steps"] == 40
        dec.push(toks[:, 0])
        dec.reset()  # right after a push: that push is taken first, then forgotten
        dec.push(toks[:, 5])
        dec.fill(buf, layer=2)
        assert np.array_equal(buf, fulls[2][h.row_ids(toks[:, 5:6], layer=2)[:, -1]])


def test_bad_use_is_a_typed_error(two_tables: Any) -> None:
    path, h, _ = two_tables
    with pytest.raises(InvalidArgument, match="no tables"):
        DecoderProcess(path, {}, h, batch=2)
    with pytest.raises(engramdb.errors.TableNotFound):
        DecoderProcess(path, {2: "nope"}, h, batch=2)
    with pytest.raises(InvalidArgument, match="cpus"):
        DecoderProcess(path, {2: "e2"}, h, batch=2, cpus={10_000})
    with pytest.raises(InvalidArgument, match="does not pickle"):
        DecoderProcess(path, {2: "e2"}, lambda: None, batch=2)
    dec = DecoderProcess(path, {lay: f"e{lay}" for lay in LAYERS}, h, batch=2)
    buf = np.empty(dec.layer_shape, np.uint8)
    with pytest.raises(InvalidArgument, match="push"):
        dec.fill(buf, layer=2)
    with pytest.raises(ShapeMismatch, match="expected 2 tokens"):
        dec.push(np.array([1, 2, 3]))
    with pytest.raises(InvalidDtype, match="float"):
        dec.push(np.array([1.0, 2.0]))
    dec.push(np.array([1, 2]))
    with pytest.raises(InvalidArgument, match="not one of"):
        dec.fill(buf, layer=3)
    with pytest.raises(InvalidArgument, match="not one of"):
        dec.local_ids()  # two layers: name one
    with pytest.raises(ShapeMismatch):
        dec.fill(np.empty((2, 16, 159), np.uint8), layer=2)
    with pytest.raises(InvalidArgument, match="one layer's"):
        dec.fill(buf)
    dec.close()
    dec.close()  # twice is fine
    with pytest.raises(InvalidArgument, match="closed"):
        dec.push(np.array([1, 2]))


def test_the_companion_exiting_is_a_typed_error(two_tables: Any, mode: str) -> None:
    path, h, _ = two_tables
    dec = DecoderProcess(path, {2: "e2"}, h, batch=2)
    try:
        os.kill(dec._proc.pid, signal.SIGKILL)
        dec._proc.wait()
        dec.push(np.array([1, 2]))
        with pytest.raises(ProcessExited, match="exited"):
            dec.fill(np.empty(dec.layer_shape, np.uint8), layer=2)
        with pytest.raises(ProcessExited):
            dec.reset()
    finally:
        dec.close()


def test_the_companion_never_outlives_its_decoder(two_tables: Any) -> None:
    """Closed, or dropped without a close, the companion exits (and closes its database)."""
    path, h, _ = two_tables
    dec = DecoderProcess(path, {2: "e2"}, h, batch=2)
    proc = dec._proc
    dec.close()
    assert proc.poll() == 0
    dec = DecoderProcess(path, {2: "e2"}, h, batch=2)
    proc = dec._proc
    del dec
    gc.collect()
    assert proc.poll() == 0


def test_the_compiled_waits() -> None:
    """`wait_word` returns 1 once the word is reached, -1 once the fail word is, 0 after its
    timeout; `publish` stores a word; `wait_pushed` returns the new count, or -1 on STOP."""
    wait, publish = step_compiled("wait_word"), step_compiled("publish")
    pushed, notify = step_compiled("wait_pushed"), step_compiled("notify")
    if wait is None or publish is None or pushed is None or notify is None:
        pytest.skip("engramdb.io._submitter is not built")
    words = np.zeros(64, np.int64)
    addr = words.ctypes.data
    assert wait(addr, 40, 3, 41, 1_000_000) == 0  # 1 ms, nothing published
    publish(addr, 41, 3)
    assert wait(addr, 40, 3, 41, 1_000_000) == -1
    publish(addr, 40, 5)
    assert words[40] == 5
    assert wait(addr, 40, 3, 41, 1_000_000) == 1
    bell = os.eventfd(0, os.EFD_CLOEXEC)
    try:
        assert notify(addr, bell, 2) == 1  # nobody watching: the doorbell rang
        assert pushed(addr, bell, 0, 0, 0) == 2
        os.eventfd_write(bell, decode_companion.STOP)
        assert pushed(addr, bell, 2, 0, 0) == -1
    finally:
        os.close(bell)
