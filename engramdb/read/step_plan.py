"""The step reader's per-step bookkeeping: the tables as it sees them (and the ``O_DIRECT``
descriptors of their files), the plan of a step shape, the tickets a decoder waits on, and
the helpers that need none of the reader's own state (rows read again after a short read,
the wait on its ring, its release). `engramdb.read.steps` reads; kept apart so the reader's
module stays its read path."""

from __future__ import annotations

import errno as _errno
import math
import mmap
import os
import stat
from typing import Protocol

import numpy as np

from engramdb.errors import TruncatedFile
from engramdb.io.base import fd_path, read_error
from engramdb.io.uring_ring import (
    IORING_ENTER_GETEVENTS,
    IORING_ENTER_SQ_WAKEUP,
    Ring,
    enter,
    open_direct,
)
from engramdb.layouts.geometry import PAGE

__all__ = [
    "CANCELLED",
    "DONE",
    "FAILED",
    "QUEUED",
    "RUNNING",
    "Layout",
    "Plan",
    "StepTable",
    "StepTicket",
    "direct_layout",
    "grid_view",
    "plan_spans",
    "release",
    "reread",
    "staged",
    "stride",
    "take_step",
    "wait_ring",
]

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"


class StepTable(Protocol):
    """What the reader reads: a local table whose rows it can locate itself."""

    name: str
    row_bytes: int

    def step_layout(self) -> tuple[list[int], int, int] | None: ...
    def note_buffered_read(self) -> None: ...
    def note_step_read(self, rows: int, device_bytes: int) -> None: ...


class Collector(Protocol):
    """What a ticket waits on (`engramdb.read.steps.StepReader`)."""

    def collect(self, t: StepTicket) -> None: ...


