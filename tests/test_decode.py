"""The decode API returns exactly keygen + fetch, step by step, for random token streams."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb import keygen
from engramdb.decode import Decoder
from engramdb.errors import InvalidArgument, ReadError, ShapeMismatch, TruncatedFile
from engramdb.testing.pages import drop_mapped_pages, evict, resident_pages
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


def wait_mapped(s: Any) -> None:
    """Fetch spread rows until the table's read rule is in its mapped state (a busy machine
    may make it suspect); skip the test if it never gets there."""
    for _ in range(20):
        s.fetch(np.arange(0, s.n_rows, max(1, s.n_rows // 300)))
        if s.mapped_state():
            return
        time.sleep(0.3)
    pytest.skip("the read rule did not reach its mapped state")


@pytest.mark.parametrize("prefetch", [True, False, "auto"])
@pytest.mark.parametrize("ram_budget", [None, "256K"])
def test_one_sequence_equals_keygen_plus_fetch(
    tmp_path: Path, rng: np.random.Generator, prefetch: bool | str, ram_budget: str | None
) -> None:
    h = small_qwen()
    full = build_for(tmp_path, h, 2, "ple", 1)
    toks = tokens(rng, (300,))
    expect = full[h.row_ids(toks, layer=2)]  # [T, 16, 160]
    # no background warm: the table stays cold, so every prefetched step is a cold read (the
    # warm of this small table could finish mid-loop and move later steps to the mapping)
    with engramdb.open(tmp_path, ram_budget=ram_budget, background_warm=False) as db:
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
            st = db["ple"].stats()
            if ram_budget is None:  # one mapped array: the decoder's step reader read each step
                assert st["step_rows"] == toks.size * 16
                assert st["step_device_bytes"] >= toks.size * 16 * 160
                assert "prefetch" not in st
            else:  # a RAM tier: the table's prefetcher admits the rows
                assert st["prefetch"]["submitted"] == toks.size
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


def _make_cold(db_path: Path, *stores: Any) -> bool:
    """Drop the tables' pages (our mappings, then the page cache); False if the filesystem
    keeps them."""
    for s in stores:
        drop_mapped_pages(s.array())
        for sh in s.info.shards:
            evict(db_path / sh.path)
    probe = stores[0].array()
    addrs = probe.ctypes.data + np.arange(0, probe.shape[0], 97) * probe.shape[1]
    return bool(resident_pages(addrs).mean() < 0.5)


@pytest.mark.parametrize("batch", [None, 3])
def test_auto_keeps_prefetching_a_cold_table_despite_its_own_prefetches(
    tmp_path: Path, rng: np.random.Generator, batch: int | None
) -> None:
    """The auto rule judges residency from rows it has not prefetched: its own prefetched
    fills (which leave those rows resident, and which used to flip the read rule into its
    mapped state) never switch prefetch off on a cold table; a resident table does."""
    h = small_qwen(ple_layer_ids=[2, 5])
    fulls = {lay: build_for(tmp_path, h, lay, f"ple{lay}", lay) for lay in (2, 5)}
    n = 30
    toks = tokens(rng, (3 if batch else 1, n))
    # No background warm: the table must stay cold for the test (the memory policy would
    # otherwise read it in sequentially after the first cold read, as it should).
    with engramdb.open(tmp_path, background_warm=False) as db:
        stores = {2: db["ple2"], 5: db["ple5"]}
        if not _make_cold(tmp_path, *stores.values()):
            pytest.skip("this filesystem does not drop cached pages on request")
        dec = Decoder(stores, h, batch=batch, auto_recheck_s=0.0)  # judge every step
        out = np.empty(dec.out_shape, np.uint8)
        served = 0
        for t in range(n):
            g0 = dec.kept_fills
            dec.push(toks[:, t] if batch else int(toks[0, t]))
            dec.fill(out)
            for i, lay in enumerate((2, 5)):
                want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]]
                assert np.array_equal(out[:, i] if batch else out[i], want if batch else want[0])
            if dec.kept_fills > g0:
                # Served from its prefetch. A buffered prefetch leaves those rows resident, so
                # sampling them (what the read rule's sample did) would call the table
                # resident; the step reader's O_DIRECT reads leave the page cache alone.
                rows = dec.filled_rows[0]
                assert rows is not None
                step_read = stores[2].counters()["step_rows"] > 0
                assert step_read or dec.rule.rows_resident(stores[2], rows.reshape(-1))
                served += 1
        assert served > 0
        # The new rows of each step were cold when judged (random rows of a cold table),
        # so every step of every layer prefetched.
        assert dec.prefetched == 2 * n
        assert dec.auto_checks >= 2 * n
        assert dec.kept_fills >= served  # served from the rows its prefetches read
        for s in stores.values():
            s.populate()
        # a gather a busy machine preempts looks like one that faulted (prefetch then stays on
        # for `fault_s`, rightly for real faults): this part tests the residency judgement
        dec.rule.fault_s = 0.0
        before = dec.prefetched
        quiet = 0
        for t in range(n):
            b0 = dec.prefetched
            dec.push(toks[:, t] if batch else int(toks[0, t]))
            dec.fill(out)
            quiet += dec.prefetched == b0
        # (This VM may reclaim idle pages on its own; most steps find the rows resident.)
        assert quiet >= n // 2, "a resident table is read without a thread hand-off"
        assert dec.prefetched - before <= 2 * n - quiet


def test_auto_prefetches_while_the_background_warm_reads(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a table's background warm is still reading it, a sample of resident rows says
    little about the rest of a step's rows: the auto rule prefetches every step; once the
    pass is over, a resident table is read without prefetches."""
    h = small_qwen()
    full = build_for(tmp_path, h, 2, "ple", 5)
    n = 20
    toks = tokens(rng, (1, n))
    with engramdb.open(tmp_path, background_warm=False) as db:
        s = db["ple"]
        s.populate()  # every row resident: on its own the rule would not prefetch
        warming = [True]
        monkeypatch.setattr(s, "warming", lambda: warming[0])
        dec = Decoder({2: s}, h, auto_recheck_s=0.0)
        out = np.empty(dec.out_shape, np.uint8)
        for t in range(n):
            dec.push(int(toks[0, t]))
            dec.fill(out)
            want = full[h.row_ids(toks[:, : t + 1], layer=2)[0, -1]]
            assert np.array_equal(out.reshape(want.shape), want)
        assert dec.prefetched == n
        warming[0] = False
        before = dec.prefetched
        for t in range(n):
            dec.push(int(toks[0, t]))
            dec.fill(out)
        assert dec.prefetched - before <= n // 2  # (this VM may reclaim idle pages)


