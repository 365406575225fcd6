"""The compiled one-pass gather of rows assembled from several columns
(``engramdb.io.columns``, ``_columns.c``) and attached column-split reads with and without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_attach import V41_S, V41_W, files, v41_checkpoint

import engramdb
from engramdb.errors import RowIdOutOfRange
from engramdb.io import columns, gather

native = pytest.mark.skipif(columns._native is None, reason="compiled gather not built")


def concat(cols: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.concatenate([c[ids] for c in cols], axis=1)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_install_builds_the_compiled_gather() -> None:
    # the default install (pip install -e .) compiles it where a C compiler is present
    assert columns._native is not None
    assert columns.native_enabled()


@native
@pytest.mark.parametrize("widths", [(256, 8), (7, 1, 64), (160,), (3, 5, 200, 8)])
def test_rows_equal_the_concatenated_columns(
    widths: tuple[int, ...], rng: np.random.Generator
) -> None:
    n = 5000
    cols = [rng.integers(0, 256, (n, w), dtype=np.uint8) for w in widths]
    for size in (0, 1, 11, 12, 13, 4097):
        ids = rng.integers(0, n, size)
        buf = np.full(size * sum(widths) + 1, 0xAB, np.uint8)
        out = buf[1:].reshape(size, sum(widths))  # not aligned: still exact
        assert columns.take_columns([(c, c.shape[1]) for c in cols], ids, out)
        assert np.array_equal(out, concat(cols, ids)), (widths, size)
        assert buf[0] == 0xAB  # nothing written before the output


@native
def test_placed_columns_copy_byte_ranges_of_wider_rows(rng: np.random.Generator) -> None:
    # the weight rows less their first 24 bytes, then a record of those 24 bytes + a scale
    n = 3000
    w = rng.integers(0, 256, (n, 256), dtype=np.uint8)
    rec = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    specs = [(w, 232, 256, 24, 24), (rec, 24, 32, 0, 0), (rec, 8, 32, 24, 256)]
    for size in (0, 1, 33, 600):
        ids = rng.integers(0, n, size)
        out = np.full((size, 272), 0xAB, np.uint8)  # 8 bytes no column names
        assert columns.take_columns(specs, ids, out)
        assert np.array_equal(out[:, 24:256], w[ids, 24:])
        assert np.array_equal(out[:, :24], rec[ids, :24])
        assert np.array_equal(out[:, 256:264], rec[ids, 24:])
        assert (out[:, 264:] == 0xAB).all()  # left alone
    with pytest.raises(RowIdOutOfRange, match="3000"):
        columns.take_columns(specs, np.array([5, 3000], np.int64), np.empty((2, 272), np.uint8))
    with pytest.raises(ValueError, match="stride"):  # 250 bytes at 24 overrun a 256 B row
        columns.take_columns([(w, 250, 256, 24, 0)], np.arange(2), np.empty((2, 250), np.uint8))
    with pytest.raises(ValueError, match="out holds"):  # a column past the output row
        columns.take_columns([(w, 256, 256, 0, 8)], np.arange(2), np.empty((2, 256), np.uint8))


@native
def test_an_id_out_of_range_raises_naming_it(rng: np.random.Generator) -> None:
    w, s = np.zeros((100, 256), np.uint8), np.zeros((90, 8), np.uint8)  # s shorter
    ids = np.array([1, 2, 95, 3], np.int64)
    out = np.empty((4, 264), np.uint8)
    with pytest.raises(RowIdOutOfRange, match="95"):
        columns.take_columns([(w, 256), (s, 8)], ids, out)
    with pytest.raises(RowIdOutOfRange, match="-1"):
        columns.take_columns([(w, 256), (s, 8)], np.array([-1], np.int64), out[:1])


@native
def test_sizes_that_do_not_fit_are_refused() -> None:
    w = np.zeros((10, 256), np.uint8)
    ids = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="out holds"):
        columns.take_columns([(w, 256)], ids, np.empty((3, 256), np.uint8))
    with pytest.raises(ValueError, match="does not tile"):
        columns.take_columns([(w, 100)], ids, np.empty((4, 100), np.uint8))
    with pytest.raises(ValueError, match="columns"):
        columns._native.take(np.empty(0, np.uint8), ids[:0], [])  # type: ignore[union-attr]


def test_arrays_it_cannot_take_leave_the_output_alone(rng: np.random.Generator) -> None:
    w = rng.integers(0, 256, (50, 16), dtype=np.uint8)
    out = np.zeros((4, 16), np.uint8)
    ids = np.arange(4, dtype=np.int64)
    assert not columns.take_columns([(w[:, ::2], 8), (w[:, 1::2], 8)], ids, out)
    assert not columns.take_columns([(w, 16)], ids.astype(np.int32), out)
    assert not columns.take_columns([(w, 16)], ids, np.zeros((4, 32), np.uint8)[:, ::2])
    assert not out.any()


@pytest.mark.parametrize("compiled", [True, False])
def test_attached_column_split_rows_with_and_without_it(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    if compiled and columns._native is None:
        pytest.skip("compiled gather not built")
    monkeypatch.setattr(columns, "_enabled", compiled)
    ran = []
    real = columns.take_columns

    def spy(*a: object) -> bool:
        ran.append(real(*a))  # type: ignore[arg-type]
        return ran[-1]

    monkeypatch.setattr("engramdb.read.attached.take_columns", spy)
    want = v41_checkpoint(tmp_path / "ckpt", rng, rows=6000)[1]
    db = tmp_path / "db"
    engramdb.attach(
        db, "t", files(tmp_path / "ckpt"), tensor=V41_W.format(1), scale_tensor=V41_S.format(1)
    )
    with engramdb.open(db, backend="mmap") as d:
        st = d["t"]
        for resident in (False, True):
            if resident:
                assert st._segments.record.wait(30)
            for size in (1, 16, 2049, 5000):
                ids = rng.integers(0, 6000, size)
                assert np.array_equal(st.fetch(ids), want[ids]), (resident, size)
    assert ran and all(r is compiled for r in ran)


def test_turned_off_by_environment() -> None:
    code = "from engramdb.io import columns; print(columns.native_enabled())"
    env = {**os.environ, columns.NATIVE_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


@native
def test_an_id_out_of_range_leaves_out_untouched(rng: np.random.Generator) -> None:
    """Every id is checked before a byte is written, so a caller may leave the bounds check
    to this call: with one column of whole rows too (its own loop)."""
    w = rng.integers(0, 256, (300, 24), dtype=np.uint8)
    s = rng.integers(0, 256, (300, 8), dtype=np.uint8)
    ids = rng.integers(0, 300, 1000)
    for bad in (300, -1):
        ids[700] = bad
        for cols, width in (([(w, 24), (s, 8)], 32), ([(w, 24)], 24)):
            out = np.full((1000, width), 0xAB, np.uint8)
            with pytest.raises(RowIdOutOfRange, match=str(bad)):
                columns.take_columns(cols, ids, out)
            assert (out == 0xAB).all()
    ids[700] = 299
    out = np.zeros((1000, 32), np.uint8)
    assert columns.take_columns([(w, 24), (s, 8)], ids, out)
    assert np.array_equal(out, concat([w, s], ids))


@native
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32])
@pytest.mark.parametrize("lead", [0, 8])  # rows on cache lines, and 8 bytes off them
def test_prefetched_take_equals_np_take(dtype: type, lead: int, rng: np.random.Generator) -> None:
    rows, width = 4000, 128 // np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, lead + rows * width * np.dtype(dtype).itemsize, dtype=np.uint8)
    table = raw[lead:].view(dtype).reshape(rows, width)
    for size in (0, 1, 31, 32, 33, 5000):
        ids = rng.integers(0, rows, size)
        out = np.full((size, width), 7, dtype)
        assert columns.take_prefetched(table, ids, out)
        if size:  # a window's int32 ranks too
            out32 = np.zeros_like(out)
            assert columns.take_prefetched(table, ids.astype(np.int32), out32)
            assert out32.tobytes() == out.tobytes()
        # compared as bytes: random float bits hold NaNs
        assert out.tobytes() == table[ids].tobytes(), (dtype, lead, size)


@native
def test_prefetched_take_raises_at_an_id_out_of_range(rng: np.random.Generator) -> None:
    table = rng.integers(0, 256, (100, 64), dtype=np.uint8)
    ids = np.array([3, 99, 100, 5], np.int64)
    out = np.zeros((4, 64), np.uint8)
    with pytest.raises(RowIdOutOfRange, match="100"):
        columns.take_prefetched(table, ids, out)
    assert np.array_equal(out[:2], table[[3, 99]]) and not out[2:].any()
    with pytest.raises(RowIdOutOfRange, match="-2"):
        columns.take_prefetched(table, np.array([-2], np.int64), out[:1])


def test_prefetched_take_leaves_arrays_it_cannot_take_alone(rng: np.random.Generator) -> None:
    table = rng.integers(0, 256, (50, 16), dtype=np.uint8)
    ids = np.arange(4, dtype=np.int64)
    out = np.zeros((4, 16), np.uint8)
    assert not columns.take_prefetched(table[:, ::2], ids, out[:, :8].copy())
    assert not columns.take_prefetched(table, ids.astype(np.float64), out)
    assert not columns.take_prefetched(table, ids, np.zeros((4, 32), np.uint8)[:, ::2])
    assert not columns.take_prefetched(table, ids, np.zeros((4, 16), np.int8))
    assert not columns.take_prefetched(table, ids, np.zeros((5, 16), np.uint8))
    assert not out.any()


@pytest.mark.parametrize("compiled", [True, False])
def test_large_fetches_of_a_built_table_take_the_prefetched_gather(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    if compiled and columns._native is None:
        pytest.skip("compiled gather not built")
    monkeypatch.setattr(columns, "_enabled", compiled)
    monkeypatch.setenv("ENGRAMDB_GATHER_THREADS", "1")
    from engramdb.io import gather

    monkeypatch.setattr(gather, "_threads", None)
    ran = []
    real = columns.take_prefetched

    def spy(*a: np.ndarray) -> bool:
        ran.append(real(*a))
        return ran[-1]

    monkeypatch.setattr(gather, "take_prefetched", spy)
    rows = rng.integers(0, 256, (20_000, 160), dtype=np.uint8)
    engramdb.build(tmp_path / "db", "t", 160, [rows])
    with engramdb.open(tmp_path / "db", backend="mmap") as d:
        st = d["t"]
        for size in (1, 16, 200, 5000, 5000, 5000):
            ids = rng.integers(0, 20_000, size)
            assert np.array_equal(st.fetch(ids), rows[ids]), size
    assert ran and all(r is compiled for r in ran)  # the batches of 64 KiB or more


@native
def test_take_one_prefetches_for_tables_larger_than_the_last_level_cache(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = []
    real = columns.take_prefetched

    def spy(table: np.ndarray, ids: np.ndarray, out: np.ndarray, prefetch: bool = True) -> bool:
        asked.append(prefetch)
        return real(table, ids, out, prefetch)

    monkeypatch.setattr(gather, "take_prefetched", spy)
    table = rng.integers(0, 256, (4000, 256), dtype=np.uint8)  # 1 MiB
    ids = rng.integers(0, 4000, 1000)  # 256 KiB of rows
    out = np.zeros((1000, 256), np.uint8)
    for llc, want in ((64 << 20, False), (512 << 10, True)):
        monkeypatch.setattr(gather, "_llc", llc)
        gather.take_one(table, ids, out)
        assert asked[-1] is want and np.array_equal(out, table[ids])
    n = len(asked)
    gather.take_one(table, ids[:10], out[:10])  # 2.5 KiB: np.take
    assert len(asked) == n and np.array_equal(out[:10], table[ids[:10]])
    monkeypatch.setattr(gather, "_llc", None)
    assert gather.llc_bytes() >= 1 << 20  # read from sysfs (or the 32 MiB default)


@native
def test_the_gather_without_prefetch_equals_np_take(rng: np.random.Generator) -> None:
    table = rng.integers(0, 256, (3000, 200), dtype=np.uint8)
    ids = rng.integers(0, 3000, 4000)
    out = np.zeros((4000, 200), np.uint8)
    assert columns.take_prefetched(table, ids, out, prefetch=False)
    assert np.array_equal(out, table[ids])
    ids[10] = -1
    with pytest.raises(RowIdOutOfRange, match="-1"):
        columns.take_prefetched(table, ids, out, prefetch=False)


@native
def test_heads_checker_and_rows_matcher_read_ids_in_place(rng: np.random.Generator) -> None:
    """The two checks a torch forward runs on ids at a tensor's address agree with numpy's
    answers: per-head bounds (negative ids are huge), and local ids + head offsets equal to
    global rows (as numpy's wrapping add says); a count that is not a whole number of heads,
    or rows of another length, is False."""
    check, match = columns.heads_checker(), columns.rows_matcher()
    assert check is not None and match is not None
    heads = np.array([5, 9, 2], np.int64)
    bounds = heads.astype(np.uint64).tobytes()
    offsets = np.array([0, 5, 14], np.int64)
    for _ in range(200):
        ids = rng.integers(-2, 11, (int(rng.integers(0, 6)), 3)).astype(np.int64)
        addr = ids.ctypes.data
        want = bool(((ids >= 0) & (ids < heads)).all())
        assert check(addr, ids.size, bounds) == want
        rows = ids + offsets
        assert match(addr, ids.size, rows, offsets.tobytes())
        if ids.size:
            other = rows.copy()
            other.reshape(-1)[int(rng.integers(0, ids.size))] += 1
            assert not match(addr, ids.size, other, offsets.tobytes())
            assert not match(addr, ids.size, rows[:-1], offsets.tobytes())  # fewer rows
            assert not check(addr, ids.size - 1, bounds)  # not whole rows of heads
    huge = np.array([[2**63 - 1, 0, 0]], np.int64)
    assert not check(huge.ctypes.data, 3, bounds)
    wrap = huge + offsets  # numpy wraps the sum: so does the check
    assert match(huge.ctypes.data, 3, wrap, offsets.tobytes())
    strided = np.zeros((3, 6), np.int64)[:, ::2]
    assert not match(huge.ctypes.data, 3, strided[:1], offsets.tobytes())  # not contiguous
    assert not match(huge.ctypes.data, 3, None, offsets.tobytes())


@native
def test_globalizer_checks_and_offsets_ids_in_place(rng: np.random.Generator) -> None:
    """The compiled check-and-offset of a buffer of local ids: where it is C-contiguous
    int64 with a last axis of H and every id is below its head's size (negative ids are
    huge) it writes numpy's ``ids + offsets`` and says 1; an id out of range: 0; ids of
    another dtype, layout or last axis, or an ``out`` of another length: -1, nothing
    written."""
    to_global = columns.globalizer()
    assert to_global is not None
    heads = np.array([5, 9, 2], np.int64)
    bounds = heads.astype(np.uint64).tobytes()
    offsets = np.array([0, 5, 14], np.int64)
    offs = offsets.tobytes()
    for _ in range(200):
        ids = rng.integers(-2, 11, (int(rng.integers(0, 3)), int(rng.integers(0, 4)), 3))
        out = np.full(ids.size, -7, np.int64)
        ok = to_global(ids, bounds, offs, out)
        assert ok == int(((ids >= 0) & (ids < heads)).all())
        if ok:
            assert np.array_equal(out, (ids + offsets).reshape(-1))
        if ids.size:
            out[:] = -7
            assert to_global(ids, bounds, offs, out[:-1]) == -1
            assert to_global(ids.reshape(-1)[:-1], bounds, offs, out[:-1]) == -1  # last axis
            assert to_global(ids.astype(np.int32), bounds, offs, out) == -1
            assert to_global(ids.astype(np.uint64), bounds, offs, out) == -1
            assert (out == -7).all()  # nothing written
    edge = np.array([[4, 8, 1], [0, 0, 0]], np.int64)  # each head's last row
    out = np.empty(6, np.int64)
    assert to_global(edge, bounds, offs, out) == 1
    assert out.tolist() == [4, 13, 15, 0, 5, 14]
    wide = np.zeros((2, 6), np.int64)
    wide[:, ::2] = edge
    assert to_global(wide[:, ::2], bounds, offs, out) == -1  # not contiguous
    assert to_global(bytes(48), bounds, offs, out) == -1  # no int64 format
    edge[1, 2] = 2  # one past head 2's rows
    assert to_global(edge, bounds, offs, out) == 0
    with pytest.raises(TypeError):  # out must be writable
        to_global(edge, bounds, offs, bytes(48))


@native
@pytest.mark.parametrize("prefetch", [True, False])
def test_grid_take_writes_runs_of_rows_into_a_layer_slice(
    prefetch: bool, rng: np.random.Generator
) -> None:
    """`grid_taker`: row i of ids goes to ``offset + (i // group) * stride + (i % group) *
    width`` of ``out``: layer 1 of a ``[B, L, H, rb]`` buffer equals ``table[ids]`` there,
    and every other byte is left alone."""
    take = columns.grid_taker()
    assert take is not None
    table = rng.integers(0, 256, (3000, 40), dtype=np.uint8)
    b, n_l, h = 5, 3, 4
    ids = rng.integers(0, 3000, b * h).astype(np.int64)
    out = np.full((b, n_l, h, 40), 7, np.uint8)
    assert take(out, 1 * h * 40, h, n_l * h * 40, table, 40, ids, prefetch) == -1
    assert np.array_equal(out[:, 1], table[ids].reshape(b, h, 40))
    assert (out[:, [0, 2]] == 7).all()
    ids[9] = 3000  # past the table: its position; rows before it written, none after
    out[...] = 7
    assert take(out, 0, h, n_l * h * 40, table, 40, ids, prefetch) == 9
    assert np.array_equal(out[:2, 0].reshape(-1, 40), table[ids[:8]])
    assert np.array_equal(out[2, 0, 0], table[ids[8]])
    assert (out[2, 0, 1:] == 7).all() and (out[3:] == 7).all()


@native
def test_grid_take_refuses_places_outside_the_output(rng: np.random.Generator) -> None:
    take = columns.grid_taker()
    assert take is not None
    table = rng.integers(0, 256, (100, 8), dtype=np.uint8)
    out = np.zeros((3, 2, 4, 8), np.uint8)
    ids = np.arange(12, dtype=np.int64)
    with pytest.raises(ValueError, match="out of 192 bytes"):
        take(out, 33, 4, 64, table, 8, ids)  # the last run would end past the buffer
    with pytest.raises(ValueError):
        take(out, 0, 4, 31, table, 8, ids)  # runs closer than a run's bytes
    with pytest.raises(ValueError):
        take(out, 0, 5, 64, table, 8, ids)  # not a whole number of runs
    assert not out.any()


@native
def test_grid_take_checks_a_sources_size_before_reading(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """With ``fd``, the file must still hold ``min_size`` bytes: -2 and nothing written when
    it is shorter (truncated) or the descriptor cannot be sought."""
    take = columns.grid_taker()
    assert take is not None
    table = rng.integers(0, 256, (64, 16), dtype=np.uint8)
    path = tmp_path / "src.bin"
    table.tofile(path)
    ids = np.array([3, 60, 0, 17], np.int64)
    out = np.zeros((4, 16), np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert take(out, 0, 4, 64, table, 16, ids, True, fd, table.nbytes) == -1
        assert np.array_equal(out, table[ids])
        out[...] = 0
        os.truncate(path, table.nbytes - 1)
        assert take(out, 0, 4, 64, table, 16, ids, True, fd, table.nbytes) == -2
        assert not out.any()
    finally:
        os.close(fd)
    no_fd = 1 << 30  # past any descriptor table: lseek fails
    assert take(out, 0, 4, 64, table, 16, ids, True, no_fd, table.nbytes) == -2
    assert not out.any()
