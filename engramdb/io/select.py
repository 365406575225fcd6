"""Choosing a backend: the ``auto`` rule and the name -> backend factory.

The rule (measured on these machines, see ``docs/io.md``), from the share of a batch's
sampled pages that are in the page cache:

* all resident (and mapped) -> ``mmap``: a populated mapping gathers 10-20x faster than any
  syscall path (e.g. 19 M vs ~1 M rows/s for 160 B rows);
* none resident -> ``io_uring`` with ``O_DIRECT`` where it saves device bytes
  (`direct_pays`: 1.00x device bytes for 2560 B rows, 512 B instead of 4 KiB for 160 B
  rows, ~10 % more rows/s there; no page-cache pollution), buffered ``io_uring`` for
  page-sized page-aligned rows (same bytes, ~10 % faster buffered);
* some resident -> buffered ``io_uring``: the resident part is served from memory;
* where io_uring is unavailable (kernel, sandbox, ``ENGRAMDB_DISABLE_IO_URING``) ``preadv``
  takes both cold roles.

Residency is sampled with ``mincore`` (~2-3 us per page). A cold fault through a mapping
costs ~50-100 us against ~1 us per request on io_uring, so the mapping only wins when well
under ~2 % of a batch is cold; "every sampled page resident" is the cheap test of that.
`AutoBackend` keeps the answer as a state so the warm path pays one sample per large batch,
not a full check (see its docstring).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from engramdb.errors import BackendUnavailable, InvalidArgument, StoreClosed
from engramdb.io.base import Backend, Batch
from engramdb.io.mmapio import MmapBackend
from engramdb.io.preadv import PreadvBackend
from engramdb.io.residency import resident_count
from engramdb.io.uring import IoUringBackend

__all__ = [
    "BACKENDS",
    "AutoBackend",
    "choose_backend",
    "cold_backend",
    "direct_pays",
    "make_backend",
]

BACKENDS = ("auto", "mmap", "preadv", "io_uring")


def choose_backend(
    resident_fraction: float,
    *,
    mapped: bool,
    io_uring: bool,
    direct: bool = True,
    fits: bool = False,
    warming: bool = False,
) -> str:
    """The auto rule as a pure function: the backend for a batch whose sampled pages are
    ``resident_fraction`` resident. ``mapped``: a mapping exists; ``io_uring``: io_uring
    works here; ``direct``: O_DIRECT is allowed and saves device bytes (`direct_pays`);
    ``fits``: the table fits the page-cache budget and the caller did not ask for O_DIRECT;
    ``warming``: a background warm pass is reading the table into the page cache now.
    Returns ``"mmap"``, ``"io_uring_direct"``, ``"io_uring"`` or ``"preadv"``.

    A table that fits is read through the page cache (buffered) so reading it warms it and
    the rule moves on to the mapping; O_DIRECT (which never warms anything) is kept for
    tables that cannot fit, and for the seconds a background warm pass runs: the pass warms
    the table, in 2 MiB page-cache folios, where buffered random reads would leave 4 KiB
    ones in every region they touch first (mapped through 4 KiB page-table entries, warm
    gathers then ran ~1.2-1.3x slower here). The full table of inputs -> choice is in
    ``docs/io.md``."""
    if mapped and resident_fraction >= 1.0:
        return "mmap"
    if not io_uring:
        return "preadv"
    if direct and mapped and (warming or (not fits and resident_fraction <= 0.0)):
        return "io_uring_direct"
    return "io_uring"


def direct_pays(
    offsets: ArrayLike,
    lengths: ArrayLike,
    *,
    sector: int = 512,
    page: int = 4096,
    max_ratio: float = 0.75,
) -> bool:
    """Whether O_DIRECT reads of these requests move at most ``max_ratio`` of the device
    bytes buffered reads would (sector-aligned spans against whole pages).

    Measured here: for page-sized, page-aligned rows (4096 B) O_DIRECT reads the same bytes
    and ran ~10 % slower than buffered io_uring; for 160 B and 2560 B rows it reads 6x / 2.3x
    fewer bytes and ran as fast or faster. Vectorised; meant for a sample of a batch.
    """
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    if off.shape[0] == 0:
        return True
    ln = np.broadcast_to(np.asarray(lengths, dtype=np.int64), off.shape)
    end = off + ln
    direct = int((-(-end // sector) - off // sector).sum()) * sector
    buffered = int((-(-end // page) - off // page).sum()) * page
    return direct <= max_ratio * buffered


def cold_backend(**options: Any) -> Backend:
    """io_uring if available here, else preadv (options go to whichever is built)."""
    if IoUringBackend.availability()[0]:
        return IoUringBackend(**options)
    options.pop("direct", None)
    options.pop("entries", None)
    return PreadvBackend(**options)


def _label(b: Backend) -> str:
    return f"{b.name}_direct" if b.direct else b.name


class AutoBackend(Backend):
    """Per batch: ``mmap`` while the data is resident, else a cold backend (see the module
    docstring for the rule).

    ``mapped`` is an `MmapBackend` over the same descriptors (``None``: no residency
    information, every batch goes to ``cold``). ``cold`` (buffered; default io_uring, else
    preadv) serves partly resident data; ``direct_cold`` serves data with no sampled page
    resident (default: an O_DIRECT `IoUringBackend` when io_uring works and ``use_direct``).
    The sub-backends are closed with this one.

    The choice is a small state machine, cheap on the warm path:

    * in the *mapped* state, a batch of at least ``min_sampled`` requests first checks
      ``1 + n // 65536`` (at most ``samples``) of its pages with ``mincore``; a miss sends
      it, and the state, cold before anything is read. Smaller batches are not sampled (a
      stray fault costs them less than the check);
    * an mmap batch slower than ``slow_us`` per request (it may have faulted, or the machine
      was busy) makes the next batch check a full ``samples`` pages;
    * while the whole mapping is locked in memory (``locked``), the mapped state checks
      nothing and a slow batch changes nothing (locked pages cannot have gone);
    * in a *cold* state, every ``recheck_s`` seconds a batch samples ``samples`` pages and
      the rule picks again (mmap, direct or buffered).

    Callers that plan per backend (the `Store`: a plan pays for syscall backends only) use
    `choose` then `feedback`; `read` does both. ``choices`` counts what served each batch
    (``"mmap"``, ``"io_uring_direct"``, ``"io_uring"``, ``"preadv"``).
    """

    name = "auto"
    supports_direct = False
    wants_plan = True

    def __init__(
        self,
        mapped: MmapBackend | None = None,
        cold: Backend | None = None,
        direct_cold: Backend | None = None,
        *,
        use_direct: bool = True,
        samples: int = 16,
        min_sampled: int = 256,
        slow_us: float = 2.0,
        recheck_s: float = 0.25,
    ) -> None:
        super().__init__()
        if samples < 1 or min_sampled < 1 or slow_us <= 0 or recheck_s < 0:
            raise InvalidArgument(
                "samples and min_sampled must be >= 1, slow_us > 0 and recheck_s >= 0"
            )
        self.mapped = mapped
        self.cold = cold if cold is not None else cold_backend()
        if direct_cold is None and use_direct and IoUringBackend.availability()[0]:
            direct_cold = IoUringBackend(direct=True)
        self.direct_cold = direct_cold if use_direct else None
        self.samples = int(samples)
        self.min_sampled = int(min_sampled)
        self.slow_us = float(slow_us)
        self.recheck_s = float(recheck_s)
        self.choices: dict[str, int] = {}
        self.last_choice = ""
        #: The table fits the page-cache budget (set by the table's owner): cold reads stay
        #: buffered so they warm the page cache.
        self.fits = False
        #: Whether a background warm pass is filling the table now (set by the table's
        #: owner): cold batches then read O_DIRECT, leaving the page cache to the pass.
        self.warming: Callable[[], bool] | None = None
        #: Called after a slow mapped batch (it may have faulted): the table's memory policy
        #: populates this process's page tables in the background (`MappedTiers`).
        self.on_slow_mapped: Callable[[], object] | None = None
        #: Called once, when a check first puts the rule in its mapped state (the table's
        #: owner may then start filling this process's page tables in the background).
        self.on_mapped: Callable[[], object] | None = None
        #: Whether resident batches may be served from the mapping (a table with an RSS budget
        #: below its size says no: mapped gathers would fault the table into its RSS; resident
        #: batches then go to buffered syscall reads, page-cache hits).
        self.serve_mapped = True
        self._lock = threading.Lock()
        self._state: Backend = self.cold  # the backend serving batches until the next check
        self._checked = -float("inf")  # monotonic time of the last cold-state sample
        self._suspect = False  # the last mmap batch was slow: check harder next time
        #: In the mapped state and not suspect: a caller may gather from the mapping without
        #: asking (one attribute read; kept in step by `choose` and `feedback`).
        self.mapped_ok = False
        #: Whether every page the mapping serves is locked in memory (set by the table's
        #: owner, `ResidentLock.whole`): locked pages cannot have been evicted, so the mapped
        #: state needs no residency sample and a slow mapped batch is a busy machine (on a
        #: VM, memory the host has let go cold), not page faults: the rule stays as it is.
        self.locked: Callable[[], bool] | None = None

    @property
    def io_uring(self) -> bool:
        return self.cold.name == "io_uring"

    @property
    def in_mapped_state(self) -> bool:
        """Whether the rule is in its mapped state: the last check found the batch's sampled
        pages resident, so batches are served from the mapping until a check says otherwise
        (False without a mapping). One attribute read."""
        return self.mapped is not None and self._state is self.mapped

    @property
    def suspect(self) -> bool:
        """Whether the last mmap batch was slow (it may have faulted): the next batch checks a
        full sample of its pages before it is served."""
        return self._suspect

    def _pick(self, fraction: float, offsets: ArrayLike, lengths: ArrayLike | None) -> Backend:
        direct = self.direct_cold is not None and (lengths is None or direct_pays(offsets, lengths))
        name = choose_backend(
            fraction,
            mapped=self.mapped is not None and self.serve_mapped,
            io_uring=self.io_uring,
            direct=direct,
            fits=self.fits,
            warming=self.warming is not None and self.warming(),
        )
        if name == "mmap" and self.mapped is not None:
            return self.mapped
        if name == "io_uring_direct" and self.direct_cold is not None:
            return self.direct_cold
        return self.cold

    def resident_fraction(self, fds: ArrayLike, offsets: ArrayLike, samples: int = 0) -> float:
        """Share of sampled request pages that are resident (0.0 without a mapping).

        ``samples`` (default: the configured number) requests evenly spread over the
        batch are checked, one ``mincore`` (~2 us) each.
        """
        mapped = self.mapped
        if mapped is None:
            return 0.0
        off = np.asarray(offsets).reshape(-1)
        n = off.shape[0]
        if n == 0:
            return 1.0
        k = min(n, samples or self.samples)
        # A handful of samples: plain Python is cheaper than numpy calls at this size.
        pick = [i * (n - 1) // max(1, k - 1) for i in range(k)]  # distinct because k <= n
        offs = off[pick].tolist()
        fd = np.asarray(fds).reshape(-1)
        fdl = fd[pick].tolist() if fd.shape[0] == n else [int(fd[0])] * k
        try:
            addrs = []
            for f, o in zip(fdl, offs, strict=True):
                base, size = mapped.address(f)
                addrs.append(base + min(max(o, 0), size - 1))
            hits = resident_count(addrs)
        except OSError:  # no mapping for a file, or an address outside it: read it cold
            return 0.0
        return hits / k

    def _choose(
        self, fds: ArrayLike, offsets: ArrayLike, lengths: ArrayLike | None, n: int
    ) -> Backend:
        """The backend for this batch of ``n`` requests (see the class docstring for the cost).

        ``fds``/``offsets``/``lengths`` describe the batch's requests, or an evenly spread
        sample of them (at least ``samples`` long), with ``n`` (`choose`'s ``batch_rows``)
        the batch size: a caller that has row ids rather than offsets only needs to locate
        that sample. ``lengths`` (an int for equal rows) lets the rule skip O_DIRECT where
        it would not save device bytes (`direct_pays`); without it O_DIRECT is assumed to
        pay.
        """
        if self._closed:
            raise StoreClosed("auto backend is closed")
        mapped = self.mapped
        if mapped is None:
            chosen: Backend = self.cold
        else:
            if self._state is mapped:
                locked = self.locked
                if locked is not None and locked():
                    self._suspect = False
                elif n >= self.min_sampled or self._suspect:
                    k = self.samples if self._suspect else min(self.samples, 1 + n // 65536)
                    self._suspect = False
                    frac = self.resident_fraction(fds, offsets, k)
                    if frac < 1.0:
                        self._state = self._pick(frac, offsets, lengths)
                        self._checked = time.monotonic()
            else:
                now = time.monotonic()
                if now - self._checked >= self.recheck_s:
                    self._checked = now
                    frac = self.resident_fraction(fds, offsets)
                    self._state = self._pick(frac, offsets, lengths)
                    hook = self.on_mapped
                    if hook is not None and self._state is mapped:
                        self.on_mapped = None
                        hook()
            chosen = self._state
        self.mapped_ok = mapped is not None and chosen is mapped and not self._suspect
        label = _label(chosen)
        with self._lock:
            self.choices[label] = self.choices.get(label, 0) + 1
            self.last_choice = label
        return chosen

    def feedback(self, chosen: Backend, requests: int, seconds: float) -> None:
        """Report how long ``chosen`` took for ``requests``: after a slow mmap batch (page
        faults, or a busy machine) the next batch checks a full sample, except while the
        whole mapping is locked (`locked`: its pages cannot have gone)."""
        if chosen is self.mapped and requests and seconds * 1e6 > self.slow_us * requests:
            locked = self.locked
            if locked is not None and locked():
                return
            self._suspect = True
            self.mapped_ok = False
            slow = self.on_slow_mapped
            if slow is not None:
                slow()

    def warm_started(self, chosen: Backend) -> Backend:
        """A background warm pass just started, for a batch the rule gave ``chosen``: a
        buffered cold state moves to O_DIRECT now (not at the next residency check, up to
        ``recheck_s`` later), and the backend this batch should use is returned (counted
        under its own label)."""
        direct = self.direct_cold
        if direct is None or self.mapped is None:
            return chosen
        if self._state is self.cold:
            self._state = direct
        if chosen is not self.cold:
            return chosen
        with self._lock:
            old, new = _label(chosen), _label(direct)
            left = self.choices.get(old, 0) - 1
            if left > 0:
                self.choices[old] = left
            else:
                self.choices.pop(old, None)
            self.choices[new] = self.choices.get(new, 0) + 1
            self.last_choice = new
        return direct

    def recheck_soon(self) -> None:
        """Make the next batch in a cold state sample residency (a warm pass just finished:
        waiting out ``recheck_s`` would serve resident rows by syscalls meanwhile). Thread-safe
        (one attribute write)."""
        self._checked = -float("inf")

    def count_mapped(self) -> None:
        """Count a batch a caller served from the mapping after its own residency check
        (no lock: under concurrent callers a count may be lost, never a read)."""
        ch = self.choices
        ch["mmap"] = ch.get("mmap", 0) + 1
        self.last_choice = "mmap"

    def fault_feedback(self, requests: int, seconds: float) -> None:
        """`feedback` for a mapped gather the caller ran without `choose` (a table's fast
        path): a slow one makes the next batch check a full sample."""
        if self.mapped is not None:
            self.feedback(self.mapped, requests, seconds)

    def _read(self, batch: Batch, dest: np.ndarray) -> None:
        chosen = self.choose(batch.fds, batch.offsets, batch.lengths)
        t0 = time.perf_counter()
        chosen.read_batch(batch, dest)
        self.feedback(chosen, batch.n, time.perf_counter() - t0)
        self._count(batch.n, batch.nbytes, 0)

    def _close(self) -> None:
        self.cold.close()
        if self.direct_cold is not None:
            self.direct_cold.close()
        if self.mapped is not None:
            self.mapped.close()


def make_backend(
    name: str,
    *,
    regions: Mapping[int, np.ndarray] | None = None,
    **options: Any,
) -> Backend:
    """Build a backend by name: ``"auto"``, ``"mmap"``, ``"preadv"`` or ``"io_uring"``.

    ``regions`` (fd -> mapped uint8 view) is required for ``"mmap"`` and lets ``"auto"`` use
    the mapping for resident data. ``options`` go to the syscall backend's constructor
    (e.g. ``threads=`` for preadv, ``entries=``/``direct=`` for io_uring; for ``"auto"``,
    ``direct=False`` keeps cold reads buffered). Raises
    `InvalidArgument` for an unknown name and `BackendUnavailable` (with the reason) for
    ``"io_uring"`` where it cannot run.
    """
    if name == "preadv":
        return PreadvBackend(**options)
    if name == "io_uring":
        ok, why = IoUringBackend.availability()
        if not ok:
            raise BackendUnavailable(f"io_uring backend unavailable: {why}")
        return IoUringBackend(**options)
    if name == "mmap":
        if regions is None:
            raise InvalidArgument("the mmap backend needs mapped regions (fd -> view)")
        return MmapBackend(regions)
    if name == "auto":
        mapped = MmapBackend(regions) if regions is not None else None
        use_direct = bool(options.pop("direct", True))
        return AutoBackend(mapped, cold_backend(**options), use_direct=use_direct)
    raise InvalidArgument(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
