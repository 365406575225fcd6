"""The RAM tier: a row cache with a byte budget, frequency-first + CLOCK.

Two regions share one slab of ``slots`` rows:

* the **hot region** (slots ``[0, n_hot)``) holds rows admitted from the hot set that
  ``engramdb index`` computed (most frequent rows first); it is never evicted, so a one-off
  scan cannot flush it;
* the **CLOCK region** (the rest) takes every other row read through the cache and evicts
  with CLOCK (a reference bit per slot, second chance), an LRU approximation whose update on
  a hit is one vectorised store instead of list surgery.

Row id → slot is an open-addressing hash table (linear probing, multiplicative hash, load
<= 0.5) held in numpy arrays; lookups, inserts and deletes run vectorised over a whole batch
(a loop per probe *round*, never per row). The index costs ~33 bytes per slot, counted in
the budget.

A presence bitmap (one bit per table row, also counted in the budget) answers most misses
with a single gather, so a scan-heavy or uniform workload does not pay hash probes for
rows that are not cached.

Thread safety: one lock around probe + copy, so a concurrent admission can never move a
slot under a reader (a hit always returns the row the slot held when it was found).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.io.gather import take_one
from engramdb.stats import Stats

_EMPTY = np.int64(-1)
_TOMB = np.int64(-2)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class CacheStats(Stats):
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    admitted: int = 0
    hot_rows: int = 0
    bypassed: int = 0  # rows of batches served past the tier (Store: sampled hit rate too low)

    derived: ClassVar[tuple[str, ...]] = ("hit_rate",)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _slots_for(budget: int, row_bytes: int) -> int:
    """Most slots whose rows, slot metadata (9 B) and hash index (a power-of-two table of
    12 B entries, at least twice the slots) fit in ``budget`` bytes."""
    best = 0
    for bits in range(4, 48):
        size = 1 << bits
        slots = min(size // 2, (budget - size * 12) // (row_bytes + 9))
        if slots <= 0 and best:
            break
        best = max(best, slots)
    return int(best)


class _HashIndex:
    """int64 key → int32 value, open addressing; all operations batch-vectorised."""

    def __init__(self, capacity: int):
        bits = max(4, int(np.ceil(np.log2(max(8, 2 * capacity)))))
        self.bits = bits
        self.size = 1 << bits
        self.mask = self.size - 1
        self.keys = np.full(self.size, _EMPTY, dtype=np.int64)
        self.vals = np.zeros(self.size, dtype=np.int32)
        self.tombs = 0
        self.live = 0

    def _home(self, ids: np.ndarray) -> np.ndarray:
        h = ids.view(np.uint64) * _GOLDEN
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, positions) for ``ids``; -1 where absent."""
        n = ids.size
        vals = np.full(n, -1, dtype=np.int64)
        where = np.full(n, -1, dtype=np.int64)
        pos = self._home(ids)
        active = np.arange(n)
        while active.size:
            p = pos[active]
            k = self.keys[p]
            hit = k == ids[active]
            if hit.any():
                vals[active[hit]] = self.vals[p[hit]]
                where[active[hit]] = p[hit]
            keep = ~hit & (k != _EMPTY)
            active = active[keep]
            pos[active] = (p[keep] + 1) & self.mask
        return vals, where

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Insert keys known to be absent and unique."""
        pos = self._home(ids)
        active = np.arange(ids.size)
        while active.size:
            p = pos[active]
            k = self.keys[p]
            free = (k == _EMPTY) | (k == _TOMB)
            cand = active[free]
            # several keys may aim at one free position: the first of each wins this round
            _, first = np.unique(pos[cand], return_index=True)
            won = cand[first]
            wp = pos[won]
            self.tombs -= int(np.count_nonzero(self.keys[wp] == _TOMB))
            self.keys[wp] = ids[won]
            self.vals[wp] = values[won]
            done = np.zeros(ids.size, dtype=bool)
            done[won] = True
            active = active[~done[active]]
            pos[active] = (pos[active] + 1) & self.mask
        self.live += ids.size

    def delete_at(self, positions: np.ndarray) -> None:
        self.keys[positions] = _TOMB
        self.tombs += positions.size
        self.live -= positions.size

    def needs_rebuild(self) -> bool:
        # Probes stop only at an empty entry: keep at least a quarter of the table empty.
        return self.tombs > self.size // 4 or self.tombs + self.live > (3 * self.size) // 4


class RowCache:
    """Rows of one table in RAM under a byte budget (slab + index both counted).

    ``get_into(ids, out)`` copies the cached rows into ``out`` and returns the mask of misses;
    ``admit(ids, rows)`` inserts rows read from below; ``load_hot(ids, rows)`` fills the
    pinned hot region. Ids must be validated int64 row ids of the table.
    """

    def __init__(
        self, row_bytes: int, budget_bytes: int, n_rows: int, *, hot_fraction: float = 0.5
    ):
        if row_bytes <= 0:
            raise InvalidArgument(f"row_bytes must be > 0, got {row_bytes}")
        if not 0.0 <= hot_fraction <= 1.0:
            raise InvalidArgument(f"hot_fraction must be in [0, 1], got {hot_fraction}")
        bitmap_bytes = n_rows // 8 + 1
        slots = _slots_for(int(budget_bytes) - bitmap_bytes, row_bytes)
        if slots < 1:
            raise InvalidArgument(
                f"ram budget {budget_bytes} B holds no {row_bytes} B row (with its index)"
            )
        self.row_bytes = row_bytes
        self.budget_bytes = int(budget_bytes)
        self.slots = slots
        self.max_hot = int(slots * hot_fraction)
        self.n_hot = 0
        self.data = np.empty((slots, row_bytes), dtype=np.uint8)
        self.slot_key = np.full(slots, -1, dtype=np.int64)
        self.ref = np.zeros(slots, dtype=np.uint8)
        self._taken = np.zeros(slots, dtype=bool)
        self.n_rows = n_rows
        self._present = np.zeros(bitmap_bytes, dtype=np.uint8)
        self._index = _HashIndex(slots)
        self._hand = 0
        self._filled = 0  # CLOCK-region slots ever used, counted from n_hot
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return (
            self.data.nbytes
            + self.slot_key.nbytes
            + self.ref.nbytes
            + self._index.keys.nbytes
            + self._index.vals.nbytes
            + self._present.nbytes
        )

    def _maybe_present(self, ids: np.ndarray) -> np.ndarray:
        return (self._present[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1 == 1

    def _mark(self, ids: np.ndarray, on: bool) -> None:
        bits = np.uint8(1) << (ids & 7).astype(np.uint8)
        if on:
            np.bitwise_or.at(self._present, ids >> 3, bits)
        else:
            np.bitwise_and.at(self._present, ids >> 3, ~bits)

    def __len__(self) -> int:
        return self._index.live

    # -- reads --------------------------------------------------------------------------------
    def get_into(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows of ``ids`` (int64, 1-D) into ``out`` ``[n, row_bytes]``; returns a
        bool mask of the positions that missed (their ``out`` rows are untouched)."""
        with self._lock:
            maybe = self._maybe_present(ids)
            slots = np.full(ids.size, -1, dtype=np.int64)
            if maybe.any():
                slots[maybe] = self._index.find(ids[maybe])[0]
            hit = slots >= 0
            n_hit = int(np.count_nonzero(hit))
            if n_hit:
                hs = slots[hit]
                if n_hit == ids.size:
                    take_one(self.data, hs, out)
                else:
                    out[hit] = self.data[hs]
                self.ref[hs] = 1
            self.stats.hits += n_hit
            self.stats.misses += ids.size - n_hit
            return ~hit

    def present(self, ids: np.ndarray) -> np.ndarray:
        """Whether each of ``ids`` is cached, from the presence bitmap alone (one gather, no
        lock: an estimate under concurrent admissions, exact otherwise). No stats."""
        return self._maybe_present(ids)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._index.find(np.ascontiguousarray(ids, dtype=np.int64))[0] >= 0

    # -- writes -------------------------------------------------------------------------------
    def _victims(self, need: int) -> np.ndarray:
        """``need`` CLOCK-region slots: never-used ones first, then CLOCK second chance."""
        lo = self.n_hot
        region = self.slots - lo
        out: list[np.ndarray] = []
        taken = self._taken  # slots already chosen by this call: a sweep may pass them again
        fresh = min(need, region - self._filled)
        if fresh > 0:
            out.append(np.arange(lo + self._filled, lo + self._filled + fresh))
            taken[out[-1]] = True
            self._filled += fresh
            need -= fresh
        while need > 0:
            window = min(region, max(4 * need, 4096))
            order = lo + (self._hand + np.arange(window)) % region
            zero = np.flatnonzero((self.ref[order] == 0) & ~taken[order])
            if zero.size >= need:
                last = int(zero[need - 1])
                chosen = order[zero[:need]]
                self.ref[order[: last + 1]] = 0  # the skipped ones used their second chance
                self._hand = (self._hand + last + 1) % region
                need = 0
            else:
                chosen = order[zero]
                need -= zero.size
                self.ref[order] = 0
                self._hand = (self._hand + window) % region
            taken[chosen] = True
            out.append(chosen)
        for c in out:
            taken[c] = False
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def admit(self, ids: np.ndarray, rows: np.ndarray) -> int:
        """Insert rows read from below (``rows[i]`` is row ``ids[i]``). Rows already cached
        and duplicates are skipped; at most the CLOCK region's size is admitted per call.
        Returns how many rows were inserted."""
        if self.slots - self.n_hot <= 0 or ids.size == 0:
            return 0
        with self._lock:
            uniq, first = np.unique(ids, return_index=True)
            present, _ = self._index.find(uniq)
            new = present < 0
            uniq, first = uniq[new], first[new]
            region = self.slots - self.n_hot
            if uniq.size > region:  # keep the last ones of the batch (most recent)
                uniq, first = uniq[-region:], first[-region:]
            if uniq.size == 0:
                return 0
            victims = self._victims(uniq.size)
            old = self.slot_key[victims]
            was_used = old >= 0
            if was_used.any():
                _, where = self._index.find(old[was_used])
                self._index.delete_at(where)
                self._mark(old[was_used], False)
                self.slot_key[victims] = -1
                self.stats.evictions += int(np.count_nonzero(was_used))
                if self._index.needs_rebuild():
                    self._rebuild()
            self.data[victims] = rows[first]
            self.slot_key[victims] = uniq
            self.ref[victims] = 0
            self._index.insert(uniq, victims.astype(np.int32))
            self._mark(uniq, True)
            self.stats.admitted += uniq.size
            return int(uniq.size)

    def load_hot(self, ids: np.ndarray, rows: np.ndarray) -> int:
        """Fill the pinned hot region with rows in priority order (most frequent first), up to
        ``hot_fraction`` of the slots. Replaces any previous hot set. Returns rows pinned."""
        with self._lock:
            uniq_pos = np.sort(np.unique(ids, return_index=True)[1])
            ids, rows = ids[uniq_pos], rows[uniq_pos]
            n = min(ids.size, self.max_hot)
            ids, rows = ids[:n], rows[:n]
            # start from an empty cache: the hot region takes the low slots
            self._index = _HashIndex(self.slots)
            self.slot_key[:] = -1
            self.ref[:] = 0
            self.data[:n] = rows
            self.slot_key[:n] = ids
            self._index.insert(ids, np.arange(n, dtype=np.int32))
            self._present[:] = 0
            self._mark(ids, True)
            self.n_hot = n
            self._hand = 0
            self._filled = 0
            self.stats.hot_rows = n
            return n

    def _rebuild(self) -> None:
        live = np.flatnonzero(self.slot_key >= 0)
        self._index = _HashIndex(self.slots)
        self._index.insert(self.slot_key[live], live.astype(np.int32))

    def clear(self) -> None:
        with self._lock:
            self._index = _HashIndex(self.slots)
            self._present[:] = 0
            self.slot_key[:] = -1
            self.ref[:] = 0
            self.n_hot = 0
            self._hand = 0
            self._filled = 0
            self.stats = CacheStats()


