"""The decode API returns exactly keygen + fetch, step by step, for random token streams."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb import keygen
from engramdb.decode import Decoder
from engramdb.errors import InvalidArgument, ReadError, ShapeMismatch
from engramdb.testing.tables import MemoryTable

EOS = 248_044
VOCAB = 248_320


def small_qwen(**over: object) -> keygen.Hasher:
    return keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000, **over)


def build_for(path: Path, h: keygen.Hasher, layer: int, name: str, seed: int) -> np.ndarray:
    rows = h.table_rows(layer)
    full = np.random.default_rng(seed).integers(0, 256, (rows, 160), dtype=np.uint8)
    engramdb.build(path, name, 160, [full], rows_per_badge=128)
    return full


def tokens(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    t = rng.integers(0, VOCAB, shape)
    t[rng.random(shape) < 0.05] = EOS  # segment ends exercise the look-back barrier
    return t


@pytest.mark.parametrize("prefetch", [True, False, "auto"])
@pytest.mark.parametrize("ram_budget", [None, "256K"])
def test_one_sequence_equals_keygen_plus_fetch(
    tmp_path: Path, rng: np.random.Generator, prefetch: bool | str, ram_budget: str | None
) -> None:
    h = small_qwen()
    full = build_for(tmp_path, h, 2, "ple", 1)
    toks = tokens(rng, (300,))
    expect = full[h.row_ids(toks, layer=2)]  # [T, 16, 160]
    with engramdb.open(tmp_path, ram_budget=ram_budget) as db:
        dec = Decoder(db["ple"], h, prefetch=prefetch)
        out = np.empty(dec.out_shape, np.uint8)
        assert out.shape == (16, 160)
        for t in range(toks.size):
            rows = dec.push(int(toks[t]))
            assert np.array_equal(rows[0], h.row_ids(toks[: t + 1], layer=2)[-1])
            dec.fill(out)
            assert np.array_equal(out, expect[t]), f"step {t}"
        if prefetch is True:
            assert dec.prefetched == toks.size
            assert db["ple"].stats()["prefetch"]["submitted"] == toks.size
        if prefetch is False:
            assert dec.prefetched == 0


def test_a_batch_of_sequences_equals_keygen_plus_fetch(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    h = small_qwen()
    full = build_for(tmp_path, h, 2, "ple", 2)
    toks = tokens(rng, (5, 120))
    expect = full[h.row_ids(toks, layer=2)]  # [B, T, 16, 160]
    with engramdb.open(tmp_path) as db:
        dec = Decoder(db["ple"], h, batch=5, prefetch=True)
        out = np.empty(dec.out_shape, np.uint8)
        assert out.shape == (5, 16, 160)
        for t in range(toks.shape[1]):
            dec.push(toks[:, t])
            dec.fill(out)
            assert np.array_equal(out, expect[:, t])
        dec.reset()  # new requests start fresh
        dec.step(toks[:, 0], out)
        assert np.array_equal(out, expect[:, 0])


def test_several_layers_fill_b_l_h_row_bytes(tmp_path: Path, rng: np.random.Generator) -> None:
    h = small_qwen(ple_layer_ids=[2, 5])
    fulls = {lay: build_for(tmp_path, h, lay, f"ple{lay}", lay) for lay in (2, 5)}
    toks = tokens(rng, (3, 60))
    with engramdb.open(tmp_path) as db:
        dec = Decoder({2: db["ple2"], 5: db["ple5"]}, h, batch=3, prefetch=True)
        out = np.empty(dec.out_shape, np.uint8)
        assert out.shape == (3, 2, 16, 160)
        expect = {lay: fulls[lay][h.row_ids(toks, layer=lay)] for lay in (2, 5)}
        for t in range(toks.shape[1]):
            dec.push(toks[:, t])
            dec.fill(out)
            assert np.array_equal(out[:, 0], expect[2][:, t])
            assert np.array_equal(out[:, 1], expect[5][:, t])


def test_bad_use_is_a_typed_error(tmp_path: Path) -> None:
    h = small_qwen()
    build_for(tmp_path, h, 2, "ple", 3)
    engramdb.build(tmp_path, "small", 160, [np.zeros((100, 160), np.uint8)])
    with engramdb.open(tmp_path) as db:
        with pytest.raises(InvalidArgument, match="addresses"):
            Decoder(db["small"], h)
        with pytest.raises(InvalidArgument):
            Decoder(db["ple"], h, prefetch="sometimes")
        dec = Decoder(db["ple"], h, batch=2)
        with pytest.raises(InvalidArgument, match="before push"):
            dec.fill(np.empty(dec.out_shape, np.uint8))
        with pytest.raises(ShapeMismatch):
            dec.push([1, 2, 3])
        dec.push([1, 2])
        with pytest.raises(ShapeMismatch):
            dec.fill(np.empty((2, 16, 161), np.uint8))


def test_a_failed_prefetch_raises_at_fill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = small_qwen()
    build_for(tmp_path, h, 2, "ple", 4)
    with engramdb.open(tmp_path, ram_budget="256K") as db:  # RAM tier: the prefetch thread
        s = db["ple"]

        def broken(ids: np.ndarray) -> int:
            raise ReadError("injected")

        monkeypatch.setattr(s.prefetcher, "_read", broken)
        dec = Decoder(s, h, prefetch=True)
        dec.push(9707)
        assert dec.prefetched == 1, "the step submitted a background read"
        deadline = time.monotonic() + 5
        while s.prefetcher.stats.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(ReadError, match="injected"):
            dec.fill(np.empty(dec.out_shape, np.uint8))


def test_auto_prefetch_follows_the_read_rule(tmp_path: Path, rng: np.random.Generator) -> None:
    """`prefetch="auto"` reads ahead while the table is not known resident, not once it is."""
    import time

    h = small_qwen()
    full = build_for(tmp_path, h, 2, "ple", 5)
    toks = tokens(rng, (40,))
    with engramdb.open(tmp_path) as db:
        s = db["ple"]
        dec = Decoder(s, h)  # a fresh store has not seen the table resident yet
        out = np.empty(dec.out_shape, np.uint8)
        dec.push(int(toks[0]))
        assert dec.prefetched == 1
        dec.fill(out)
        assert np.array_equal(out, full[h.row_ids(toks[:1], layer=2)[0]])
        s.populate()
        time.sleep(0.3)  # the rule re-samples a cold-state batch after 0.25 s
        s.fetch(np.arange(0, s.n_rows, max(1, s.n_rows // 300)))
        # Each step reads ahead exactly when the rule is not in its mapped state. (This VM
        # reclaims idle page-cache pages on its own, and a slow step makes the rule check
        # again, so which steps are resident is not fixed; the coupling is.)
        quiet = 0
        for t in toks[1:]:
            mapped = s.mapped_state()
            before = dec.prefetched
            dec.push(int(t))
            assert (dec.prefetched > before) == (not mapped), "prefetch follows the read rule"
            quiet += mapped
            dec.fill(out)
            while s.prefetcher.busy:  # no read of this step may move the rule meanwhile
                time.sleep(0.001)
        assert quiet >= 1, "resident steps make no thread hand-off"
        assert s.stats()["small_gathers"] > 0


@pytest.mark.parametrize("batch", [None, 3])
def test_decoder_reads_any_row_table(
    tmp_path: Path, rng: np.random.Generator, batch: int | None
) -> None:
    """Tables that are not local have no prefetcher: their rows are read at fill."""
    h = small_qwen()
    full = np.random.default_rng(9).integers(0, 256, (h.table_rows(2), 160), dtype=np.uint8)
    table = MemoryTable(full, name="ple")
    toks = tokens(rng, (3, 40))
    expect = full[h.row_ids(toks, layer=2)]  # [B, T, 16, 160]
    dec = Decoder(table, h, batch=batch)
    out = np.empty(dec.out_shape, np.uint8)
    for t in range(toks.shape[1]):
        dec.push(int(toks[0, t]) if batch is None else toks[:, t])
        dec.fill(out)
        assert np.array_equal(out, expect[0, t] if batch is None else expect[:, t]), f"step {t}"
    assert dec.prefetched == 0
    h2 = small_qwen(ple_layer_ids=[2, 5])
    fulls = {
        lay: np.random.default_rng(lay).integers(0, 256, (h2.table_rows(lay), 160), np.uint8)
        for lay in (2, 5)
    }
    several = Decoder({lay: MemoryTable(f) for lay, f in fulls.items()}, h2, batch=3)
    out = np.empty(several.out_shape, np.uint8)  # [B, L, H, rb]: strided per layer
    for t in range(5):
        several.push(toks[:, t])
        several.fill(out)
        for i, lay in enumerate((2, 5)):
            assert np.array_equal(out[:, i], fulls[lay][h2.row_ids(toks, layer=lay)][:, t])
    with pytest.raises(InvalidArgument, match="local"):
        Decoder(table, h, prefetch=True)
