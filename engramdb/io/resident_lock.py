"""Keeping a warmed table in RAM: ``mlock`` once the background warm made it resident.

A table served from the page cache competes with a table held in anonymous memory, which a
host without swap never reclaims. Page-cache pages have no such guarantee: memory pressure,
``memory.reclaim`` or a proactive-reclaim policy (a DAMON ``pageout`` scheme on this
project's test VMs) take them, and a read of a page that went is a device read. Locked,
they stay (docs/io.md, docs/probes.md, 40th stop); a whole table locked also lets large
mapped batches skip the read rule's residency sample (`ResidentLock.whole`).

`ResidentLock` is a table's ``lock`` open option:

* ``"auto"`` (the default) locks the table when its background warm pass finished, if this
  process's auto-locked tables then take at most `AUTO_LOCK_SHARE` of ``MemTotal`` and
  ``MemAvailable`` keeps the safety margin beside it; a refused ``mlock`` (``RLIMIT_MEMLOCK``
  without ``CAP_IPC_LOCK``) leaves the table unlocked and says so in ``state``.
* ``True`` locks after every finished warm pass whatever the size (refusals as above).
* ``False`` never locks by itself (`ResidentLock.lock` still does: ``engramdb warm --lock``).

Locking runs in `LOCK_STEP` pieces (each ``mlock`` call holds the process's mapping lock
only for its piece), stops when told to, and `unlock` releases everything (also at close).
Several processes locking one table's pages share them: no extra memory.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from engramdb.errors import InvalidArgument, MemoryLockRefused
from engramdb.io.process_memory import lock_range, meminfo, safety_margin, unlock_range
from engramdb.layouts.geometry import PAGE

__all__ = [
    "AUTO_LOCK_SHARE",
    "LOCK_STEP",
    "ResidentLock",
    "auto_locked_bytes",
    "parse_lock",
    "release_range",
]

#: ``lock="auto"``: this process's auto-locked tables stay within this share of ``MemTotal``.
AUTO_LOCK_SHARE = 0.5
#: Bytes one ``mlock`` call takes.
LOCK_STEP = 64 << 20

_GUARD = threading.Lock()
_AUTO = [0]  # bytes auto-locked by this process's tables
_LIVE: weakref.WeakSet[ResidentLock] = weakref.WeakSet()  # for `release_range`


def _uncount(n: int) -> None:
    with _GUARD:
        _AUTO[0] -= n


def auto_locked_bytes() -> int:
    """Bytes this process's tables hold locked under ``lock="auto"``."""
    return _AUTO[0]


def release_range(addr: int, length: int) -> int:
    """Unlock every table of this process whose locked range meets ``[addr, addr + length)``
    (before its pages are dropped on purpose, e.g. `engramdb.testing.pages`: a locked page
    cannot be); their next finished warm pass locks them again. Returns how many."""
    n = 0
    for rl in list(_LIVE):
        if rl.locked_bytes and rl.base < addr + length and addr < rl.base + rl.locked_bytes:
            rl.unlock()
            n += 1
    return n


def parse_lock(value: object) -> bool | str:
    """The ``lock`` open option: ``"auto"``, ``True`` or ``False`` (`InvalidArgument` else)."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[return-value]
    raise InvalidArgument(f"lock must be 'auto', True or False, got {value!r}")


class ResidentLock:
    """The ``mlock`` of one mapped table ``[base, base + length)`` (module doc).

    ``state``: ``"off"`` (``lock=False``), ``"waiting"`` (for a finished warm pass),
    ``"locked"``, ``"partly locked"`` (an explicit budget), or why it is not locked."""

    def __init__(self, base: int, length: int, option: bool | str = "auto") -> None:
        self.base = int(base)
        self.length = int(length)
        self.option = parse_lock(option)
        self.locked_bytes = 0
        #: Whether the whole table is locked now: its pages cannot leave the page cache, so
        #: a read needs no residency check (one attribute read).
        self.whole = False
        self.state = "off" if self.option is False else "waiting"
        self._counted: weakref.finalize | None = None  # our share of `_AUTO` (`unlock`, or
        # the table dropped unclosed: its mapping, and so the lock, went with it)
        self._mutex = threading.Lock()
        _LIVE.add(self)

    def after_warm(self, stop: Callable[[], bool] = lambda: False) -> int:
        """A warm pass made the table resident: lock it as the option says (never raises:
        a refusal is recorded in ``state``). Returns the bytes locked."""
        if self.option is False or self.length <= 0:
            return self.locked_bytes
        with self._mutex:
            if self.locked_bytes >= self.length:
                return self.locked_bytes
            if self.option == "auto" and not self._count_auto():
                return 0
            try:
                self._lock_to(self.length, stop)
            except MemoryLockRefused as e:
                self._release()
                self.state = f"refused: {e}"
                return 0
            if self.locked_bytes < self.length:  # stopped (closing): nothing half-held
                self._release()
                self.state = "waiting"
                return 0
            self.state = "locked"
            self.whole = True
            return self.locked_bytes

    def lock(self, budget: int | None = None) -> int:
        """Lock the table now (faulting in what is missing), or its first ``budget`` bytes;
        the bytes locked. Refused → `MemoryLockRefused` naming ``RLIMIT_MEMLOCK``."""
        n = self.length
        if budget is not None and budget < self.length:
            n = int(budget) - int(budget) % PAGE
        with self._mutex:
            if n > self.locked_bytes:
                self._lock_to(n, lambda: False)
                self.whole = self.locked_bytes >= self.length
                self.state = "locked" if self.whole else "partly locked"
            return self.locked_bytes

    def unlock(self) -> None:
        """Release the lock (and this table's share of the auto-locked bytes)."""
        with self._mutex:
            self._release()
            if self.state in ("locked", "partly locked"):
                self.state = "off" if self.option is False else "waiting"

    def _count_auto(self) -> bool:
        """Reserve this table's bytes under the ``"auto"`` bound; False (with ``state``)
        where they do not fit."""
        info = meminfo()
        total = info.get("MemTotal", 0)
        with _GUARD:
            if _AUTO[0] + self.length > AUTO_LOCK_SHARE * total:
                self.state = (
                    f"not locked: {_AUTO[0] + self.length} bytes auto-locked would pass "
                    f"{AUTO_LOCK_SHARE:.0%} of MemTotal ({total} bytes)"
                )
                return False
            if info.get("MemAvailable", 0) - self.length < safety_margin(info):
                self.state = "not locked: MemAvailable would fall under the safety margin"
                return False
            _AUTO[0] += self.length
        self._counted = weakref.finalize(self, _uncount, self.length)
        return True

    def _lock_to(self, n: int, stop: Callable[[], bool]) -> None:
        """``mlock`` ``[locked_bytes, n)`` in `LOCK_STEP` pieces until ``stop()``."""
        while self.locked_bytes < n and not stop():
            step = min(LOCK_STEP, n - self.locked_bytes)
            lock_range(self.base + self.locked_bytes, step)
            self.locked_bytes += step

    def _release(self) -> None:
        self.whole = False
        if self.locked_bytes:
            unlock_range(self.base, self.locked_bytes)
            self.locked_bytes = 0
        if self._counted is not None:
            self._counted()  # (once: a finalizer runs at most once)
            self._counted = None