class BufferPool:
    """Output buffers for the allocating reads (``fetch``, ``read_records`` without ``out=``),
    reused once the caller has dropped them.

    A fresh large ``np.empty`` is mapped anew by the allocator and every page of it faults on
    first write (here that made an allocating read ~0.5-0.7x its ``out=`` form). The pool keeps
    up to ``keep`` buffers per thread and hands one out again only when nothing but the pool
    references it (its reference count; a view of it references it too), so a result the
    caller still holds is never overwritten. Requests under ``min_bytes`` are plain
    ``np.empty`` (small allocations come from the heap, already faulted)."""

    def __init__(self, *, keep: int = 4, min_bytes: int = 1 << 18) -> None:
        self.keep = int(keep)
        self.min_bytes = int(min_bytes)
        self._local = threading.local()
        self.reused = 0
        self.allocated = 0

    def empty(self, shape: tuple[int, ...], nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of ``shape`` (``nbytes`` its size)."""
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype=np.uint8)
        pool: list[np.ndarray] | None = getattr(self._local, "bufs", None)
        if pool is None:
            pool = self._local.bufs = []
        free = -1
        for i in range(len(pool)):
            # References: the list slot and getrefcount's argument; more means a caller (or a
            # view it holds) still uses the buffer.
            if sys.getrefcount(pool[i]) <= 2:
                if nbytes <= pool[i].nbytes <= 2 * nbytes:
                    self.reused += 1
                    return pool[i][:nbytes].reshape(shape)
                free = i
        buf = np.empty(nbytes, dtype=np.uint8)
        self.allocated += 1
        if free >= 0:
            pool[free] = buf
        elif len(pool) < self.keep:
            pool.append(buf)
        return buf.reshape(shape)

    def nbytes(self) -> int:
        """Bytes this thread's pool holds."""
        pool = getattr(self._local, "bufs", None) or []
        return int(sum(b.nbytes for b in pool))
