"""The process's one submission-polling kernel thread, for reads an engine thread must not
wait on or pay for.

A ring made by `polled_ring` is read by a kernel thread (``IORING_SETUP_SQPOLL``): the
caller writes submission entries and moves the tail — memory stores, no system call — and
the kernel thread, on another core, issues the reads. Every such ring of the process shares
one thread (``IORING_SETUP_ATTACH_WQ`` to an anchor ring made once), which sleeps after
`IDLE_MS` without submissions; `submit_pushed` wakes it when it sleeps.

Measured here (2-core VM, a single-thread torch loop, 32 cold ``O_DIRECT`` 4 KiB reads a
step, rows needed a quarter into a 3.9 ms step): submitting with ``io_uring_enter`` from the
loop's thread cost 150 us a step (0.954x the loop over RAM); through the polling thread
25 us (1.000x). 256 reads in an 8.7 ms step: 440 us (0.887x) against 37 us (0.992x).

The price is a core: the thread spins while submissions keep coming (a decode loop) and for
`IDLE_MS` after. So it is used only where the process may run on at least `MIN_CPUS` CPUs.
On a 2-core host the spinning thread took the core the table's background warm and the
kernel's I/O work needed, and the model's thread stalled for tens of ms outside its lookup
(5.1 GB cold decode at 6-8 ms steps: p99 33-46 ms with the poller, 9.5-29 ms without,
tokens/s equal within the noise; ``docs/probes.md``, 12th stop). ``ENGRAMDB_SQPOLL=0`` turns
it off everywhere (readers then submit with ``io_uring_enter`` from their own thread),
``ENGRAMDB_SQPOLL=1`` uses it from two CPUs up; a process allowed on one CPU and a kernel or
sandbox that refuses it get none.
Only on x86-64, whose ordering of plain stores the kernel thread relies on here (Python has
no release store; other architectures submit with ``io_uring_enter``).

**Without the polling thread, a submitter that sleeps** (`Submitter`, the compiled
``_submitter.c`` where it is built). A ring from `polled_ring` gets one thread of its own
that runs a C loop without the GIL, at ``SCHED_IDLE``. `submit_pushed` hands it the count
of entries just pushed (an atomic add to a word shared with the loop) instead of entering
the ring, and rings an eventfd (one ``eventfd_write``, 50-55 us here) only where the loop
sleeps. Decode steps come at a steady pace: the loop learns it and watches the shared word
for a short window around the next hand-over (`SPIN_ENV`), spinning from `MIN_CPUS` CPUs up
and in short sleeps below (`NAP_ENV`), so most cost the engine no system call (1-2 us). The
thread then calls ``io_uring_enter`` on another core, and the kernel's ~1.8 us a read of
submission work (~460 us for a B=8 step's 256 reads) leaves the engine's thread. The thread
spins (or naps) only in its short watch and needs no GIL, so it hands nothing back to the
engine; at ``SCHED_IDLE`` it never preempts the engine's thread that woke it (at normal
priority it did, on the engine's own core: the ``eventfd_write`` then took 340 us). Where
every CPU is busy at normal priority it waits, and the step's reads start when the reader
waits for them (below).

Nothing waits on that thread: a reader's wait for completions submits whatever is still
pending itself (``io_uring_enter`` with ``to_submit``; the kernel serializes the two), so
a slow, failed or stopped submitter costs time, never a hang. It is used from two CPUs up;
``ENGRAMDB_SUBMITTER=0`` turns it off, and readers then enter the ring themselves.
"""

from __future__ import annotations

import errno as _errno
import os
import platform
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engramdb._cpus import PROCESS_CPUS, run_as_worker
from engramdb.io.columns import native_enabled
from engramdb.io.uring_ring import (
    IORING_ENTER_SQ_WAKEUP,
    IORING_SQ_NEED_WAKEUP,
    Ring,
    enter,
)

try:
    from engramdb.io import _submitter as _native_submitter
except ImportError:  # pragma: no cover - built without a C compiler
    _native_submitter = None  # type: ignore[assignment]

