"""Every bad input raises its typed error; nothing is returned or written half."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engramdb
from engramdb.errors import (
    EngramDBError,
    InvalidDtype,
    InvalidLayout,
    RowIdOutOfRange,
    ShapeMismatch,
    StoreClosed,
    TableNotFound,
)

HEADS = [11, 7, 13]


@pytest.fixture
def table(db_factory):  # type: ignore[no-untyped-def]
    path, rows = db_factory({"t": (24, HEADS)})
    db = engramdb.open(path)
    yield db["t"], rows["t"]
    db.close()


def test_out_of_range_ids_name_id_and_position(table) -> None:  # type: ignore[no-untyped-def]
    s, _ = table
    with pytest.raises(RowIdOutOfRange, match=r"row id 31 at position 2") as e:
        s.fetch([0, 5, 31])
    assert isinstance(e.value, IndexError) and isinstance(e.value, EngramDBError)
    with pytest.raises(IndexError, match=r"row id -1 at position 1"):
        s.fetch(np.array([3, -1, 99]))
    with pytest.raises(IndexError, match=r"position \(1, 0\)"):
        s.fetch(np.array([[1, 2], [400, 3]]))


def test_bad_dtypes_rejected(table) -> None:  # type: ignore[no-untyped-def]
    s, _ = table
    with pytest.raises(InvalidDtype, match="float64"):
        s.fetch(np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        s.fetch(np.array([True, False]))
    with pytest.raises(RowIdOutOfRange):
        s.fetch(np.array([2**63 + 5], dtype=np.uint64))


def test_other_integer_dtypes_and_empty(table) -> None:  # type: ignore[no-untyped-def]
    s, full = table
    assert np.array_equal(s.fetch(np.array([1, 30], dtype=np.int32)), full[[1, 30]])
    assert np.array_equal(s.fetch(np.array([1, 30], dtype=np.uint16)), full[[1, 30]])
    assert s.fetch([]).shape == (0, 24)
    assert s.fetch(np.zeros((0, 3), np.int64)).shape == (0, 3, 24)


def test_fetch_into_validation(table) -> None:  # type: ignore[no-untyped-def]
    s, full = table
    ids = np.array([1, 2, 3])
    with pytest.raises(ShapeMismatch):
        s.fetch_into(ids, np.empty((3, 23), np.uint8))
    with pytest.raises(InvalidDtype):
        s.fetch_into(ids, np.empty((3, 24), np.int8))
    with pytest.raises(InvalidLayout):
        s.fetch_into(ids, np.empty((24, 3), np.uint8).T)
    ro = np.zeros((3, 24), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidLayout, match="writable"):
        s.fetch_into(ids, ro)
    out = np.full((3, 24), 7, np.uint8)
    with pytest.raises(RowIdOutOfRange):
        s.fetch_into(np.array([1, 2, 31]), out)
    assert (out == 7).all(), "a rejected batch must leave the output untouched"
    s.fetch_into(ids, out)
    assert np.array_equal(out, full[ids])


def _local(b: int, l: int, rng: np.random.Generator) -> np.ndarray:  # noqa: E741
    return np.ascontiguousarray(
        np.stack([rng.integers(0, h, size=(b, l)) for h in HEADS], axis=-1), dtype=np.int64
    )


def test_lookup_into_validation_list(table, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    s, full = table
    ids = _local(2, 4, rng)
    out = np.empty((2, 4, 3, 24), np.uint8)
    with pytest.raises(InvalidDtype):
        s.lookup_into(ids.tolist(), out)  # a list: no implicit conversion
    with pytest.raises(InvalidDtype, match="int32"):
        s.lookup_into(ids.astype(np.int32), out)
    with pytest.raises(InvalidLayout):
        s.lookup_into(np.asfortranarray(ids), out)
    with pytest.raises(ShapeMismatch):
        s.lookup_into(ids.reshape(8, 3), out)
    with pytest.raises(ShapeMismatch, match="3 heads"):
        s.lookup_into(ids[..., :2].copy(), out[..., :2, :].copy())
    with pytest.raises(ShapeMismatch):
        s.lookup_into(ids, np.empty((2, 4, 3, 25), np.uint8))
    with pytest.raises(InvalidDtype):
        s.lookup_into(ids, out.tolist())
    ro = np.empty_like(out)
    ro.flags.writeable = False
    with pytest.raises(InvalidLayout):
        s.lookup_into(ids, ro)
    with pytest.raises(InvalidLayout):
        s.lookup_into(ids, np.empty((24, 3, 4, 2), np.uint8).T)
    s.lookup_into(ids, out)
    assert np.array_equal(out, full[ids + s.head_offsets])


def test_lookup_into_head_bounds_at_every_boundary(table) -> None:  # type: ignore[no-untyped-def]
    """A global id passed where a local one is expected is caught at each head boundary."""
    s, full = table
    for h, n in enumerate(HEADS):
        ids = np.zeros((1, 2, 3), np.int64)
        ids[0, 1, h] = n - 1
        out = np.empty((1, 2, 3, 24), np.uint8)
        s.lookup_into(ids, out)
        assert np.array_equal(out[0, 1, h], full[s.head_offsets[h] + n - 1])
        ids[0, 1, h] = n
        out[:] = 9
        with pytest.raises(RowIdOutOfRange, match=f"head {h}") as e:
            s.lookup_into(ids, out)
        assert "(0, 1, " in str(e.value)
        assert (out == 9).all()
        ids[0, 1, h] = -1
        with pytest.raises(IndexError):
            s.lookup_into(ids, out)


def test_lookup_into_empty_batch_is_noop(table) -> None:  # type: ignore[no-untyped-def]
    s, _ = table
    s.lookup_into(np.zeros((0, 5, 3), np.int64), np.empty((0, 5, 3, 24), np.uint8))


def test_closed_store_and_unknown_table(db_factory) -> None:  # type: ignore[no-untyped-def]
    path, _ = db_factory({"t": (8, (10,))})
    db = engramdb.open(path)
    s = db["t"]
    with pytest.raises(TableNotFound, match="nope"):
        db["nope"]
    with pytest.raises(KeyError):
        db["nope"]
    db.close()
    with pytest.raises(StoreClosed):
        s.fetch([1])
    with pytest.raises(StoreClosed):
        db["t"]


def test_database_collected_after_module_teardown(db_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A database never closed may be collected at interpreter exit after the modules'
    globals are cleared (``os`` is None then): it still closes its descriptors, and raises
    nothing (no "Exception ignored" traceback)."""
    import engramdb.database as database_module

    path, _ = db_factory({"a": (8, (10,)), "b": (8, (10,))})
    db = engramdb.open(path)
    db["a"].fetch([1])
    fds = [fd for fds in db._shard_fds.values() for fd in fds]
    assert fds  # table "b" was never opened: its descriptors are the database's
    files = {fd: _identity(os.fstat(fd)) for fd in fds}
    monkeypatch.setattr(database_module, "os", None)
    db.__del__()
    monkeypatch.undo()
    for fd in fds:
        # closed: the number is free, or another thread's open took it for another file
        try:
            now = _identity(os.fstat(fd))
        except OSError:
            continue
        assert now != files[fd], f"descriptor {fd} still open on table b's shard"
    db.close()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def test_open_missing_database(tmp_path: Path) -> None:
    from engramdb.errors import DatabaseNotFound

    with pytest.raises(DatabaseNotFound):
        engramdb.open(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        engramdb.open(tmp_path)


def test_unsigned_max_reads_negative_ids_as_huge_on_every_path() -> None:
    from engramdb.validate import unsigned_max

    few = np.array([[3, 7], [0, 5]], np.int64)  # contiguous, a decode step's size
    assert unsigned_max(few) == 7
    assert unsigned_max(np.array([4, -1], np.int64)) == 2**64 - 1
    many = np.arange(1000, dtype=np.int64)  # one numpy reduction
    assert unsigned_max(many) == 999
    many[500] = -2
    assert unsigned_max(many) == 2**64 - 2
    strided = np.arange(40, dtype=np.int64)[::2].copy()[::-1]  # not C-contiguous
    assert not strided.flags.c_contiguous and unsigned_max(strided) == 38
    assert unsigned_max(np.empty(0, np.int64)) == 0


_EDGES = [0, 1, -1, -(2**63), 2**63 - 1, 7, 8, 9, 2**40]


@settings(max_examples=400, deadline=None)
@given(
    n_rows=st.sampled_from([0, 1, 2, 8, 1000, 8_000_000, 2**40 + 7, 2**63 - 1]),
    ids=st.lists(
        st.one_of(st.sampled_from(_EDGES), st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**24)),
        min_size=1,
        max_size=40,
    ),
    shift=st.sampled_from([-1, 0, 1]),
)
def test_small_bounds_is_exact_for_every_id(n_rows: int, ids: list[int], shift: int) -> None:
    """The lane check agrees with the plain comparison for every id, the ids at
    ``n_rows - 1``, ``n_rows``, ``n_rows + 1`` and negative ones included."""
    from engramdb.validate import SmallBounds

    ids = ids + [min(max(n_rows + shift, -(2**63)), 2**63 - 1)]
    arr = np.array(ids, np.int64)
    want = bool(((arr >= 0) & (arr < n_rows)).all())
    assert SmallBounds(n_rows).ok(arr) is want


