"""The RAM record of attached column-split tables (``engramdb.read.resident``): the layout of
narrow columns and of the wide rows' spill, and rows read through it equal the tensors' bytes
for every alignment of the weight tensor, compiled or not, warm or cold."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from warm_checks import fetch_into_fast_when_mapped

import engramdb
from engramdb.errors import TruncatedFile
from engramdb.io import columns
from engramdb.read import attached as att
from engramdb.read import resident
from engramdb.read.resident import Piece, layout, spec_list, spill_of
from engramdb.testing.pages import evict

W, S = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"


@pytest.mark.parametrize(
    ("offset", "want"),
    [
        (0, None),  # whole lines already
        (4096 + 64, None),
        (8, (248, 8)),  # its last 8 bytes sit alone on a fifth line
        (8 + 128, (248, 8)),
        (16 + 128, None),  # measured: a loss from 16 bytes on, once the table is large
        (24, None),
        (32, None),
        (40, None),
        (56 + 128, None),
    ],
)
def test_spill_of_a_256_byte_row(offset: int, want: tuple[int, int] | None) -> None:
    assert spill_of(offset, 256, 0) == want


def test_spill_of_other_widths_and_starts() -> None:
    assert spill_of(8, 264, 0) is None  # its lines vary from row to row
    assert spill_of(8, 128, 16) == (16 + 120, 8)  # placed after a 16 B column
    assert spill_of(8, 0, 0) is None
    assert resident.MAX_SPILL == 8


def test_layout_orders_pieces_as_in_a_row_and_merges_neighbours() -> None:
    # V4.1 at +8: the weight's last 8 bytes, then the scale: one 16-byte copy
    pieces, width = layout([(256, 8)], (248, 8))
    assert width == 16
    assert pieces == [Piece(248, 8, 0, -1), Piece(256, 8, 8, 0)]
    rec = np.zeros((5, 16), np.uint8)
    assert [s[1:] for s in spec_list(rec, pieces, True)] == [(16, 16, 0, 248)]
    assert [s[1:] for s in spec_list(rec, pieces, False)] == [(8, 16, 8, 256)]
    # a spill apart from the scale in a row (the weight's first 24 bytes): two copies
    pieces, width = layout([(256, 8)], (0, 24))
    assert [s[1:] for s in spec_list(np.zeros((5, width), np.uint8), pieces, True)] == [
        (24, 32, 0, 0),
        (8, 32, 24, 256),
    ]
    # no spill: the narrow columns alone, in row order
    pieces, width = layout([(300, 4), (256, 8)], None)
    assert (width, [p.column for p in pieces]) == (12, [1, 0])


def checkpoint(path: Path, rng: np.random.Generator, rows: int, align: int) -> np.ndarray:
    """One V4.1 layer (weight ``[rows, 256]`` then scale ``[rows, 8]``) in a safetensors file
    whose weight starts ``align`` bytes past a cache line; returns the 264 B rows."""
    w = rng.integers(0, 256, (rows, 256), dtype=np.uint8)
    s = rng.integers(0, 256, (rows, 8), dtype=np.uint8)
    doc = {
        W: {"dtype": "F8_E4M3", "shape": [rows, 256], "data_offsets": [0, rows * 256]},
        S: {"dtype": "F8_E8M0", "shape": [rows, 8], "data_offsets": [rows * 256, rows * 264]},
    }
    text = json.dumps(doc).encode()
    text += b" " * ((align - 8 - len(text)) % 64)  # data start = 8 + len(text)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + w.tobytes() + s.tobytes())
    return np.concatenate([w, s], axis=1)


def attach(tmp_path: Path, rng: np.random.Generator, align: int, rows: int = 5000):
    src = tmp_path / f"m{align}.safetensors"
    want = checkpoint(src, rng, rows, align)
    db = tmp_path / f"db{align}"
    engramdb.attach(db, "t", [str(src)], tensor=W, scale_tensor=S)
    return db, src, want


def seg_of(st: object) -> att.SourceSegments:
    seg = st._segments  # type: ignore[attr-defined]
    assert isinstance(seg, att.SourceSegments)
    return seg


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("align", [0, 8, 16, 24, 32, 56])
def test_rows_through_the_record_equal_the_tensors(
    tmp_path: Path,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    align: int,
    compiled: bool,
) -> None:
    if compiled and columns._native is None:
        pytest.skip("the compiled gather is not built")
    monkeypatch.setattr(columns, "_enabled", compiled)
    db, src, want = attach(tmp_path, rng, align)
    n = want.shape[0]
    spill = spill_of(align, 256, 0)
    with engramdb.open(db, backend="mmap") as d:
        st = d["t"]
        seg = seg_of(st)
        st.populate()  # loads the record and, the weight now resident, fills the spill
        rec = seg.record
        assert rec.state == "ready"
        assert rec.nbytes == n * (8 + (spill[1] if spill else 0))
        assert rec.spill_state == ("ready" if spill else "off")
        if spill and compiled:
            # the weight column is read without its spill: one line less per row
            (a, width, stride, skip, dst) = seg._gather_specs()[0]
            assert a.shape == (n, 256) and width == 256 - spill[1] and stride == 256
            assert dst == skip == 0
            assert [x[1:] for x in seg._gather_specs()[1:]] == [
                (spill[1] + 8,) * 2 + (0, 256 - spill[1])
            ]
        for size in (1, 7, att.CHUNK_ROWS + 3, 3 * att.CHUNK_ROWS):
            ids = rng.integers(0, n, size)
            assert np.array_equal(st.fetch(ids), want[ids]), size
        assert np.array_equal(st.fetch(np.array([0, n - 1])), want[[0, -1]])
    with engramdb.open(db, backend="preadv") as d:
        st = d["t"]
        seg_of(st).record.wait(30)
        evict(str(src))
        ids = rng.integers(0, n, (3, 500))
        assert np.array_equal(st.fetch(ids), want[ids])  # cold: reads + the record


def test_no_room_for_the_spill_keeps_the_scale_in_ram(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, _, want = attach(tmp_path, rng, 8)
    n = want.shape[0]
    monkeypatch.setenv(resident.RESIDENT_ENV, str(resident.resident_used() + n * 8 + 100))
    with engramdb.open(db, backend="mmap") as d:
        st = d["t"]
        st.populate()
        rec = seg_of(st).record
        assert (rec.state, rec.spill_state, rec.nbytes) == ("ready", "off", n * 8)
        ids = rng.integers(0, n, 3000)
        assert np.array_equal(st.fetch(ids), want[ids])


def test_the_spill_can_be_turned_off(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, _, want = attach(tmp_path, rng, 8)
    monkeypatch.setenv(resident.SPILL_ENV, "0")
    with engramdb.open(db, backend="mmap") as d:
        st = d["t"]
        st.populate()
        rec = seg_of(st).record
        assert (rec.spill, rec.spill_state, rec.nbytes) == (None, "off", want.shape[0] * 8)
        ids = rng.integers(0, want.shape[0], 3000)
        assert np.array_equal(st.fetch(ids), want[ids])


def test_a_cold_table_fills_its_spill_only_once_resident(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    db, src, want = attach(tmp_path, rng, 8)
    evict(str(src))
    with engramdb.open(db, backend="preadv") as d:
        st = d["t"]
        seg = seg_of(st)
        assert seg.record.wait(30)
        assert seg.record.spill_state == "idle"  # not read from the device for it
        st.populate()
        assert seg.record.spill_state == "ready"
    # a table already in the page cache fills it as it loads the scale
    with engramdb.open(db, backend="mmap") as d:
        seg = seg_of(d["t"])
        assert seg.record.wait(30)
        assert seg.record.spill_state == "ready"


def test_a_finished_background_warm_fills_the_spill(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    db, src, want = attach(tmp_path, rng, 8)
    evict(str(src))
    with engramdb.open(db) as d:  # the default: auto, background warm
        st = d["t"]
        seg = seg_of(st)
        ids = rng.integers(0, want.shape[0], 2000)
        assert np.array_equal(st.fetch(ids), want[ids])  # cold: starts the warm pass
        deadline = time.monotonic() + 30
        while seg.record.spill_state != "ready" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seg.record.spill_state == "ready"
        assert np.array_equal(st.fetch(ids), want[ids])


def test_truncated_before_the_fill_fails_the_fill_not_the_reads(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    db, src, want = attach(tmp_path, rng, 8)
    with engramdb.open(db, backend="mmap") as d:
        st = d["t"]
        seg = seg_of(st)
        evict(str(src))  # the load leaves the spill to later
        assert seg.record.wait(30) and seg.record.spill_state == "idle"
        with open(src, "r+b") as f:
            f.truncate(8192)
        seg.record.fill_spill()
        assert seg.record.spill_state.startswith("failed") and str(src) in seg.record.spill_state
        with pytest.raises(TruncatedFile, match="truncated while open"):
            st.fetch(np.arange(0, want.shape[0], 7))


def test_fetch_into_fast_path_of_column_split_rows(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    db, src, want = attach(tmp_path, rng, 8)  # with the spill
    n = want.shape[0]
    with engramdb.open(db) as d:  # the default auto backend, warm: the mapped fast path
        st = d["t"]
        st.populate()
        assert st._cols_fast
        st.fetch(np.arange(300))  # the read rule's first batch finds the rows resident
        batches = [
            (rng.integers(0, n, size), np.empty((size, 264), np.uint8)) for size in (300, 4000)
        ]
        fetch_into_fast_when_mapped(st, batches)
        for ids, out in batches:
            assert np.array_equal(out, want[ids])
        # the ids are checked by the compiled gather itself (no numpy pass over them first):
        # an id out of range, small batch or large (split across the pool where it may), at
        # either end, raises naming it and its place, and leaves ``out`` untouched
        for size, bad in ((400, n), (400, -1), (6000, n), (6000, -3)):
            ids = rng.integers(0, n, size)
            ids[size - 7] = bad
            out = np.full((size, 264), 0xAB, np.uint8)
            with pytest.raises(
                engramdb.errors.RowIdOutOfRange, match=rf"{bad} at position {size - 7} "
            ):
                st.fetch_into(ids, out)
            assert (out == 0xAB).all()
        ids = rng.integers(0, n, 6000)
        out = np.empty((6000, 264), np.uint8)
        assert np.array_equal(st.fetch_into(ids, out), want[ids])
        with open(src, "r+b") as f:
            f.truncate(4096)
        with pytest.raises(TruncatedFile, match="truncated while open"):
            st.fetch_into(ids, out)
