"""``warm``: bring tables into the page cache at device speed, or a table's hot set into its
RAM tier, and report residency.

Page-cache warming faults the table's mapping in with ``MADV_POPULATE_READ`` from background
threads (ctypes releases the GIL), chunk by chunk: one ``WILLNEED`` over a whole file would
only start ~8 MiB of read-ahead. Afterwards the mapping's page tables are filled, so the warm
gather path runs at memory speed at once.

With ``verify=True`` (the default) each table's bytes are then hashed from the now-resident
mapping, 64 MiB block by block (XXH3-64 runs at ~10 GB/s, above device speed), and compared
with the manifest's block checksums: a flipped byte raises `ChecksumMismatch` naming the
table, shard and byte range, so a warmed table is known to hold the bytes it was built with.

Hot-set warming (`warm_hot`) reads the rows `engramdb index` ranked most frequent, most
frequent first, through the normal read path and pins them in the RAM tier (the tier lives
in the process: warm it in the process that serves, e.g. before ``serve`` takes requests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from engramdb.database import Database
from engramdb.errors import ChecksumMismatch
from engramdb.layouts.manifest import CHECK_BLOCK_BYTES
from engramdb.read.index import load_index
from engramdb.store import Store
from engramdb.units import Summary, format_bytes


@dataclass(frozen=True)
class WarmSummary(Summary):
    table: str
    bytes: int
    seconds: float
    resident_before: float
    resident_after: float

    def line(self) -> str:
        return (
            f"warmed {self.table!r}: {self.size_and_rate()}, resident {self.resident_before:.0%} -> "
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
    verify: bool = True,
) -> list[WarmSummary]:
    """Populate each table's mapping (reads cold pages from the device), then with
    ``verify`` check every 64 MiB block against the manifest (`verify_resident`). Cost: one
    sequential pass over the non-resident bytes, ~0.1 s/GB more to hash them."""
    out = []
    for name in tables or db.tables:
        store = db[name]
        before = store.residency()
        t0 = time.perf_counter()
        store.populate(threads=threads, progress=progress)
        if verify:
            verify_resident(store)
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
            f"({format_bytes(self.bytes)} of a {format_bytes(self.budget_bytes)} tier) in "
            f"{self.size_and_rate().split(' in ', 1)[1]}"
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
            f"held {self.table!r} for {self.seconds:.1f} s: locked "
            f"{format_bytes(self.locked_bytes)}, {self.rewarms} re-warm(s), resident {self.resident_after:.0%}"
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


def verify_resident(store: Store) -> None:
    """Hash ``store``'s mapped bytes block by block (the manifest's 64 MiB blocks; the whole
    shard where a manifest has no blocks) and raise `ChecksumMismatch` at the first block
    that differs, naming table, shard and byte range. Reads the mapping (faults in what is
    not resident). An attached table's rows live in its source files: their identity is
    checked at open and their blocks by `engramdb verify` (``attach --checksum``)."""
    if store.attached:
        return
    flat = store.array().reshape(-1)
    start = 0
    for sh in store.info.shards:
        data = flat[start : start + sh.bytes]
        start += sh.bytes
        if sh.blocks:
            for i, want in enumerate(sh.blocks):
                lo = i * CHECK_BLOCK_BYTES
                hi = min(sh.bytes, lo + CHECK_BLOCK_BYTES)
                got = xxhash.xxh3_64_hexdigest(data[lo:hi].data)
                if got != want:
                    raise ChecksumMismatch(
                        f"table {store.name!r}: shard {sh.path!r} bytes [{lo}, {hi}) have "
                        f"xxh3-64 {got}, the manifest says {want} (rows "
                        f"{sh.first_row + lo // store.row_bytes} to "
                        f"{sh.first_row + (hi - 1) // store.row_bytes}); run `engramdb verify`"
                    )
        elif xxhash.xxh3_64_hexdigest(data.data) != sh.xxh3_64:
            raise ChecksumMismatch(
                f"table {store.name!r}: shard {sh.path!r} does not match its xxh3-64 "
                f"{sh.xxh3_64}; run `engramdb verify`"
            )
