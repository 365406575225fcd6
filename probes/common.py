"""Shared probe plumbing: interleaved repetitions, medians, ratios, RSS, JSON output."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"


def vm_hwm_mb(pid: str = "self") -> float:
    """Peak resident set size (VmHWM) in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def proc_read_bytes() -> int:
    """Bytes this process has read from the block layer (``/proc/self/io`` read_bytes)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def rate(fn: Callable[[], int], seconds: float) -> float:
    """Calls ``fn`` (returning the units it did) for about ``seconds``; units per second."""
    done = 0
    t0 = time.perf_counter()
    while True:
        done += fn()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return done / dt


class CacheFlush:
    """Evicts the CPU caches between timed arms: one read of a populated buffer twice the
    last-level cache. The arms of a warm probe gather the same ids from the same files; on
    a machine whose last-level cache is large (480 MiB here) an arm that runs right after
    one that read the same rows finds them there, and the ABBA order then decides which
    arm wins. Flushed, every arm starts from main memory, as a model's lookup does after
    the step's own work has gone through the cache."""

    def __init__(self, nbytes: int | None = None):
        import numpy as np

        from engramdb.io.gather import llc_bytes

        n = nbytes if nbytes is not None else 2 * llc_bytes()
        self.nbytes = n
        self._buf = np.ones(n // 8, np.uint64)  # written once: populated

    def __call__(self) -> None:
        self._buf.max()


def interleave(
    arms: dict[str, Callable[[], float]],
    reps: int,
    echo: Callable[[str], None] = print,
    before: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Run each arm once per repetition, alternating the order (ABAB / BABA), and print
    every figure; ``before`` (e.g. a `CacheFlush`) runs, untimed, before every arm."""
    names = list(arms)
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        row = []
        for n in order:
            if before is not None:
                before()
            v = arms[n]()
            results[n].append(v)
            row.append(f"{n}={v / 1e6:.2f}M")
        echo(f"  rep {r}: " + "  ".join(row))
    return results


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def pooled_ratio(times: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Baseline over arm time summed over paired blocks ``(t_base, t_arm)``: ``(low, ratio,
    high)``, with a 95 % bootstrap interval (blocks resampled with replacement, 4000 draws)."""
    import numpy as np

    t = np.asarray(times, dtype=np.float64).reshape(-1, 2)
    pick = np.random.default_rng(0).integers(0, len(t), (4000, len(t)))
    boot = t[pick, 0].sum(axis=1) / t[pick, 1].sum(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(t[:, 0].sum() / t[:, 1].sum()), float(hi)


def write_json(name: str, doc: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return path


def read_once(paths: Any) -> None:
    """One CPU read of every byte of each file in ``paths`` (already in the page cache). On
    this VM the first CPU touch of memory the device wrote is slow, and timed batches would
    otherwise meet those first touches (a first repetition at 0.3 M rows/s, seen)."""
    import numpy as np

    for p in paths:
        m = np.memmap(p, np.uint8, "r")
        int(m[: m.size // 8 * 8].view(np.uint64).max())
        del m


def cpu_note() -> str:
    return f"{os.cpu_count()} cpus, pid {os.getpid()}"


def _cpu_list(text: str) -> set[int]:
    """CPUs of a kernel cpu list (``"0-1,3"``)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def disk_irq_cpus(path: str | Path) -> set[int]:
    """The CPUs that take the interrupts of the block device holding ``path``: the effective
    affinity of its queues' lines in ``/proc/interrupts`` (``virtio1-req.0``, ``nvme0q3``).
    Empty where that is not found (a loop or network device, no sysfs)."""
    try:
        st = os.stat(path)
        node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        if (node / "partition").exists():
            node = node.parent
        dev = (node / "device").resolve().name  # virtio1, nvme0, ...
        cpus: set[int] = set()
        with open("/proc/interrupts") as f:
            for line in f:
                fields = line.split()
                name = fields[-1] if fields else ""
                if name.startswith((f"{dev}-req", f"{dev}q")) and fields[0].endswith(":"):
                    irq = fields[0][:-1]
                    cpus |= _cpu_list(Path(f"/proc/irq/{irq}/effective_affinity_list").read_text())
        return cpus
    except (OSError, ValueError):
        return set()


def current_cpu() -> int:
    """The CPU the calling thread runs on (``sched_getcpu``), -1 where unknown."""
    global _getcpu
    if _getcpu is None:
        import ctypes

        try:
            _getcpu = ctypes.CDLL(None).sched_getcpu
        except (OSError, AttributeError):
            _getcpu = False
    return int(_getcpu()) if _getcpu else -1


_getcpu: Any = None


def cpu_busy_ticks() -> list[int]:
    """Each CPU's busy clock ticks so far (user, nice, system, irq, softirq from
    ``/proc/stat``; ``os.sysconf("SC_CLK_TCK")`` a second), [] where unknown."""
    out = []
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"cpu") and line[3:4].isdigit():
                    v = line.split()[1:8]
                    out.append(sum(int(v[i]) for i in (0, 1, 2, 5, 6)))
    except (OSError, ValueError, IndexError):
        return []
    return out


def thread_sleeps() -> int:
    """The calling thread's voluntary context switches so far (-1 where unknown): each is a
    wait, for a read or a lock (the GIL held by another thread of the process among them)."""
    try:
        with open("/proc/thread-self/status", "rb") as f:
            for line in f:
                if line.startswith(b"voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1
