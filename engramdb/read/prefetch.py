"""Background reads of rows a *future* step will need.

A `Prefetcher` belongs to one table, seen through the small `RowSource` protocol below (a
`engramdb.read.table.LocalTable` is one). `submit(rowids)` returns a `Ticket` at once (a few
microseconds: a bounds check and a queue append) and a background thread reads the rows:

* into the table's RAM tier when it has one (rows not yet cached are read through the
  table's read path below the tier and admitted);
* otherwise into the page cache: one buffered batch through io_uring (else preadv) — sorted,
  deduplicated, every row in flight at once — followed by a gather through the table's mapping,
  so the page-table entries exist too and the later gather runs at memory speed;
* a decode step's rows kept on the ticket (``keep_rows``, at most `ADVISE_ROWS` rows of a
  table that is one mapped array): one ``process_madvise(MADV_WILLNEED)`` call starts every
  row's read (`engramdb.io.advise.willneed_rows`), then one gather from the mapping
  (`engramdb.io.gather.take_one`) takes them as they arrive. Both calls release the GIL: a few microseconds of Python a
  step, where the io_uring batch holds the GIL ~0.2 ms, which a model thread waits for.

A later `Store.fetch` / `fetch_into` / `lookup_into` of rows that are still being read waits for
them (and only for them); a ticket that failed raises its error at the first fetch that needs
one of its rows, or at `Ticket.wait`, or at `Prefetcher.drain` — an error is never dropped.

The queue is bounded (``depth`` tickets): a submission to a full queue is refused (the ticket
comes back cancelled and is counted in ``dropped``), so memory stays bounded whatever the
caller does. A ticket still queued can be cancelled; a fetch that needs the rows of a queued
ticket reads them itself rather than waiting behind other tickets.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engramdb._cpus import run_as_worker
from engramdb.errors import EngramDBError, InvalidArgument, StoreClosed
from engramdb.io.advise import willneed_rows
from engramdb.io.foreground import FOREGROUND
from engramdb.io.gather import take_one
from engramdb.io.select import cold_backend
from engramdb.read.cache import RowCache
from engramdb.read.plan import GeometryLike, ReadPlan, assemble
from engramdb.read.step_plan import CANCELLED, DONE, FAILED, QUEUED, RUNNING
from engramdb.stats import Stats
from engramdb.validate import as_rowids, check_bounds

if TYPE_CHECKING:
    from engramdb.io import Backend


class RowSource(Protocol):
    """What a `Prefetcher` reads from: a local table's trusted read path for validated ids
    (`engramdb.read.table.LocalTable` implements it)."""

    name: str
    n_rows: int
    row_bytes: int

    @property
    def closed(self) -> bool: ...
    @property
    def cache(self) -> RowCache | None: ...
    @property
    def geometry(self) -> GeometryLike: ...
    @property
    def fd_array(self) -> np.ndarray: ...
    def array(self) -> np.ndarray: ...
    def plan_for(self, flat: np.ndarray) -> ReadPlan: ...
    def take_mapped(self, flat: np.ndarray, out2d: np.ndarray) -> None: ...
    def scratch(self, name: str, nbytes: int) -> np.ndarray: ...
    def read_below(self, flat: np.ndarray, out2d: np.ndarray) -> None: ...
    def note_buffered_read(self) -> None: ...


#: Kept-rows tickets up to this many rows are read by advice + gather (a decode step's).
ADVISE_ROWS = 4096
_SMALL_PRODUCT = 1 << 16  # below this, a broadcast compare beats np.isin's sort


@dataclass
class PrefetchStats(Stats):
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    dropped: int = 0
    rows_read: int = 0
    waits: int = 0


class Ticket:
    """One submitted batch of row ids. `wait` blocks until it is read (re-raising its error);
    `cancel` withdraws it while still queued. ``state`` is one of queued / running / done /
    failed / cancelled."""

    __slots__ = ("ids", "state", "error", "surfaced", "finished", "_owner", "keep", "uids", "rows")

    def __init__(self, ids: np.ndarray, owner: Prefetcher | None, keep: bool = False):
        self.ids = ids
        #: ``keep_rows``: once done, ``rows[k]`` holds row ``uids[k]`` (sorted unique ids).
        self.keep = keep
        self.uids: np.ndarray | None = None
        self.rows: np.ndarray | None = None
        self.state = QUEUED
        self.error: BaseException | None = None
        self.surfaced = False
        #: Set once the ticket will not change any more (by its prefetcher; callers wait on it).
        self.finished = threading.Event()
        self._owner = owner

    def done(self) -> bool:
        """True once the ticket will not change any more (done, failed or cancelled)."""
        return self.finished.is_set()

    def cancel(self) -> bool:
        """Withdraw a queued ticket; False if it is already running or finished."""
        owner = self._owner
        if owner is None:
            return self.state == CANCELLED
        return owner.cancel(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the ticket is finished; raise its error if it failed (once surfaced, a
        failed ticket raises again on every wait). Returns False on timeout."""
        if not self.finished.wait(timeout):
            return False
        if self.error is not None:
            if self._owner is not None:
                self._owner.forget_failure(self)
            self.surfaced = True
            raise self.error
        return True

    def __repr__(self) -> str:
        return f"<Ticket {self.state} {self.ids.size} rows>"