def test_auto_turns_prefetch_back_on_when_the_read_rule_sees_faults(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    h = small_qwen()
    build_for(tmp_path, h, 2, "ple", 5)
    # no background warm: the slow-batch reports below would start one, which would read the
    # evicted rows back in under the test
    with engramdb.open(tmp_path, background_warm=False) as db:
        s = db["ple"]
        s.populate()
        dec = Decoder(s, h, auto_recheck_s=3600.0)  # judged once, then only by the trigger
        out = np.empty(dec.out_shape, np.uint8)
        dec.push(1)
        dec.fill(out)
        if dec.prefetched:
            pytest.skip("the populated table was not resident (memory pressure)")
        wait_mapped(s)
        dec.push(2)
        assert dec.prefetched == 0
        dec.fill(out)
        auto = s.backend
        assert auto is not None
        auto.feedback(auto.mapped, 16, 1.0)  # what a page-faulting mapped gather reports
        checks = dec.auto_checks
        dec.push(3)
        assert dec.auto_checks == checks + 1, "a suspected fault makes the push check at once"
        assert dec.prefetched == 0, "the rows are resident: a slow gather alone switches nothing"
        dec.fill(out)
        drop_mapped_pages(s.array())
        for sh in s.info.shards:
            evict(tmp_path / sh.path)
        auto.feedback(auto.mapped, 16, 1.0)
        dec.push(4)
        if dec.prefetched == 0:
            pytest.skip("this filesystem does not drop cached pages on request")
        assert dec.prefetched == 1, "evicted rows: the immediate check turns prefetch on"
        dec.fill(out)


@pytest.mark.parametrize("batch", [None, 4])
def test_prefill_equals_pushing_one_by_one(
    tmp_path: Path, rng: np.random.Generator, batch: int | None
) -> None:
    h = small_qwen(ple_layer_ids=[2, 5])
    fulls = {lay: build_for(tmp_path, h, lay, f"ple{lay}", lay) for lay in (2, 5)}
    toks = tokens(rng, (batch or 1, 40))
    with engramdb.open(tmp_path) as db:
        stores = {2: db["ple2"], 5: db["ple5"]}
        for prefetch in (True, False, "auto"):
            dec = Decoder(stores, h, batch=batch, prefetch=prefetch)
            prompt = toks[:, :32] if batch else toks[0, :32]
            rows = dec.prefill(prompt)
            assert dec.pending_shape == dec.prefill_shape(32)
            out = np.empty(dec.pending_shape, np.uint8)
            dec.fill(out)
            for i, lay in enumerate((2, 5)):
                full_rows = h.row_ids(toks, layer=lay)  # [B, T, H]
                assert np.array_equal(rows[i], full_rows[:, :32] if batch else full_rows[0, :32])
                want = fulls[lay][full_rows[:, :32]]  # [B, 32, H, rb]
                got = out[:, :, i] if batch else out[None, :, i]
                assert np.array_equal(got, want)
            step = np.empty(dec.out_shape, np.uint8)
            for t in range(32, 40):  # decode continues the prompt's look-back
                dec.push(toks[:, t] if batch else int(toks[0, t]))
                dec.fill(step)
                for i, lay in enumerate((2, 5)):
                    want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]]
                    assert np.array_equal(
                        step[:, i] if batch else step[i], want if batch else want[0]
                    )
    with engramdb.open(tmp_path) as db:  # one layer at a time, right before it runs
        dec = Decoder({2: db["ple2"], 5: db["ple5"]}, h, batch=batch)
        out = np.zeros(dec.out_shape, np.uint8)
        dec.push(toks[:, 0] if batch else int(toks[0, 0]))
        dec.fill(out, layer=5)
        assert dec.filled_rows[0] is None and dec.filled_rows[1] is not None
        lead = (slice(None),) if batch else ()
        assert not out[(*lead, 0)].any(), "layer 2's slice is not written yet"
        want5 = fulls[5][h.row_ids(toks[:, :1], layer=5)[:, -1]]
        assert np.array_equal(out[(*lead, 1)], want5 if batch else want5[0])
        dec.fill(out, layer=2)
        want2 = fulls[2][h.row_ids(toks[:, :1], layer=2)[:, -1]]
        assert np.array_equal(out[(*lead, 0)], want2 if batch else want2[0])
        with pytest.raises(InvalidArgument):
            dec.fill(out, layer=7)
    with engramdb.open(tmp_path) as db:
        one = Decoder(db["ple2"], h, layer=2)
        one.prefill(toks[0, :5])
        with pytest.raises(ShapeMismatch):
            one.fill(np.empty(one.out_shape, np.uint8))  # a prefill fills [T, H, rb]
        with pytest.raises(ShapeMismatch):
            one.prefill(toks[:, :5].reshape(1, 1, -1))
        with pytest.raises(ShapeMismatch):
            one.prefill(np.zeros(0, np.int64))


