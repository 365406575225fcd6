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
"""

from __future__ import annotations

import errno as _errno
import os
import platform
import threading

from engramdb.io.uring_ring import (
    IORING_ENTER_SQ_WAKEUP,
    IORING_SQ_NEED_WAKEUP,
    Ring,
    enter,
)

__all__ = ["IDLE_MS", "MIN_CPUS", "SQPOLL_ENV", "polled_ring", "sqpoll_state", "submit_pushed"]

#: ``0``: submit with ``io_uring_enter`` from the reader's thread; ``1``: use the polling
#: thread from two CPUs up; unset: from `MIN_CPUS` up.
SQPOLL_ENV = "ENGRAMDB_SQPOLL"
#: CPUs the process must be allowed on before it spends one on a polling thread by default.
MIN_CPUS = 4
#: The polling thread sleeps after this many milliseconds without a submission.
IDLE_MS = 50

_lock = threading.Lock()
_fence = threading.Lock()  # acquire + release: a locked instruction, a full fence on x86-64
_anchor: dict[str, object] = {"pid": -1, "ring": None, "why": ""}


def _anchor_ring() -> Ring | None:
    """The process's anchor ring (its polling thread), made once per process; None (with the
    reason in `sqpoll_state`) where polling is off or refused."""
    pid = os.getpid()
    with _lock:
        if _anchor["pid"] != pid:  # first use, or a child after fork: the parent's is not ours
            _anchor.update(pid=pid, ring=None, why="")
            setting = os.environ.get(SQPOLL_ENV, "").strip()
            cpus = sorted(os.sched_getaffinity(0))
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


def polled_ring(entries: int) -> Ring:
    """A ring of ``entries`` whose submissions the shared polling thread picks up, or a
    plain ring where polling is off or refused. Raises `OSError` where io_uring is."""
    anchor = _anchor_ring()
    if anchor is not None:
        try:
            return Ring(entries, sqpoll_idle_ms=IDLE_MS, attach_fd=anchor.fd)
        except OSError as e:
            if e.errno not in (_errno.EINVAL, _errno.EPERM, _errno.EOPNOTSUPP):
                raise
    return Ring(entries)


def submit_pushed(ring: Ring, count: int) -> int:
    """Hand the ``count`` entries just pushed (`Ring.push`) to the kernel: the polling
    thread picks them up (woken if it sleeps), or one ``io_uring_enter`` submits them.
    Returns 0, or ``-errno`` of a failed ``io_uring_enter``."""
    if ring.sqpoll:
        with _fence:  # the tail store reaches memory before the flag is read
            pass
        if int(ring.sq_flags[0]) & IORING_SQ_NEED_WAKEUP:
            r = enter(ring.fd, 0, 0, IORING_ENTER_SQ_WAKEUP)
            if r < 0 and r not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
                return r
        return 0
    while ring.unsubmitted():
        r = enter(ring.fd, ring.unsubmitted(), 0, 0)
        if r < 0 and r not in (-_errno.EINTR, -_errno.EAGAIN, -_errno.EBUSY):
            return r
    return 0
