"""``warm``: bring tables into the page cache at device speed, or a table's hot set into its
RAM tier, and report residency.

Page-cache warming faults the table's mapping in with ``MADV_POPULATE_READ`` from background
threads (ctypes releases the GIL), chunk by chunk: one ``WILLNEED`` over a whole file would
only start ~8 MiB of read-ahead. Afterwards the mapping's page tables are filled, so the warm
gather path runs at memory speed at once.

Hot-set warming (`warm_hot`) reads the rows `engramdb index` ranked most frequent, most
frequent first, through the normal read path and pins them in the RAM tier (the tier lives
in the process: warm it in the process that serves, e.g. before ``serve`` takes requests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engramdb.database import Database
from engramdb.read.index import load_index
from engramdb.units import Summary


@dataclass(frozen=True)
class WarmSummary(Summary):
    table: str
    bytes: int
    seconds: float
    resident_before: float
    resident_after: float

    def line(self) -> str:
        return (
            f"warmed {self.table!r}: {self.bytes / 1e9:.2f} GB in {self.seconds:.2f} s "
            f"({self.gb_per_s:.2f} GB/s), resident {self.resident_before:.0%} -> "
            f"{self.resident_after:.0%}"
        )


def residency(db: Database, tables: list[str] | None = None) -> dict[str, float]:
    """Fraction (0..1) of each table's pages in the page cache (``mincore``; no reads)."""
    return {name: db[name].residency() for name in (tables or db.tables)}


def warm_tables(
    db: Database,
    tables: list[str] | None = None,
    *,
    threads: int = 4,
    progress: Callable[[int], None] | None = None,
) -> list[WarmSummary]:
    """Populate each table's mapping (reads cold pages from the device). Cost: one
    sequential pass over the non-resident bytes; ~0.1 s/GB when already resident."""
    out = []
    for name in tables or db.tables:
        store = db[name]
        before = store.residency()
        t0 = time.perf_counter()
        store.populate(threads=threads, progress=progress)
        dt = time.perf_counter() - t0
        out.append(WarmSummary(name, store.nbytes, dt, before, store.residency()))
    return out


def warm_view(db: Database, table: str, name: str, *, threads: int = 4) -> WarmSummary:
    """Populate Store-P view ``name`` of ``table`` (its records and key index) into the page
    tables; reads it from the device if cold. The summary names it ``table/name``."""
    view = db[table].view(name)
    before = view.residency()
    t0 = time.perf_counter()
    view.populate(threads=threads)
    dt = time.perf_counter() - t0
    return WarmSummary(f"{table}/{name}", view.nbytes, dt, before, view.residency())


@dataclass(frozen=True)
class HotSummary(Summary):
    table: str
    rows: int
    hot_rows: int
    bytes: int
    budget_bytes: int
    seconds: float

    def line(self) -> str:
        return (
            f"hot set of {self.table!r}: pinned {self.rows:,} of {self.hot_rows:,} hot rows "
            f"({self.bytes / 1e6:.1f} MB of a {self.budget_bytes / 1e6:.1f} MB tier) in "
            f"{self.seconds:.2f} s ({self.gb_per_s:.2f} GB/s)"
        )


def warm_hot(db: Database, tables: list[str] | None = None) -> list[HotSummary]:
    """Pin each table's hot set (from ``engramdb index``) in its RAM tier, most frequent rows
    first, up to the tier's hot share. The database must be opened with ``ram_budget=``.
    Cost: one read of the pinned rows (random reads when cold)."""

    out = []
    for name in tables or db.tables:
        store = db[name]
        hot = load_index(db.path, name).hot_rows
        t0 = time.perf_counter()
        pinned = store.load_hot(hot)
        dt = time.perf_counter() - t0
        cache = store.cache
        assert cache is not None
        out.append(
            HotSummary(
                name, pinned, int(hot.size), pinned * store.row_bytes, cache.budget_bytes, dt
            )
        )
    return out


@dataclass(frozen=True)
class HoldSummary:
    table: str
    locked_bytes: int
    rewarms: int
    seconds: float
    resident_after: float

    def line(self) -> str:
        return (
            f"held {self.table!r} for {self.seconds:.1f} s: locked {self.locked_bytes / 1e9:.2f} "
            f"GB, {self.rewarms} re-warm(s), resident {self.resident_after:.0%}"
        )


def hold(
    db: Database,
    tables: list[str] | None = None,
    *,
    lock: bool = False,
    lock_budget: int | None = None,
    watch: bool = False,
    seconds: float | None = None,
    interval: float = 1.0,
    stop: threading.Event | None = None,
) -> list[HoldSummary]:
    """Keep tables resident while this process runs: ``lock`` ``mlock``s each table (or its
    first ``lock_budget`` bytes across the tables, in order; refused → `MemoryLockRefused`
    naming ``RLIMIT_MEMLOCK``), ``watch`` re-warms a table at the background warm's bounded
    rate whenever its residency drops (e.g. a checkpoint load evicted it), checked every
    ``interval`` seconds. Returns after ``seconds`` (None: until ``stop`` is set)."""
    names = tables or db.tables
    stores = [db[n] for n in names]
    left = lock_budget
    t0 = time.perf_counter()
    for s in stores:
        if lock:
            if left is not None and left <= 0:
                break
            got = s.tiers.lock(left)
            left = None if left is None else left - got
    stop = stop or threading.Event()
    starts = {s.name: s.tiers.warm_starts for s in stores}
    deadline = None if seconds is None else t0 + seconds
    while True:
        if watch:
            for s in stores:
                s.tiers.keep_warm = True
                s.tiers.check()
        wait = interval if deadline is None else min(interval, deadline - time.perf_counter())
        if wait <= 0 or stop.wait(wait):
            break
    for s in stores:
        if watch:
            s.tiers.warm.wait()
    dt = time.perf_counter() - t0
    return [
        HoldSummary(
            s.name,
            s.tiers.locked_bytes,
            s.tiers.warm_starts - starts[s.name],
            dt,
            s.residency(),
        )
        for s in stores
    ]