def test_compressed_option_takes_compressed_ids(tmp_path: Path, rng: np.random.Generator) -> None:
    cfg = dict(
        engram_vocab_size_per_ngram=[3000, 3000],
        ngram_sizes=[2, 3],
        n_head_per_ngram=2,
        target_layers=[1],
        pad_id=3,
    )
    lookup = rng.integers(0, 500, 2000)
    lookup[:500] = np.arange(500)
    with_map = keygen.hasher("engram-peft", cfg, token_map=lookup)
    rows = with_map.table_rows(1)
    full = np.random.default_rng(4).integers(0, 256, (rows, 32), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 32, [full])
    raw = rng.integers(0, 2000, 50)
    with engramdb.open(tmp_path) as db:
        a = Decoder(db["t"], with_map)
        b = Decoder(db["t"], with_map, compressed=True)
        oa, ob = np.empty(a.out_shape, np.uint8), np.empty(b.out_shape, np.uint8)
        for t in raw:
            a.step(int(t), oa)
            b.step(int(lookup[t]), ob)
            assert np.array_equal(oa, ob)
        assert np.array_equal(oa, full[with_map.row_ids(raw, layer=1)[-1]])
        no_map = keygen.hasher(
            "engram-peft", {**cfg, "compressed_vocab_size": 500}, compressed_pad_id=int(lookup[3])
        )
        with pytest.raises(InvalidArgument, match="compression map"):
            Decoder(db["t"], no_map)
        c = Decoder(db["t"], no_map, compressed=True)
        oc = np.empty(c.out_shape, np.uint8)
        for t in raw:
            c.step(int(lookup[t]), oc)
        assert np.array_equal(oc, oa)


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


