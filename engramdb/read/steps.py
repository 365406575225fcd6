"""`StepReader`: a decode step's cold rows read without the engine's thread waiting or paying.

A `engramdb.decode.Decoder` hashes each step's new tokens as soon as they are sampled; the
layers that read the tables come later in the step. For the layers whose rows are cold, the
decoder hands the reader every layer's row ids at once (`StepReader.submit`, at ``push``).
The reader writes one ``O_DIRECT`` read per row into its ``io_uring`` submission queue and
returns: the process's polling kernel thread (`engramdb.io.sqpoll`), or where there is none
the ring's sleeping `Submitter` thread (woken with one ``eventfd_write``), issues the reads
on another core. At ``fill``, the layer's `StepTicket` reads the completions from the ring (no
system call once they are in; ``io_uring_enter`` waits, the GIL released, for any still in
flight) and copies the rows out of the reader's staging buffer.

Why this path, as measured on these machines (2-core VM, a single-thread torch loop, a
3.9 ms step, 32 cold rows a step needed a quarter into it):

* A background Python thread costs the engine more than the reads: waking a thread that
  sleeps on the other core took 27 us in the waker and 108 us until it ran, and each GIL
  hand-off between the two threads costs such a wake, paid by the engine when it comes back
  from a torch call (a background reader: 110-175 us a step in ``push``).
* Submitting the reads with ``io_uring_enter`` from the engine's thread costs ~1-2 us a read
  in the kernel (150 us a step: 0.954x the loop over RAM); through the polling thread the
  engine pays only for filling the entries (1.000x; 256 reads in an 8.7 ms step: 0.992x
  against 0.887x).
* ``O_DIRECT`` lands the rows in the reader's staging buffer, touched once when allocated.
  A page-cache read makes the kernel allocate fresh pages, and on a VM that returns free
  memory to its host the first CPU touch of each costs a second-level fault (6-10 us a
  page here). The device is asked for exactly the pages under the rows.

The page cache still fills: a table that fits starts its background warm at its first step
read (`LocalTable.note_buffered_read`), and the decoder's ``auto`` rule reads a resident
table from its mapping.

Per step the engine's thread runs a dozen numpy operations (offsets, the entries' ``off`` /
``len`` fields, one copy into the ring); a plan per step shape (the tables and their row
counts) holds everything that does not change between steps: each request's descriptor,
staging slot and file base offset.

One reader belongs to one decoder (or one module) and is used from one thread. A step
submitted while the previous one's reads are still in flight first waits for those (their
tickets end ``cancelled`` unless collected). A failed read raises `ReadError` naming the
file and offset at the layer's ``fill``; a read past the end of a file (a source truncated
under the reader) raises `TruncatedFile`; a short read of a row still inside the file is
read again with ``pread``.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Sequence

import numpy as np

from engramdb.io.base import read_error
from engramdb.io.foreground import FOREGROUND
from engramdb.io.mapping import prefault
from engramdb.io.sqpoll import polled_ring, step_compiled, submit_pushed
from engramdb.io.uring import IoUringBackend
from engramdb.io.uring_ring import (
    CQE_DTYPE,
    Ring,
)
from engramdb.layouts.geometry import PAGE
from engramdb.read import read_order
from engramdb.read.step_plan import (
    CANCELLED,
    FAILED,
    RUNNING,
    Layout,
    Plan,
    StepTable,
    StepTicket,
    direct_layout,
    plan_spans,
    release,
    staged,
    stride,
    take_step,
)
from engramdb.read.step_reap import StepCollector

__all__ = ["MAX_STEP_ROWS", "RUNNING", "StepReader", "StepTable", "StepTicket"]
_Job = tuple[StepTable, np.ndarray, StepTicket]  # a layer's table, row ids and ticket
_Cols = tuple[np.ndarray, np.ndarray, np.ndarray]  # entries' offset, length, descriptor words

# How long a step's reads keep the device busy, for the background warm's gap reading: a
# random 4 KiB read's latency, plus one read at the device's random-read rate (measured here:
# 88-95 k/s, ~0.2 ms latency with a few in flight).
_LATENCY_S = 2e-4
_PER_READ_S = 1.1e-5
#: Rows one step may hand the reader (larger steps use the tables' prefetchers): the kernel's
#: largest ring. The ring grows to the largest step read so far.
MAX_STEP_ROWS = 32768


class StepReader(StepCollector):
    """See the module docstring. `available` says whether this process can use it at all;
    `submit` returns False (nothing submitted) for a step it cannot read (a table assembled
    from several tensors, tables of different row widths, a file system that refuses
    ``O_DIRECT``, more than `MAX_STEP_ROWS` rows), which the caller reads another way."""

    def __init__(self) -> None:
        self._ring: Ring | None = None
        self._ring_plan: Plan | None = None  # the plan whose fd / addr the stage holds
        self._layouts: dict[int, tuple[StepTable, Layout | None]] = {}
        self._plans: dict[tuple[int, ...], Plan] = {}  # by tables and sizes
        self._direct: list[int] = []  # O_DIRECT descriptors to close
        self._buf: np.ndarray | None = None
        self._map: mmap.mmap | None = None
        self._plan: Plan | None = None  # the current step's
        self._cols: dict[int, _Cols] = {}  # ring position -> its entries' off, len, fd
        self._tickets: list[StepTicket] = []
        self._got = np.zeros(0, np.int64)  # per routed request (`_route`): bytes read, or -errno
        self._checked = False  # the current step's reads reaped and checked
        self._error: BaseException | None = None  # a read of the current step that failed
        self._left = 0  # requests of the current step not reaped yet
        self._routed = False  # completions read one by one this step (no whole-step sum)
        self._ordered = False  # the step in flight takes part in `read_order` (ends its burst)
        self._ready: set[int] = set()  # tickets (by lo) whose reads are checked
        self._indexed: set[int] = set()  # tickets (by lo) whose rows' units are computed
        # per ticket: completions reaped one by one (`_reap`), and the sum of their results
        self._counts = self._sums = np.zeros(0, np.int64)
        self._warmed: set[int] = set()  # tables told of a cold read (their warm starts)
        self._last: tuple[StepTable, Plan] | None = None  # a one-table step (`submit_fast`)
        self.closed = False
        self.retried = 0  # rows read again by ``pread`` after a short or interrupted read
        #: The compiled writer of a step's reads and copier of its rows
        #: (`engramdb.io.sqpoll.step_compiled`), or None.
        self._spans_fn = step_compiled("spans")
        self._files_fn = step_compiled("spans_files")  # for tables of several files
        self._copy_fn = step_compiled("copy_out")
        self._route_fn = step_compiled("route") if CQE_DTYPE.itemsize == 16 else None
        self._take_fn = (CQE_DTYPE.itemsize == 16 and step_compiled("take_step")) or take_step
        self._owned: list[object] = [None, None]  # the ring and the staging mapping
        self._finalizer = weakref.finalize(self, release, self._direct, self._owned)

    @staticmethod
    def available() -> bool:
        return IoUringBackend.availability()[0]

    # -- plans -------------------------------------------------------------------------------
    def _layout(self, store: StepTable) -> Layout | None:
        hit = self._layouts.get(id(store))
        if hit is not None and hit[0] is store:
            return hit[1]
        lay = direct_layout(store, self._direct)
        self._layouts[id(store)] = (store, lay)
        return lay

    def _plan_for(self, jobs: list[_Job], key: tuple[int, ...]) -> Plan | None:
        """A new plan for ``jobs`` (kept under ``key``, their tables and sizes); None where
        the step cannot be read this way."""
        layouts = [self._layout(store) for store, _, _ in jobs]
        if any(lay is None for lay in layouts):
            return None
        lays = [lay for lay in layouts if lay is not None]
        if len({lay.row_bytes for lay in lays}) != 1:
            return None
        sizes = [int(ids.size) for _, ids, _ in jobs]
        n = sum(sizes)
        buf = self._buffer(n * stride(lays[0].row_bytes, max(lay.align for lay in lays)))
        plan = Plan(lays, sizes, int(buf.ctypes.data))
        if self._got.size < n:  # each request's result, for any plan made so far
            self._got = np.empty(max(n, 256), np.int64)
        if len(self._plans) >= 16:  # a few shapes repeat (steps, prefills): keep it bounded
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _buffer(self, nbytes: int) -> np.ndarray:
        """The staging buffer, grown to ``nbytes`` (plans made for a smaller one are
        dropped: their slot addresses point into it)."""
        buf = self._buf
        if buf is None or buf.size < nbytes:
            size = -(-max(nbytes, 1 << 20) // PAGE) * PAGE
            m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = prefault(np.frombuffer(m, np.uint8))  # touched once: no fault per read
            old = self._map
            self._buf, self._map = buf, m  # between steps: no read targets the old one
            self._owned[1] = m
            self._plans.clear()
            self._ring_plan = None
            if old is not None:
                try:
                    old.close()
                except BufferError:  # pragma: no cover - rows are copies; nothing views it
                    pass
        return buf

    # -- submission --------------------------------------------------------------------------
    def submit(self, jobs: list[_Job], ordered: bool = False) -> bool:
        """Start the reads of one step: ``(table, ids, ticket)`` per layer, in the order the
        engine needs them (validated int64 ids of any shape; a ticket's rows come back in
        their order), the first layer's read first; ``ordered``: after other readers' steps
        too (`engramdb.read.read_order`). False, with nothing submitted, for a step it cannot
        read."""
        # (every statement here runs once a step on the engine's thread, just after the
        # model's compute has evicted the interpreter's code and data: each costs ~1 us)
        if self._left:
            self.drain()
        # (loops, not comprehensions: in this Python each of those is a call of its own)
        layer_ids = []
        key_parts: list[int] = []
        n = 0
        for store, ids, _ in jobs:
            layer_ids.append(ids)
            key_parts += (id(store), ids.size)
            n += ids.size
        key = tuple(key_parts)
        if self.closed or n == 0 or n > MAX_STEP_ROWS:
            return n == 0 and not self.closed
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan_for(jobs, key)
            if plan is None:
                return False
        ring = self._ring
        if ring is None or ring.entries < n:
            if ring is not None:
                ring.close()
            ring = self._ring = polled_ring(max(256, 1 << (n - 1).bit_length()))
            self._owned[0] = ring
            self._ring_plan = None
            self._cols.clear()
        # each row's file offset, its aligned span, into the submission entries: straight
        # into the ring's slots where they do not wrap (descriptor, address and tag written
        # once per plan and position), else staged
        # several files and no compiled writer: the descriptors change per step (entries
        # staged again); the compiled one writes each row's descriptor into its entry
        computed = not plan.single_file and self._files_fn is None
        if computed:
            plan_spans(plan, layer_ids)
            self._ring_plan = None
        tail = int(ring.sq_tail[0])
        pos = tail & ring.sq_mask
        if pos + n <= ring.entries:
            cols = self._cols.get(pos) if self._ring_plan is plan else None
            if cols is None:
                if self._ring_plan is not plan:
                    self._cols.clear()
                    self._ring_plan = plan
                cols = self._stage_at(ring, plan, pos, n)
            if computed or not self._spans_compiled(layer_ids, plan, ring, pos):
                if not computed:
                    plan_spans(plan, layer_ids)
                np.copyto(cols[0], plan.tmp, casting="unsafe")  # off
                np.copyto(cols[1], plan.span, casting="unsafe")  # len (rw_flags, the high half, 0)
                if not plan.single_file:
                    np.copyto(cols[2], plan.fd)
            ring.sq_tail[0] = (tail + n) & 0xFFFFFFFF
        else:
            if not computed:
                plan_spans(plan, layer_ids)
            self._cols.clear()
            self._ring_plan = None
            st = staged(ring.stage, plan)
            st["off"] = plan.tmp
            st["len"] = plan.span
            ring.push(n)
        lo = 0
        tickets = []
        for k, (store, ids_i, t) in enumerate(jobs):
            t.reader, t.store, t.lo, t.hi, t.k = self, store, lo, lo + ids_i.size, k
            t.state = RUNNING
            lo = t.hi
            tickets.append(t)
            if id(store) not in self._warmed:
                self._warmed.add(id(store))
                store.note_buffered_read()  # a table that fits starts its background warm
        self._tickets = tickets
        # a step of one table read the long way: the next such step may take `submit_fast`
        single = len(jobs) == 1 and ordered and not computed and self._ring_plan is plan
        self._last = (jobs[0][0], plan) if single else None
        # the first layer's reads first: the device serves a batch interleaved (`read_order`)
        self._launch(ring, plan, jobs[0][1].size if len(tickets) > 1 else 0, ordered)
        return True

    def _launch(self, ring: Ring, plan: Plan, first: int, ordered: bool) -> None:
        """The step of ``plan`` just pushed into ``ring`` (its tickets set) becomes the one in
        flight and goes to the kernel, its ``first`` entries read first; ``ordered``: after
        this thread's other readers' steps (`read_order`)."""
        n = plan.n
        self._checked = self._routed = False  # (`_counts` is zeroed by the first route)
        self._error = None
        if self._ready:
            self._ready.clear()
        if self._indexed:
            self._indexed.clear()
        self._plan = plan
        self._left = n
        self._ordered = ordered
        lead, after = read_order.begin(self) if ordered else (0, 0)
        # the background warm reads around these reads: about their device time (noted
        # first: a companion's submission returns only once the first layer's reads are in)
        FOREGROUND.note(_LATENCY_S + n * _PER_READ_S)
        r = submit_pushed(ring, n, first, lead, after)
        if lead:
            read_order.led(r == 1)
        if r < 0:
            self._failed(ring, plan, r)

    def submit_fast(self, store: StepTable, ids: np.ndarray, t: StepTicket) -> bool:
        """`submit` (``ordered``) of one table's rows in its steady state, in a few
        statements: the last step read the same table's same number of rows, each of its
        reads was reaped, and the ring's next entries already hold the plan's fixed fields;
        one compiled call then writes the reads' offsets and lengths. False (nothing
        submitted) where that does not hold: `submit` reads it the long way."""
        last = self._last
        if last is None or last[0] is not store or self._left or self.closed:
            return False
        plan, ring = last[1], self._ring
        n = plan.n
        if ids.size != n or ring is None or self._ring_plan is not plan or self._plan is not plan:
            return False
        tail = int(ring.sq_tail[0])
        pos = tail & ring.sq_mask
        if pos + n > ring.entries:
            return False
        if pos not in self._cols:
            self._stage_at(ring, plan, pos, n)
        if not self._spans_compiled((ids,), plan, ring, pos):
            return False
        ring.sq_tail[0] = (tail + n) & 0xFFFFFFFF
        t.reader, t.store, t.lo, t.hi, t.k, t.state = self, store, 0, n, 0, RUNNING
        self._tickets = [t]
        self._launch(ring, plan, 0, True)
        return True

    def _stage_at(self, ring: Ring, plan: Plan, pos: int, n: int) -> _Cols:
        """Entries ``pos .. pos + n - 1`` of ``ring`` given ``plan``'s fixed fields (its
        descriptors, staging addresses, tags), kept for later steps at ``pos``; their offset,
        length and descriptor words (the columns a step writes)."""
        ring.sqes[pos : pos + n] = staged(ring.stage, plan)
        words = ring.sqes[pos : pos + n].view(np.uint64).reshape(n, 8)
        fds = ring.sqes[pos : pos + n].view(np.int32).reshape(n, 16)[:, 1]
        cols = self._cols[pos] = (words[:, 1], words[:, 3], fds)
        return cols

    def _failed(self, ring: Ring, plan: Plan, r: int) -> None:
        """The step's ``io_uring_enter`` failed with ``r`` (-errno): its tickets fail, and
        the next step gets a fresh ring."""
        err = read_error(-r, int(plan.src_fd[0]), int(plan.off[0]), "io_uring_enter failed")
        self._left = 0
        for t in self._tickets:
            t.error, t.state = err, FAILED
        self._tickets = []
        self._ring = None  # a fresh ring next time
        self._owned[0] = None
        self._last = None
        ring.close()

    def _spans_compiled(self, ids: Sequence[np.ndarray], plan: Plan, ring: Ring, pos: int) -> bool:
        """The step's reads (``ids``: each table's row ids) written into entries ``pos..``
        of ``ring`` and into ``plan`` (offsets, starts, spans, their totals; for tables of
        several files each row's descriptors too) by one compiled call; False where it is
        not built or the ids are not ``plan.n`` contiguous int64 (the caller then writes
        every column of those entries another way)."""
        try:
            if plan.single_file:
                spans = self._spans_fn
                if spans is None:
                    return False
                plan.span_total = spans(
                    ids, plan.base, plan.rb, plan.align, plan.off, plan.tmp,
                    plan.ip, plan.span, ring.sqes, pos, plan.part_span, plan.n,
                )  # fmt: skip
                return True
            files = self._files_fn
            if files is None:
                return False
            plan.span_total = files(
                ids, plan.files, plan.rb, plan.align, plan.off, plan.tmp, plan.ip,
                plan.span, plan.fd, plan.src_fd, ring.sqes, pos, plan.part_span, plan.n,
            )  # fmt: skip
        except (ValueError, BufferError, TypeError):
            return False
        return True

    # -- completion --------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every read of the current step (tickets not collected end cancelled)."""
        while self._left > 0 and self._ring is not None:
            self._reap(wait=True)
        for t in self._tickets:
            if t.state == RUNNING:
                t.state = CANCELLED
        self._tickets = []

    def close(self) -> None:
        """Wait for reads in flight, then release the ring, the staging buffer and the
        ``O_DIRECT`` descriptors (idempotent)."""
        self.closed = True
        try:
            self.drain()
        finally:
            self._finalizer()
            self._ring = None
            self._buf = None
            self._map = None
            self._plans.clear()
