"""Memory tiers that manage themselves: the page-cache budget, a bounded-rate background
warm, the RSS budget, ``mlock`` and the memory accounting behind ``Store.memory()``.

* `page_cache_budget` — bytes a table may add to the page cache: ``MemAvailable`` minus a
  safety margin (`safety_margin`: 5 % of ``MemTotal``, at least 512 MiB), or the caller's
  value (``open(..., page_cache_budget="8G")``, or ``ENGRAMDB_PAGE_CACHE_BUDGET``).
* `BackgroundWarm` — one sequential pass over a table's shards at a bounded rate (its own
  descriptors, faulted through its own sequential mapping so read-ahead makes 2 MiB
  page-cache folios, then ``MADV_POPULATE_READ`` of the chunk so this process's page tables are filled too), skipping
  resident chunks; it cancels itself when ``MemAvailable`` falls under the safety margin or
  the bytes it added reach the budget, and on `cancel`. Beside periodic foreground reads (a
  decode loop, `engramdb.io.foreground`) it reads in pieces sized to the gaps between them,
  unless it starts with little of the table missing (a top-up: it reads that at once).
* re-exported from `engramdb.io.process_memory`: `mapped_rss` / `process_rss` — this
  process's resident pages of a mapping (``/proc/self/smaps``) and its ``VmRSS`` /
  ``RssAnon`` / ``RssFile``; `trim_mapped` drops this process's page-table entries of a range
  (``MADV_DONTNEED``: the page cache itself stays, for other processes and for a later minor
  fault); `lock_range` — ``mlock`` with a typed `MemoryLockRefused` naming ``RLIMIT_MEMLOCK``.
* a finished warm pass then locks the table (`engramdb.io.resident_lock`, the ``lock`` open
  option, ``"auto"`` by default): reclaim cannot take a warmed table's pages from under it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

from engramdb._cpus import run_as_worker
from engramdb.errors import InvalidArgument
from engramdb.io.foreground import (
    FOREGROUND,
    StopSignal,
    background_idle,
    idle_priority,
    overlap_rate,
    read_in_gaps,
)
from engramdb.io.mapping import (
    MADV_DONTNEED,
    MADV_SEQUENTIAL,
    madvise,
    map_range,
    populate_range,
    range_pages,
    touch_pages,
    unmap_range,
)
from engramdb.io.process_memory import (
    lock_range,
    mapped_rss,
    mapped_rss_split,
    meminfo,
    process_rss,
    safety_margin,
    trim_mapped,
    unlock_range,
)
from engramdb.io.residency import sampled_residency
from engramdb.io.resident_lock import ResidentLock
from engramdb.layouts.geometry import PAGE
from engramdb.units import parse_size

__all__ = [
    "BUDGET_ENV",
    "BackgroundWarm",
    "lock_range",
    "mapped_rss",
    "mapped_rss_split",
    "meminfo",
    "page_cache_budget",
    "parse_budget",
    "process_rss",
    "range_residency",
    "safety_margin",
    "trim_mapped",
    "unlock_range",
]

#: Environment override of the default page-cache budget (a size: ``8G``, ``512M``, bytes).
BUDGET_ENV = "ENGRAMDB_PAGE_CACHE_BUDGET"
_WILLNEED_STEP = 128 << 10  # the smallest common read_ahead_kb
_UNKNOWN_READ_AHEAD = 8 << 20


def _read_ahead_bytes(fd: int) -> int:
    """The block device's read-ahead window for ``fd``'s file (``read_ahead_kb`` in sysfs,
    the partition's disk for a partition); 8 MiB where it cannot be found (a filesystem
    without a block device, no sysfs)."""
    try:
        dev = os.fstat(fd).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for path in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
            try:
                with open(path) as f:
                    return int(f.read().strip()) << 10
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return _UNKNOWN_READ_AHEAD


def parse_budget(value: int | str | None, *, what: str = "page_cache_budget") -> int | None:
    """A budget in bytes: an int ``>= 0`` or a size string (``"8G"``); ``None`` / ``"auto"``
    mean the default (returned as None). Anything else is `InvalidArgument` naming it."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"{what} must be a size (bytes or e.g. '8G'), got {value!r}")
    try:
        return parse_size(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"{what}: {e}") from None