@pytest.mark.parametrize("layers", [(2,), (2, 5)])
def test_fills_of_attached_tables_check_truncation(
    tmp_path: Path, rng: np.random.Generator, layers: tuple[int, ...]
) -> None:
    """Attached tables (one layer: the table's small gather; several: the direct fill, one
    take from each source's mapping) check their sources' sizes before every fill:
    truncated under the decoder, the next fill raises `TruncatedFile` naming the file,
    never a SIGBUS or a wrong row."""
    h = small_qwen(ple_layer_ids=list(layers))
    fulls = {}
    for lay in layers:
        fulls[lay] = np.random.default_rng(lay).integers(
            0, 256, (h.table_rows(lay), 160), dtype=np.uint8
        )
        fulls[lay].tofile(tmp_path / f"rows{lay}.bin")
        engramdb.attach(tmp_path / "db", f"e{lay}", [tmp_path / f"rows{lay}.bin"], row_bytes=160)
    toks = tokens(rng, (1, 20))
    with engramdb.open(tmp_path / "db", background_warm=False) as db:
        for lay in layers:
            db[f"e{lay}"].populate()
        dec = Decoder({lay: db[f"e{lay}"] for lay in layers}, h, prefetch=False)
        out = np.empty(dec.out_shape, np.uint8)
        for t in range(10):
            dec.push(int(toks[0, t]))
            dec.fill(out)
            for i, lay in enumerate(layers):
                want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[0, -1]]
                assert np.array_equal(out if len(layers) == 1 else out[i], want)
        if len(layers) > 1:
            assert dec.direct_fills > 0
        os.truncate(tmp_path / f"rows{layers[-1]}.bin", 4096)
        dec.push(int(toks[0, 10]))
        with pytest.raises(TruncatedFile, match=f"rows{layers[-1]}.bin"):
            dec.fill(out)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("batch", [None, 3])
def test_direct_fills_into_layer_slices_equal_keygen_plus_fetch(
    tmp_path: Path, rng: np.random.Generator, prefetch: bool, batch: int | None
) -> None:
    """Resident tables: `fill(layer=)` gathers each layer's rows straight into its strided
    slice of ``[B, L, H, rb]`` (prefill ``[B, T, L, H, rb]``), bytes equal to the tables."""
    h = small_qwen(ple_layer_ids=[2, 5])
    fulls = {lay: build_for(tmp_path, h, lay, f"e{lay}", lay) for lay in h.layers}
    seqs = 1 if batch is None else batch
    toks = tokens(rng, (seqs, 40))
    with engramdb.open(tmp_path) as db:
        for lay in h.layers:
            db[f"e{lay}"].populate()
        dec = Decoder({lay: db[f"e{lay}"] for lay in h.layers}, h, batch=batch, prefetch=prefetch)
        pre = np.empty(dec.prefill_shape(8), np.uint8)
        dec.prefill(toks[0, :8] if batch is None else toks[:, :8])
        for lay in reversed(h.layers):  # any order, one layer at a time
            dec.fill(pre, layer=lay)
        for i, lay in enumerate(h.layers):
            want = fulls[lay][h.row_ids(toks[:, :8], layer=lay)]  # [S, 8, H, rb]
            got = pre[..., i, :, :] if batch is not None else pre[:, i][None]
            assert np.array_equal(got, want)
        out = np.empty(dec.out_shape, np.uint8)
        for t in range(8, 40):
            dec.push(int(toks[0, t]) if batch is None else toks[:, t])
            for lay in h.layers:
                dec.fill(out, layer=lay)
            for i, lay in enumerate(h.layers):
                want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]]  # [S, H, rb]
                got = out[:, i] if batch is not None else out[i][None]
                assert np.array_equal(got, want), f"step {t} layer {lay}"
        # without prefetch the direct path served (resident tables); with it, every prefetch
        # was either taken from the rows it read (kept on its ticket) or, when the step came
        # before the worker reached it, withdrawn and read at fill
        if prefetch:
            assert dec.prefetched == 2 * 33  # prefill and 32 pushes, two layers each
            assert dec.kept_fills + dec.withdrawn_fills == dec.prefetched
            assert dec.direct_fills == 0
        else:
            assert dec.direct_fills > 0 and dec.prefetched == 0


