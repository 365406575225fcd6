"""Benchmarks of Store-P view reads: the library side of ``engramdb view bench|lat``.

`measure_throughput` times `View.read_records` in batches (warm or cold, access or random
order) and reports records/s, MB/s and bytes amplification from the view's counters and
``/proc/self/io``; `measure_latency` times single `View.read_record` calls (p50 / p99).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.units import per_second
from engramdb.view import View

__all__ = ["LatencyResult", "ThroughputResult", "measure_latency", "measure_throughput"]


def _proc_read_bytes() -> int:
    """Bytes this process caused to be read from block devices (``/proc/self/io``)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


@dataclass(frozen=True)
class ThroughputResult:
    """One `measure_throughput` run. Rates per second; bytes are totals of the run."""

    mode: str  # "warm" | "cold"
    order: str  # "access" | "random"
    batch: int
    records: int
    seconds: float
    bytes_returned: int
    bytes_requested: int
    device_bytes: int  # -1 when /proc/self/io is unavailable
    residency_before: float
    backend: str
    batches: dict[str, int]  # batches per path: mmap, syscall (of which direct)

    @property
    def records_per_s(self) -> float:
        return per_second(self.records, self.seconds)

    @property
    def mb_per_s(self) -> float:
        return per_second(self.bytes_returned / 1e6, self.seconds)

    @property
    def api_amplification(self) -> float:
        """Bytes the view asked its mapping / backend for, per byte returned."""
        return self.bytes_requested / self.bytes_returned if self.bytes_returned else 0.0

    @property
    def device_amplification(self) -> float:
        """Bytes read from the device (``/proc/self/io``), per byte returned."""
        if self.device_bytes < 0 or not self.bytes_returned:
            return float("nan")
        return self.device_bytes / self.bytes_returned

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            records_per_s=self.records_per_s,
            mb_per_s=self.mb_per_s,
            api_amplification=self.api_amplification,
            device_amplification=self.device_amplification,
        )
        return d

    def line(self) -> str:
        dev = (
            f"device {self.device_amplification:.2f}x"
            if self.device_bytes >= 0
            else "device bytes unknown"
        )
        return (
            f"{self.mode} {self.order}-order read_records, batch {self.batch:,}: "
            f"{self.records_per_s / 1e3:,.1f} k records/s, {self.mb_per_s:,.0f} MB/s, "
            f"amplification api {self.api_amplification:.2f}x, {dev} "
            f"(resident before {self.residency_before:.0%}, backend {self.backend} "
            f"{self.batches})"
        )


def _batches(
    n: int, count: int, order: str, batch: int, rng: np.random.Generator
) -> list[np.ndarray]:
    if order == "access":
        start = int(rng.integers(0, max(1, n - count + 1)))
        ids = np.arange(start, start + count, dtype=np.int64)
    elif order == "random":
        ids = rng.permutation(n)[:count].astype(np.int64)
    else:
        raise InvalidArgument(f"order must be 'access' or 'random', got {order!r}")
    return [ids[i : i + batch] for i in range(0, count, batch)]


