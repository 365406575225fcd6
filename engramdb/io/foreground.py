"""Latency-sensitive device reads, seen by the background warm so it reads between them.

A decode step reads a few dozen cold rows and needs them within a millisecond or two; the
background warm streams a whole table at device speed. Behind the warm's read-ahead (an
8 MiB window per chunk here) a step's reads queued for 6–13 ms at p50, against 0.7 ms alone.

`FOREGROUND` is the process's record of those reads: the syscall read paths of a table
(`engramdb.read.table.LocalTable.read_below`, the `engramdb.read.prefetch.Prefetcher`) wrap
each cold batch in `Foreground.reading`. From it the warm learns whether reads are *periodic*
(a decode loop: batches separated by gaps) and, if so, reads in small pieces only in the
gaps — after a batch is done and while the next is not yet due (`Foreground.wait_gap`), so
the device queue is empty when the next batch arrives. A load that keeps the device busy
for more than 60 % of each interval (batches back to back, or a large decode batch) is not
waited for: the warm then reads at full speed, since finishing it soon is what such a load
needs most (`Foreground.yielding`).

When every recent batch was a prefetch (rows for a future step, read while the model
computes: nobody waited on them), the loop gains nothing from the warm finishing soon, while
each byte the warm reads still costs the model's own step something (the device's DMA, the
host's I/O work, the page-cache work: about 0.1 s of a 38 ms step's time per GB read here).
The warm then also paces its pieces to `overlap_rate` (default 16 MiB/s for all the
process's tables together: a 5 GB table warms in about five minutes of such a loop, sooner
when the loop pauses; `Foreground.overlapped`).

``ENGRAMDB_WARM_YIELD=0`` turns the yielding off (the warm always reads at full speed);
``ENGRAMDB_WARM_OVERLAP_RATE`` (bytes/s, ``"64M"``) sets the pace beside prefetched reads.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engramdb.errors import InvalidArgument
from engramdb.io.mapping import populate_range
from engramdb.units import parse_size

try:  # a piece's calls without the GIL in between (`read_in_gaps`)
    from engramdb.io._pieces import read_piece as _read_piece
except ImportError:  # not built: the calls one by one
    _read_piece = None  # type: ignore[assignment]

__all__ = [
    "FOREGROUND",
    "OVERLAP_RATE_ENV",
    "YIELD_ENV",
    "Foreground",
    "StopSignal",
    "background_idle",
    "idle_priority",
    "overlap_rate",
    "read_in_gaps",
]

#: Set to ``0`` to keep the background warm at full speed beside foreground reads.
YIELD_ENV = "ENGRAMDB_WARM_YIELD"
#: The warm's pace (bytes/s) beside a loop whose reads are all prefetches.
OVERLAP_RATE_ENV = "ENGRAMDB_WARM_OVERLAP_RATE"
_OVERLAP_RATE = 16 << 20

_RECENT_S = 0.25  # foreground reads within this long count as active
_MAX_PERIOD_S = 0.5  # batch intervals longer than this are not a periodic loop
_BUSY_MAX = 0.6  # busier than this (fraction of each interval reading): a heavy load
_EWMA = 0.25
#: One piece read between periodic foreground batches (16 MiB pieces sized to long gaps
#: measured no better here).
_PIECE = 1 << 20


class Foreground:
    """Counts in-flight foreground batches and learns their rhythm (thread-safe).

    ``period``: smoothed interval between the starts of successive batches (0 until two
    have started less than `_MAX_PERIOD_S` apart); ``busy``: smoothed fraction of that
    interval spent reading. ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # the condition's own lock, taken directly where nobody waits (a C-level `with`)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.inflight = 0
        self._batches = 0
        self.last_start = float("-inf")
        self._period = 0.0
        self.busy = 0.0
        #: Batches announced with `note` count as in flight until this time.
        self.busy_until = float("-inf")
        #: When the last batch a caller waited on started (not a prefetch).
        self.last_waited = float("-inf")
        #: `note`'s batches ``(start, duration)`` not yet taken into the rhythm: the engine's
        #: thread only appends (a decode step's note inside a model step, where the code and
        #: data of the bookkeeping below sit cold: ~10 us there, against ~2 us for the
        #: append); whoever reads the rhythm next takes them in, under the lock, in order.
        #: Bounded: with no reader, the oldest go.
        self._noted: deque[tuple[float, float]] = deque(maxlen=64)

    @property
    def period(self) -> float:
        """The smoothed interval between batch starts (0: no rhythm)."""
        with self._lock:
            self._absorb()
            return self._period

    @property
    def batches(self) -> int:
        """Batches seen (entered or noted)."""
        with self._lock:
            self._absorb()
            return self._batches

    def enter(self, *, waited: bool = True) -> None:
        """A foreground batch starts its device reads; ``waited=False`` for a prefetch (a
        future step's rows, read while the caller computes)."""
        with self._lock:
            self._absorb()
            now = self._clock()
            if self.inflight == 0:
                self._started(now)
            if waited:
                self.last_waited = now
            self.inflight += 1
            self._batches += 1

    def exit(self) -> None:
        """The batch's reads are done."""
        with self._cond:
            self._absorb()
            self.inflight = max(0, self.inflight - 1)
            if self.inflight == 0:
                if self._period > 0.0:
                    frac = min(1.0, (self._clock() - self.last_start) / self._period)
                    self.busy += _EWMA * (frac - self.busy)
                self._cond.notify_all()

    def _started(self, now: float) -> None:
        """A batch starts with none in flight (the lock held): learn the interval."""
        gap = now - self.last_start
        if 0.0 < gap < _MAX_PERIOD_S:
            p = self._period
            self._period = gap if p == 0.0 else p + _EWMA * (gap - p)
        elif gap >= _MAX_PERIOD_S:
            self._period = 0.0  # a pause: the rhythm is learnt again
        self.last_start = now

    def _absorb(self) -> None:
        """(The lock held) the batches `note` announced since, in their order."""
        q = self._noted
        while q:  # (only the lock's holder takes: the engine's thread only appends)
            now, duration = q.popleft()
            if self.inflight == 0 and now >= self.busy_until:
                self._started(now)
                if self._period > 0.0:
                    self.busy += _EWMA * (min(1.0, duration / self._period) - self.busy)
            self.busy_until = max(self.busy_until, now + duration)
            self._batches += 1

    def note(self, duration: float) -> None:
        """A batch whose reads were handed to the kernel and are expected to take about
        ``duration`` seconds (`engramdb.read.steps.StepReader`: nobody waits on them until
        the engine needs the rows, so their end is estimated, not observed). It counts as in
        flight until then. Cheap for the caller: recorded, and taken into the rhythm by the
        next reader of it."""
        self._noted.append((self._clock(), duration))

    @contextmanager
    def reading(self, *, waited: bool = True) -> Iterator[None]:
        """``with FOREGROUND.reading(): backend.read(...)`` (``waited=False``: a prefetch)."""
        self.enter(waited=waited)
        try:
            yield
        finally:
            self.exit()

    def yielding(self) -> bool:
        """Whether the warm should read in the gaps: periodic foreground batches seen in the
        last `_RECENT_S`, not busy enough to be a throughput load, and not turned off."""
        if os.environ.get(YIELD_ENV, "1") == "0":
            return False
        with self._cond:
            self._absorb()
            now = self._clock()
            return (
                self._period > 0.0 and now - self.last_start < _RECENT_S and self.busy < _BUSY_MAX
            )

    def overlapped(self) -> bool:
        """Whether the warm should also pace itself (`overlap_rate`): `yielding`, and no
        batch in the last `_RECENT_S` was one a caller waited on (every read was a
        prefetch, hidden behind the caller's compute)."""
        if not self.yielding():
            return False
        with self._cond:
            return self._clock() - self.last_waited >= _RECENT_S

    def wait_gap(self, need: float, *, timeout: float) -> bool:
        """Block until a read of about ``need`` seconds fits before the next batch is due:
        no batch in flight, and ``now + need`` not past the predicted next start (the last
        start plus the period), or no batch expected any more. False when ``timeout`` ran
        out first (the caller reads anyway: the warm is never starved)."""
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                self._absorb()
                now = self._clock()
                if self.inflight == 0 and now >= self.busy_until:
                    period = self._period
                    due = self.last_start + period
                    if period == 0.0 or now > due + period or now + need <= due:
                        return True  # no rhythm, the loop stopped, or the read fits
                    # a batch is due before this read would end: wait for it to start and end
                    wake = min(deadline, due + period)
                else:
                    wake = min(deadline, max(self.busy_until, now + 1e-4))
                if now >= deadline:
                    return False
                self._cond.wait(max(0.0, min(wake - now, 0.05)))


