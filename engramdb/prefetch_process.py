"""Reads for modules' `prefetch` in a process of their own (`PrefetchProcess`).

A torch module's ``prefetch(ids)`` (`engramdb.torch.DiskMultiHeadEmbedding`) starts the
rows' reads on the engine's thread, right after the sampling: deciding resident or cold,
planning and submitting the reads costs that thread tens of microseconds inside a model
step, and the table's background warm runs Python beside it. A `PrefetchProcess` takes
that work to a companion process: ``prefetch`` copies the validated row ids into shared
memory and bumps a word (no system call while the companion watches it); the companion
reads the rows (the `Decoder`'s rule: resident rows gathered from its mapping, cold ones
read with ``O_DIRECT``), copies them into shared memory and publishes a word per table;
the module's forward of those ids waits for that word and copies the rows out::

    with PrefetchProcess(db, ["l1", "l3"]) as procs:
        emb = {lay: DiskMultiHeadEmbedding(db[f"l{lay}"], process=procs) for lay in (1, 3)}
        for step in range(n_steps):
            ids = hash_next(tokens)                  # the model's own keygen
            for lay in (1, 3):
                emb[lay].prefetch(ids[lay])          # a copy and an atomic add
            ...                                      # the blocks before the layer
            out = emb[1](ids[1])                     # waits for the word, copies

A read that fails raises its own error (`TruncatedFile`, `ChecksumMismatch`...) from the
forward; the companion exiting raises `ProcessExited`. It also warms the tables in the
background (the database's default), off the engine's process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from engramdb.companion_client import CompanionClient, checked_cpus
from engramdb.database import Database
from engramdb.database import open as open_db
from engramdb.decode_companion import CMD, DONE, STEP, RowsLayout
from engramdb.errors import InvalidArgument, ProcessExited
from engramdb.io.sqpoll import step_compiled


class RowsTicket:
    """One table's pending request in a `PrefetchProcess` (a module keeps it until its
    forward): `finish_into` waits for the rows and copies them."""

    __slots__ = ("proc", "slot", "seq", "n", "ids")

    def __init__(self, proc: PrefetchProcess, slot: int, seq: int, n: int, ids: np.ndarray):
        self.proc, self.slot, self.seq, self.n = proc, slot, seq, n
        #: the request's global row ids (a view of the slot: valid until its next request)
        self.ids = ids

    def cancel(self) -> bool:
        """False: a request handed over is never withdrawn (a later one replaces it)."""
        return False

    def finish_into(self, dest: np.ndarray) -> None:
        """Wait for the rows and copy them into ``dest`` (``[n, row bytes]`` uint8)."""
        self.proc.finish_into(self, dest)


class PrefetchProcess(CompanionClient):
    """A companion process reading rows of ``tables`` (names in the database at ``path``, or
    an open `Database`) for modules' prefetches (see the module). ``max_rows``: the most ids
    one request takes (a module's larger requests are read in its own process).
    ``open_options``: `engramdb.open` keywords for the companion's database; ``cpus``: the
    CPUs the companion may run on."""

    _what = "prefetch process"

    def __init__(
        self,
        path: str | os.PathLike[str] | Database,
        tables: Sequence[str],
        *,
        max_rows: int = 4096,
        open_options: dict[str, Any] | None = None,
        cpus: set[int] | None = None,
    ):
        names = [tables] if isinstance(tables, str) else [str(t) for t in tables]
        if not names:
            raise InvalidArgument("no tables given")
        if len(set(names)) != len(names):
            raise InvalidArgument(f"a table is named twice: {names}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise InvalidArgument(f"max_rows must be an int >= 1, got {max_rows!r}")
        checked_cpus(cpus)
        own = not isinstance(path, Database)
        db = path if isinstance(path, Database) else open_db(path, **dict(open_options or {}))
        try:
            stores = [db[n] for n in names]
        except BaseException:
            if own:
                db.close()
            raise
        self._own_db, self._db = own, db
        self.tables, self.max_rows = names, max_rows
        self.row_bytes = [int(s.row_bytes) for s in stores]
        self._slot_of = {n: j for j, n in enumerate(names)}
        self._n_rows = [int(s.n_rows) for s in stores]
        lay = self._layout = RowsLayout(self.row_bytes, max_rows)
        self._launch(lay.size, lay.words)
        _, self._ids, self._data = lay.views(self._mm)
        self._last = [0] * len(names)  # per table: the hand-over of its last request
        # the compiled hand-over of a module's ids (`hand`), None with the eventfds
        self._hand = step_compiled("hand_rows") if self._wait is not None else None
        #: whether `hand` is built (else modules hand their ids over by `request`)
        self.hands_over = self._hand is not None
        self._dest = [a.ctypes.data for a in self._ids]
        job = {
            "kind": "rows", "path": str(db.path), "tables": names, "max_rows": max_rows,
            "row_bytes": self.row_bytes,
        }  # fmt: skip
        self._start_job(job, cpus, open_options)

    def slot(self, store: Any) -> int:
        """The slot of ``store`` (a table of this process's database, or its name)."""
        name = store if isinstance(store, str) else getattr(store, "name", None)
        j = self._slot_of.get(name)  # type: ignore[arg-type]
        if j is None:
            raise InvalidArgument(f"table {name!r} is not one of the process's {self.tables}")
        if not isinstance(store, str) and (
            int(store.row_bytes) != self.row_bytes[j] or int(store.n_rows) != self._n_rows[j]
        ):
            raise InvalidArgument(f"table {name!r} differs from the process's table of that name")
        return j

    def request(self, slot: int, flat: np.ndarray) -> RowsTicket:
        """Hand over the rows ``flat`` (int64 global row ids, already checked in range) of
        table ``slot``; returns the ticket its forward waits on."""
        self._check()
        n = int(flat.size)
        if n > self.max_rows:
            raise InvalidArgument(f"{n} rows in one request; this process takes {self.max_rows}")
        lay = self._layout
        self._taken(self._last[slot])  # the companion has copied the slot's last ids
        self._ids[slot][:n] = flat.reshape(-1)
        words = self._words
        words[lay.count + slot] = n
        words[lay.req + slot] = self._seq + 1  # (the hand-over `_ring` makes next)
        seq = self._last[slot] = self._ring(STEP)
        return RowsTicket(self, slot, seq, n, self._ids[slot][:n])

    def hand(
        self, slot: int, address: int, n: int, bounds: bytes, offsets: bytes
    ) -> RowsTicket | None:
        """`request` of the ``n`` int64 local ids at ``address`` (a contiguous ``[..., H]``
        tensor's data, 0 < n <= `max_rows`): checked below each head's ``bounds`` and made
        global by ``offsets`` straight into the slot, in one compiled call. None where an id
        is out of range (nothing handed over); raises `InvalidArgument` where the compiled
        hand-over is not built (use `request`)."""
        hand = self._hand
        if hand is None or self._closed:
            self._check()
            raise InvalidArgument("no compiled hand-over here: use request()")
        self._taken(self._last[slot])  # the companion has copied the slot's last ids
        lay = self._layout
        seq = self._seq + 1
        r = hand(self._addr, self._fds["bell"], address, n, bounds, offsets, self._dest[slot],
                 CMD, STEP, lay.count + slot, lay.req + slot, seq)  # fmt: skip
        if r == 2:
            return None
        if r < 0:
            raise ProcessExited(f"the {self._what}'s doorbell failed")
        self._seq = self._last[slot] = seq
        return RowsTicket(self, slot, seq, n, self._ids[slot][:n])

    def finish_into(self, t: RowsTicket, dest: np.ndarray) -> None:
        """Wait for ticket ``t``'s rows and copy them into ``dest`` (raising its read's error)."""
        self._check()
        self._await(DONE + t.slot, t.seq)
        np.copyto(dest.reshape(t.n, -1), self._data[t.slot][: t.n])

    def stats(self) -> dict[str, Any]:
        """The companion's counters: ``requests``, ``read`` (from a prefetch's reads),
        ``gathered`` (resident rows, from its mapping), ``auto_switches`` and, per table,
        ``counters()`` and the background warm's ``memory()["warm"]``."""
        return self._control(("stats",))  # type: ignore[no-any-return]

    def _release_views(self) -> None:
        self._ids = self._data = []

    def _describe(self) -> str:
        return f"tables={self.tables}"