def test_a_residency_sample_spreads_over_positions_not_one_head(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """The `auto` rule's sample of a step's rows (`LocalTable.rows_resident`) spreads over
    positions: a prompt's ids ``[B, T, H]`` whose first position is one pad row in every
    sequence (resident: every prompt reads it) and cold rows elsewhere are cold, not
    resident. A fixed stride of a multiple of B * H sampled that one row eight times."""
    rows, rb = 1 << 16, 160
    engramdb.build(tmp_path, "t", rb, [rng.integers(0, 256, (rows, rb), dtype=np.uint8)])
    with engramdb.open(tmp_path, background_warm=False) as db:
        st = db["t"]
        b, t, h = 8, 8, 16
        ids = rng.integers(rows // 2, rows, (b, t, h)).astype(np.int64)  # far from row 0
        ids[:, 0, :] = 0  # every sequence's first position: the pad row
        for p in tmp_path.rglob("*.edb"):
            evict(p)
        drop_mapped_pages(st.array())
        st.gather(np.zeros(1, np.int64), np.empty((1, rb), np.uint8))  # the pad row's page
        assert st.rows_resident(np.zeros(1, np.int64))
        if st.rows_resident(ids[:, 1:].reshape(-1)):
            pytest.skip("this filesystem does not drop cached pages on request")
        assert not st.rows_resident(ids.reshape(-1))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("batch", [None, 3])
def test_layer_fills_of_a_step_buffer_take_the_quick_path(
    tmp_path: Path,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    compiled: bool,
    batch: int | None,
) -> None:
    """Once a step buffer has been filled, each one-layer fill of a resident table without a
    prefetch is one gather into the layer's slice (`Decoder._take_layer`; compiled, or
    ``np.take`` without the loop), the attached source's size checked first: bytes equal to
    the sources, the general path not taken, and a source truncated under it raises
    `TruncatedFile` naming that file (the other layer still fills)."""
    h = small_qwen(ple_layer_ids=[2, 5])
    fulls = {}
    for lay in h.layers:
        fulls[lay] = np.random.default_rng(lay).integers(
            0, 256, (h.table_rows(lay), 160), dtype=np.uint8
        )
        fulls[lay].tofile(tmp_path / f"rows{lay}.bin")
        engramdb.attach(tmp_path / "db", f"e{lay}", [tmp_path / f"rows{lay}.bin"], row_bytes=160)
    seqs = 1 if batch is None else batch
    toks = tokens(rng, (seqs, 30))
    # the mmap backend: on a loaded machine a gather slow enough to look like faults would
    # turn `auto`'s read rule off the mapping for a while (tested elsewhere, not here)
    with engramdb.open(tmp_path / "db", backend="mmap", background_warm=False) as db:
        for lay in h.layers:
            db[f"e{lay}"].populate()
        dec = Decoder({lay: db[f"e{lay}"] for lay in h.layers}, h, batch=batch, prefetch=False)
        if not compiled:
            dec._grid = None
        out = np.empty(dec.out_shape, np.uint8)

        def step(t: int) -> None:
            dec.push(int(toks[0, t]) if batch is None else toks[:, t])
            for lay in h.layers:
                dec.fill(out, layer=lay)

        step(0)  # the buffer's first fill: the general path
        general = []
        monkeypatch.setattr(dec, "_fill_direct", lambda *a: general.append(a) or False)
        before = dec.direct_fills
        for t in range(1, 25):
            step(t)
            for i, lay in enumerate(h.layers):
                want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]]  # [S, H, rb]
                got = out[:, i] if batch is not None else out[i][None]
                assert np.array_equal(got, want), f"step {t} layer {lay}"
        assert general == [] and dec.direct_fills - before == 2 * 24
        monkeypatch.undo()
        os.truncate(tmp_path / "rows5.bin", 4096)
        dec.push(int(toks[0, 25]) if batch is None else toks[:, 25])
        dec.fill(out, layer=2)
        want = fulls[2][h.row_ids(toks[:, :26], layer=2)[:, -1]]
        assert np.array_equal(out[:, 0] if batch is not None else out[0][None], want)
        with pytest.raises(TruncatedFile, match="rows5.bin"):
            dec.fill(out, layer=5)