class KeptRows(Protocol):
    """A finished read that kept its rows: a ``keep_rows`` `Ticket` (``uids`` sorted unique,
    ``rows[k]`` is row ``uids[k]``) or a step reader's `StepTicket` (``uids`` None, ``rows`` in the
    order of its ``ids``)."""

    ids: np.ndarray
    uids: np.ndarray | None
    rows: np.ndarray | None
    state: str


def take_kept(t: KeptRows, ids: np.ndarray, out: np.ndarray) -> bool:
    """Copy rows ``ids`` (any shape, each one the ticket asked for) from a finished
    ``keep_rows`` ticket into ``out`` (``ids.shape + (row_bytes,)``, may be strided). False
    when the ticket kept no rows, or (rows in request order) ``ids`` are not exactly the
    ticket's (nothing written)."""
    uids, rows = t.uids, t.rows
    if rows is None or t.state != DONE:
        return False
    if uids is None:  # in request order: only the very ids it read
        mine = t.ids
        if mine.size != ids.size or mine.tobytes() != ids.tobytes():
            return False
        out[...] = rows.reshape(out.shape)
        return True
    rows.take(np.searchsorted(uids, ids), 0, out, "clip")
    return True


def _intersects(a: np.ndarray, b: np.ndarray) -> bool:
    if a.size == 0 or b.size == 0:
        return False
    if a.size * b.size <= _SMALL_PRODUCT:
        return bool((a.reshape(-1, 1) == b.reshape(1, -1)).any())
    return bool(np.isin(a, b).any())


