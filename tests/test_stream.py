"""Corpus streaming yields exactly keygen + fetch for every position, in corpus order."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb import keygen
from engramdb.errors import InvalidArgument, TokenIdOutOfRange
from engramdb.stream import stream
from engramdb.testing.dbs import TableSpec, make_db
from engramdb.testing.tables import MemoryTable

EOS = 248_044
VOCAB = 248_320


@pytest.fixture
def db_and_table(tmp_path: Path) -> tuple[Path, keygen.Hasher, np.ndarray]:
    h = keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000)
    spec = TableSpec(160, (h.table_rows(2),), rows_per_badge=128)
    path, rows = make_db(tmp_path, {"ple": spec})
    return path, h, rows["ple"]


def corpus(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    t = rng.integers(0, VOCAB, shape)
    t[rng.random(shape) < 0.02] = EOS
    return t


def collect(it: object) -> tuple[list[np.ndarray], list[np.ndarray]]:
    toks, es = [], []
    for t, e in it:  # type: ignore[attr-defined]
        toks.append(np.array(t))
        es.append(np.array(e))
    return toks, es


@pytest.mark.parametrize("batch_tokens", [1, 7, 1000, 5000])
def test_one_long_sequence_in_chunks(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray],
    rng: np.random.Generator,
    batch_tokens: int,
) -> None:
    path, h, full = db_and_table
    seq = corpus(rng, (3000 if batch_tokens > 1 else 200,))
    with engramdb.open(path) as db:
        toks, es = collect(db.stream(seq, preset=h, batch_tokens=batch_tokens))
        assert all(t.shape[0] <= batch_tokens for t in toks)
        assert np.array_equal(np.concatenate(toks), seq)
        assert np.array_equal(np.concatenate(es), db["ple"].fetch(h.row_ids(seq, layer=2)))


def test_sequences_in_blocks_files_and_iterables(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray],
    rng: np.random.Generator,
    tmp_path: Path,
) -> None:
    path, h, full = db_and_table
    block = corpus(rng, (50, 64))  # 50 fresh sequences
    with engramdb.open(path) as db:
        s = db["ple"]
        toks, es = collect(stream(s, block, preset=h, batch_tokens=640))
        assert [t.shape for t in toks] == [(10, 64)] * 5
        assert np.array_equal(np.concatenate(es), full[h.row_ids(block, layer=2)])
        docs = [corpus(rng, (n,)) for n in (5, 1, 900, 33)]
        toks, es = collect(stream(s, iter(docs), preset=h, batch_tokens=256))
        got = np.concatenate(es)
        want = np.concatenate([full[h.row_ids(d, layer=2)] for d in docs])
        assert np.array_equal(got, want)
        cdir = tmp_path / "corpus"
        cdir.mkdir()
        np.save(cdir / "a.npy", docs[2])
        np.save(cdir / "b.npy", block[:3])
        toks, es = collect(db.stream(cdir, preset=h, batch_tokens=300))
        assert [t.shape for t in toks] == [(300,), (300,), (300,), (3, 64)]
        want = np.concatenate(
            [
                full[h.row_ids(docs[2], layer=2)],
                full[h.row_ids(block[:3], layer=2)].reshape(-1, 16, 160),
            ]
        )
        assert np.array_equal(np.concatenate([e.reshape(-1, 16, 160) for e in es]), want)


def test_buffers_are_reused_unless_copied(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    path, h, full = db_and_table
    seq = corpus(rng, (4000,))
    with engramdb.open(path) as db:
        it = db.stream(seq, preset=h, batch_tokens=100, depth=2)
        held = [e for _, e in it]
        bases = {e.base.ctypes.data if e.base is not None else 0 for e in held}
        pre = it.stats().get("warm_lookahead_batches", 0)  # batches gathered while it warmed
        assert len(bases) <= 4 + pre, "a ring of depth + 2 buffers"
        assert len(held) > 4 + pre, "the ring is reused"
        owned = [e for _, e in db.stream(seq, preset=h, batch_tokens=100, copy=True)]
        assert np.array_equal(np.concatenate(owned), full[h.row_ids(seq, layer=2)])


def test_errors_reach_the_consumer_and_threads_stop(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    path, h, _ = db_and_table
    seq = corpus(rng, (5000,))
    seq[3500] = VOCAB + 10
    before = threading.active_count()
    with engramdb.open(path) as db:
        it = db.stream(seq, preset=h, batch_tokens=500)
        n = 0
        with pytest.raises(TokenIdOutOfRange):
            for t, _ in it:
                n += t.size
        assert n == 3500, "every batch before the bad one arrived"
        for i, _ in enumerate(db.stream(seq[:3000], preset=h, batch_tokens=10)):
            if i == 3:
                break  # abandoning the generator stops the producer
    import gc

    gc.collect()
    assert threading.active_count() <= before + 1  # a gather pool thread may stay


def test_bad_arguments_are_refused_at_the_call(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray],
) -> None:
    path, h, _ = db_and_table
    engramdb.build(path, "other", 160, [np.zeros((10, 160), np.uint8)])
    with engramdb.open(path) as db:
        with pytest.raises(InvalidArgument, match="addresses"):
            db.stream(np.arange(10), preset="qwen3.8-flash-next", table="ple")
        with pytest.raises(InvalidArgument, match="table="):
            db.stream(np.arange(10), preset=h)
        with pytest.raises(InvalidArgument, match="batch_tokens"):
            db.stream(np.arange(10), preset=h, table="ple", batch_tokens=0)


def test_a_store_p_view_serves_the_same_rows(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    path, h, full = db_and_table
    seq = corpus(rng, (3000,))
    engramdb.build_view(path, table="ple", name="v", keys=h.keys(seq[:2000]), hasher=h)
    with engramdb.open(path) as db:
        s = db["ple"]
        with engramdb.open_view(path, s, "v", hasher=h) as v:
            toks, es = collect(stream(s, seq, preset=h, batch_tokens=700, view=v))
            assert np.array_equal(np.concatenate(es), full[h.row_ids(seq, layer=2)])
            st = v.stats()
            assert st["hits"] > 0 and st["misses"] > 0, st  # view hits, Store-I misses
        by_name = collect(db.stream(seq, preset=h, table="ple", batch_tokens=700, view="v"))[1]
        assert np.array_equal(np.concatenate(by_name), full[h.row_ids(seq, layer=2)])


def test_stream_reads_any_row_table(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    """A table that is not local (here in memory) streams through `RowTable.gather`."""
    _, h, full = db_and_table
    seq = corpus(rng, (2500,))
    table = MemoryTable(full, name="ple")
    toks, es = collect(engramdb.stream(table, seq, preset=h, batch_tokens=700))
    assert np.array_equal(np.concatenate(toks), seq)
    assert np.array_equal(np.concatenate(es), full[h.row_ids(seq, layer=2)])
    assert table.gathers == len(toks)
    with pytest.raises(InvalidArgument, match="no views"):
        engramdb.stream(table, seq, preset=h, view="v")


# -- access-order reads: warm (fits the budget), windows (over it) ---------------------------
@pytest.mark.parametrize(
    "budget, mode, want",
    [
        (None, "auto", "warm"),  # fits MemAvailable: read sequentially once, then the mapping
        ("half", "auto", "windows"),  # over the budget: windows in file order
        ("tenth", "windows", "windows"),  # a small budget: many small windows
        (None, "batch", "batch"),  # the per-batch read path
    ],
)
def test_every_read_mode_is_bit_equal_to_an_in_ram_gather(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray],
    rng: np.random.Generator,
    budget: str | None,
    mode: str,
    want: str,
) -> None:
    path, h, full = db_and_table
    seq = corpus(rng, (20_000,))
    block = corpus(rng, (30, 50))
    with engramdb.open(path) as db:
        s = db["ple"]
        b = {None: None, "half": s.nbytes // 2, "tenth": s.nbytes // 10}[budget]
        for data, bt in ((seq, 1500), (block, 500)):
            st = db.stream(data, preset=h, batch_tokens=bt, page_cache_budget=b, mode=mode)
            toks, es = collect(st)
            ref = full[h.row_ids(data, layer=2)]
            assert np.array_equal(np.concatenate(toks), data)
            assert np.array_equal(np.concatenate(es).reshape(ref.shape), ref)
            stats = st.stats()
            assert stats["mode"] == want
            assert stats["tokens"] == data.size and stats["batches"] == len(toks)
            assert stats["table_bytes"] == s.nbytes
            if want == "warm":
                assert stats["warm_seconds"] is not None and s.residency() == 1.0
            if want == "windows":
                assert stats["page_cache_budget"] == b
                dev = stats["device"]
                for k in ("merge_gap", "max_read", "depth", "random_iops", "seq_bytes_per_s"):
                    assert dev[k] > 0, k
                assert stats["windows"] >= 1 and stats["runs"] >= stats["windows"]
                assert stats["rows_read"] >= len(np.unique(h.row_ids(data, layer=2)))
                assert stats["bytes_read"] >= stats["rows_read"] * 160
                assert stats["window_cap_bytes"] > 0


def test_windows_mode_delivers_batches_before_an_error_and_stops(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    path, h, full = db_and_table
    seq = corpus(rng, (6000,))
    seq[4200] = VOCAB + 1
    before = threading.active_count()
    with engramdb.open(path) as db:
        b = db["ple"].nbytes // 4
        got = []
        with pytest.raises(TokenIdOutOfRange):
            for _, e in db.stream(seq, preset=h, batch_tokens=600, page_cache_budget=b):
                got.append(e.copy())
        assert len(got) == 7, "the batches before the bad one"
        assert np.array_equal(np.concatenate(got), full[h.row_ids(seq[:4200], layer=2)])
        it = db.stream(seq[:4000], preset=h, batch_tokens=100, page_cache_budget=b)
        next(it)
        it.close()  # abandoning a windowed stream stops its loader and reader
    assert threading.active_count() <= before + 1


def test_read_mode_arguments_are_checked(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray],
) -> None:
    path, h, full = db_and_table
    with engramdb.open(path) as db:
        with pytest.raises(InvalidArgument, match="mode"):
            db.stream(np.arange(10), preset=h, mode="fast")
        with pytest.raises(InvalidArgument, match="page_cache_budget"):
            db.stream(np.arange(10), preset=h, page_cache_budget=0)
    with pytest.raises(InvalidArgument, match="local table"):
        engramdb.stream(MemoryTable(full, name="ple"), np.arange(10), preset=h, mode="windows")


def test_gathers_served_while_the_table_warms_equal_the_rows(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    from engramdb.read.stream_warm import TableWarm

    path, h, full = db_and_table
    with engramdb.open(path) as db:
        s = db["ple"]
        for p in {s.db_path / sh.path for sh in s.info.shards}:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        arr = s.array()
        done: list[float] = []
        # 4 KiB chunks: a row may straddle two of them; gathers start before the warm ends
        w = TableWarm(arr, threads=2, chunk=4096, on_done=lambda dt, err: done.append(dt))
        outs = []
        gathers = []
        for _ in range(4):
            ids = rng.integers(0, s.n_rows, 3000)
            out = np.empty((ids.size, 160), np.uint8)
            t = threading.Thread(target=w.gather, args=(ids, out))
            t.start()
            gathers.append(t)
            outs.append((ids, out))
        pend = []
        for _ in range(3):  # filled by the warm's filler thread, not by the caller
            ids = rng.integers(0, s.n_rows, 2000)
            out = np.empty((ids.size, 160), np.uint8)
            pend.append(w.submit(ids, out))
            outs.append((ids, out))
        for t in gathers:
            t.join()
        for p in pend:
            p.wait()
        w.join()
        assert w.done and len(done) == 1 and s.residency() == 1.0
        for ids, out in outs:
            assert np.array_equal(out, full[ids])
        ids = rng.integers(0, s.n_rows, 500)
        out = np.empty((500, 160), np.uint8)
        w.gather(ids, out)  # once warm: one np.take
        assert np.array_equal(out, full[ids])


def test_windows_grow_with_the_budget_and_stay_within_it(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    path, h, full = db_and_table
    seq = corpus(rng, (6_000,))
    ref = full[h.row_ids(seq, layer=2)]
    got = {}
    with engramdb.open(path) as db:
        nbytes = db["ple"].nbytes
        for frac in (0.4, 0.9):
            st = db.stream(
                seq,
                preset=h,
                batch_tokens=200,
                mode="windows",
                page_cache_budget=int(frac * nbytes),
            )
            _, es = collect(st)
            assert np.array_equal(np.concatenate(es).reshape(ref.shape), ref)
            got[frac] = st.stats()
    for s in got.values():
        assert s["within_budget"] and s["memory_bytes"] <= s["page_cache_budget"]
        assert s["payload_bytes"] == seq.size * 16 * 160
        assert s["bytes_read"] >= s["rows_read"] * 160
    small, large = got[0.4], got[0.9]
    assert large["window_tokens_max"] > small["window_tokens_max"]
    assert large["windows"] < small["windows"] and large["bytes_read"] < small["bytes_read"]


def test_closing_a_stream_stops_its_warm(
    db_and_table: tuple[Path, keygen.Hasher, np.ndarray], rng: np.random.Generator
) -> None:
    from engramdb.errors import StoreClosed
    from engramdb.read.stream_warm import TableWarm

    path, h, full = db_and_table
    with engramdb.open(path) as db:
        s = db["ple"]
        for p in {s.db_path / sh.path for sh in s.info.shards}:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        w = TableWarm(s.array(), threads=1, chunk=4096)
        w.stop()
        w.join()
        assert w.done or isinstance(w.error, StoreClosed)
        if not w.done:
            with pytest.raises(StoreClosed):
                w.gather(np.arange(10), np.empty((10, 160), np.uint8))
        before = threading.active_count()
        it = db.stream(corpus(rng, (3000,)), preset=h, batch_tokens=100, mode="warm")
        next(it)
        it.close()
        assert threading.active_count() <= before


def test_warm_fills_equal_the_rows_for_item_and_row_layouts(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A submitted gather fills by whole-row items where the table's rows and the output
    lie back to back (also from an unaligned start, as an attached tensor's rows do), and by
    2-D rows where the output is strided; both equal the table's rows."""
    from engramdb.read.stream_warm import TableWarm, _row_items

    raw = rng.integers(0, 256, 8 + 700 * 96, dtype=np.uint8)
    f = tmp_path / "t.bin"
    raw.tofile(f)
    mm = np.memmap(f, dtype=np.uint8, mode="r")
    arr = mm[8:].reshape(700, 96)  # rows start 8 bytes into the first page
    assert _row_items(arr) is not None and _row_items(arr[:, :64]) is None
    w = TableWarm(arr, threads=2, chunk=4096)
    ids = rng.integers(0, 700, 5000)
    flat = np.empty((ids.size, 96), np.uint8)
    wide = np.zeros((ids.size, 128), np.uint8)
    strided = wide[:, :96]  # rows 128 bytes apart: the 2-D path
    pend = [w.submit(ids, flat), w.submit(ids, strided)]
    for p in pend:
        p.wait()
    w.join()
    want = np.asarray(arr)[ids]
    assert np.array_equal(flat, want) and np.array_equal(strided, want)
    assert not wide[:, 96:].any()  # nothing written beside the strided rows
