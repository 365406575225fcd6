"""`ResidentRecord`: the RAM record of an attached column-split table: its narrow columns,
and the bytes of its wide rows that spill onto one more cache line.

`engramdb.read.attached` keeps an attached table's narrow columns (V4.1's 8 B scale beside
a 256 B weight row) in RAM. This module lays them out as one *record* per row, in the
order of their bytes in an output row, and adds the **spill** where it pays:

* A safetensors tensor starts wherever its header ends: 8-byte, not 64-byte, aligned. A
  256 B weight row that starts ``a`` bytes past a cache line spans 5 lines, not 4, so a
  warm gather of V4.1's 264 B rows reads 5 lines of weight and 1 of scale, where a built
  264 B row is 5 adjacent lines.
* Where ``a`` is at most `MAX_SPILL` (8) the record also holds each weight row's last
  ``a`` bytes (the ones alone on its fifth line), beside the scale: a gather then reads 4
  lines of the mapping and 1 of the record, spill and scale in one copy (they are adjacent
  in the output row). Measured here (docs/probes.md, 23rd stop; ``probes/attach_record.py``):
  rows/s of the attached V4.1 table against the same rows built, one thread, every file
  populated on 2 MiB page-cache folios and read once by the CPU, CPU caches flushed, the
  scale-only record against the one with the spill: a = 8: 0.87x -> 0.92x (3 GiB), 0.88x
  -> 0.90x (6 GiB). Not kept where it did not pay: a = 16 and 24, where it gained on small
  tables (0.5 GiB, largely in this machine's 480 MiB L3) but a record of 24-32 B a row lost
  at 6 GiB (a = 16: 0.88x / 0.83x without it, 0.85x / 0.81x with it; a = 24: 0.87x / 0.81x
  against 0.80x / 0.78x); a = 32 (0.88x either way); the first ``64 - a`` bytes of rows at
  a >= 40 (a = 48, 3 GiB: 0.86x / 0.92x without, 0.83x / 0.88x with: its 32 B record
  costs more than the line it saves); a table of one column (5 lines against 4 + 1 of a
  separate record: 0.80x against 0.89x).
* ``ENGRAMDB_ATTACH_SPILL=0`` keeps the narrow columns only (the spill costs ``a`` bytes
  of RAM per row: 3 GB for a V4.1 layer of 384 M rows at a = 8).

The spill is a copy of the source's bytes, taken from the page cache: it is filled only
once the wide column is resident (after `populate`, a finished background warm, or at load
when the rows already sit in the page cache), with sequential ``pread`` calls (a source
truncated meanwhile ends the fill with `TruncatedFile`; nothing is mapped past its end).
Until then gathers read the wide rows whole from the mapping, as without it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engramdb._cpus import run_as_worker
from engramdb.errors import StoreClosed
from engramdb.io.columns import take_columns
from engramdb.io.mapping import prefault
from engramdb.io.tiers import meminfo, parse_budget

__all__ = [
    "LINE",
    "MAX_SPILL",
    "RESIDENT_ENV",
    "SPILL_ENV",
    "Piece",
    "ResidentRecord",
    "copy_rows",
    "layout",
    "resident_budget",
    "spec_list",
    "spill_of",
]

#: Bytes per CPU cache line.
LINE = 64
#: The most bytes of a wide row the record keeps (measured: a gain at 8; at 16 and 24 a
#: gain only while the record fits the CPU caches, a loss at 6 GiB).
MAX_SPILL = 8
#: ``0`` keeps only the narrow columns in the record.
SPILL_ENV = "ENGRAMDB_ATTACH_SPILL"


#: A compiled gather's column: ``(source, width, stride, skip, dst)`` (`take_columns`).
Spec = tuple[np.ndarray, int, int, int, int]


@dataclass(frozen=True)
class Piece:
    """Bytes of a record: ``width`` bytes at ``rec`` of the record go to ``dst`` of an
    output row; ``column`` is the narrow column's index, or -1 for the wide rows' spill."""

    dst: int
    width: int
    rec: int
    column: int


def spill_of(offset: int, width: int, start: int) -> tuple[int, int] | None:
    """``(dst, nbytes)``, in an output row, of the bytes of a wide column to keep in the
    record: its rows are ``width`` bytes, the first at byte ``offset`` of its (page-aligned)
    mapping, and sit at ``start`` of an output row. The last ``a`` bytes of each row, where
    the rows start ``a`` bytes past a line (``0 < a <= MAX_SPILL``) and ``width`` is whole
    lines (so every row's lines fall alike); else None."""
    if width <= 0 or width % LINE:
        return None
    a = offset % LINE
    if not 0 < a <= MAX_SPILL:
        return None
    return start + width - a, a


def layout(narrow: list[tuple[int, int]], spill: tuple[int, int] | None) -> tuple[list[Piece], int]:
    """The record's pieces, in output-row order, and its width: ``narrow`` the narrow
    columns' ``(start, width)`` in an output row (column ``i`` is ``narrow[i]``), ``spill``
    from `spill_of` or None."""
    parts = [(s, w, i) for i, (s, w) in enumerate(narrow)]
    if spill is not None:
        parts.append((spill[0], spill[1], -1))
    pieces, at = [], 0
    for dst, width, column in sorted(parts):
        pieces.append(Piece(dst, width, at, column))
        at += width
    return pieces, at


def spec_list(record: np.ndarray, pieces: list[Piece], spill: bool) -> list[Spec]:
    """Compiled-gather column specs ``(record, width, record width, offset, dst)`` of the
    record's pieces (with the spill, or without it while it is not filled), pieces adjacent
    both in the record and in an output row merged into one copy."""
    out: list[list[int]] = []
    for p in pieces:
        if p.column < 0 and not spill:
            continue
        last = out[-1] if out else None
        if last is not None and last[1] + last[0] == p.rec and last[2] + last[0] == p.dst:
            last[0] += p.width
        else:
            out.append([p.width, p.rec, p.dst])
    rw = record.shape[1]
    return [(record, w, rw, r, d) for w, r, d in out]


#: ``pread(file index, dest, file offset)``: fills ``dest`` or raises (`TruncatedFile`).
Pread = Callable[[int, np.ndarray, int], None]
#: Raises (`StoreClosed`) once the table is closed: checked between reads.
Check = Callable[[], None]
#: Bytes per sequential read of a fill.
FILL_BYTES = 8 << 20
#: Ids per ``np.take`` of whole records in `ResidentRecord.fill` without the compiled gather.
FILL_CHUNK = 2048


def copy_rows(
    record: np.ndarray,
    piece: Piece,
    file: int,
    offset: int,
    first: int,
    rows: int,
    width: int,
    pread: Pread,
    check: Check,
) -> None:
    """Copy the last ``piece.width`` bytes of each of ``rows`` rows of ``width`` bytes (all of
    a narrow column's row; a wide row's spill) into the record's piece from record row
    ``first`` on: the rows lie back to back at ``offset`` of ``file`` and are read
    sequentially in reads of `FILL_BYTES` (``check`` between reads)."""
    s = piece.width
    buf = np.empty((max(1, FILL_BYTES // width), width), np.uint8)
    k = buf.shape[0]
    for lo in range(0, rows, k):
        check()
        n = min(k, rows - lo)
        pread(file, buf[:n], offset + lo * width)
        record[first + lo : first + lo + n, piece.rec : piece.rec + s] = buf[:n, width - s :]


# -- the process-wide budget ----------------------------------------------------------------
#: Bytes of resident records this process may hold (``0``: none).
RESIDENT_ENV = "ENGRAMDB_ATTACH_RESIDENT"

_budget_lock = threading.Lock()
_resident_used = 0


def resident_budget() -> int:
    """Bytes of records all attached tables of this process may keep in RAM:
    ``ENGRAMDB_ATTACH_RESIDENT`` (a size, e.g. ``"2G"``; ``0`` turns residency off) if set,
    else 1/16 of ``MemTotal``."""
    env = os.environ.get(RESIDENT_ENV, "").strip()
    if env:
        b = parse_budget(env, what=RESIDENT_ENV)
        if b is not None:
            return b
    return meminfo().get("MemTotal", 0) // 16


def resident_used() -> int:
    """Bytes of records this process holds now."""
    return _resident_used


def _reserve(nbytes: int) -> bool:
    global _resident_used
    with _budget_lock:
        if _resident_used + nbytes > resident_budget():
            return False
        _resident_used += nbytes
        return True


def _release(nbytes: int) -> None:
    global _resident_used
    with _budget_lock:
        _resident_used = max(0, _resident_used - nbytes)


# -- the record -----------------------------------------------------------------------------
class Column(Protocol):
    """What the record needs of a column (`engramdb.read.attached`): its width, where its
    bytes go in an output row, its runs (arrays, first rows, files, file offsets), and a
    slot for its RAM view."""

    width: int
    start: int
    arrays: list[np.ndarray]
    first: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    resident: np.ndarray | None


class ResidentRecord:
    """The narrow columns of an attached table (and its wide rows' spill) in RAM: loaded in
    a background thread started by `start`, within the process budget; see the module
    docstring. ``wide`` is the widest column when it is one run (else None),
    ``wide_resident`` says whether its pages are in the page cache, ``pread(file, dest,
    offset)`` reads a source."""

    def __init__(
        self,
        name: str,
        n_rows: int,
        narrow: Sequence[Column],
        wide: Column | None,
        pread: Pread,
        wide_resident: Callable[[], bool],
    ):
        self.name = name
        self.n_rows = n_rows
        self.narrow = narrow
        self.wide = wide
        self._io = (pread, self._check_open)  # copy_rows' reader and its closed check
        self._wide_resident = wide_resident
        #: ``(dst, bytes)`` of each wide row kept beside the narrow columns, or None.
        keep = bool(narrow) and os.environ.get(SPILL_ENV, "").strip() != "0"
        self.spill = (
            spill_of(int(wide.offset[0]), wide.width, wide.start)
            if wide is not None and keep
            else None
        )
        #: ``off`` (nothing to keep), ``idle``, ``loading``, ``ready``, or why not
        #: (``over budget``, ``failed: ...``, ``closed``).
        self.state = "idle" if narrow else "off"
        #: The spill's: ``off`` (none, or no room), ``idle``, ``filling``, ``ready``, or why not.
        self.spill_state = "off" if self.spill is None else "idle"
        self.nbytes = 0
        self.seconds = 0.0
        self.pieces: list[Piece] = []
        self.width = 0
        #: ``[n_rows, width]`` once loaded.
        self.array: np.ndarray | None = None
        self._loader: threading.Thread | None = None
        self._filler: threading.Thread | None = None
        self._release: weakref.finalize | None = None  # type: ignore[type-arg]
        self._lock = threading.Lock()
        self._stop = False

    def start(self) -> None:
        """Start loading the narrow columns in a background thread (once; nothing when there
        are none or the budget is spent)."""
        if self.state != "idle":
            return
        with self._lock:
            if self.state != "idle":
                return
            narrow = [(c.start, c.width) for c in self.narrow]
            need = self.n_rows * sum(w for _, w in narrow)
            spill = self.spill
            if spill is not None and _reserve(need + self.n_rows * spill[1]):
                need += self.n_rows * spill[1]
            elif _reserve(need):
                spill = None  # room for the narrow columns only
                self.spill_state = "off"
            else:
                self.state = f"over budget ({need} B > {resident_budget()} B left)"
                self.spill_state = "off"
                return
            self.pieces, self.width = layout(narrow, spill)
            self.nbytes = need
            # returned at close, after a failed load, or when an unclosed table is collected
            self._release = weakref.finalize(self, _release, need)
            self.state = "loading"
            self._loader = threading.Thread(
                target=self._load, name=f"engramdb-resident-{self.name}", daemon=True
            )
            self._loader.start()

    def wait(self, timeout: float | None = None) -> bool:
        """`start` if idle and wait for the load; whether the narrow columns are in RAM."""
        self.start()
        t = self._loader
        if t is not None:
            t.join(timeout)
        return self.state == "ready"

    def _check_open(self) -> None:
        if self._stop:
            raise StoreClosed(f"table {self.name!r} is closed")

    def _load(self) -> None:
        run_as_worker()
        t0 = time.perf_counter()
        try:
            rec = prefault(np.empty((self.n_rows, self.width), np.uint8))  # written in full
            for p in self.pieces:
                if p.column >= 0:
                    c = self.narrow[p.column]
                    for r, a in enumerate(c.arrays):  # a loop over runs, not rows
                        f, off, first = int(c.file[r]), int(c.offset[r]), int(c.first[r])
                        copy_rows(rec, p, f, off, first, a.shape[0], c.width, *self._io)
        except Exception as e:  # the columns stay read from their sources (which guard)
            if self._release is not None:
                self._release()
            self.nbytes = 0
            self.state = "closed" if self._stop else f"failed: {e}"
            self.spill_state = "off"
            return
        for p in self.pieces:
            if p.column >= 0:
                self.narrow[p.column].resident = rec[:, p.rec : p.rec + p.width]
        self.array = rec
        self.seconds = time.perf_counter() - t0
        self.state = "ready"
        if self.spill_state == "idle" and self._wide_resident():
            self.fill_spill()  # the rows sit in the page cache already (another process)

    def start_spill(self) -> None:
        """`fill_spill` in a background thread (e.g. when a background warm finished)."""
        with self._lock:
            busy = self._filler is not None or self._stop
            if self.spill_state != "idle" or self.state != "ready" or busy:
                return
            self._filler = threading.Thread(
                target=self._spill_worker, name=f"engramdb-spill-{self.name}", daemon=True
            )
            self._filler.start()

    def _spill_worker(self) -> None:
        run_as_worker()
        self.fill_spill()

    def fill_spill(self) -> None:
        """Copy each wide row's spill into the record with sequential reads, if the narrow
        columns are loaded and it is not filled yet (the caller knows the wide column is
        resident); from then on warm gathers read one line less of the mapping per row."""
        pieces = [p for p in self.pieces if p.column < 0]
        wide, rec = self.wide, self.array
        with self._lock:
            if not pieces or wide is None or rec is None or self.spill_state != "idle":
                return
            self.spill_state = "filling"
        try:
            f, off = int(wide.file[0]), int(wide.offset[0])
            copy_rows(rec, pieces[0], f, off, 0, self.n_rows, wide.width, *self._io)
        except Exception as e:  # gathers keep reading the wide rows whole
            self.spill_state = "closed" if self._stop else f"failed: {e}"
            return
        self.spill_state = "ready"

    def specs(self, columns: Sequence[Column]) -> list[Spec]:
        """Compiled-gather specs ``(source, width, stride, skip, dst)`` of a row made of
        ``columns`` (each one array): the columns not in RAM from their arrays (the wide one
        less its last bytes once the spill is filled), then the record's pieces."""
        rec = self.array
        spill = self.spill if self.spill_state == "ready" else None
        out: list[Spec] = []
        for c in columns:
            if rec is not None and c.resident is not None:
                continue
            cut = spill[1] if spill is not None and c is self.wide else 0
            out.append((c.arrays[0], c.width - cut, c.width, 0, c.start))
        if rec is not None:
            out += spec_list(rec, self.pieces, spill is not None)
        return out

    def fill(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Write the narrow columns of validated ids ``flat`` into their bytes of ``out2d``
        (``[len(flat), row bytes]``, C-contiguous), once loaded: the compiled gather of the
        record's pieces, else per chunk of ids one ``np.take`` of whole records (a
        contiguous source: ``np.take`` of a strided column view would copy the whole
        column first) and one copy per piece."""
        rec = self.array
        if rec is None:
            return
        specs = spec_list(rec, self.pieces, False)
        if take_columns(specs, flat, out2d):
            return
        n = flat.size
        buf = np.empty((min(n, FILL_CHUNK), rec.shape[1]), np.uint8)
        for a in range(0, n, FILL_CHUNK):
            b = min(n, a + FILL_CHUNK)
            t = buf[: b - a]
            np.take(rec, flat[a:b], axis=0, out=t, mode="clip")
            for _, w, _, r, d in specs:
                out2d[a:b, d : d + w] = t[:, r : r + w]

    def close(self) -> None:
        """Stop the load and the fill, return the budget, drop the record."""
        self._stop = True
        for t in (self._loader, self._filler):
            if t is not None:
                t.join()
        self._loader = self._filler = None
        if self._release is not None:
            self._release()  # once: a no-op after a failed load
            self.nbytes = 0
        if self.state in ("idle", "ready", "loading"):
            self.state = "closed"
        if self.spill_state in ("idle", "filling", "ready"):
            self.spill_state = "closed"
        for c in self.narrow:
            c.resident = None
        self.array = None