__all__ = [
    "IDLE_MS",
    "MIN_CPUS",
    "NAP_ENV",
    "NAP_US",
    "SPIN_ENV",
    "SPIN_US",
    "SQPOLL_ENV",
    "SUBMITTER_ENV",
    "Submitter",
    "nap_ns",
    "polled_ring",
    "spin_ns",
    "sqpoll_state",
    "submit_pushed",
    "submitter_state",
]

#: ``0``: submit with ``io_uring_enter`` from the reader's thread; ``1``: use the polling
#: thread from two CPUs up; unset: from `MIN_CPUS` up.
SQPOLL_ENV = "ENGRAMDB_SQPOLL"
#: ``0``: no submitter thread (`Submitter`): readers without the polling thread enter the ring.
SUBMITTER_ENV = "ENGRAMDB_SUBMITTER"
#: Microseconds: the widest window a `Submitter` watches around a step's expected hand-over
#: (``0``: never watch; the engine rings its eventfd every step). Unset: `SPIN_US`.
SPIN_ENV = "ENGRAMDB_SUBMITTER_SPIN_US"
SPIN_US = 1000
#: Microseconds: how the watch waits inside its window: ``0`` spins, ``N`` sleeps ``N`` us at
#: a time (a hand-over then waits up to that long for its reads to start). Unset: spin from
#: `MIN_CPUS` CPUs up, else `NAP_US`.
NAP_ENV = "ENGRAMDB_SUBMITTER_NAP_US"
NAP_US = 50
#: CPUs the process must be allowed on before it spends one on a polling thread by default.
MIN_CPUS = 4
#: The polling thread sleeps after this many milliseconds without a submission.
IDLE_MS = 50

_lock = threading.Lock()
#: Forks this process has been through (a child's count differs from its parent's): a
#: per-call ``getpid`` was a system call a step on the engine's thread.
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))
_fence = threading.Lock()  # acquire + release: a locked instruction, a full fence on x86-64
_anchor: dict[str, object] = {"gen": -1, "ring": None, "why": ""}


def _process_cpus() -> frozenset[int]:
    """The CPUs the process had at import (`PROCESS_CPUS`), else this thread's now."""
    return PROCESS_CPUS or frozenset(os.sched_getaffinity(0))


def _anchor_ring() -> Ring | None:
    """The process's anchor ring (its polling thread), made once per process; None (with the
    reason in `sqpoll_state`) where polling is off or refused."""
    gen = _forks[0]
    with _lock:
        if _anchor["gen"] != gen:  # first use, or a child after fork: the parent's is not ours
            _anchor.update(gen=gen, ring=None, why="")
            setting = os.environ.get(SQPOLL_ENV, "").strip()
            cpus = sorted(_process_cpus())
            n_cpus = len(cpus)
            if setting == "0":
                _anchor["why"] = f"turned off by {SQPOLL_ENV}=0"
            elif platform.machine().lower() not in ("x86_64", "amd64"):
                _anchor["why"] = f"not on {platform.machine()} (x86-64 only)"
            elif n_cpus < 2:
                _anchor["why"] = "one CPU: a polling thread would take it from the engine"
            elif n_cpus < MIN_CPUS and setting != "1":
                _anchor["why"] = (
                    f"{n_cpus} CPUs: a spinning polling thread would take one from the engine "
                    f"and the table's warm ({SQPOLL_ENV}=1 uses it anyway)"
                )
            else:
                try:  # the last CPU this process may use: off the engine's, where possible
                    _anchor["ring"] = Ring(2, sqpoll_idle_ms=IDLE_MS, sqpoll_cpu=cpus[-1])
                except OSError:
                    try:
                        _anchor["ring"] = Ring(2, sqpoll_idle_ms=IDLE_MS)
                    except OSError as e:
                        _anchor["why"] = f"io_uring_setup refused SQPOLL: {e.strerror or e}"
        ring = _anchor["ring"]
    return ring if isinstance(ring, Ring) else None


def sqpoll_state() -> tuple[bool, str]:
    """``(polling, why not)`` for this process (makes the anchor ring on first call)."""
    ring = _anchor_ring()
    return ring is not None, str(_anchor["why"])


