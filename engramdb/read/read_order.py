"""The order of one thread's step reads across readers: the rows needed soonest read first.

A model with a table per layer may prefetch every layer's rows right after sampling, each
through its own reader (`engramdb.torch.DiskMultiHeadEmbedding.prefetch`, one
`engramdb.read.steps.StepReader` and ring per layer). Handed to the device together, the
reads are served interleaved: with two layers' 128 reads each, the first layer's were all
in after 1.8 ms at p50 (2.3 ms at p90), against 1.0 ms (1.1-1.2 ms) when the second
layer's were submitted only after them, and the whole step took as long either way. The
first layer is needed soonest, a few blocks into the step.

So the reads a thread submits one after another, before any of them is consumed, form a
*burst*: the first reader's step gets a lead number, which its submitter thread publishes
once that step's reads are all in; the later readers' steps wait for it before they are
submitted (`engramdb.io.sqpoll.Submitter.wake`: at most 3 ms, and their own reader's wait
submits them in any case). Consuming rows (`StepReader.finish_into` / `collect`) ends the
burst; a reader that comes again also starts a new one. Readers without a submitter thread
take no part: their reads go at once.
"""

from __future__ import annotations

import itertools
import threading

__all__ = ["begin", "end", "led"]

_numbers = itertools.count(1)  # lead numbers, rising across the process (`next` is atomic)
_local = threading.local()


class _Burst:
    __slots__ = ("lead", "members", "live")

    def __init__(self, lead: int, member: int) -> None:
        self.lead = lead
        self.members = {member}
        self.live = True  # the lead's reads went to a submitter thread: it will publish


def begin(reader: object) -> tuple[int, int]:
    """``(lead, after)`` for the step ``reader`` is about to submit from this thread: a new
    lead number for the first of a burst (and ``after`` 0), else 0 and the burst's lead
    number (0 where the lead will not be published)."""
    burst: _Burst | None = getattr(_local, "burst", None)
    key = id(reader)
    if burst is None or key in burst.members:
        _local.burst = _Burst(next(_numbers), key)
        return _local.burst.lead, 0
    burst.members.add(key)
    return 0, burst.lead if burst.live else 0


def led(handed: bool) -> None:
    """The first step of this thread's burst was (``handed``) or was not given to a
    submitter thread (then nothing publishes its lead: the later steps do not wait)."""
    burst: _Burst | None = getattr(_local, "burst", None)
    if burst is not None and not handed:
        burst.live = False


def end() -> None:
    """Rows of this thread's burst were consumed: the next step read starts a new one."""
    _local.burst = None
