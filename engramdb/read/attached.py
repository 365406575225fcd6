"""`SourceSegments`: an attached table's rows read in place from its source files.

An attached table (``docs/format.md`` section 6) has no shards: each row is the
concatenation of its *columns* (e.g. a 256 B FP8 weight row and an 8 B scale row), and each
column's rows are *runs* of consecutive rows at byte offsets of source files (e.g. 128
safetensors tensors concatenated along rows). Every source file is mapped whole, read-only,
once; a run is a zero-copy ``[rows, width]`` view of its file's mapping.

* Warm gathers: one ``np.take`` per column when a column is one run (a table that is one
  run of one column — a single tensor — *is* a ``[n_rows, row_bytes]`` array, gathered
  exactly like a built table); a column of many runs groups the ids by run with one sort
  (a loop over runs, never over rows).
* Cold reads: `plan` returns a `ReadPlan` with one read per (distinct row, column) at the
  absolute file offset, so the syscall backends (preadv, io_uring, O_DIRECT widened to the
  file's alignment by the backend) read straight from the sources; a row's columns that are
  adjacent in one file are one read.
* Truncation: `guard` ``fstat``s the files before every read and raises `TruncatedFile`
  naming a file shorter than at attach, so no read touches a mapped page past its end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engramdb.errors import StoreClosed, TruncatedFile
from engramdb.io.gather import take_rows
from engramdb.io.mapping import (
    MADV_RANDOM,
    address_view,
    madvise,
    map_range,
    populate_range,
    range_pages,
    unmap_range,
)
from engramdb.layouts.geometry import PAGE
from engramdb.layouts.manifest import TableInfo
from engramdb.read.plan import ReadPlan

__all__ = ["SourceSegments"]


class _Column:
    """One column: its runs as arrays, with their first rows / files / offsets (int64)."""

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

    def runs_of(self, flat: np.ndarray) -> np.ndarray | None:
        """The run of each id (None: the column is one run)."""
        if len(self.arrays) == 1:
            return None
        return np.searchsorted(self.first, flat, side="right") - 1

    def files_of(self, run: np.ndarray | None) -> list[int]:
        """The files a batch with runs ``run`` touches."""
        if run is None:
            return [int(self.file[0])]
        return np.unique(self.file[run]).tolist()  # type: ignore[no-any-return]

    def take(self, flat: np.ndarray, out: np.ndarray, run: np.ndarray | None) -> None:
        """``out[i] = row flat[i]`` of this column (``out`` contiguous ``[n, width]``);
        ``run`` from `runs_of`."""
        if run is None:
            take_rows(self.arrays[0], flat, out)
            return
        order = np.argsort(run, kind="stable")
        counts = np.bincount(run, minlength=len(self.arrays))
        sorted_ids = flat[order] - self.first[run[order]]
        tmp = np.empty_like(out)
        pos = 0
        for r in np.flatnonzero(counts):
            n = int(counts[r])
            take_rows(self.arrays[r], sorted_ids[pos : pos + n], tmp[pos : pos + n])
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
    `advise`, `residency`, `close`) plus `take`, `plan`, `where`, `guard` and `regions`."""

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
                addr = map_range(fd, 0, span) if size else 0
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

    # -- reads ------------------------------------------------------------------------------
    def guard(self, files: list[int] | None = None) -> None:
        """Raise `TruncatedFile` naming a source (of ``files``, default all) that is now
        shorter than at attach (a read of its mapping past the new end would raise SIGBUS):
        one ``fstat`` per file, ~0.3 us."""
        for i in range(len(self._fds)) if files is None else files:
            now = os.fstat(self._fds[i]).st_size
            if now < self._sizes[i]:
                raise TruncatedFile(
                    f"table {self.name!r}: source {self._paths[i]!r} was truncated while open "
                    f"({now} bytes, attached with {self._sizes[i]})"
                )

    def take(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Rows of validated ids from the mappings (one gather per column), after `guard`
        of the files the batch touches."""
        if self.single is not None:
            self.guard(self._single_file)
            take_rows(self.single, flat, out2d)
            return
        runs = [c.runs_of(flat) for c in self.columns]
        self.guard(sorted({f for c, r in zip(self.columns, runs) for f in c.files_of(r)}))
        if len(self.columns) == 1:
            self.columns[0].take(flat, out2d, runs[0])
            return
        n = flat.size
        for c, r in zip(self.columns, runs):
            # np.take into a strided slice of out is ~4x slower than into a contiguous buffer
            part = np.empty((n, c.width), np.uint8)
            c.take(flat, part, r)
            out2d[:, c.start : c.start + c.width] = part

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

    def plan(self, flat: np.ndarray) -> ReadPlan:
        """Syscall reads for validated ids: per distinct id one read per column (columns
        adjacent in one file merged), landing at ``i * row_bytes + column start`` of the
        scratch, so `assemble` puts rows back as for a built table."""
        uniq, inverse = np.unique(flat, return_inverse=True)
        inverse = inverse.reshape(-1).astype(np.int64, copy=False)
        u = uniq.size
        rb = self.row_bytes
        base = np.arange(u, dtype=np.int64) * rb
        reads: list[list[np.ndarray]] = []  # [file, offset, length, dest] per read
        touched: set[int] = set()
        for c in self.columns:
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
        """Mapped (address, length) ranges of the rows' bytes, one per run."""
        out = []
        for c in self.columns:
            for a in c.arrays:
                if a.size:
                    out.append((a.ctypes.data, a.size))
        return out

    def populate(self, *, threads: int = 2, progress: Callable[[int], None] | None = None) -> None:
        """Fault the rows' pages in (``MADV_POPULATE_READ`` per 64 MiB, in threads)."""
        self.guard()
        chunk = 64 << 20
        work = [(a + o, min(chunk, n - o)) for a, n in self._ranges() for o in range(0, n, chunk)]

        def one(w: tuple[int, int]) -> None:
            populate_range(*w)
            if progress is not None:
                progress(w[1])

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(one, work))

    def advise(self, advice: int) -> None:
        for a, n in self._ranges():
            madvise(a, n, advice)

    def residency(self) -> float:
        """Fraction of the rows' pages in the page cache (``mincore``)."""
        if not self._maps:
            raise StoreClosed(f"table {self.name!r} is closed")
        total = hit = 0
        for a, n in self._ranges():
            have, pages = range_pages(a, n)
            total += pages
            hit += have
        return hit / total if total else 1.0

    def close(self) -> None:
        maps, self._maps = self._maps, []
        self.columns = []
        self.single = None
        self.files = []
        for addr, span in maps:
            unmap_range(addr, span)
