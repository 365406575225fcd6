"""`PrefetchRule`: when a decoder prefetches a layer's rows, and from where.

``Decoder(prefetch="auto")`` asks, for each layer at each push, whether the rows just hashed
get a background read (`want`), and if so whether they are cold (`cold`: the step reader
reads them from the device) or in the page cache (the table's prefetcher copies them: the
mapping of this process is what is cold). The rule judges residency from rows it has *not*
prefetched: every ``recheck_s`` seconds it checks (``mincore``, ~2 us a page) a few of the
rows a push has just hashed, before they are submitted; all resident turns prefetch off, any
miss on. While the checks keep finding an off layer resident, each waits twice as long as
the last, up to `CALM_MAX` doublings (16 x ``recheck_s``): inside a model step a check cost
~120 us, and every tenth step or so paid one. While off, a fill the read rule saw
page-faulting (it leaves its mapped state or marks it suspect) makes the next push check at
once and starts the doubling over (a slow gather on a busy machine then costs a check, not
a switch). While the table's background warm reads it, prefetch stays on, from the device
(a warm that starts while prefetch is off and the read rule is cleanly mapped is seen at the
next recheck, or at once by a fill it makes fault). A fill through the
mapping that faulted (`faulted`) keeps prefetch on for ``fault_s`` where the rows are sampled
cold (read from the device); resident rows, whose faults are minor (this mapping not
populated yet), stay with the fills. ``prefetch=True`` always prefetches (still judging
where from); tables with a fixed backend or a RAM tier follow their own read rule.
``checks`` / ``switches`` count the samples and the decisions that changed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from engramdb.read.table import LocalTable

__all__ = ["CALM_MAX", "PrefetchRule"]

#: Doublings of an off layer's recheck interval while its checks keep finding it resident.
CALM_MAX = 4


class PrefetchRule:
    """Per layer of a decoder (``stores``: its local tables, None where not local)."""

    def __init__(self, stores: Sequence[LocalTable | None], prefetch: bool | str, recheck_s: float):
        n = len(stores)
        self.prefetch = prefetch
        self.recheck_s = float(recheck_s)
        #: Seconds prefetch stays on after a fill through the mapping faulted, where the
        #: rows are sampled cold (their faults read the device).
        self.fault_s = 1.0
        self.on: list[bool | None] = [None] * n  # None: not judged yet
        self.at = [-float("inf")] * n
        self.own = [s is not None and s.backend_name == "auto" and s.cache is None for s in stores]
        self.was_mapped = [False] * n
        #: The last sample of the layer's rows found them cold (read from the device).
        self.cold = [True] * n
        self.fault_until = [-float("inf")] * n
        #: Per layer: prefetch is off and nothing needs a look before this time (the next
        #: recheck) while the store's read rule stays in its clean mapped state: `want`
        #: answers in one test (a decode step runs it for every layer, cache-cold).
        self.quiet_until = [-float("inf")] * n
        #: Per layer: checks in a row that found it resident with prefetch already off (its
        #: quiet window is ``recheck_s`` doubled that many times, at most `CALM_MAX`; -1
        #: after a fault or a hint: the next such check starts the doubling over).
        self.calm = [0] * n
        self.checks = 0
        self.switches = 0
        #: Looks the store's read rule asked for (`want`: it left its mapped state, or lost
        #: residency, while the layer was off); each starts the doubling over.
        self.hints = 0

    def rows_resident(self, store: LocalTable, flat: np.ndarray) -> bool:
        """Whether a few spread rows of ``flat`` sit on resident pages (``mincore``)."""
        self.checks += 1
        return store.rows_resident(flat)

    def faulted(self, i: int) -> None:
        """A fill of layer ``i`` through the mapping faulted: prefetch for `fault_s`."""
        self.fault_until[i] = time.monotonic() + self.fault_s
        self.quiet_until[i] = -float("inf")
        self.calm[i] = -1  # the doubling starts over

    def _judge_cold(self, i: int, store: LocalTable, flat: np.ndarray, now: float) -> None:
        if now - self.at[i] >= self.recheck_s:
            self.at[i] = now
            self.cold[i] = not self.rows_resident(store, flat)

    def _force(self, i: int) -> bool:
        if self.on[i] is False:
            self.switches += 1
        self.on[i] = True
        return True

    def quiet(self, i: int, store: LocalTable | None, now: float) -> bool:
        """Whether layer ``i`` is in its quiet window at ``now``: prefetch off, no recheck
        due, and ``store``'s read rule mapped and not suspect (so no hint), so `want` says no
        without a look. A warm that starts meanwhile is seen at the recheck, or at once by a
        fill it makes fault (`faulted`)."""
        return now < self.quiet_until[i] and store is not None and store.mapped_state()

    def want(self, i: int, store: LocalTable | None, flat: np.ndarray) -> bool:
        """Whether layer ``i``'s rows ``flat`` (just hashed, not yet read) get a prefetch."""
        pf = self.prefetch
        if store is None or pf is False:
            return False
        now = time.monotonic()
        if self.quiet(i, store, now):
            return False
        if pf is True:
            self._judge_cold(i, store, flat, now)
            return True
        if not self.own[i]:  # a fixed backend or a RAM tier: the store's own rule
            return not store.mapped_state()
        on = self.on[i]
        if store.warming():
            # a sample of resident rows says little while the warm reads (at B=8 the rows it
            # missed faulted 16-21 times a step, 3.6 ms a fill): prefetch, from the device
            self.cold[i] = True
            return self._force(i)
        if now < self.fault_until[i]:
            # a fill through the mapping was slow: rows sampled cold (major faults) are read
            # ahead from the device; resident ones (minor faults: this mapping not populated
            # yet) stay with the fills, since the table's prefetcher thread would cost this
            # thread a GIL hand-off a step (warm B=8: 0.94x-0.98x against 0.99x, 30th stop)
            self._judge_cold(i, store, flat, now)
            return self._force(i) if self.cold[i] else self._decide(i, store, False)
        # While off, the read rule's view of the fills is a hint to look again now; the
        # decision itself always comes from the rows just hashed.
        hint = on is False and (
            (store.resident_state() and not store.mapped_state())
            or (self.was_mapped[i] and not store.resident_state())
        )
        if hint or on is None or now - self.at[i] >= self.recheck_s:
            if hint:
                self.hints += 1
                self.calm[i] = -1
            self.at[i] = now
            decided = not self.rows_resident(store, flat)
            self.cold[i] = decided
        else:
            decided = on
        return self._decide(i, store, decided)

    def _decide(self, i: int, store: LocalTable, decided: bool) -> bool:
        """Record layer ``i``'s decision (switches counted; off: quiet until the recheck)."""
        on = self.on[i]
        if on is not None and decided != on:
            self.switches += 1
        calm = self.calm[i] = min(self.calm[i] + 1, CALM_MAX) if on is False and not decided else 0
        self.on[i] = decided
        self.was_mapped[i] = store.resident_state()
        self.quiet_until[i] = (
            -float("inf") if decided else self.at[i] + self.recheck_s * (1 << calm)
        )
        return decided