@settings(max_examples=300, deadline=None)
@given(
    heads=st.lists(st.integers(0, 2**40), min_size=1, max_size=20),
    rows=st.integers(1, 8),
    data=st.data(),
)
def test_small_bounds_per_head_is_exact(heads: list[int], rows: int, data) -> None:  # type: ignore[no-untyped-def]
    """One bound per head (the last axis): each id is checked against its own head's size,
    so an id past a small head is refused even when it is below a larger head's size."""
    from engramdb.validate import SmallBounds

    def one(h: int) -> st.SearchStrategy[int]:
        return st.sampled_from([0, h - 1, h, h + 1, -1, -(2**63), 2**63 - 1]).filter(
            lambda v: -(2**63) <= v < 2**63
        )

    ids = np.array([[data.draw(one(h)) for h in heads] for _ in range(rows)], dtype=np.int64)
    want = bool(((ids >= 0) & (ids < np.array(heads))).all())
    assert SmallBounds(heads).ok(ids) is want


def test_a_decode_step_fetch_refuses_every_out_of_range_id(db_factory) -> None:  # type: ignore[no-untyped-def]
    """The small fast path of a mapped table (a decode step's 16 ids): each bad id in each
    position is refused, named, and the output is left as it was; good ids read the rows."""
    path, rows = db_factory({"t": (8, [100])})
    with engramdb.open(path, backend="mmap") as db:
        t = db["t"]
        out = np.empty((16, 8), np.uint8)
        ok = np.arange(16, dtype=np.int64) * 6 + 3
        before = t.counters()["small_gathers"]
        np.testing.assert_array_equal(t.fetch_into(ok, out), rows["t"][ok])
        assert t.counters()["small_gathers"] == before + 1  # the mapped fast path served it
        for bad in (100, 101, -1, -(2**63), 2**63 - 1):
            for pos in (0, 7, 15):
                ids = ok.copy()
                ids[pos] = bad
                out[:] = 0xAB
                with pytest.raises(RowIdOutOfRange, match=str(bad)):
                    t.fetch_into(ids, out)
                assert (out == 0xAB).all()