@contextmanager
def _resident_decoder(tmp_path: Path, recheck_s: float) -> Iterator[tuple[Any, Decoder, Any]]:
    """A one-layer table built, opened without background warm, populated and served from
    its mapping; a `Decoder` over it (``auto_recheck_s``) and a buffer for its fills."""
    h = small_qwen()
    build_for(tmp_path, h, 2, "ple", 5)
    with engramdb.open(tmp_path, background_warm=False) as db:
        s = db["ple"]
        s.populate()
        dec = Decoder(s, h, auto_recheck_s=recheck_s)
        out = np.empty(dec.out_shape, np.uint8)
        wait_mapped(s)
        yield s, dec, out


def _fill_faults(rule: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[int]]:
    """``rule.faulted`` as it was, and a list of the faults reported through it from now on
    (a fill slow on a busy machine reports one, which ends a quiet window early)."""
    fault = rule.faulted
    by_fills: list[int] = []
    monkeypatch.setattr(rule, "faulted", lambda i: (by_fills.append(i), fault(i)))
    return fault, by_fills


def test_a_faulting_fill_ends_the_rules_quiet_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefetch judged off, no recheck due and the read rule cleanly mapped: a push asks the
    table nothing (the rule's quiet window) until a fill reports faults (`faulted`). The next
    push then looks again: rows still resident (minor faults: the fills keep them) start no
    prefetch; rows found cold (the table evicted) are read ahead."""
    with _resident_decoder(tmp_path, 3600.0) as (s, dec, out):
        dec.push(1)
        dec.fill(out)
        if dec.prefetched or not s.mapped_state():
            pytest.skip("the populated table was not resident (memory pressure)")
        fault, by_fills = _fill_faults(dec.rule, monkeypatch)
        asked: list[int] = []
        monkeypatch.setattr(s, "warming", lambda: asked.append(1) or False)
        # a window the store ended (its read rule left its mapped state: a fill sampled
        # slow on a busy machine) rightly asks again too
        ended: list[int] = []
        quiet = dec.rule.quiet

        def spy(i: int, store: Any, now: float) -> bool:
            q = quiet(i, store, now)
            if not q and now < dec.rule.quiet_until[i]:
                ended.append(i)
            return q

        monkeypatch.setattr(dec.rule, "quiet", spy)
        for attempt in range(6):  # again where a fault or the store ended the window meanwhile
            by_fills.clear()
            if attempt:  # the look that fault asked for opens a new quiet window
                dec.push(1)
                dec.fill(out)
            asked.clear()
            ended.clear()
            for t in range(2, 8):
                dec.push(t)
                dec.fill(out)
            if not by_fills and not ended:
                break
        else:
            pytest.skip("the fills or the read rule kept ending the window (a busy machine)")
        assert asked == [] and dec.prefetched == 0
        fault(0)
        dec.push(9)
        assert asked == [1] and dec.prefetched == 0  # looked; resident: no prefetcher thread
        dec.fill(out)
        drop_mapped_pages(s.array())
        for sh in s.info.shards:
            evict(tmp_path / sh.path)
        dec.rule.recheck_s = 0.0  # the next look samples the rows
        fault(0)
        dec.push(10)
        if not dec.rule.cold[0]:
            pytest.skip("the evicted table stayed resident")
        assert dec.prefetched == 1 and asked == [1, 1]
        dec.fill(out)


def test_an_off_layers_rechecks_space_out_while_its_rows_stay_resident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm layer judged off is checked again after ``recheck_s``, then after twice that
    while each check finds its rows resident, up to 16 times; a fault starts it over."""
    with _resident_decoder(tmp_path, 0.02) as (s, dec, out):
        rule = dec.rule
        fault, by_fills = _fill_faults(rule, monkeypatch)
        tok = iter(range(1, 1000))

        def step() -> float:
            """A push and fill once the layer's quiet window is over; the new window in
            units of ``recheck_s``."""
            time.sleep(max(0.0, rule.quiet_until[0] - time.monotonic()) + 0.002)
            dec.push(next(tok))
            dec.fill(out)
            return round((rule.quiet_until[0] - rule.at[0]) / rule.recheck_s, 6)

        def windows(n: int, restart: bool) -> list[float]:
            """``n`` steps' windows (after a fault, where ``restart``); again from a fault
            where a fill reported one or the table's read rule asked for a look meanwhile
            (`hints`: it left its mapped state, a fill sampled slow on a busy machine)."""
            for _ in range(6):
                if restart:
                    fault(0)
                by_fills.clear()
                hints = rule.hints
                got = [step() for _ in range(n)]
                if not by_fills and rule.hints == hints:
                    return got
                restart = True
            pytest.skip("the fills or the read rule kept asking for looks (a busy machine)")

        first = windows(7, False)
        # (the read rule's mapped state, not `mapped_state`: a fill after a long quiet
        # window may sample slow on a VM, which marks the rule suspect until its next batch)
        if dec.prefetched or not s.resident_state():
            pytest.skip("the populated table was not resident (memory pressure)")
        assert first == [1, 2, 4, 8, 16, 16, 16]
        checks = rule.checks
        assert checks >= 7  # every window ended in a look at the rows
        assert windows(3, True) == [1, 2, 4]
        assert dec.prefetched == 0 and rule.checks > checks
        rows = dec.push(next(tok))[0]  # the fills still give the table's rows
        dec.fill(out)
        want = s.fetch(rows.reshape(-1))
        assert np.array_equal(out.reshape(want.shape), want)


@pytest.mark.parametrize("batch", [None, 3])
def test_local_ids_are_the_models_per_head_ids(
    tmp_path: Path, rng: np.random.Generator, batch: int | None
) -> None:
    """`local_ids(layer)`: the pending step's (or prefill's) row ids less each head's offset,
    as `Hasher.local_ids` gives them, in one buffer reused from step to step."""
    h = small_qwen(ple_layer_ids=[2, 5])
    for lay in h.layers:
        build_for(tmp_path, h, lay, f"e{lay}", lay)
    seqs = 1 if batch is None else batch
    toks = tokens(rng, (seqs, 12))
    with engramdb.open(tmp_path) as db:
        dec = Decoder({lay: db[f"e{lay}"] for lay in h.layers}, h, batch=batch)
        with pytest.raises(InvalidArgument, match="before push"):
            dec.local_ids(2)
        dec.prefill(toks[0, :6] if batch is None else toks[:, :6])
        for lay in h.layers:
            want = h.local_ids(toks[:, :6], layer=lay)  # [S, 6, H]
            got = dec.local_ids(lay)
            assert np.array_equal(got, want[0] if batch is None else want)
        bufs = {}
        for t in range(6, 12):
            rows = dec.push(int(toks[0, t]) if batch is None else toks[:, t])
            for i, lay in enumerate(h.layers):
                got = dec.local_ids(lay)
                want = h.local_ids(toks[:, : t + 1], layer=lay)[:, -1]  # [S, H]
                assert np.array_equal(got.reshape(want.shape), want)
                assert np.array_equal(got + h.offsets(lay), rows[i])
                assert bufs.setdefault(lay, got) is got  # the same buffer each step
        with pytest.raises(InvalidArgument, match="not one of"):
            dec.local_ids(3)
        with pytest.raises(InvalidArgument, match="not one of"):
            dec.local_ids()  # two layers: name one
        one = Decoder(db["e5"], h, layer=5, batch=batch)
        one.push(int(toks[0, 0]) if batch is None else toks[:, 0])
        want = h.local_ids(toks[:, :1], layer=5)[:, -1]
        assert np.array_equal(one.local_ids().reshape(want.shape), want)
        # a prefill's ids, then steps: the prefill's buffer never takes a step's ids
        one.prefill(toks[0, 1:4] if batch is None else toks[:, 1:4])
        want = h.local_ids(toks[:, :4], layer=5)[:, 1:]
        assert np.array_equal(one.local_ids().reshape(want.shape), want)
        for t in range(4, 7):
            one.push(int(toks[0, t]) if batch is None else toks[:, t])
            want = h.local_ids(toks[:, : t + 1], layer=5)[:, -1]
            assert np.array_equal(one.local_ids().reshape(want.shape), want), t


@pytest.mark.parametrize("prefetch", [True, False, "auto"])
@pytest.mark.parametrize("batch", [None, 3])
def test_a_buffer_per_layer_takes_that_layers_rows(
    tmp_path: Path, rng: np.random.Generator, prefetch: bool | str, batch: int | None
) -> None:
    """``fill(buf, layer=)`` with ``buf`` of `layer_shape` (the pending shape less its layer
    axis) writes that layer's rows there, contiguous: the prefill's and every step's, cold
    (the step reader or the prefetcher) and resident (the one-gather paths), bytes equal to
    the tables; the step's whole buffer still fills alongside."""
    h = small_qwen(ple_layer_ids=[2, 5])
    fulls = {lay: build_for(tmp_path, h, lay, f"e{lay}", lay) for lay in h.layers}
    seqs = 1 if batch is None else batch
    toks = tokens(rng, (seqs, 30))
    with engramdb.open(tmp_path) as db:
        if prefetch is True:  # cold: the step reader's reads (or the prefetcher's)
            for p in tmp_path.rglob("*.edb"):
                evict(p)
        else:
            for lay in h.layers:
                db[f"e{lay}"].populate()
        dec = Decoder({lay: db[f"e{lay}"] for lay in h.layers}, h, batch=batch, prefetch=prefetch)
        dec.prefill(toks[0, :6] if batch is None else toks[:, :6])
        assert dec.layer_shape == dec.prefill_shape(6)[:-3] + dec.prefill_shape(6)[-2:]
        for lay in h.layers:
            pre = np.empty(dec.layer_shape, np.uint8)
            dec.fill(pre, layer=lay)
            want = fulls[lay][h.row_ids(toks[:, :6], layer=lay)]  # [S, 6, H, rb]
            assert np.array_equal(pre, want[0] if batch is None else want)
        bufs: dict[int, np.ndarray] = {}
        whole = np.empty(dec.out_shape, np.uint8)
        for t in range(6, 30):
            dec.push(int(toks[0, t]) if batch is None else toks[:, t])
            if not bufs:  # a step's layer shape: [S, H, rb] ([H, rb] for one sequence)
                bufs = {lay: np.empty(dec.layer_shape, np.uint8) for lay in h.layers}
            for i, lay in enumerate(h.layers):
                dec.fill(bufs[lay], layer=lay)
                want = fulls[lay][h.row_ids(toks[:, : t + 1], layer=lay)[:, -1]]  # [S, H, rb]
                got = bufs[lay]
                assert np.array_equal(got if batch is not None else got[None], want), (t, lay)
                if t % 5 == 0:  # the whole step's buffer, filled from the same step
                    dec.fill(whole, layer=lay)
                    part = whole[:, i] if batch is not None else whole[i][None]
                    assert np.array_equal(part, want)
        if prefetch is False:
            assert dec.direct_fills > 0
        with pytest.raises(InvalidArgument, match="pass layer="):
            dec.fill(bufs[2])
        with pytest.raises(InvalidArgument, match="pass layer="):
            dec.fill(np.empty(dec.layer_shape, np.uint8))  # a new one, too
        with pytest.raises(ShapeMismatch):
            dec.fill(np.empty(dec.layer_shape[:-1] + (8,), np.uint8), layer=2)
        with pytest.raises(InvalidArgument, match="not one of"):
            dec.fill(bufs[2], layer=4)
        one = Decoder(db["e5"], h, layer=5, batch=batch)
        assert one.layer_shape == one.out_shape