def read_in_gaps(
    record: Foreground,
    fd: int,
    file_off: int,
    addr: int,
    n: int,
    bps: float,
    *,
    populate: bool,
    stop: threading.Event,
    pace: float | None = None,
) -> tuple[int, int, float]:
    """Read ``n`` bytes of ``fd`` at ``file_off`` (mapped at ``addr``) in `_PIECE` pieces,
    each started in a gap between ``record``'s batches that it ends before the next is due
    at the pieces' observed rate ``bps`` (`Foreground.wait_gap`, never waiting more than two
    of their periods): ``WILLNEED`` of exactly the piece, then the wait for it (this
    process's page tables with ``populate``, else its last page). With ``pace`` (bytes/s),
    a piece read while ``record`` is `Foreground.overlapped` is followed by a pause that
    holds the paced pieces of all the process's warms together to that rate (`_Pacer`).
    Returns the pieces read, how many of them were paced, and the updated rate; stops
    early once ``stop`` is set.

    Where ``engramdb.io._pieces`` is built, a piece's advice, wait and (where ``stop`` is a
    `StopSignal`, whose byte ends it early) pause run in one call that releases the GIL
    once: each release is a chance for the GIL to land
    here in the middle of the engine's compute, and the engine's thread then waits for it
    (0.13-0.27 such waits a step beside a B=1 decode with the calls one by one,
    `docs/probes.md`, 34th stop)."""
    sub = pieces = paced = 0
    native = _read_piece
    stop_flag = stop.flag if isinstance(stop, StopSignal) else None
    pause_in_call = native is not None and stop_flag is not None
    while sub < n and not stop.is_set():
        record.wait_gap(_PIECE / bps, timeout=max(0.02, 2 * record.period))
        m = min(n - sub, _PIECE)
        t = time.monotonic()
        slot_end = 0.0  # where the piece's slot in the pacing schedule ends (0: not paced)
        if pace is not None and record.overlapped():
            paced += 1
            slot_end = _PACER.slot(m, pace, t)
        if native is not None:  # advice, wait (and pause) in one call: the GIL taken back once
            wake = int(slot_end * 1e9) if pause_in_call else 0
            place = addr + sub if populate else 0
            took = native(fd, file_off + sub, m, place, wake, stop_flag) / 1e9
        else:
            os.posix_fadvise(fd, file_off + sub, m, os.POSIX_FADV_WILLNEED)
            if populate:
                populate_range(addr + sub, m)
            else:
                os.pread(fd, 1, file_off + sub + m - 1)
            took = time.monotonic() - t
        bps += _EWMA * (m / max(took, 1e-6) - bps)
        pieces += 1
        sub += m
        if slot_end and not pause_in_call:
            stop.wait(max(0.0, slot_end - time.monotonic()))
    return pieces, paced, bps