def page_cache_budget(value: int | str | None = None) -> int:
    """Bytes a table may add to the page cache: ``value`` if given, else
    ``ENGRAMDB_PAGE_CACHE_BUDGET`` if set, else ``MemAvailable - safety_margin()`` (>= 0)."""
    b = parse_budget(value)
    if b is not None:
        return b
    env = os.environ.get(BUDGET_ENV)
    if env:
        b = parse_budget(env, what=BUDGET_ENV)
        if b is not None:
            return b
    info = meminfo()
    return max(0, info.get("MemAvailable", 0) - safety_margin(info))


def range_residency(addr: int, length: int) -> int:
    """Resident page-cache pages of ``[addr, addr + length)`` inside a live mapping."""
    return range_pages(addr, length)[0]


# -- the background warm --------------------------------------------------------------------
#: A pass that starts with at most this share of its table missing, and at most
#: `TOP_UP_BYTES`, reads the missing pages at once instead of in a decode loop's gaps
#: (`BackgroundWarm`): at device speed, a fraction of a second.
TOP_UP_SHARE = 0.1
TOP_UP_BYTES = 256 << 20


class BackgroundWarm:
    """One bounded-rate sequential pass that brings a mapped table into the page cache and
    this process's page tables, in a daemon thread.

    ``base`` is the mapping's address; ``shards`` are ``(fd, nbytes)`` laid back to back in
    it, each starting on a page boundary (a `ShardMapping`), or ``(fd, nbytes, offset)``
    for a part of a file from page-aligned ``offset`` (an attached table's tensor).
    ``rate`` bounds the bytes read per second (the foreground keeps the rest of the device); ``budget`` bounds the bytes it
    adds to the page cache; a chunk is not read while ``MemAvailable`` is under ``margin``.
    ``state`` is ``"idle"``, ``"running"``, ``"done"`` or ``"cancelled"`` (``reason`` says
    why: ``"memory pressure"``, ``"budget"``, ``"cancelled"``, or the error).

    Beside a decode loop a pass reads in the loop's gaps, paced while every read of the loop
    is a prefetch (`read_in_gaps`). A pass that starts with little of the table missing
    (`TOP_UP_SHARE` of it at most, `TOP_UP_BYTES` at most, estimated from spread pages) is
    a *top-up* (``top_up``): it reads what is missing at once. A table the page cache lost a
    little of (reclaimed pages) is whole again in a fraction of a second, rather than read
    at the paced rate for seconds while the decoder reads each step's rows from the device
    because a warm is under way (`LocalTable.warming`)."""

    def __init__(
        self,
        base: int,
        shards: Sequence[tuple[int, ...]],
        *,
        rate: float,
        budget: int,
        margin: int | None = None,
        chunk: int = 16 << 20,
        populate: bool = True,
    ) -> None:
        if rate <= 0 or chunk < PAGE or chunk % PAGE:
            raise InvalidArgument("warm rate must be > 0 and chunk a positive page multiple")
        self.base = int(base)
        self.shards = [(int(sh[0]), int(sh[1]), int(sh[2]) if len(sh) > 2 else 0) for sh in shards]
        if any(off % PAGE for _, _, off in self.shards):
            raise InvalidArgument("warm regions must start on a page boundary")
        #: Bytes of the mapping the regions take, back to back from ``base`` (whole pages).
        self.span = sum(-(-size // PAGE) * PAGE for _, size, _ in self.shards)
        self.rate = float(rate)
        self.budget = int(budget)
        self.margin = safety_margin() if margin is None else int(margin)
        self.chunk = int(chunk)
        self.populate = bool(populate)  # also fill this process's page tables per chunk
        self.state = "idle"
        self.reason = ""
        self.bytes_read = 0  # bytes read from files (skipped resident chunks not counted)
        self.reading = False  # met pages not in the page cache (not only page tables)
        self.bytes_added = 0  # page-cache pages this pass brought in, in bytes
        self.passes = 0
        self.gap_pieces = 0  # pieces read between periodic foreground batches
        self.paced_pieces = 0  # of those, pieces paced beside prefetched reads
        self.top_up = False  # the pass found little missing: read it at once (class doc)
        #: ``time.monotonic()`` when the last pass started and when it ended (0.0: not yet).
        self.started_at = self.ended_at = 0.0
        self._piece_bps = 1e9  # smoothed read rate of those pieces (bytes/s)
        #: Called (from the warm thread) when a pass finished reading the whole table.
        self.on_done: Callable[[], None] | None = None
        #: Then called (same thread) with a "stop now" check: what keeps the table resident.
        self.on_resident: Callable[[Callable[[], bool]], object] | None = None
        self._stop = StopSignal()  # (its byte also ends a native piece's pause)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def seconds(self) -> float:
        """How long the last pass ran (so far, while it runs; 0.0 before the first)."""
        if not self.started_at:
            return 0.0
        return (self.ended_at or time.monotonic()) - self.started_at

    def start(self) -> bool:
        """Start a pass unless one is running; returns whether one was started."""
        with self._lock:
            if self.state == "running":
                return False
            self._stop.clear()
            self.state, self.reason = "running", ""
            self.bytes_read = self.bytes_added = 0
            self.reading = False
            self.started_at, self.ended_at = time.monotonic(), 0.0
            self._thread = threading.Thread(target=self._run, name="engramdb-warm", daemon=True)
            self._thread.start()
            return True

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the pass at the next chunk and wait for it (idempotent)."""
        with self._lock:
            t = self._thread
            if self.state == "running":
                self.reason = reason
            self._stop.set()
        if t is not None and t is not threading.current_thread():
            t.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the pass; returns whether it has finished."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def _finish(self, state: str, reason: str = "") -> None:
        with self._lock:
            self.state = state
            self.ended_at = time.monotonic()
            if reason and not self.reason:
                self.reason = reason
            self.passes += 1
        done, resident = self.on_done, self.on_resident
        if state == "done" and done is not None:
            done()  # e.g. the read rule checks residency at its next batch, not 0.25 s later
        if state == "done" and resident is not None:
            resident(self._stop.is_set)  # e.g. `ResidentLock.after_warm`, stopped by `cancel`

    def missing_estimate(self, samples: int = 1024) -> int:
        """Bytes of the pass's regions not in the page cache, estimated from ``samples``
        evenly spread pages (one ``mincore`` each: ~2 ms for 1024, whatever the size)."""
        return int(self.span * (1.0 - sampled_residency(self.base, self.span, samples)))

    def _run(self) -> None:
        run_as_worker()
        t0 = time.monotonic()
        try:
            lost = self.missing_estimate()
            self.top_up = lost <= min(TOP_UP_BYTES, TOP_UP_SHARE * self.span)
            idle_priority(background_idle())  # a companion's: page-table work too
            pos = self.base
            for fd, size, start in self.shards:
                own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
                span = -(-size // PAGE) * PAGE
                seq = 0
                slack = 2 * _read_ahead_bytes(own)  # POSIX_FADV_SEQUENTIAL doubles it
                try:
                    # the doubled read-ahead window keeps the device busy beside foreground
                    # reads (1.2 GB/s here against 0.7 without it)
                    os.posix_fadvise(own, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    if size:
                        seq = map_range(own, start, span)
                        madvise(seq, span, MADV_SEQUENTIAL)
                    for off in range(0, size, self.chunk):
                        if self._stop.is_set():
                            self._finish("cancelled", "cancelled")
                            return
                        n = min(self.chunk, size - off)
                        addr = pos + off
                        have = range_residency(addr, n)
                        missing = -(-n // PAGE) - have
                        if missing:
                            self.reading = True
                            if meminfo().get("MemAvailable", 0) < self.margin:
                                self._finish("cancelled", "memory pressure")
                                return
                            if self.bytes_added + missing * PAGE > self.budget:
                                self._finish("cancelled", "budget")
                                return
                            # Counted over the chunk plus the read-ahead window past it:
                            # read-ahead brings those pages in too.
                            win = min(size, off + n + slack) - off
                            before, pages = range_pages(addr, win)
                            gaps = FOREGROUND.yielding()
                            idle_priority(gaps or background_idle())
                            if gaps and not self.top_up:
                                # periodic foreground reads (a decode loop): the chunk in
                                # pieces, each in a gap between their batches, no read-ahead
                                # past it (so the device queue is empty when a batch comes),
                                # on the CPU only when nothing else wants it; paced when
                                # every read of the loop is a prefetch (nobody waits on
                                # the table, and each byte read slows the loop's compute)
                                pieces, paced, self._piece_bps = read_in_gaps(
                                    FOREGROUND, own, start + off, addr, n, self._piece_bps,
                                    populate=self.populate, stop=self._stop,
                                    pace=overlap_rate(),
                                )  # fmt: skip
                                self.gap_pieces += pieces
                                self.paced_pieces += paced
                            elif self.bytes_added + (pages - before) * PAGE <= self.budget:
                                # Faulted in through our own sequential mapping of our
                                # own descriptor: read-ahead then fills the page cache
                                # with 2 MiB folios, which mappings map with 2 MiB entries
                                # (WILLNEED steps leave 4 KiB folios; gathers through
                                # 4 KiB entries ran ~1.3x slower here, TLB misses), at
                                # 1.5-1.8 GB/s here (1 MiB preads: 0.7-0.95).
                                populate_range(seq + off, n)
                            else:
                                # Near the budget: exactly this chunk, no read-ahead past it.
                                for sub in range(off, off + n, _WILLNEED_STEP):
                                    step = min(_WILLNEED_STEP, off + n - sub)
                                    os.posix_fadvise(own, start + sub, step, os.POSIX_FADV_WILLNEED)
                                os.pread(own, 1, start + off + n - 1)  # the chunk's last page
                            self.bytes_read += n
                            self.bytes_added += max(0, range_pages(addr, win)[0] - before) * PAGE
                        elif seq:
                            # mincore counts pages read-ahead still has in flight: fault
                            # them through the sequential view too, so read-ahead goes on
                            # (through the table's random-advice mapping it would stop, and
                            # the rest would come 4 KiB at a time)
                            populate_range(seq + off, n)
                        if self.populate and not self._stop.is_set():  # page tables (cheap
                            populate_range(addr, n)  # when hot; not after a cancelled piece)
                            # and one byte of each page read by this CPU: on this VM a
                            # resident page not read for a while is slow at its next read
                            # (the host's side of guest memory, `touch_pages`); paid here,
                            # not in the gathers after it (~0.1 us a page where it is not)
                            touch_pages(addr, n)
                        if seq:  # our private view's page-table entries: not this RSS
                            madvise(seq + off, n, MADV_DONTNEED)
                        # Rate bound: never ahead of rate * elapsed.
                        ahead = self.bytes_read / self.rate - (time.monotonic() - t0)
                        if ahead > 0 and self._stop.wait(ahead):
                            self._finish("cancelled", "cancelled")
                            return
                finally:
                    if seq:
                        unmap_range(seq, span)
                    os.close(own)
                pos += span
        except Exception as e:  # a vanished file, an unreadable page: stop, say why
            self._finish("cancelled", f"{type(e).__name__}: {e}")
            return
        self._finish("done")


# -- one mapped table's memory --------------------------------------------------------------
class MappedTiers:
    """The memory policy of one mapped table: whether it fits the page-cache budget, the
    background warm started by its first cold read, the RSS budget, ``mlock`` and the
    keep-warm watcher.

    ``base``/``length`` are the table mapping; ``shards`` its ``(fd, nbytes)`` back to back.
    ``budget`` is the page-cache budget (None: `page_cache_budget()` at each decision),
    ``rate`` the background warm's bytes per second, ``rss_budget`` the most bytes of the
    mapping this process keeps mapped resident (None: no bound), ``keep_warm`` re-warms after
    residency loss. A watcher thread runs only when ``rss_budget`` or ``keep_warm`` is set,
    every ``interval`` seconds. ``lock`` (`engramdb.io.resident_lock`): ``"auto"`` ``mlock``s
    the table once a warm pass made it resident (within half of ``MemTotal``), ``True``
    whatever its size, ``False`` only on `lock`."""

    def __init__(
        self,
        base: int,
        length: int,
        shards: Sequence[tuple[int, ...]],
        *,
        budget: int | None,
        rate: float,
        rss_budget: int | None = None,
        keep_warm: bool = False,
        background: bool = True,
        interval: float = 0.25,
        lock: bool | str = "auto",
    ) -> None:
        self.base = int(base)
        self.length = int(length)
        self.budget_option = budget
        self.rss_budget = rss_budget
        self.keep_warm = bool(keep_warm)
        self.background = bool(background)
        self.interval = float(interval)
        self.fits = self._fits()
        populate = rss_budget is None or rss_budget >= self.length
        self.warm = BackgroundWarm(
            self.base, shards, rate=rate, budget=self.budget(), populate=populate
        )
        self.warm_starts = 0
        self.trimmed_bytes = 0
        self.trims = 0
        # ``lock`` (`ResidentLock`): after a finished warm pass; never with an RSS budget
        # below the table (a lock holds every page mapped)
        self.resident_lock = ResidentLock(self.base, self.length, lock if populate else False)
        self.warm.on_resident = self.resident_lock.after_warm
        self._hand = 0  # where the next RSS trim starts (a clock over the mapping)
        self._trim_lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if rss_budget is not None or self.keep_warm:
            self._watcher = threading.Thread(target=self._watch, name="engramdb-tiers", daemon=True)
            self._watcher.start()

    def budget(self) -> int:
        """The page-cache budget in bytes now (the option, else the default)."""
        return page_cache_budget(self.budget_option)

    def resident_bytes(self) -> int:
        """Bytes of the table in the page cache (``mincore``; the last page counted up to
        the table's end)."""
        return min(self.length, range_residency(self.base, self.length) * PAGE)

    def sampled_residency(self, samples: int = 256) -> float:
        """Share of ``samples`` evenly spread pages of the table in the page cache (one
        ``mincore`` each: ~0.5 ms for 256, whatever the table's size)."""
        return sampled_residency(self.base, self.length, samples)

    def _fits(self) -> bool:
        """Whether the table's non-resident bytes fit the budget: no page looked at when the
        whole table does; else estimated from `sampled_residency` (256 ``mincore`` calls,
        not one per page: a count over a 50 GB table would take ~0.1 s of every open)."""
        budget = self.budget()
        if self.length <= budget:
            return True
        missing = self.length * (1.0 - self.sampled_residency())
        return missing <= budget

    # -- the background warm ------------------------------------------------------------------
    def on_cold_read(self) -> bool:
        """A batch went to the device: if the table fits, start the background warm (once;
        with ``keep_warm``, again whenever none is running: pages were lost, and the
        watcher would notice only at its next check); whether a pass started now."""
        if not self.fits or self.warm.running:
            return False
        if (self.background and self.warm.state == "idle") or self.keep_warm:
            return self.start_warm()
        return False

    def warm_once(self) -> bool:
        """Start the background pass if it never ran, the table fits and background warms
        are on; whether one started. For reads that are a sign the table is not (or not in
        this process) at memory speed but not of lost pages: a mapped gather that was slow
        (page faults: the table in the page cache, e.g. after ``engramdb warm`` in another
        process, this process's page tables empty; resident chunks then cost only their
        entries) or a prefetch's syscall read. Lost pages are the ``keep_warm`` watcher's
        and `on_cold_read`'s. One attribute read once the pass has run."""
        if self.warm.state != "idle" or not self.background or not self.fits:
            return False
        return self.start_warm()

    def start_warm(self) -> bool:
        """Start a background warm pass (skips resident chunks); whether one started."""
        self.warm.budget = self.budget()
        started = self.warm.start()
        self.warm_starts += started
        return started

    # -- RSS budget ---------------------------------------------------------------------------
    def mapped_rss(self) -> int:
        return mapped_rss(self.base, self.length)

    def mapped_rss_split(self) -> tuple[int, int]:
        return mapped_rss_split(self.base, self.length)

    def trim(self) -> int:
        """Drop this process's mapped pages of the table beyond ``rss_budget`` (to 90 % of
        it), a window at a time from a rotating hand; returns the bytes of address range
        dropped. The page cache keeps the pages (a later touch is a minor fault)."""
        limit = self.rss_budget
        if limit is None:
            return 0
        with self._trim_lock:
            dropped = 0
            for _ in range(4):
                rss = self.mapped_rss()
                target = int(limit * 0.9)
                if rss <= limit and dropped == 0:
                    return 0
                if rss <= target:
                    break
                density = max(rss / self.length, 1e-9)
                span = min(self.length, -(-int((rss - target) / density) // PAGE) * PAGE)
                start = self._hand
                first = min(span, self.length - start)
                trim_mapped(self.base + start, first)
                if span > first:
                    trim_mapped(self.base, span - first)
                self._hand = (start + span) % max(PAGE, self.length)
                self._hand -= self._hand % PAGE
                dropped += span
            self.trimmed_bytes += dropped
            self.trims += 1
            return dropped

    # -- mlock --------------------------------------------------------------------------------
    @property
    def locked_bytes(self) -> int:
        return self.resident_lock.locked_bytes

    def lock(self, budget: int | None = None) -> int:
        """``mlock`` the table (faults it in), or its first ``budget`` bytes; returns the
        bytes locked. Refused → `MemoryLockRefused` naming ``RLIMIT_MEMLOCK``."""
        return self.resident_lock.lock(budget)

    def unlock(self) -> None:
        self.resident_lock.unlock()

    # -- the watcher --------------------------------------------------------------------------
    def check(self) -> None:
        """One watcher step: trim to the RSS budget; with ``keep_warm``, re-warm when pages
        were lost and the table still fits."""
        if self.rss_budget is not None:
            self.trim()
        if self.keep_warm and not self.warm.running:
            if self.sampled_residency() < 1.0:
                self.fits = self._fits()
                if self.fits:
                    self.start_warm()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the mapping went away under us: stop watching
                return

    def close(self) -> None:
        self._stop.set()
        self.warm.cancel("closed")
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join()
        self.unlock()