def measure_throughput(
    view: View,
    *,
    order: str = "random",
    batch: int = 16384,
    cold: bool = False,
    records: int | None = None,
    seconds: float = 1.0,
    seed: int = 0,
) -> ThroughputResult:
    """records/s of `View.read_records` in batches of ``batch`` ids.

    ``order="access"`` reads consecutive slots (a replay of the build corpus's first
    accesses); ``"random"`` a random permutation. Warm: populates the view, runs one untimed
    pass, then repeats passes for about ``seconds``. Cold: evicts the view (`View.evict`),
    then reads ``records`` records once (default: all, at most 262,144), each at most once.
    Device bytes come from ``/proc/self/io`` (other threads of this process count too).
    """
    if batch < 1:
        raise InvalidArgument(f"batch must be >= 1, got {batch}")
    n = view.n_records
    if n == 0:
        raise InvalidArgument(f"view {view.name!r} has no records to read")
    count = min(n, records if records is not None else (262_144 if cold else n))
    if count < 1:
        raise InvalidArgument(f"records must be >= 1, got {records}")
    rng = np.random.default_rng(seed)
    batches = _batches(n, count, order, batch, rng)
    out = np.empty((min(batch, count), view.record_bytes), dtype=np.uint8)

    def run_pass() -> int:
        for b in batches:
            view.read_records(b, out=out[: b.shape[0]])
        return count

    if cold:
        residency = view.evict()
    else:
        view.populate()
        run_pass()
        residency = view.residency()
    c0 = view.counters
    dev0 = _proc_read_bytes()
    t0 = time.perf_counter()
    done = run_pass()
    if not cold:
        while time.perf_counter() - t0 < seconds:
            done += run_pass()
    dt = time.perf_counter() - t0
    dev1 = _proc_read_bytes()
    c1 = view.counters
    paths = {
        "mmap": c1["mmap_batches"] - c0["mmap_batches"],
        "syscall": c1["io_batches"] - c0["io_batches"],
        "direct": c1["direct_batches"] - c0["direct_batches"],
    }
    return ThroughputResult(
        mode="cold" if cold else "warm",
        order=order,
        batch=batch,
        records=done,
        seconds=dt,
        bytes_returned=c1["bytes_returned"] - c0["bytes_returned"],
        bytes_requested=c1["bytes_requested"] - c0["bytes_requested"],
        device_bytes=dev1 - dev0 if dev0 >= 0 and dev1 >= 0 else -1,
        residency_before=residency,
        backend=view.backend,
        batches={k: v for k, v in paths.items() if v},
    )


@dataclass(frozen=True)
class LatencyResult:
    """Per-call latency of `View.read_record`, microseconds (timer overhead included)."""

    mode: str
    steps: int
    p50_us: float
    p99_us: float
    mean_us: float
    max_us: float
    residency_before: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return (
            f"{self.mode} read_record x {self.steps:,}: p50 {self.p50_us:.2f} us, p99 "
            f"{self.p99_us:.2f} us, mean {self.mean_us:.2f} us (resident before "
            f"{self.residency_before:.0%})"
        )


def measure_latency(
    view: View, *, steps: int = 10_000, cold: bool = False, warmup: int = 1000, seed: int = 0
) -> LatencyResult:
    """p50 / p99 of single `View.read_record` calls on random records, each call timed with
    ``perf_counter_ns`` (~0.05 us of the figure is the timer). Warm: the view is populated
    and ``warmup`` calls run first. Cold: the view is evicted first and every step reads a
    different record (so each is a fresh fault unless records share a page)."""
    if steps < 1:
        raise InvalidArgument(f"steps must be >= 1, got {steps}")
    n = view.n_records
    if n == 0:
        raise InvalidArgument(f"view {view.name!r} has no records to read")
    rng = np.random.default_rng(seed)
    if cold:
        steps = min(steps, n)
        ids = rng.permutation(n)[:steps].tolist()
        residency = view.evict()
    else:
        ids = rng.integers(0, n, size=steps).tolist()
        view.populate()
        for i in rng.integers(0, n, size=warmup).tolist():
            view.read_record(i)
        residency = view.residency()
    clock = time.perf_counter_ns
    read = view.read_record
    times = np.empty(len(ids), dtype=np.int64)
    # One Python loop around single calls is the thing being measured here.
    for j, i in enumerate(ids):
        t = clock()
        read(i)
        times[j] = clock() - t
    us = times / 1e3
    return LatencyResult(
        mode="cold" if cold else "warm",
        steps=len(ids),
        p50_us=float(np.percentile(us, 50)),
        p99_us=float(np.percentile(us, 99)),
        mean_us=float(us.mean()),
        max_us=float(us.max()),
        residency_before=residency,
    )