class StopSignal(threading.Event):
    """A `threading.Event` compiled code can read without the GIL: ``flag`` (one byte) is 1
    while it is set (`read_in_gaps` hands it to a native piece, whose pause it ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = bytearray(1)

    def set(self) -> None:
        self.flag[0] = 1
        super().set()

    def clear(self) -> None:
        self.flag[0] = 0
        super().clear()


class _Pacer:
    """One schedule for every table's warm in the process (they share the device, and the
    model's step pays for each byte whichever table it belongs to): a piece of ``n`` bytes
    started at ``t`` holds the next ``n / rate`` seconds from ``t`` or from the end of the
    pieces before it, whichever is later; its reader waits until that slot ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = float("-inf")

    def slot(self, n: int, rate: float, t: float) -> float:
        """When the slot of a piece of ``n`` bytes started at ``t`` ends (monotonic)."""
        with self._lock:
            self._free_at = max(self._free_at, t) + n / rate
            return self._free_at


_PACER = _Pacer()


def overlap_rate() -> float:
    """The background warm's pace beside prefetched reads, bytes/s: ``ENGRAMDB_WARM_OVERLAP_RATE``
    (a size per second: ``"64M"``, ``"1G"``, or a plain number), else 16 MiB/s. Raises
    `InvalidArgument` naming a value that is not a positive size."""
    text = os.environ.get(OVERLAP_RATE_ENV, "").strip()
    if not text:
        return float(_OVERLAP_RATE)
    try:
        rate = parse_size(text)
    except (InvalidArgument, ValueError) as e:
        raise InvalidArgument(f"{OVERLAP_RATE_ENV}={text!r} is not a size per second") from e
    if rate <= 0:
        raise InvalidArgument(f"{OVERLAP_RATE_ENV}={text!r} must be positive")
    return float(rate)


_idle = threading.local()
#: Whether every background pass of this process runs under ``SCHED_IDLE`` (`background_idle`).
_ALL_IDLE = [False]


def background_idle(on: bool | None = None) -> bool:
    """Whether this process's background passes (the warm) always run under ``SCHED_IDLE``;
    ``on`` sets it. A companion process (`engramdb.decode_companion`) has one foreground
    thread on its own CPU, whose reads the warm's page-table work would otherwise share
    that CPU with at equal weight (its gathers waited out the scheduler's slices: 0.75-0.83x
    over a warm run's first blocks, 38th stop)."""
    if on is not None:
        _ALL_IDLE[0] = bool(on)
    return _ALL_IDLE[0]


def idle_priority(on: bool) -> bool:
    """Run the calling thread under ``SCHED_IDLE`` (``on``) or back under the normal policy,
    changing it only when it differs; returns ``on``. Beside a decode loop the warm's CPU
    (page-cache work, this process's page tables) then never delays the model's thread or a
    prefetch; a throughput load keeps the warm at normal priority, so it is not starved."""
    if getattr(_idle, "on", False) != on:
        try:
            policy = os.SCHED_IDLE if on else os.SCHED_OTHER
            os.sched_setscheduler(0, policy, os.sched_param(0))
        except OSError:  # not allowed here: the normal policy
            return on
        _idle.on = on
    return on


#: The process's foreground record (one device queue is shared by all its tables).
FOREGROUND = Foreground()