def step_compiled(name: str) -> Callable[..., Any] | None:
    """A compiled part of a decode step's reads from ``_submitter``, or None where it is not
    built or the compiled parts are off (``ENGRAMDB_NATIVE=0``): ``"spans"`` writes a step's
    reads into a ring's entries (each row's offset, aligned start and length, in one call),
    ``"copy_out"`` copies its rows from the staging buffer into the engine's buffer."""
    if _native_submitter is None or not native_enabled():
        return None
    return getattr(_native_submitter, name, None)


def _env_us(name: str, default: float) -> int:
    """The microseconds setting ``name`` (unset or not a number: ``default``), clamped to
    0..10 ms, in nanoseconds."""
    raw = os.environ.get(name, "").strip()
    try:
        us = float(raw) if raw else default
    except ValueError:
        us = default
    return int(min(max(us, 0.0), 10_000.0) * 1000)


def spin_ns() -> int:
    """The watch window's cap in nanoseconds: `SPIN_ENV` where set, else `SPIN_US`; 0: off."""
    return _env_us(SPIN_ENV, SPIN_US)


def nap_ns() -> int:
    """How the watch waits, in nanoseconds: 0 spins (by default where the process may run on
    at least `MIN_CPUS` CPUs: like the polling thread, not on a smaller host), else each of
    its sleeps (`NAP_US` by default below `MIN_CPUS`); `NAP_ENV` where set."""
    return _env_us(NAP_ENV, 0 if len(_process_cpus()) >= MIN_CPUS else NAP_US)


def submitter_state() -> tuple[bool, str]:
    """``(used, why not)``: whether rings without the polling thread get a `Submitter`."""
    if os.environ.get(SUBMITTER_ENV, "").strip() == "0":
        return False, f"turned off by {SUBMITTER_ENV}=0"
    if _native_submitter is None:
        return False, "engramdb.io._submitter is not built (no C compiler at install)"
    if len(_process_cpus()) < 2:
        return False, "one CPU: the submission work would stay on the engine's CPU"
    return True, ""


class Submitter:
    """A thread that submits one ring's pushed entries (see the module docstring). `wake`
    hands it a count; `stop` ends it (idempotent; the ring's `close` calls it first)."""

    def __init__(self, ring: Ring) -> None:
        assert _native_submitter is not None
        self._efd = os.eventfd(0, os.EFD_CLOEXEC)
        self._gen = _forks[0]  # a forked child has the ring but not the thread
        # the words shared with the C loop, alone on a cache line: entries handed over, the
        # loop watching, and its counts (`counts`)
        words = _native_submitter.STATE_WORDS
        raw = np.zeros(2 * words, np.int64)
        at = (-raw.ctypes.data % 64) // 8
        self._state = raw[at : at + words]
        self._addr = int(self._state.ctypes.data)
        self._notify = _native_submitter.notify
        #: The C loop's result once it ended (0 after `stop`, -errno after a failure).
        self.result: int | None = None
        # the queue's head and its tail now: the loop's submissions never reach past the
        # entries handed over (into a step pushed but not handed over yet)
        queue = (int(ring.sq_head.ctypes.data), int(ring.sq_tail[0]))
        self._thread = threading.Thread(
            target=self._run,
            args=(ring.fd, spin_ns(), nap_ns(), int(ring.cq_tail.ctypes.data), *queue),
            name="engramdb-submitter",
            daemon=True,
        )
        self._thread.start()

    def _run(
        self, ring_fd: int, spin: int, nap: int, cq_tail: int, sq_head: int, tail0: int
    ) -> None:
        run_as_worker()
        assert _native_submitter is not None
        try:  # never preempts the engine's thread it was woken by: it runs on an idle CPU
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # pragma: no cover - refused: normal priority
            pass
        self.result = _native_submitter.run(
            ring_fd, self._efd, self._addr, spin, nap, cq_tail, sq_head, tail0
        )

    def wake(self, count: int, first: int = 0, lead: int = 0, after: int = 0) -> bool:
        """Hand over ``count`` entries just pushed; False when the thread has ended. The
        loop submits the first ``first`` of them alone and the rest once those are read (0:
        all at once); publishes ``lead`` (> 0) once all are read; submits none before a
        loop of the process published ``after`` (another ring's ``lead``:
        `engramdb.read.read_order`). Each hold lasts at most 3 ms."""
        if self.result is not None or self._efd < 0 or self._gen != _forks[0]:
            return False
        return self._notify(self._addr, self._efd, count, first, lead, after) >= 0

    def counts(self) -> dict[str, int]:
        """Hand-overs the loop's watch caught (no system call on the engine's thread) and
        those the doorbell woke it for, the nanoseconds it watched, and the hand-overs whose
        reads it held back (`wake`'s ``first`` and ``after``)."""
        caught, rung, watched_ns = (int(x) for x in self._state[2:5])  # the C loop's words
        held = int(self._state[7])
        return {"caught": caught, "rung": rung, "watched_ns": watched_ns, "held": held}

    def stop(self) -> None:
        if self._efd < 0 or self._gen != _forks[0]:
            return
        assert _native_submitter is not None
        os.eventfd_write(self._efd, _native_submitter.STOP)
        self._thread.join()
        os.close(self._efd)
        self._efd = -1


