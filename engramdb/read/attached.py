"""`SourceSegments`: an attached table's rows read in place from its source files.

An attached table (``docs/format.md`` section 6) has no shards: each row is the
concatenation of its *columns* (e.g. a 256 B FP8 weight row and an 8 B scale row), and each
column's rows are *runs* of consecutive rows at byte offsets of source files (e.g. 128
safetensors tensors concatenated along rows). Every source file is mapped whole, read-only,
once; a run is a zero-copy ``[rows, width]`` view of its file's mapping.

* Warm gathers: a table that is one run of one column — a single tensor — *is* a
  ``[n_rows, row_bytes]`` array, gathered exactly like a built table. Rows of several
  columns that are each one array (V4.1's weight and scale tensors) go through the compiled
  one-pass gather (`engramdb.io.columns.take_columns`) where it is built; otherwise they are
  gathered in chunks of `CHUNK_ROWS` ids (a loop over chunks, never over rows):
  per chunk one ``np.take`` per column into a reused per-thread buffer that stays in L2,
  copied into the column's strided slice of the output (as uint64 words where aligned).
  A column of many runs groups a chunk's ids by run with one sort (a loop over runs).
* Resident narrow columns: every column but the widest that is at most a quarter of a row
  (V4.1's 8 B scale of a 264 B row) is read sequentially into RAM once, in a background
  thread started by the first read (or by `populate`, which waits for it), while the
  process-wide budget allows (`resident_budget`: ``ENGRAMDB_ATTACH_RESIDENT`` bytes, ``0``
  turns it off; default 1/16 of ``MemTotal``): one record per row, with the widest
  column's bytes on a cache line of their own where that pays (`engramdb.read.resident`).
  Until it is loaded (or when it does not fit, or the load fails) the column is read from
  its source like the others. Once loaded a cold row costs one device read, like a built
  row.
* Cold reads: `plan` returns a `ReadPlan` with one read per (distinct row, column not
  resident) at the absolute file offset, and `fill_resident` writes the resident columns
  into the assembled rows, so the syscall backends (preadv, io_uring, O_DIRECT widened to the
  file's alignment by the backend) read straight from the sources; a row's columns that are
  adjacent in one file are one read.
* Truncation: `guard` reads the files' sizes (``lseek(SEEK_END)``) before every read and raises `TruncatedFile`
  naming a file shorter than at attach, so no read touches a mapped page past its end.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np

from engramdb.errors import StoreClosed, TruncatedFile
from engramdb.io.columns import native_enabled, take_columns
from engramdb.io.gather import PARALLEL_MIN_BYTES, SplitDecision, run_split
from engramdb.io.mapping import (
    MADV_RANDOM,
    address_view,
    madvise,
    map_file_aligned,
    populate_sequential,
    range_pages,
    unmap_range,
)
from engramdb.layouts.geometry import PAGE
from engramdb.layouts.manifest import TableInfo
from engramdb.read.plan import ReadPlan
from engramdb.read.resident import RESIDENT_ENV, ResidentRecord, Spec, resident_budget
from engramdb.validate import check_bounds

__all__ = ["CHUNK_ROWS", "RESIDENT_ENV", "SourceSegments", "resident_budget"]

#: Ids per chunk of a multi-column gather: 2048 rows of a 256 B column is 512 KiB (in L2).
CHUNK_ROWS = 2048


class _Column:
    """One column: its runs as arrays, with their first rows / files / offsets (int64), and
    its RAM copy once resident."""

    def __init__(
        self,
        width: int,
        arrays: list[np.ndarray],
        first: np.ndarray,
        file: np.ndarray,
        offset: np.ndarray,
        start: int,
    ):
        self.width = width
        self.arrays = arrays
        self.first = first
        self.file = file
        self.offset = offset
        self.start = start  # byte offset of this column inside a row
        #: ``[n_rows, width]`` RAM copy (a resident narrow column), or None.
        self.resident: np.ndarray | None = None

    def runs_of(self, flat: np.ndarray) -> np.ndarray | None:
        """The run of each id (None: the column is one run, or resident)."""
        if len(self.arrays) == 1 or self.resident is not None:
            return None
        return np.searchsorted(self.first, flat, side="right") - 1

    def files_of(self, run: np.ndarray | None) -> list[int]:
        """The files a batch with runs ``run`` touches (none once resident)."""
        if self.resident is not None:
            return []
        if run is None:
            return [int(self.file[0])]
        return np.unique(self.file[run]).tolist()  # type: ignore[no-any-return]

    def take(self, flat: np.ndarray, out: np.ndarray, run: np.ndarray | None) -> None:
        """``out[i] = row flat[i]`` of this column from its source (``out`` contiguous
        ``[n, width]``); ``run`` from `runs_of`."""
        if run is None:
            np.take(self.arrays[0], flat, axis=0, out=out, mode="clip")
            return
        order = np.argsort(run, kind="stable")
        counts = np.bincount(run, minlength=len(self.arrays))
        sorted_ids = flat[order] - self.first[run[order]]
        tmp = np.empty_like(out)
        pos = 0
        for r in np.flatnonzero(counts):
            n = int(counts[r])
            np.take(self.arrays[r], sorted_ids[pos : pos + n], 0, tmp[pos : pos + n], "clip")
            pos += n
        out[order] = tmp

    def where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, absolute byte offset) of each id's bytes of this column."""
        if len(self.arrays) == 1:
            return np.full(ids.shape, self.file[0], np.int32), self.offset[0] + ids * self.width
        run = np.searchsorted(self.first, ids, side="right") - 1
        return self.file[run].astype(np.int32), self.offset[run] + (
            ids - self.first[run]
        ) * self.width


