"""The contract every table handle passes, as a reusable pytest class.

Subclass `TableContract` once per handle (or configuration) and provide a function-scoped
``table`` fixture that yields ``(handle, rows, heads)``: a freshly opened `RowTable`, the
``[n_rows, row_bytes]`` uint8 rows it must return (what was written), and its per-head row
counts. Every ``test_*`` method then runs against that handle::

    class TestLocalStore(TableContract):
        @pytest.fixture
        def table(self, tmp_path):
            db, rows = make_db(tmp_path, {"t": (160, (3000, 5000))})
            with engramdb.open(db) as d:
                yield d["t"], rows["t"], (3000, 5000)

The suite checks exact bytes (`fetch`, `fetch_into`, `lookup_into`, `to_global`), bad ids
(`RowIdOutOfRange` naming the id; the output untouched), dtypes (`InvalidDtype`), layouts
(`InvalidLayout`), shapes (`ShapeMismatch`), empty batches, list input, closed handles
(`StoreClosed`) and concurrent reads from threads. The handle is closed by one test
(`test_closed_handle_raises`): the fixture's teardown must tolerate a closed handle. A handle
that legitimately differs says so with a documented capability flag on its subclass
(`close_closes_handle`), never by skipping a check for the others.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest

from engramdb.errors import (
    InvalidDtype,
    InvalidLayout,
    RowIdOutOfRange,
    ShapeMismatch,
    StoreClosed,
)
from engramdb.table_api import RowTable, TableSchema
from engramdb.testing.threads import run_threads

__all__ = ["MemoryTable", "TableContract"]

Case = tuple[Any, np.ndarray, Sequence[int]]


def _offsets(heads: Sequence[int]) -> np.ndarray:
    h = np.asarray(heads, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(h)[:-1]]).astype(np.int64)


def _local_ids(rng: np.random.Generator, heads: Sequence[int], shape: tuple[int, int]) -> Any:
    cols = [rng.integers(0, int(n), shape) for n in heads]
    return np.ascontiguousarray(np.stack(cols, axis=-1).astype(np.int64))


class MemoryTable(RowTable):
    """A `RowTable` over rows in memory: the smallest handle that is not a local table, for
    tests of workloads (`engramdb.stream`, `Decoder`) on any `RowTable`. Counts `gather`
    calls in ``gathers``."""

    def __init__(self, rows: np.ndarray, heads: Sequence[int] | None = None, name: str = "mem"):
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        heads = (rows.shape[0],) if heads is None else tuple(int(h) for h in heads)
        RowTable.__init__(self, TableSchema(name, int(rows.shape[1]), int(rows.shape[0]), heads))
        self._rows: np.ndarray | None = rows
        self.gathers = 0

    def gather(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        rows = self._rows
        if rows is None:
            raise StoreClosed(self._closed_message())
        np.take(rows, flat, axis=0, out=out2d)
        self.gathers += 1

    @property
    def closed(self) -> bool:
        return self._rows is None

    def close(self) -> None:
        self._rows = None


class TableContract:
    """Tests every table handle must pass. Not collected itself (its name lacks ``Test``)."""

    #: Reader threads in the concurrency test, and batches each one reads.
    threads = 4
    batches_per_thread = 20

    #: Capability: the handle's own `close` closes it. False for a handle whose `close`
    #: releases nothing because another object owns its resources (`RemoteStore`: the
    #: `Client` holds the connections); `test_closed_handle_raises` then checks that the
    #: handle still reads after its `close`, and closes it through `close_owner`.
    close_closes_handle = True

    #: Capability: `fetch_into` / `lookup_into` write into any writable buffer. False for a
    #: handle whose transport writes only into memory registered with it first
    #: (`MooncakeTable` in ranged mode: ``get_into_ranges`` refuses an unregistered output
    #: with `OutputNotRegistered`); the tests that read into a caller's buffer then hold it
    #: in `register_out` for the call.
    any_output_buffer = True

    def register_out(self, t: Any, out: np.ndarray) -> AbstractContextManager[Any]:
        """A context in which ``out`` may be written by ``t`` (used when
        `any_output_buffer` is False)."""
        raise NotImplementedError("a handle with any_output_buffer = False needs register_out")

    def _into(self, t: Any, out: np.ndarray) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.any_output_buffer else self.register_out(t, out)

    def close_owner(self, t: Any) -> None:
        """Close what owns ``t`` (used when `close_closes_handle` is False)."""
        raise NotImplementedError("a handle with close_closes_handle = False needs close_owner")

    @pytest.fixture
    def table(self) -> Any:
        raise NotImplementedError("subclasses provide a `table` fixture: (handle, rows, heads)")

    # --- schema -----------------------------------------------------------------------------
    def test_schema(self, table: Case) -> None:
        t, rows, heads = table
        assert isinstance(t, RowTable)
        assert t.n_rows == rows.shape[0] == sum(heads)
        assert t.row_bytes == rows.shape[1]
        assert t.n_heads == len(heads)
        assert list(np.asarray(t.heads)) == list(heads)
        assert list(np.asarray(t.head_offsets)) == _offsets(heads).tolist()
        assert t.nbytes == rows.size
        assert not t.closed

    # --- exact bytes ------------------------------------------------------------------------
    def test_fetch_returns_the_source_rows(self, table: Case) -> None:
        t, rows, _ = table
        rng = np.random.default_rng(1)
        ids = rng.integers(0, rows.shape[0], 300)
        ids[:5] = [0, rows.shape[0] - 1, 7, 7, 0]  # both ends and duplicates
        got = t.fetch(ids)
        assert got.dtype == np.uint8 and got.shape == (300, t.row_bytes)
        np.testing.assert_array_equal(got, rows[ids])
        grid = ids[:240].reshape(4, 6, 10)
        np.testing.assert_array_equal(t.fetch(grid), rows[grid])
        for dtype in (np.int32, np.uint16, np.uint64):
            small = ids[ids < 60_000][:20].astype(dtype)
            np.testing.assert_array_equal(t.fetch(small), rows[small.astype(np.int64)])

    def test_fetch_into_writes_and_returns_out(self, table: Case) -> None:
        t, rows, _ = table
        rng = np.random.default_rng(2)
        ids = rng.integers(0, rows.shape[0], (16, 8))
        out = np.full((16, 8, t.row_bytes), 0xAB, dtype=np.uint8)
        with self._into(t, out):
            assert t.fetch_into(ids, out) is out
        np.testing.assert_array_equal(out, rows[ids])
        big = rng.integers(0, rows.shape[0], 4096)
        out2 = np.empty((4096, t.row_bytes), dtype=np.uint8)
        with self._into(t, out2):
            t.fetch_into(big, out2)
        np.testing.assert_array_equal(out2, rows[big])

    def test_lookup_into_reads_per_head_local_ids(self, table: Case) -> None:
        t, rows, heads = table
        rng = np.random.default_rng(3)
        local = _local_ids(rng, heads, (4, 9))
        local[0, 0] = [n - 1 for n in heads]  # each head's last row
        local[0, 1] = 0
        out = np.full((*local.shape, t.row_bytes), 0xCD, dtype=np.uint8)
        with self._into(t, out):
            assert t.lookup_into(local, out) is out
        np.testing.assert_array_equal(out, rows[local + _offsets(heads)])

    def test_to_global(self, table: Case) -> None:
        t, _, heads = table
        rng = np.random.default_rng(4)
        local = _local_ids(rng, heads, (3, 5))
        np.testing.assert_array_equal(t.to_global(local), local + _offsets(heads))
        np.testing.assert_array_equal(
            t.to_global(local[0, 0].tolist()), local[0, 0] + _offsets(heads)
        )
        with pytest.raises(ShapeMismatch):
            t.to_global(np.zeros((2, len(heads) + 1), np.int64))
        bad = local.copy()
        bad[1, 2, -1] = heads[-1]
        with pytest.raises(RowIdOutOfRange, match=str(heads[-1])):
            t.to_global(bad)

    # --- bad ids ----------------------------------------------------------------------------
    def test_out_of_range_ids_name_the_id_and_leave_out_untouched(self, table: Case) -> None:
        t, rows, heads = table
        n = rows.shape[0]
        for bad in (n, n + 12345, -1):
            with pytest.raises(RowIdOutOfRange, match=str(bad)) as err:
                t.fetch([3, bad, 5])
            assert isinstance(err.value, IndexError)
            out = np.full((3, t.row_bytes), 0x5A, dtype=np.uint8)
            with pytest.raises(RowIdOutOfRange, match=str(bad)):
                t.fetch_into(np.array([3, bad, 5]), out)
            assert (out == 0x5A).all(), "a bad id leaves out untouched"
        local = np.zeros((1, 2, len(heads)), np.int64)
        local[0, 1, -1] = heads[-1]
        out4 = np.full((*local.shape, t.row_bytes), 0x5A, dtype=np.uint8)
        with pytest.raises(RowIdOutOfRange, match=str(heads[-1])):
            t.lookup_into(local, out4)
        assert (out4 == 0x5A).all()
        local[0, 1, -1] = -1
        with pytest.raises(RowIdOutOfRange, match="-1"):
            t.lookup_into(local, out4)
        np.testing.assert_array_equal(t.fetch([3, 5]), rows[[3, 5]])  # the handle still works

    def test_wrong_dtypes(self, table: Case) -> None:
        t, _, heads = table
        for ids in (np.array([1.0, 2.0]), np.array([True, False]), ["a"]):
            with pytest.raises(InvalidDtype):
                t.fetch(ids)
            with pytest.raises(InvalidDtype):
                t.fetch_into(ids, np.empty((len(ids), t.row_bytes), np.uint8))
        with pytest.raises(InvalidDtype):
            t.fetch_into([1, 2], np.empty((2, t.row_bytes), np.int8))
        with pytest.raises(InvalidDtype):
            t.fetch_into([1, 2], [[0] * t.row_bytes] * 2)
        local = np.zeros((1, 1, len(heads)), np.int32)
        with pytest.raises(InvalidDtype):
            t.lookup_into(local, np.empty((1, 1, len(heads), t.row_bytes), np.uint8))
        with pytest.raises(InvalidDtype):
            t.lookup_into(local.astype(np.int64).tolist(), np.empty((1, 1, len(heads), 8)))
        with pytest.raises(InvalidDtype):
            t.lookup_into(
                local.astype(np.int64), np.empty((1, 1, len(heads), t.row_bytes), np.float32)
            )

    def test_wrong_layouts(self, table: Case) -> None:
        t, _, heads = table
        strided = np.empty((4, 2 * t.row_bytes), np.uint8)[:, ::2]
        with pytest.raises(InvalidLayout):
            t.fetch_into([1, 2, 3, 4], strided)
        readonly = np.empty((4, t.row_bytes), np.uint8)
        readonly.flags.writeable = False
        with pytest.raises(InvalidLayout):
            t.fetch_into([1, 2, 3, 4], readonly)
        fortran = np.asfortranarray(np.empty((4, t.row_bytes), np.uint8))
        with pytest.raises(InvalidLayout):
            t.fetch_into([1, 2, 3, 4], fortran)
        h = len(heads)
        ids = np.zeros((2, 3, 2 * h), np.int64)[:, :, ::2]
        with pytest.raises(InvalidLayout):
            t.lookup_into(ids, np.empty((2, 3, h, t.row_bytes), np.uint8))
        out = np.empty((2, 3, h, 2 * t.row_bytes), np.uint8)[..., ::2]
        with pytest.raises(InvalidLayout):
            t.lookup_into(np.zeros((2, 3, h), np.int64), out)

    def test_shape_mismatch(self, table: Case) -> None:
        t, _, heads = table
        h = len(heads)
        with pytest.raises(ShapeMismatch):
            t.fetch_into([1, 2, 3], np.empty((2, t.row_bytes), np.uint8))
        with pytest.raises(ShapeMismatch):
            t.fetch_into([1, 2], np.empty((2, t.row_bytes + 1), np.uint8))
        with pytest.raises(ShapeMismatch):
            t.fetch_into([[1, 2]], np.empty((2, t.row_bytes), np.uint8))
        with pytest.raises(ShapeMismatch):
            t.lookup_into(np.zeros((2, h), np.int64), np.empty((2, h, t.row_bytes), np.uint8))
        with pytest.raises(ShapeMismatch):
            t.lookup_into(
                np.zeros((1, 2, h + 1), np.int64), np.empty((1, 2, h + 1, t.row_bytes), np.uint8)
            )
        with pytest.raises(ShapeMismatch):
            t.lookup_into(np.zeros((1, 2, h), np.int64), np.empty((1, 2, h, 1), np.uint8))

    # --- edge batches -----------------------------------------------------------------------
    def test_empty_batches(self, table: Case) -> None:
        t, _, heads = table
        got = t.fetch([])
        assert got.shape == (0, t.row_bytes) and got.dtype == np.uint8
        assert t.fetch(np.zeros((3, 0), np.int64)).shape == (3, 0, t.row_bytes)
        out = np.empty((0, t.row_bytes), np.uint8)
        assert t.fetch_into(np.zeros(0, np.int64), out) is out
        local = np.zeros((0, 1, len(heads)), np.int64)
        out4 = np.empty((0, 1, len(heads), t.row_bytes), np.uint8)
        assert t.lookup_into(local, out4) is out4
        assert t.to_global(np.zeros((0, len(heads)), np.int64)).shape == (0, len(heads))

    def test_list_input(self, table: Case) -> None:
        t, rows, _ = table
        np.testing.assert_array_equal(t.fetch([4, 1, 4]), rows[[4, 1, 4]])
        np.testing.assert_array_equal(t.fetch([[0], [2]]), rows[[[0], [2]]])
        out = np.empty((2, t.row_bytes), np.uint8)
        with self._into(t, out):
            t.fetch_into([9, 8], out)
        np.testing.assert_array_equal(out, rows[[9, 8]])
        np.testing.assert_array_equal(t.fetch(7), rows[7])

    # --- lifecycle --------------------------------------------------------------------------
    def test_closed_handle_raises(self, table: Case) -> None:
        t, rows, heads = table
        if not self.close_closes_handle:
            t.close()
            assert not t.closed
            np.testing.assert_array_equal(t.fetch([3, 5]), rows[[3, 5]])
            self.close_owner(t)
        else:
            t.close()
        assert t.closed
        t.close()  # idempotent
        with pytest.raises(StoreClosed):
            t.fetch([0])
        with pytest.raises(StoreClosed):
            t.fetch_into([0], np.empty((1, t.row_bytes), np.uint8))
        with pytest.raises(StoreClosed):
            t.lookup_into(
                np.zeros((1, 1, len(heads)), np.int64),
                np.empty((1, 1, len(heads), t.row_bytes), np.uint8),
            )
        assert "closed" in repr(t)

    # --- threads ----------------------------------------------------------------------------
    def test_concurrent_reads_equal_the_source(self, table: Case) -> None:
        t, rows, heads = table
        start = threading.Barrier(self.threads)

        def reader(seed: int) -> None:
            rng = np.random.default_rng(100 + seed)
            start.wait()
            for i in range(self.batches_per_thread):
                n = int(rng.integers(1, 600))
                ids = rng.integers(0, rows.shape[0], n)
                if i % 3 == 0:
                    got = t.fetch(ids)
                elif i % 3 == 1:
                    got = np.empty((n, t.row_bytes), np.uint8)
                    with self._into(t, got):
                        t.fetch_into(ids, got)
                else:
                    local = _local_ids(rng, heads, (1, n))
                    got = np.empty((*local.shape, t.row_bytes), np.uint8)
                    with self._into(t, got):
                        t.lookup_into(local, got)
                    ids = local + _offsets(heads)
                if not np.array_equal(got, rows[ids]):
                    raise AssertionError(f"thread {seed}: batch {i} differs from the source")

        run_threads(reader, [(k,) for k in range(self.threads)])