class Prefetcher:
    """Background reader for one table (see the module docstring; ``store`` is any
    `RowSource`).

    ``depth``: most tickets queued or running at once. ``target``: ``"auto"`` (the RAM tier
    when the store has one, else the page cache), ``"ram"`` or ``"page_cache"``. The worker
    thread starts with the first submission and stops at `close`.
    """

    def __init__(self, store: RowSource, *, depth: int = 32, target: str = "auto"):
        if depth < 1:
            raise InvalidArgument(f"prefetch depth must be >= 1, got {depth}")
        if target not in ("auto", "ram", "page_cache"):
            raise InvalidArgument(f"prefetch target must be auto, ram or page_cache: {target!r}")
        if target == "ram" and store.cache is None:
            raise InvalidArgument(f"table {store.name!r} has no RAM tier: open with ram_budget=")
        self.store = store
        self.depth = int(depth)
        if target == "auto":
            target = "ram" if store.cache is not None else "page_cache"
        self.target = target
        self.stats = PrefetchStats()
        self._queue: collections.deque[Ticket] = collections.deque()
        self._pending: list[Ticket] = []  # queued or running
        self._failed: list[Ticket] = []  # failed, error not yet raised anywhere (bounded)
        self._cond = threading.Condition()  # guards the queue, the lists and the states
        # Wake-ups go through a C queue: cheaper on the submitting thread than Condition.notify.
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._buffered: Backend | None = None
        self._slot = 0  # which of the two kept-rows buffers the next kept ticket fills

    # -- submission ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"Prefetcher(table={getattr(self.store, 'name', '?')!r}, depth={self.depth})"

    def submit(self, rowids: Any) -> Ticket:
        """Queue a background read of global ``rowids``. Never raises for bad ids: an id out of
        range fails the ticket, and the error surfaces where the rows are fetched."""
        if self._closed:
            raise StoreClosed(f"prefetcher of table {self.store.name!r} is closed")
        try:
            ids = as_rowids(rowids).reshape(-1)
            check_bounds(ids, self.store.n_rows)
        except Exception as e:  # surfaced at the fetch / wait, as promised
            # No ids to match a fetch against: a fetch of these ids fails its own validation,
            # and `Ticket.wait` / `drain` raise this error.
            t = Ticket(np.zeros(0, np.int64), self)
            with self._cond:
                self.stats.submitted += 1
            self._finish(t, FAILED, e)
            return t
        return self.submit_trusted(ids)

    def submit_trusted(self, ids: np.ndarray, *, keep_rows: bool = False) -> Ticket:
        """`submit` for validated 1-D int64 ids (keygen output for a table that fits).

        ``keep_rows`` (page-cache target): the ticket keeps the rows it read (``uids`` /
        ``rows``) instead of gathering them through the mapping, so the consumer copies them
        from there and nobody takes page faults on a mapping that is not populated. The rows
        live in one of two buffers this prefetcher alternates between: valid until the
        second ticket after this one is submitted (a decode step reads them before the next
        push)."""
        t = Ticket(ids, self, keep_rows and self.target == "page_cache")
        with self._cond:
            if self._closed:
                raise StoreClosed(f"prefetcher of table {self.store.name!r} is closed")
            self.stats.submitted += 1
            if len(self._queue) + self._running() >= self.depth:
                t.state = CANCELLED
                t.finished.set()
                self.stats.dropped += 1
                return t
            self._queue.append(t)
            self._pending.append(t)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"engramdb-prefetch-{self.store.name}", daemon=True
                )
                self._thread.start()
        self._wake.put(None)
        return t

    def _running(self) -> int:
        return sum(1 for t in self._pending if t.state == RUNNING)

    def cancel(self, t: Ticket) -> bool:
        """Withdraw ``t`` (one of this prefetcher's tickets) while it is still queued; False
        if it is already running or finished (True if it was cancelled before)."""
        with self._cond:
            if t.state != QUEUED:
                return t.state == CANCELLED
            t.state = CANCELLED
            self._queue.remove(t)
            self._pending.remove(t)
            self.stats.cancelled += 1
        t.finished.set()
        return True

    def cancel_all(self) -> int:
        """Cancel every queued ticket (running ones finish). Returns how many were cancelled."""
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
            for t in queued:
                t.state = CANCELLED
                self._pending.remove(t)
            self.stats.cancelled += len(queued)
        for t in queued:
            t.finished.set()
        return len(queued)

    # -- the fetch side -----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any ticket is queued, running or failed-and-unsurfaced (two list checks)."""
        return bool(self._pending) or bool(self._failed)

    def wait_for(self, flat: np.ndarray) -> None:
        """Before a fetch of ``flat`` (validated ids): wait for running tickets that read any
        of them, and raise the error of a failed ticket that covers any of them. Queued
        tickets are left alone (the fetch reads the rows itself)."""
        with self._cond:
            candidates = [t for t in self._pending if t.state == RUNNING] + self._failed
        for t in candidates:
            if not _intersects(t.ids, flat):
                continue
            if t.state == RUNNING:
                self.stats.waits += 1
            t.finished.wait()
            if t.error is not None:
                with self._cond:
                    if t in self._failed:
                        self._failed.remove(t)
                t.surfaced = True
                raise t.error

    def forget_failure(self, t: Ticket) -> None:
        """``t``'s error was raised to a caller: no later fetch or `drain` raises it again."""
        with self._cond:
            if t in self._failed:
                self._failed.remove(t)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until nothing is queued or running, then raise the first error no fetch has
        surfaced yet (and forget it)."""
        while True:
            with self._cond:
                live = [t for t in self._pending if t.state in (QUEUED, RUNNING)]
            if not live:
                break
            for t in live:
                t.finished.wait(timeout)
        with self._cond:
            failed = [t for t in self._failed if not t.surfaced]
            self._failed.clear()
        if failed:
            failed[0].surfaced = True
            assert failed[0].error is not None
            raise failed[0].error

    # -- the worker ---------------------------------------------------------------------------
    def _finish(self, t: Ticket, state: str, error: BaseException | None) -> None:
        with self._cond:
            t.state = state
            t.error = error
            if t in self._pending:
                self._pending.remove(t)
            if state == FAILED:
                self.stats.failed += 1
                # Bounded: past `depth` unsurfaced failures only the count grows (stats.failed).
                if len(self._failed) < self.depth:
                    self._failed.append(t)
            else:
                self.stats.completed += 1
        t.finished.set()

    def _run(self) -> None:
        run_as_worker()
        while True:
            self._wake.get()  # one token per submission (and one at close)
            with self._cond:
                if not self._queue:
                    if self._closed:
                        return
                    continue  # its ticket was cancelled
                t = self._queue.popleft()
                t.state = RUNNING
            try:
                n = self._read_kept(t) if t.keep else self._read(t.ids)
            except BaseException as e:  # kept on the ticket; raised where the rows are needed
                self._finish(t, FAILED, e)
            else:
                with self._cond:
                    self.stats.rows_read += n
                self._finish(t, DONE, None)

    def _read(self, ids: np.ndarray) -> int:
        store = self.store
        if ids.size == 0 or store.closed:
            return 0
        ids = np.unique(ids)
        cache = store.cache
        if self.target == "ram" and cache is not None:
            missing = ids[~cache.contains(ids)]
            if missing.size:
                rows = store.scratch("prefetch", missing.size * store.row_bytes)
                rows = rows.reshape(missing.size, store.row_bytes)
                store.read_below(missing, rows)
                cache.admit(missing, rows)
            return int(missing.size)
        # Page cache: one buffered batch with every row in flight (O_DIRECT would bypass the
        # cache), then a gather through the mapping to install the page-table entries.
        self._read_buffered(ids)
        rows = store.scratch("prefetch", ids.size * store.row_bytes)
        store.take_mapped(ids, rows.reshape(ids.size, store.row_bytes))
        return int(ids.size)

    def _read_buffered(self, ids: np.ndarray) -> tuple[ReadPlan, np.ndarray]:
        """One buffered batch (through the page cache) of ``ids``' pages into the store's
        ``prefetch_io`` scratch; returns the read plan and the scratch."""
        store = self.store
        if self._buffered is None:
            self._buffered = cold_backend(direct=False)
        store.note_buffered_read()  # a table that fits starts its background warm (once)
        plan = store.plan_for(ids)
        scratch = store.scratch("prefetch_io", plan.scratch_bytes)
        with FOREGROUND.reading(waited=False):  # a future step's rows: read around them
            self._buffered.read(
                store.fd_array[plan.shard], plan.offset, plan.length, scratch, plan.dest_offset
            )
        return plan, scratch

    def _read_kept(self, t: Ticket) -> int:
        """Page cache, rows kept on the ticket: one buffered batch read straight into one of
        the two row buffers (no gather through the mapping)."""
        store = self.store
        if t.ids.size == 0 or store.closed:
            t.uids, t.rows = t.ids[:0], np.zeros((0, store.row_bytes), np.uint8)
            return 0
        ids = np.unique(t.ids)
        self._slot ^= 1
        name = f"prefetch_rows{self._slot}"
        rows = store.scratch(name, ids.size * store.row_bytes).reshape(ids.size, store.row_bytes)
        if not (ids.size <= ADVISE_ROWS and self._read_advised(ids, rows)):
            plan, scratch = self._read_buffered(ids)
            assemble(plan, scratch, rows)
        t.uids, t.rows = ids, rows
        return int(ids.size)

    def _read_advised(self, ids: np.ndarray, rows: np.ndarray) -> bool:
        """Rows ``ids`` (sorted unique) of a table that is one mapped array into ``rows``: one
        ``MADV_WILLNEED`` call for all their pages, then one gather that waits for the pages
        still in flight. False (nothing read) for a table that is not one mapped array."""
        store = self.store
        try:
            table = store.array()  # an attached table's truncation check included
        except EngramDBError:
            if store.closed:
                raise
            return False  # rows assembled from several source columns: syscall reads
        store.note_buffered_read()  # a table that fits starts its background warm (once)
        with FOREGROUND.reading(waited=False):  # a future step's rows: read around them
            willneed_rows(int(table.ctypes.data), ids, store.row_bytes)
            take_one(table, ids, rows)
        return True

    def close(self) -> None:
        """Cancel queued tickets, let a running one finish, stop the thread. Idempotent."""
        self.cancel_all()
        with self._cond:
            self._closed = True
            thread = self._thread
        self._wake.put(None)
        if thread is not None:
            thread.join()
        if self._buffered is not None:
            self._buffered.close()
            self._buffered = None
