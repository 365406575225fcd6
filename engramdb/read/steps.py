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

import errno as _errno
import mmap
import weakref

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
    DONE,
    FAILED,
    RUNNING,
    Layout,
    Plan,
    StepTable,
    StepTicket,
    direct_layout,
    plan_spans,
    release,
    reread,
    staged,
    stride,
    take_step,
    wait_ring,
)

__all__ = ["MAX_STEP_ROWS", "RUNNING", "StepReader", "StepTable", "StepTicket"]
_Job = tuple[StepTable, np.ndarray, StepTicket]  # a layer's table, row ids and ticket

# How long a step's reads keep the device busy, for the background warm's gap reading: a
# random 4 KiB read's latency, plus one read at the device's random-read rate (measured here:
# 88-95 k/s, ~0.2 ms latency with a few in flight).
_LATENCY_S = 2e-4
_PER_READ_S = 1.1e-5
#: Rows one step may hand the reader (larger steps use the tables' prefetchers): the kernel's
#: largest ring. The ring grows to the largest step read so far.
MAX_STEP_ROWS = 32768


class StepReader:
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
        self._cols: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # ring position -> off, len
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
        self.closed = False
        self.retried = 0  # rows read again by ``pread`` after a short or interrupted read
        #: The compiled writer of a step's reads and copier of its rows
        #: (`engramdb.io.sqpoll.step_compiled`), or None.
        self._spans_fn = step_compiled("spans")
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
        computed = not plan.single_file
        if computed:  # several files: the descriptors change per step (entries staged again)
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
                ring.sqes[pos : pos + n] = staged(ring.stage, plan)
                words = ring.sqes[pos : pos + n].view(np.uint64).reshape(n, 8)
                cols = self._cols[pos] = (words[:, 1], words[:, 3])
            if computed or not self._spans_compiled(layer_ids, plan, ring, pos):
                if not computed:
                    plan_spans(plan, layer_ids)
                np.copyto(cols[0], plan.tmp, casting="unsafe")  # off
                np.copyto(cols[1], plan.span, casting="unsafe")  # len (rw_flags, the high half, 0)
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
        self._checked = self._routed = False  # (`_counts` is zeroed by the first route)
        self._error = None
        if self._ready:
            self._ready.clear()
        if self._indexed:
            self._indexed.clear()
        self._plan = plan
        self._left = n
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
        # the first layer's reads first: the device serves a batch interleaved (`read_order`)
        first = jobs[0][1].size if len(tickets) > 1 else 0
        self._ordered = ordered
        lead, after = read_order.begin(self) if ordered else (0, 0)
        # the background warm reads around these reads: about their device time (noted
        # first: a companion's submission returns only once the first layer's reads are in)
        FOREGROUND.note(_LATENCY_S + n * _PER_READ_S)
        r = submit_pushed(ring, n, first, lead, after)
        if lead:
            read_order.led(r == 1)
        if r < 0:
            err = read_error(-r, int(plan.src_fd[0]), int(plan.off[0]), "io_uring_enter failed")
            self._left = 0
            for t in self._tickets:
                t.error, t.state = err, FAILED
            self._tickets = []
            self._ring = None  # a fresh ring next time
            self._owned[0] = None
            ring.close()
        return True

    def _spans_compiled(self, ids: list[np.ndarray], plan: Plan, ring: Ring, pos: int) -> bool:
        """The step's reads (``ids``: each table's row ids) of one file per table written
        into entries ``pos..`` of ``ring`` and into ``plan`` (offsets, starts, spans, their
        totals) by one compiled call; False (nothing written) where it is not built or the
        ids are not ``plan.n`` contiguous int64."""
        spans = self._spans_fn
        if spans is None:
            return False
        try:
            plan.span_total = spans(
                ids, plan.base, plan.rb, plan.align, plan.off, plan.tmp,
                plan.ip, plan.span, ring.sqes, pos, plan.part_span, plan.n,
            )  # fmt: skip
        except (ValueError, BufferError, TypeError):
            return False
        return True

    # -- completion --------------------------------------------------------------------------
    def _reap_step(self) -> bool:
        """Every completion of the step in flight, waited for; True when each read returned
        its whole span (their sum is the step's: no read returns more than asked), without
        looking at them one by one. False: the slow path (`_reap`, per request) follows."""
        ring, plan = self._ring, self._plan
        assert ring is not None and plan is not None
        take, left = self._take_fn, self._left
        r = take(ring.cq_head, ring.cq_tail, ring.cqes, left, plan.span_total)
        if r == 0:  # not all in: wait for the rest
            wait_ring(ring, left - ((int(ring.cq_tail[0]) - int(ring.cq_head[0])) & 0xFFFFFFFF))
            r = take(ring.cq_head, ring.cq_tail, ring.cqes, left, plan.span_total)
        if r != 1:
            return False
        self._left = 0
        return True

    def _reap(self, wait: bool, hold: int = 0) -> None:
        """Route the completions in the ring (waiting for one first where ``wait`` and there
        are none, submitting any entries still pending but the last ``hold``) into ``_got``
        and the tickets' counts."""
        ring, plan = self._ring, self._plan
        assert ring is not None and plan is not None
        self._step_counts()
        n = self._route(ring, plan)
        if n == 0 and wait:
            r = wait_ring(ring, 1, hold)
            if r < 0 and r not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
                raise read_error(-r, int(plan.src_fd[0]), 0, "io_uring_enter failed")
            n = self._route(ring, plan)
        if n:
            self._left -= n
            self._routed = True

    def _step_counts(self) -> np.ndarray:
        """The step's completions per ticket, zeroed (with their results' sums) before its
        first completion is routed (most steps never route one by one: `_reap_step`)."""
        if not self._routed:
            self._counts, self._sums = np.zeros((2, len(self._tickets)), np.int64)
        return self._counts

    def _route(self, ring: Ring, plan: Plan) -> int:
        """Every completion now in ``ring``: its result to its request, its ticket's count up
        by one and its result into the ticket's sum, its slot freed; one compiled pass where
        built. Returns how many."""
        if self._route_fn is not None:
            return self._route_fn(
                ring.cq_head, ring.cq_tail, ring.cqes, self._got, plan.ends, self._counts,
                self._sums,
            )  # fmt: skip
        got = ring.reap()
        ud = got["user_data"].astype(np.int64)
        self._got[ud] = got["res"]
        where = np.searchsorted(plan.ends, ud, side="right")
        t = len(self._counts)
        self._counts += np.bincount(where, minlength=t)[:t]
        self._sums += np.bincount(where, got["res"], minlength=t)[:t].astype(np.int64)
        return int(got.size)

    def collect(self, t: StepTicket) -> None:
        """Wait for ``t``'s reads, check them and hand it its rows (`StepTicket.wait`). The
        first collect of a step waits for every read of the step (issued together, they
        land together) and checks them all; each ticket then copies its rows out."""
        if t.state != RUNNING:
            return
        if self._ordered:
            read_order.end()
        plan = self._checked_plan(t)
        if plan is None:
            t.error, t.state = self._error, FAILED
            return
        units = self._units(plan)
        self._index(plan, t)
        t.rows = units.take(plan.idx[t.lo : t.hi], 0).reshape(t.hi - t.lo, plan.rb)
        t.state = DONE

    @property
    def step_unit(self) -> int:
        """The copy unit of the step in flight (`finish_into` destinations end in it)."""
        plan = self._plan
        return plan.unit if plan is not None else 1

    def finish_into(self, dest: np.ndarray, t: StepTicket | None = None) -> bool:
        """Wait for the step in flight and copy rows straight into ``dest``: ticket ``t``'s,
        or (None) every row of the step. ``dest``: uint8, shape ``grid + (row_bytes //
        step_unit, step_unit)`` for a ``grid`` of those rows in submission order (e.g. the
        ticket's ids' shape, or ``[L, B, H]`` for a step of L layers); may be a strided view
        of the engine's buffer. Raises the step's error. False (nothing written) when the
        rows were already collected."""
        if t is not None:  # (no generator: a call of its own in this Python)
            if t.state != RUNNING:
                return False
            if self.finish_fast(dest, t):
                return True
            tickets = [t]
        else:
            tickets = self._tickets
            if not tickets or any(tk.state != RUNNING for tk in tickets):
                return False
        if self._ordered:
            read_order.end()
        plan = self._checked_plan(t)
        if plan is None:
            err = self._error
            assert err is not None
            for tk in tickets:
                tk.error, tk.state = err, FAILED
            raise err
        copy = self._copy_fn
        lo = 0 if t is None else t.lo
        try:
            if copy is None:
                raise ValueError
            copy(dest, self._buf, plan.slot, plan.ip, lo)  # one memcpy a row
        except (ValueError, BufferError, TypeError):  # not built, or an unusual destination
            for tk in tickets:
                self._index(plan, tk)
            idx = plan.idx if t is None else plan.idx[t.lo : t.hi]
            self._units(plan).take(idx.reshape(dest.shape[:-1]), 0, out=dest, mode="clip")
        for tk in tickets:
            tk.state = DONE  # their rows went to the engine's buffer
        return True

    def finish_fast(self, dest: np.ndarray, t: StepTicket) -> bool:
        """`finish_into` of ticket ``t`` in its steady state, in a few statements: the
        completions in the ring routed to their tickets by one compiled pass, and where
        each of ``t``'s reads is in and whole, its rows copied by another. False (nothing
        written) where that does not hold: `finish_into` waits, checks and copies the long
        way (from the routed counts)."""
        copy, route = self._copy_fn, self._route_fn
        if copy is None or route is None or t.state != RUNNING or t.reader is not self:
            return False
        plan = self._plan
        assert plan is not None
        if self._checked:
            if self._error is not None:
                return False
        else:
            if self._ordered:  # rows consumed: this thread's burst ends (`read_order`)
                read_order.end()
                self._ordered = False
            if self._left:
                ring = self._ring
                assert ring is not None
                counts = self._step_counts()
                n = route(
                    ring.cq_head, ring.cq_tail, ring.cqes, self._got, plan.ends, counts,
                    self._sums,
                )  # fmt: skip
                self._left -= n
                self._routed = True
            k = t.k
            # every read of the ticket in, and whole: their results' sum is its spans'
            if self._counts[k] != t.hi - t.lo or self._sums[k] != plan.part_span[k]:
                return False
            if not self._left:
                self._checked = True
                self._error = None
                self._note_reads(plan)
        try:
            copy(dest, self._buf, plan.slot, plan.ip, t.lo)
        except (ValueError, BufferError, TypeError):  # an unusual destination
            return False
        t.state = DONE
        return True

    def _note_reads(self, plan: Plan) -> list[int] | None:
        """The step's reads counted on their tables (`note_step_read`); each ticket's
        device bytes where the step has several (None: one)."""
        tickets = self._tickets
        if len(tickets) == 1:
            tickets[0].store.note_step_read(plan.n, plan.span_total)  # type: ignore[union-attr]
            return None
        parts = plan.part_span.tolist()
        for t, part in zip(tickets, parts):
            if t.store is not None:
                t.store.note_step_read(t.hi - t.lo, part)
        return parts  # type: ignore[no-any-return]

    def _checked_plan(self, t: StepTicket | None = None) -> Plan | None:
        """The step's plan once the reads of ticket ``t`` (None: the whole step) are reaped
        and checked; None (``_error`` set) when a read failed. A ticket other than the step's last
        waits only for its own reads where the others are still in flight (a large step:
        the lower layer's rows come first)."""
        plan = self._plan
        assert plan is not None
        if self._checked:
            return None if self._error is not None else plan
        tickets = self._tickets
        if t is not None and t is not tickets[-1] and t.lo not in self._ready:
            head = int(self._ring.cq_head[0])  # type: ignore[union-attr]
            if (int(self._ring.cq_tail[0]) - head) & 0xFFFFFFFF < self._left:  # type: ignore[union-attr]
                k = tickets.index(t)
                while self._step_counts()[k] < t.hi - t.lo:
                    # the later tickets' entries stay for the submitter (`submit`'s order)
                    self._reap(wait=True, hold=plan.n - t.hi)
                lo, hi = t.lo, t.hi
                # every read whole: their sum is the ticket's (`_route`; numpy's check: ~50 us)
                if int(self._sums[k]) != int(plan.part_span[k]):
                    got, span = self._got[lo:hi], plan.span[lo:hi]
                    err = self._reread(t.store, plan, np.flatnonzero(got != span) + lo)  # type: ignore[arg-type]
                    if err is not None:
                        self._error = err
                        return None
                self._ready.add(lo)
                return plan
        if t is not None and t.lo in self._ready:
            return plan
        self._checked = True
        self._complete()
        return None if self._error is not None else plan

    def _index(self, plan: Plan, t: StepTicket) -> None:
        """Each row's units in the staging buffer (``plan.idx``), for ticket ``t``'s rows
        (once a step)."""
        lo, hi = t.lo, t.hi
        if lo not in self._indexed:
            np.add(
                plan.base_idx[lo:hi], (plan.ip[lo:hi] >> plan.shift)[:, None], out=plan.idx[lo:hi]
            )
            self._indexed.add(lo)

    def _units(self, plan: Plan) -> np.ndarray:
        units = plan.units
        if units is None:
            buf = self._buf
            assert buf is not None
            units = plan.units = buf[: buf.size // plan.unit * plan.unit].reshape(-1, plan.unit)
        return units

    def _complete(self) -> bool:
        """Reap every completion of the step and check the reads; False (``_error`` set)
        when one failed for good."""
        fast = self._left > 0 and not self._routed and self._reap_step()
        while self._left > 0:
            self._reap(wait=True)
        plan = self._plan
        assert plan is not None
        n = plan.n
        self._error = None
        parts = self._note_reads(plan)
        # not `fast`: each completion was routed into its ticket's sum (numpy's sum: ~30 us)
        if not fast and self._sums.tolist() != (parts or plan.part_span.tolist()):
            got, span = self._got[:n], plan.span
            bad = np.flatnonzero(got != span)
            owner = self._owner_of(int(bad[0]))
            err = self._reread(owner.store, plan, bad)  # type: ignore[arg-type]
            if err is not None:
                self._error = err
                return False
        return True

    def _owner_of(self, i: int) -> StepTicket:
        for tk in self._tickets:
            if tk.lo <= i < tk.hi:
                return tk
        raise AssertionError(i)  # pragma: no cover - every request belongs to a ticket

    def _reread(self, store: StepTable, plan: Plan, bad: np.ndarray) -> BaseException | None:
        """`reread` of the requests ``bad`` into the staging buffer (counted in `retried`)."""
        assert self._buf is not None
        err, done = reread(self._buf, self._got, store, plan, bad)
        self.retried += done
        return err

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