class SourceSegments:
    """The source files of an attached table, mapped whole; see the module docstring.

    ``fds`` are its open descriptors in file order (checked by ``disk.files.open_sources``;
    the caller keeps ownership). Has the mapping surface `LocalTable` uses (`populate`,
    `advise`, `residency`, `close`) plus `take`, `plan`, `fill_resident`, `where`, `guard`
    and `regions`."""

    def __init__(self, info: TableInfo, fds: list[int]):
        att = info.attached
        assert att is not None
        self.name = info.name
        self.row_bytes = info.row_bytes
        self.n_rows = info.n_rows
        self._fds = list(fds)
        self._sizes = [f.size for f in att.files]
        self._paths = [f.path for f in att.files]
        self._maps: list[tuple[int, int]] = []
        self.files: list[np.ndarray] = []
        try:
            for fd, size in zip(fds, self._sizes):
                span = max(PAGE, -(-size // PAGE) * PAGE)
                addr = map_file_aligned(fd, span) if size else 0
                if size:
                    self._maps.append((addr, span))
                    madvise(addr, size, MADV_RANDOM)
                self.files.append(address_view(addr, size) if size else np.zeros(0, np.uint8))
        except BaseException:
            self.close()
            raise
        self.columns: list[_Column] = []
        start = 0
        for col in att.columns:
            w = col.width
            arrays = [
                self.files[r.file][r.offset : r.offset + r.rows * w].reshape(r.rows, w)
                for r in col.runs
            ]
            rows = np.asarray([r.rows for r in col.runs], np.int64)
            self.columns.append(
                _Column(
                    w,
                    arrays,
                    np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64),
                    np.asarray([r.file for r in col.runs], np.int64),
                    np.asarray([r.offset for r in col.runs], np.int64),
                    start,
                )
            )
            start += w
        one = self.columns[0]
        #: The table as one ``[n_rows, row_bytes]`` array when it is one run of one column.
        self.single: np.ndarray | None = (
            one.arrays[0] if len(self.columns) == 1 and len(one.arrays) == 1 else None
        )
        self._single_file = [int(one.file[0])]
        self.length = sum(self._sizes)
        # Narrow columns worth keeping in RAM: all but the widest, each <= 1/4 of a row.
        widest = max(self.columns, key=lambda c: c.width)
        self._narrow = [
            c
            for c in self.columns
            if c is not widest and c.width * 4 <= self.row_bytes and self.n_rows > 0
        ]
        #: The widest column when it is one run (one array at one file offset), else None.
        self._wide_run = widest if len(widest.arrays) == 1 and self.n_rows > 0 else None
        #: The narrow columns (and the wide rows' spill) in RAM, once loaded.
        self.record = ResidentRecord(
            self.name,
            self.n_rows,
            list(self._narrow),
            self._wide_run,
            self._pread,
            self._wide_resident,
        )
        self._specs: tuple[tuple[bool, bool], list[Spec]] | None = None
        #: Every column one run: a batch's runs and files are known without looking.
        self._one_run = all(len(c.arrays) == 1 for c in self.columns)
        self._split = SplitDecision()
        self._bufs = threading.local()
        #: One row as a structured dtype with a ``V{width}`` field per column.
        self._row_dtype = np.dtype(
            {
                "names": [f"c{i}" for i in range(len(self.columns))],
                "formats": [f"V{c.width}" for c in self.columns],
                "offsets": [c.start for c in self.columns],
                "itemsize": self.row_bytes,
            }
        )

    # -- resident narrow columns ---------------------------------------------------------
    def warm_region(self) -> tuple[int, int, int, int] | None:
        """``(fd, offset, nbytes, address)`` of the page-aligned byte range of the source
        holding the table's widest column, when that column is one run (a single tensor, or
        V4.1's weight beside a resident scale); None when it is several. The memory policy
        (`engramdb.io.tiers.MappedTiers`) warms and watches this range."""
        widest = self._wide_run
        if widest is None:
            return None
        f = int(widest.file[0])
        lo = int(widest.offset[0]) // PAGE * PAGE
        hi = min(
            -(-self._sizes[f] // PAGE) * PAGE,
            -(-(int(widest.offset[0]) + self.n_rows * widest.width) // PAGE) * PAGE,
        )
        base = int(self.files[f].ctypes.data)
        return self._fds[f], lo, hi - lo, base + lo

    def _wide_resident(self) -> bool:
        """Whether >= 99 % of the wide column's pages are in the page cache (``mincore``)."""
        wr = self._wide_run
        if wr is None or not self._maps:
            return False
        have, pages = range_pages(int(wr.arrays[0].ctypes.data), wr.arrays[0].size)
        return pages > 0 and have >= 0.99 * pages

    def fill_resident(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Write the resident columns of validated ids ``flat`` into ``out2d`` (after the
        reads of a `plan`, which leaves them out; nothing until the record is loaded)."""
        self.record.fill(flat, out2d)

    # -- reads ------------------------------------------------------------------------------
    def guard(self, files: list[int] | None = None) -> None:
        """Raise `TruncatedFile` naming a source (of ``files``, default all) that is now
        shorter than at attach (a read of its mapping past the new end would raise SIGBUS):
        one ``lseek(SEEK_END)`` per file (an int, no stat object: a third of an ``fstat``'s
        cost; every read here names its offset, so the descriptor's position is free)."""
        for i in range(len(self._fds)) if files is None else files:
            now = os.lseek(self._fds[i], 0, os.SEEK_END)
            if now < self._sizes[i]:
                raise TruncatedFile(
                    f"table {self.name!r}: source {self._paths[i]!r} was truncated while open "
                    f"({now} bytes, attached with {self._sizes[i]})"
                )

    def single_guard(self) -> tuple[int, int] | None:
        """``(fd, size)`` of the file behind `single`: a reader of that array checks before
        each read that the file still holds ``size`` bytes (`guard`'s test, done elsewhere,
        e.g. inside a compiled gather). None when the table is not one mapped array."""
        if self.single is None:
            return None
        f = self._single_file[0]
        return self._fds[f], self._sizes[f]

    def guard_mapped(self) -> None:
        """`guard` of the files behind `single` (the one mapped array), else of every file."""
        self.guard(self._single_file if self.single is not None else None)

    def _buf(self, width: int, rows: int = CHUNK_ROWS, kind: str = "c") -> np.ndarray:
        """This thread's reused ``[rows, width]`` gather buffer of ``kind`` (grown, never
        shrunk: fresh allocations fault their pages in)."""
        key = f"{kind}{width}"
        b = getattr(self._bufs, key, None)
        if b is None or b.shape[0] < rows:
            b = np.empty((max(rows, CHUNK_ROWS), width), np.uint8)
            setattr(self._bufs, key, b)
        return b[:rows]  # type: ignore[no-any-return]

    @property
    def checks_ids(self) -> bool:
        """Whether `take` assembles every batch in the compiled gather, which checks every id
        before it writes a byte (`take_columns`): rows from several columns, each one run.
        Its caller may then hand it unchecked ids (``checked=False``)."""
        return self.single is None and self._one_run and native_enabled()

    def take(
        self, flat: np.ndarray, out2d: np.ndarray, *, checked: bool = True, guarded: bool = False
    ) -> None:
        """Rows of ids from the mappings (and resident columns), after `guard` of the files
        the batch touches (``guarded``: the caller just did): one gather per column and chunk
        (see the module docstring); a large batch split across the gather pool while that
        pays. Ids are validated by the caller, or (``checked=False``, only where `checks_ids`)
        here: `RowIdOutOfRange` with nothing written."""
        if self.single is not None:
            if not guarded:
                self.guard(self._single_file)
            self._split.take(self.single, flat, out2d)
            return
        self.record.start()
        if self._one_run:
            runs: list[np.ndarray | None] = [None] * len(self.columns)
            if not guarded:
                self.guard(sorted({int(c.file[0]) for c in self.columns if c.resident is None}))
        else:
            runs = [c.runs_of(flat) for c in self.columns]
            self.guard(sorted({f for c, r in zip(self.columns, runs) for f in c.files_of(r)}))
        if len(self.columns) == 1:
            self.columns[0].take(flat, out2d, runs[0])
            return
        n = flat.shape[0]
        if n * self.row_bytes < PARALLEL_MIN_BYTES or not self._split.allowed:
            self._take_chunks(flat, out2d, runs, 0, n, checked)  # this thread: nothing to time
            return
        split = self._split.pick()
        if split and not checked:
            check_bounds(flat, self.n_rows)  # the parts gather apart: all checked first
            checked = True

        def part(lo: int, hi: int) -> None:
            self._take_chunks(flat, out2d, runs, lo, hi, checked)

        t0 = time.perf_counter()
        if split:
            run_split(part, n, min_items=2 * CHUNK_ROWS)
        else:
            part(0, n)
        self._split.report(split, n, time.perf_counter() - t0)

    def _take_chunks(
        self,
        flat: np.ndarray,
        out2d: np.ndarray,
        runs: list[np.ndarray | None],
        lo: int,
        hi: int,
        checked: bool = True,
    ) -> None:
        whole = lo == 0 and hi == flat.shape[0]  # no views to make
        if (self._one_run or all(r is None for r in runs)) and take_columns(
            self._gather_specs(), flat if whole else flat[lo:hi], out2d if whole else out2d[lo:hi]
        ):
            return  # every column one array: the compiled one-pass gather
        if not checked:
            check_bounds(flat[lo:hi], self.n_rows)  # a source not contiguous after all
        # Each column of ``out2d`` as a 1-D strided array of ``V{width}`` items: a copy into
        # it is one memcpy per row (faster than a 2-D uint8 or uint64 copy).
        fields = out2d.reshape(-1).view(self._row_dtype)
        wide = []
        for i, (c, r) in enumerate(zip(self.columns, runs)):
            dst = fields[f"c{i}"]
            if c.resident is not None:
                continue  # in the record: `ResidentRecord.fill` below
            if c.width * 4 <= self.row_bytes:
                # a narrow column: one gather of the whole range (a small buffer), one copy
                t = self._buf(c.width, hi - lo, "n")
                c.take(flat[lo:hi], t, None if r is None else r[lo:hi])
                dst[lo:hi] = t.reshape(-1).view(dst.dtype)
            else:
                wide.append((c, r, self._buf(c.width, CHUNK_ROWS), dst))
        for a in range(lo, hi, CHUNK_ROWS):
            b = min(hi, a + CHUNK_ROWS)
            ids = flat[a:b]
            for c, r, buf, dst in wide:
                t = buf[: b - a]
                c.take(ids, t, None if r is None else r[a:b])
                dst[a:b] = t.reshape(-1).view(dst.dtype)
        self.record.fill(flat[lo:hi], out2d[lo:hi])  # the columns in RAM, once loaded

    def _gather_specs(self) -> list[Spec]:
        """The compiled gather's column specs (`ResidentRecord.specs`), rebuilt when the
        record is loaded and when its spill is filled."""
        r = self.record
        key = (r.array is not None, r.spill_state == "ready")
        last = self._specs
        if last is None or last[0] != key:
            last = self._specs = (key, r.specs(self.columns))
        return last[1]

    def read_range(self, first: int, rows: int, out2d: np.ndarray) -> None:
        """Rows ``[first, first + rows)`` into ``out2d`` with long ``preadv`` calls (one per
        column and run the range crosses; a loop over runs, not rows), not through the
        mapping: what a bulk copy (Mooncake publish, `build --from-attached`) wants."""
        self.guard()
        end = first + rows
        for c in self.columns:
            part = out2d if len(self.columns) == 1 else np.empty((rows, c.width), np.uint8)
            r = int(np.searchsorted(c.first, first, side="right")) - 1
            pos = first
            while pos < end:
                run_end = int(c.first[r]) + c.arrays[r].shape[0]
                n = min(end, run_end) - pos
                off = int(c.offset[r]) + (pos - int(c.first[r])) * c.width
                self._pread(int(c.file[r]), part[pos - first : pos - first + n], off)
                pos += n
                r += 1
            if part is not out2d:
                out2d[:, c.start : c.start + c.width] = part

    def _pread(self, file: int, dest: np.ndarray, offset: int) -> None:
        mv = dest.reshape(-1).data
        got = 0
        while got < len(mv):
            n = os.preadv(self._fds[file], [mv[got:]], offset + got)
            if n <= 0:
                raise TruncatedFile(
                    f"table {self.name!r}: source {self._paths[file]!r} ended at byte "
                    f"{offset + got}"
                )
            got += n

    def where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, file offset) of each id's first column (the read rule's sample)."""
        return self.columns[0].where(ids)

    def single_layout(self) -> tuple[int, int] | None:
        """``(file index, byte offset of row 0)`` when the table is one run of one column
        (`single`): row ``r`` then lies at ``offset + r * row_bytes`` of that file."""
        if self.single is None:
            return None
        one = self.columns[0]
        return int(one.file[0]), int(one.offset[0])

    def sample_layout(self) -> tuple[int, int] | None:
        """``(address of row 0, width)`` of the widest column when it is one run: row ``r``'s
        bytes of it start at ``address + r * width``, so the read rule's residency sample
        needs no lookup (the narrow columns are resident, or small beside it). None
        otherwise."""
        widest = self._wide_run
        if widest is None:
            return None
        return int(widest.arrays[0].ctypes.data), widest.width

    def plan(self, flat: np.ndarray) -> ReadPlan:
        """Syscall reads for validated ids: per distinct id one read per column not resident
        (columns adjacent in one file merged), landing at ``i * row_bytes + column start``
        of the scratch, so `assemble` puts rows back as for a built table; the caller then
        calls `fill_resident` for the columns left out."""
        self.record.start()
        ready = self.record.state == "ready"  # stays so until close
        uniq, inverse = np.unique(flat, return_inverse=True)
        inverse = inverse.reshape(-1).astype(np.int64, copy=False)
        u = uniq.size
        rb = self.row_bytes
        base = np.arange(u, dtype=np.int64) * rb
        reads: list[list[np.ndarray]] = []  # [file, offset, length, dest] per read
        touched: set[int] = set()
        for c in self.columns:
            if ready and c.resident is not None:
                continue
            f, o = c.where(uniq)
            touched.update(np.unique(f).tolist())
            if reads:
                pf, po, pl, _pd = reads[-1]
                if bool(((pf == f) & (po + pl == o)).all()):
                    reads[-1][2] = pl + c.width
                    continue
            reads.append([f, o, np.full(u, c.width, np.int64), base + c.start])
        self.guard(sorted(touched))
        return ReadPlan(
            uniq,
            inverse,
            np.concatenate([r[0] for r in reads]).astype(np.int32),
            np.concatenate([r[1] for r in reads]),
            np.concatenate([r[2] for r in reads]),
            np.concatenate([r[3] for r in reads]),
            None,
            rb,
            u * rb,
            tuple(flat.shape),
        )

    def regions(self) -> dict[int, np.ndarray]:
        """fd -> the file's whole mapping (for the backends' residency checks)."""
        return dict(zip(self._fds, self.files))

    # -- residency --------------------------------------------------------------------------
    def _ranges(self) -> list[tuple[int, int]]:
        """Mapped (address, length) ranges of the rows' bytes read from the mappings (not
        the resident columns), one per run."""
        out = []
        for c in self.columns:
            if c.resident is not None:
                continue
            for a in c.arrays:
                if a.size:
                    out.append((a.ctypes.data, a.size))
        return out

    def populate(self, *, threads: int = 2, progress: Callable[[int], None] | None = None) -> None:
        """Load the resident columns (waits), then fault the other rows' pages in: one
        sequential pass per source file (``MADV_SEQUENTIAL``, ``MADV_POPULATE_READ`` per
        64 MiB; two threads interleaving one file's chunks would leave 4 KiB page-cache
        folios), up to ``threads`` files at once."""
        self.guard()
        self.record.wait()
        per_file: dict[int, list[tuple[int, int]]] = {}
        for a, n in sorted(self._ranges()):
            key = next((m for m, span in self._maps if m <= a < m + span), a)
            per_file.setdefault(key, []).append((a, n))
        populate_sequential(list(per_file.values()), threads=threads, progress=progress)
        self.record.fill_spill()  # the wide column is resident now

    def advise(self, advice: int) -> None:
        for a, n in self._ranges():
            madvise(a, n, advice)

    def residency(self) -> float:
        """Fraction of the pages of the rows read from the mappings that are in the page
        cache (``mincore``; resident columns are in RAM and not counted)."""
        if not self._maps:
            raise StoreClosed(f"table {self.name!r} is closed")
        total = hit = 0
        for a, n in self._ranges():
            have, pages = range_pages(a, n)
            total += pages
            hit += have
        return hit / total if total else 1.0

    def close(self) -> None:
        self.record.close()
        maps, self._maps = self._maps, []
        self._specs = None
        self.columns = []
        self._narrow = []
        self.single = None
        self.files = []
        for addr, span in maps:
            unmap_range(addr, span)
