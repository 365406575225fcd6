"""The CPUs the library's own worker threads run on.

A thread inherits the CPU mask of the thread that starts it. The library starts its
submitter, background warm and prefetch threads from the engine's thread, at its first read
of a kind. An engine that has pinned its decoding thread to one CPU (a common deployment)
would then share that CPU with the very threads meant to take work off it: measured here, a
B=8 cold decode whose thread was pinned before the first step spent ~0.7 ms a step more in
`Decoder.push`, the submitter asleep behind it.

`PROCESS_CPUS` is the mask of the thread that imported ``engramdb`` (in practice the
process's start-up mask: ``taskset`` on the command line is kept), and `run_as_worker`, the
first call in each such thread, moves the thread there.
"""

from __future__ import annotations

import os

__all__ = ["PROCESS_CPUS", "run_as_worker", "worker_cpus"]


def _mask() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - no affinity on this platform
        return frozenset()


#: The calling thread's CPUs when ``engramdb`` was imported (empty where not known).
PROCESS_CPUS = _mask()


def worker_cpus(inherited: frozenset[int]) -> frozenset[int]:
    """Where a worker that inherited ``inherited`` from the thread starting it runs: the
    process's CPUs, less the starter's where it pinned itself to part of them (an engine's
    decoding thread keeps its CPUs to itself), and never an empty set."""
    if not PROCESS_CPUS:
        return inherited
    if inherited and inherited < PROCESS_CPUS:
        return PROCESS_CPUS - inherited
    return PROCESS_CPUS


def run_as_worker() -> bool:
    """Move the calling thread (a library worker, first thing it does) onto `worker_cpus`
    of the mask it inherited; True when it moved. A refusal leaves it where it is."""
    here = _mask()
    want = worker_cpus(here)
    if not want or want == here:
        return False
    try:
        os.sched_setaffinity(0, want)
    except OSError:  # a cpuset that shrank since import: keep the inherited mask
        return False
    return True