class StepTicket:
    """One layer's rows of one step. `wait` collects them (reads the reader's completions,
    waiting for reads in flight; raises a failed read's error); then ``rows[k]`` is row
    ``ids[k]`` (request order: ``uids`` is None). `cancel` never withdraws (returns False):
    the reads are in flight, and waiting for them beats reading the rows again."""

    __slots__ = ("ids", "rows", "uids", "state", "error", "reader", "lo", "hi", "k", "store")

    def __init__(self, ids: np.ndarray):
        self.ids = ids
        self.rows: np.ndarray | None = None
        self.uids: np.ndarray | None = None
        self.state = QUEUED
        self.error: BaseException | None = None
        self.reader: Collector | None = None
        self.lo = self.hi = 0  # its requests in the reader's current step
        self.k = 0  # its place among the step's tickets
        self.store: StepTable | None = None

    def done(self) -> bool:
        return self.state not in (QUEUED, RUNNING)

    def cancel(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Collect the rows (blocks for reads in flight); raise the read's error."""
        reader = self.reader
        if self.state == RUNNING and reader is not None:
            reader.collect(self)
        if self.error is not None:
            raise self.error
        return True

    def __repr__(self) -> str:
        return f"<StepTicket {self.state} {self.ids.size} rows>"


class Layout:
    """One table as the reader sees it: ``O_DIRECT`` descriptors per file, rows per file
    (0: one file), the byte offset of row 0, the row width and the files' alignment."""

    __slots__ = ("fds", "dfds", "rows_per_file", "base", "row_bytes", "align")

    def __init__(
        self, fds: np.ndarray, dfds: np.ndarray, rows_per_file: int, base: int, rb: int, align: int
    ):
        self.fds, self.dfds, self.rows_per_file, self.base = fds, dfds, rows_per_file, base
        self.row_bytes, self.align = rb, align


def stride(rb: int, align: int) -> int:
    """Staging bytes per request: the longest page-aligned span a row can need."""
    return -(-(rb + align - 1) // align) * align


class Plan:
    """What does not change between steps of one shape: per request its staging slot
    (``stride`` bytes each), descriptor and base offset (single-file tables)."""

    def __init__(self, layouts: list[Layout], sizes: list[int], buf_addr: int):
        self.layouts = layouts
        self.n = n = sum(sizes)
        self.rb = rb = layouts[0].row_bytes
        self.align = a = max(lay.align for lay in layouts)
        self.stride = stride(rb, a)
        self.mask = np.int64(~(a - 1))
        self.single_file = all(lay.rows_per_file == 0 for lay in layouts)
        #: per request: the O_DIRECT descriptor the ring reads, the table's own (re-reads,
        #: errors); set per step for tables of several files
        self.fd = np.concatenate(
            [np.full(k, lay.dfds[0], np.int32) for lay, k in zip(layouts, sizes)]
        )
        self.src_fd = np.concatenate(
            [np.full(k, lay.fds[0], np.int32) for lay, k in zip(layouts, sizes)]
        )
        self.base = np.concatenate(
            [np.full(k, lay.base, np.int64) for lay, k in zip(layouts, sizes)]
        )
        #: per table: where its rows lie (`engramdb.io.sqpoll.step_compiled("spans_files")`)
        self.files = tuple((lay.rows_per_file, lay.base, lay.dfds, lay.fds) for lay in layouts)
        self.slot = np.arange(n, dtype=np.int64) * self.stride
        self.addr = (self.slot + buf_addr).astype(np.uint64)
        self.off = np.empty(n, np.int64)  # per step: each row's file offset
        self.tmp = np.empty(n, np.int64)  # per step: each request's (aligned) start
        self.span = np.empty(n, np.int64)  # per step: each request's length
        self.ip = np.empty(n, np.int64)  # per step: the row's offset inside its request
        # Rows are copied out of the staging buffer in units of ``unit`` bytes: it divides
        # the row width, the alignment (slot starts) and every row's offset in its file.
        unit = math.gcd(rb, 64, a)
        for lay in layouts:
            unit = math.gcd(unit, lay.base) if lay.base else unit
        self.unit = unit
        self.shift = unit.bit_length() - 1  # unit is a power of two
        self.unit_ar = np.arange(rb // unit, dtype=np.int64)
        self.slot_units = self.slot // unit
        self.idx = np.empty((n, rb // unit), np.int64)  # per step: each row's units
        self.base_idx = self.slot_units[:, None] + self.unit_ar  # each row's units, at ip 0
        self.units: np.ndarray | None = None  # the staging buffer as [*, unit] (set by the reader)
        self.span_total = 0  # per step: the bytes asked of the device
        self.part_span = np.zeros(len(layouts), np.int64)  # per step: those of each table
        self.starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64)  # each table's first request
        self.ends = np.cumsum(sizes, dtype=np.int64)  # and past its last


def grid_view(
    out: np.ndarray, lead: tuple[int, ...], n_layers: int, n_heads: int, unit: int, layer: int
) -> np.ndarray:
    """A decoder's output ``out`` (``[*lead, L, H, rb]``, or ``[*lead, H, rb]`` for one
    layer) as the reader's grid of rows in submission order (layers first) with ``[k, unit]``
    per row: every layer (``layer`` -1: ``[L, *lead, H, k, unit]``) or one layer's slice."""
    k = out.shape[-1] // unit
    if n_layers == 1:
        return out.reshape(lead + (n_heads, k, unit))
    grid = out.reshape(lead + (n_layers, n_heads, k, unit))
    if layer < 0:
        return np.moveaxis(grid, len(lead), 0)
    return grid[(slice(None),) * len(lead) + (layer,)]


def plan_spans(plan: Plan, ids: list[np.ndarray]) -> None:
    """Each row's file offset, its aligned read (start ``tmp``, length ``span``) and the
    row's place in it (``ip``), into ``plan``, with numpy (``ids``: the step's layers' row
    ids in order; a plan over several files also gets each row's descriptors)."""
    off, tmp, span, rb = plan.off, plan.tmp, plan.span, plan.rb
    if plan.single_file:
        flat = ids[0].reshape(-1) if len(ids) == 1 else np.concatenate([i.reshape(-1) for i in ids])
        np.multiply(flat, rb, out=off)
        off += plan.base
    else:
        lo = 0
        for lay, layer_ids in zip(plan.layouts, ids):
            hi = lo + layer_ids.size
            flat = layer_ids.reshape(-1)
            if lay.rows_per_file:
                f, local = np.divmod(flat, lay.rows_per_file)
                np.multiply(local, lay.row_bytes, out=off[lo:hi])
                plan.fd[lo:hi] = lay.dfds[f]
                plan.src_fd[lo:hi] = lay.fds[f]
            else:
                np.multiply(flat, lay.row_bytes, out=off[lo:hi])
                off[lo:hi] += lay.base
            lo = hi
    np.bitwise_and(off, plan.mask, out=tmp)
    ip = plan.ip
    np.subtract(off, tmp, out=ip)  # where the row starts in its span
    np.add(ip, rb + plan.align - 1, out=span)
    np.bitwise_and(span, plan.mask, out=span)
    np.add.reduceat(span, plan.starts, out=plan.part_span)
    plan.span_total = int(plan.part_span.sum())


def staged(stage: np.ndarray, plan: Plan) -> np.ndarray:
    """A ring's staging entries (``stage``, submission entries) for a step of ``plan``:
    descriptor, address and tag (the request's index) of each request filled in."""
    st = stage[: plan.n]
    st["fd"] = plan.fd
    st["addr"] = plan.addr
    st["user_data"] = np.arange(plan.n, dtype=np.uint64)
    return st


def take_step(
    cq_head: np.ndarray, cq_tail: np.ndarray, cqes: np.ndarray, left: int, total: int
) -> int:
    """A step's ``left`` completions taken at once where they are all in and their results
    sum to ``total`` (1: the head moved past them); 0: fewer are in; -1: more, or a read came
    back short or failed (nothing taken). The numpy twin of the compiled
    ``_submitter.take_step``, for builds without it."""
    head = int(cq_head[0])
    count = (int(cq_tail[0]) - head) & 0xFFFFFFFF
    if count != left:
        return 0 if count < left else -1
    at = (head + np.arange(count)) & (cqes.size - 1)
    if int(cqes["res"][at].astype(np.int64).sum()) != total:
        return -1
    cq_head[0] = (head + count) & 0xFFFFFFFF
    return 1


def direct_layout(store: StepTable, direct: list[int]) -> Layout | None:
    """How the reader reaches ``store``'s rows: its files, an ``O_DIRECT`` descriptor of each
    (appended to ``direct``, the caller's to close) and their offset alignment; None where
    the table does not say where its rows lie or a file system refuses ``O_DIRECT``."""
    where = store.step_layout()
    if where is None:
        return None
    fds, rows_per_file, base = where
    dfds, align = [], 512
    for fd in fds:
        dfd, a = _direct_fd(fd, direct)
        if dfd < 0:
            return None
        dfds.append(dfd)
        align = max(align, a)
    return Layout(
        np.asarray(fds, np.int32), np.asarray(dfds, np.int32), rows_per_file, base,
        store.row_bytes, align,
    )  # fmt: skip


def _direct_fd(fd: int, direct: list[int]) -> tuple[int, int]:
    """``(O_DIRECT descriptor, offset alignment)`` of the file behind ``fd`` (the descriptor
    appended to ``direct``); ``(-1, 0)`` where its file system refuses ``O_DIRECT``."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return -1, 0
    try:
        dfd, align = open_direct(fd)
    except OSError as e:
        raise read_error(e.errno or _errno.EIO, fd, 0, "cannot open O_DIRECT") from e
    if dfd < 0:
        return -1, 0
    direct.append(dfd)
    if align > PAGE:  # never seen; the staging layout assumes at most a page
        return -1, 0
    return dfd, align


def reread(
    buf: np.ndarray, got: np.ndarray, store: StepTable, plan: Plan, bad: np.ndarray
) -> tuple[BaseException | None, int]:
    """The step's requests ``bad`` whose read came back short or interrupted (``got``: each
    request's result) read again with ``pread`` into their place in the staging buffer
    ``buf`` (a loop over those rows only: never expected of a healthy file). Returns the
    error to raise where that fails (`TruncatedFile` where the file now ends before the row,
    a `ReadError` naming the file and offset otherwise; else None) and the rows read again."""
    rb = plan.rb
    done = 0
    for i in bad.tolist():
        fd, off, res = int(plan.src_fd[i]), int(plan.off[i]), int(got[i])
        if res >= off + rb - int(plan.tmp[i]):
            continue  # the span met the end of the file after the row: the row is whole
        if res < 0 and -res not in (_errno.EAGAIN, _errno.EINTR):
            return read_error(-res, fd, off), done
        try:
            data = os.pread(fd, rb, off)
        except OSError as e:
            return read_error(e.errno or _errno.EIO, fd, off), done
        if len(data) < rb:
            return TruncatedFile(
                f"table {store.name!r}: a row of {rb} B at offset {off} of {fd_path(fd)} "
                "lies past the end of the file (it is shorter than when opened)"
            ), done
        p = int(plan.slot[i] + (off - int(plan.tmp[i])))
        buf[p : p + rb] = np.frombuffer(data, np.uint8)
        done += 1
    return None, done


def wait_ring(ring: Ring, count: int, hold: int = 0) -> int:
    """Wait for ``count`` more completions of a step reader's ``ring`` (the GIL released
    meanwhile), waking a polling thread gone to sleep, or submitting the entries a
    `Submitter` has not yet but the last ``hold`` (later layers', left to it);
    ``io_uring_enter``'s result."""
    if ring.sqpoll:
        return enter(ring.fd, 0, count, IORING_ENTER_GETEVENTS | IORING_ENTER_SQ_WAKEUP)
    return enter(ring.fd, max(0, ring.unsubmitted() - hold), count, IORING_ENTER_GETEVENTS)


def release(direct: list[int], owned: list[object]) -> None:
    """A step reader's resources, at its close or collection: ``owned`` its ring and its
    staging mapping, ``direct`` the ``O_DIRECT`` descriptors it opened (closed, emptied)."""
    ring, m = owned[0], owned[1]
    if isinstance(ring, Ring):
        ring.close()  # the kernel finishes or cancels what is in flight; pinned pages stay
    if isinstance(m, mmap.mmap):
        try:
            m.close()
        except BufferError:
            pass
    for dfd in direct:
        try:
            os.close(dfd)
        except OSError:
            pass
    direct.clear()
