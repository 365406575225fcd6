"""The completion side of `engramdb.read.steps.StepReader`: a step's reads reaped from its
ring, checked (a short read of a row still inside its file is read again with ``pread``) and
its rows handed to the tickets or copied straight into the engine's buffer."""

from __future__ import annotations

import errno as _errno
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from engramdb.io.base import read_error
from engramdb.io.uring_ring import Ring
from engramdb.read import read_order
from engramdb.read.step_plan import (
    DONE,
    FAILED,
    RUNNING,
    Plan,
    StepTable,
    StepTicket,
    reread,
    wait_ring,
)

__all__ = ["StepCollector"]


class StepCollector:
    """A step reader's completion side (`StepReader` is one; its constructor sets the state
    below): reaping, checking, and handing out a step's rows."""

    _ring: Ring | None
    _plan: Plan | None  # the current step's
    _buf: np.ndarray | None
    _map: mmap.mmap | None
    _tickets: list[StepTicket]
    _got: np.ndarray  # per routed request (`_route`): bytes read, or -errno
    _checked: bool  # the current step's reads reaped and checked
    _error: BaseException | None  # a read of the current step that failed
    _left: int  # requests of the current step not reaped yet
    _routed: bool  # completions read one by one this step (no whole-step sum)
    _ordered: bool  # the step in flight takes part in `read_order` (ends its burst)
    _ready: set[int]  # tickets (by lo) whose reads are checked
    _indexed: set[int]  # tickets (by lo) whose rows' units are computed
    _counts: np.ndarray  # per ticket: completions reaped one by one (`_reap`)
    _sums: np.ndarray  # per ticket: the sum of their results
    _copy_fn: Callable[..., Any] | None  # the compiled row copier (`step_compiled`)
    _route_fn: Callable[..., int] | None  # the compiled completion router
    _take_fn: Callable[..., int]  # the whole-step completion check
    retried: int  # rows read again by ``pread`` after a short or interrupted read

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
