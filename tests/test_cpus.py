"""Library worker threads leave an engine thread's pin: they run on the CPUs the process
started with, less those the engine's thread pinned itself to."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from engramdb import _cpus
from engramdb.io.sqpoll import polled_ring, submitter_state
from engramdb.io.uring_ring import Ring

pytestmark = pytest.mark.skipif(
    len(_cpus.PROCESS_CPUS) < 2, reason="needs a process allowed on two CPUs"
)


def _in_pinned_thread(fn: Any) -> Any:
    """``fn()`` run in a thread pinned to one CPU of the process (the engine's pin)."""
    got: dict[str, Any] = {}

    def body() -> None:
        os.sched_setaffinity(0, {min(_cpus.PROCESS_CPUS)})
        try:
            got["value"] = fn()
        except BaseException as e:  # pragma: no cover - surfaced below
            got["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["value"]


def test_a_worker_leaves_the_pin_it_inherited() -> None:
    def start_worker() -> tuple[set[int], set[int]]:
        seen: dict[str, set[int]] = {}

        def worker() -> None:
            seen["before"] = set(os.sched_getaffinity(0))
            _cpus.run_as_worker()
            seen["after"] = set(os.sched_getaffinity(0))

        w = threading.Thread(target=worker)
        w.start()
        w.join()
        return seen["before"], seen["after"]

    before, after = _in_pinned_thread(start_worker)
    assert before == {min(_cpus.PROCESS_CPUS)}
    assert after == set(_cpus.PROCESS_CPUS) - before


def test_worker_cpus_keep_an_unpinned_or_odd_mask_whole() -> None:
    every = _cpus.PROCESS_CPUS
    assert _cpus.worker_cpus(every) == every  # an engine that did not pin itself
    assert _cpus.worker_cpus(frozenset()) == every
    one = frozenset({min(every)})
    assert _cpus.worker_cpus(one) == every - one
    outside = frozenset({max(every) + 1})  # not a part of the process's set: left alone
    assert _cpus.worker_cpus(outside) == every


def test_the_submitter_of_a_ring_made_by_a_pinned_thread_leaves_its_cpu() -> None:
    if not submitter_state()[0]:
        pytest.skip(f"no submitter thread here: {submitter_state()[1]}")
    try:
        ring: Ring = _in_pinned_thread(lambda: polled_ring(8))
    except OSError as e:
        pytest.skip(f"io_uring refused: {e}")
    try:
        if ring.sqpoll or ring.wake is None:
            pytest.skip("this ring is read by the polling thread, not a submitter")
        sub = ring.wake.__self__  # type: ignore[attr-defined]
        tid = sub._thread.native_id
        assert tid is not None
        want = set(_cpus.PROCESS_CPUS) - {min(_cpus.PROCESS_CPUS)}
        pause = threading.Event()
        for _ in range(200):  # the thread moves itself first thing; give it a moment
            if set(os.sched_getaffinity(tid)) == want:
                break
            pause.wait(0.005)
        assert set(os.sched_getaffinity(tid)) == want
    finally:
        ring.close()