def polled_ring(entries: int) -> Ring:
    """A ring of ``entries`` whose submissions the shared polling thread picks up; where
    polling is off or refused, a plain ring with its own `Submitter` (where
    `submitter_state` allows), else a plain ring. Raises `OSError` where io_uring is."""
    anchor = _anchor_ring()
    if anchor is not None:
        try:
            return Ring(entries, sqpoll_idle_ms=IDLE_MS, attach_fd=anchor.fd)
        except OSError as e:
            if e.errno not in (_errno.EINVAL, _errno.EPERM, _errno.EOPNOTSUPP):
                raise
    ring = Ring(entries)
    if submitter_state()[0]:
        sub = Submitter(ring)
        ring.wake = sub.wake
        ring.closers.append(sub.stop)
    return ring


#: Whether `submit_pushed` submits only a step's first entries here (`hold_in_caller`), and
#: how many steps it submitted so (`held_submits`).
_CALLER_HOLDS = [False]
_HELD = [0]


def held_submits() -> int:
    """Steps whose first layer this process submitted alone (`hold_in_caller`)."""
    return _HELD[0]


def hold_in_caller(on: bool = True) -> None:
    """For a process whose reading thread is not an engine's (a decode companion,
    `engramdb.decode_process`): a ring without a `Submitter` or polling thread then gets only
    a step's first entries from `submit_pushed` (its first layer's reads); the rest stay in
    the ring until that thread waits for a later layer's rows (`wait_ring` leaves a
    waiting layer's later entries unsubmitted), so the first layer's reads have the device
    to themselves, as a `Submitter`'s order gives them."""
    _CALLER_HOLDS[0] = bool(on)


def submit_pushed(ring: Ring, count: int, first: int = 0, lead: int = 0, after: int = 0) -> int:
    """Hand the ``count`` entries just pushed (`Ring.push`) to the kernel: the polling
    thread picks them up (woken if it sleeps), or one ``io_uring_enter`` submits them.
    Returns 0, 1 where a `Submitter` took them, or ``-errno`` of a failed
    ``io_uring_enter``. A `Submitter` (its reader's wait submits any it has not) keeps the
    order ``first`` / ``lead`` / ``after`` ask for (`Submitter.wake`: a step's first layer
    read first); the other ways submit all at once."""
    wake = ring.wake
    if wake is not None and wake(count, first, lead, after):
        return 1
    if ring.sqpoll:
        with _fence:  # the tail store reaches memory before the flag is read
            pass
        if int(ring.sq_flags[0]) & IORING_SQ_NEED_WAKEUP:
            r = enter(ring.fd, 0, 0, IORING_ENTER_SQ_WAKEUP)
            if r < 0 and r not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
                return r
        return 0
    keep = 0  # entries left in the ring for a later layer's wait (`hold_in_caller`)
    if _CALLER_HOLDS[0] and 0 < first < count and ring.unsubmitted() == count:
        keep = count - first
        _HELD[0] += 1
    while ring.unsubmitted() > keep:
        r = enter(ring.fd, ring.unsubmitted() - keep, 0, 0)
        if r < 0 and r not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
            return r
    return 0
