"""This process's memory: its resident bytes (``/proc/self/status``), a mapping's resident and
2 MiB-mapped bytes (``/proc/self/smaps``), dropping a range's page-table entries, ``mlock``
with a typed refusal, and the machine's ``/proc/meminfo`` with the safety margin the tiers
leave free. Used by the memory tiers (`engramdb.io.tiers`, which re-exports these names),
`engramdb.io.resident_lock` and ``Store.memory()``."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import resource

from engramdb.errors import MemoryLockRefused
from engramdb.io.mapping import LIBC, MADV_DONTNEED, madvise

__all__ = [
    "lock_range",
    "mapped_rss",
    "mapped_rss_split",
    "meminfo",
    "process_rss",
    "safety_margin",
    "trim_mapped",
    "unlock_range",
]

LIBC.mlock.restype = ctypes.c_int
LIBC.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.munlock.restype = ctypes.c_int
LIBC.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


_MIN_MARGIN = 512 << 20
_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmLck")
_RANGE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) ", re.M)
_RSS = re.compile(rb"^Rss:\s+(\d+) kB", re.M)
_PMD = re.compile(rb"^FilePmdMapped:\s+(\d+) kB", re.M)


def process_rss() -> dict[str, int]:
    """This process's ``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``RssShmem``, ``VmLck``
    in bytes (``/proc/self/status``)."""
    out = dict.fromkeys(_STATUS_KEYS, 0)
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0]) * 1024
    return out


def mapped_rss(addr: int, length: int) -> int:
    """Bytes of ``[addr, addr + length)`` mapped resident in this process (the ``Rss`` of
    the ``/proc/self/smaps`` entries inside it; ~1 ms)."""
    return mapped_rss_split(addr, length)[0]


def mapped_rss_split(addr: int, length: int) -> tuple[int, int]:
    """``(rss, huge)``: bytes of ``[addr, addr + length)`` mapped resident in this process,
    and the part of them mapped with 2 MiB page-table entries (``FilePmdMapped``: page-cache
    folios of 2 MiB, gathered through them without TLB misses per 4 KiB page)."""
    with open("/proc/self/smaps", "rb") as f:
        text = f.read()
    end = addr + length
    total = huge = 0
    heads = list(_RANGE.finditer(text))
    for i, m in enumerate(heads):
        lo, hi = int(m.group(1), 16), int(m.group(2), 16)
        if hi <= addr or lo >= end:
            continue
        stop = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        r = _RSS.search(text, m.end(), stop)
        if r is not None:
            total += int(r.group(1)) * 1024
        r = _PMD.search(text, m.end(), stop)
        if r is not None:
            huge += int(r.group(1)) * 1024
    return total, huge


def trim_mapped(addr: int, length: int) -> None:
    """Drop this process's page-table entries for ``[addr, addr + length)`` of a shared file
    mapping (``MADV_DONTNEED``); the pages stay in the page cache."""
    madvise(addr, length, MADV_DONTNEED)


def lock_range(addr: int, length: int) -> None:
    """``mlock`` a range (faults it in). Refused → `MemoryLockRefused` naming
    ``RLIMIT_MEMLOCK`` and its current value."""
    if length <= 0:
        return
    if LIBC.mlock(addr, length) != 0:
        e = ctypes.get_errno()
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        lim = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        hint = (
            f"RLIMIT_MEMLOCK is {lim}: raise it (ulimit -l, LimitMEMLOCK=, "
            "--ulimit memlock=) or grant CAP_IPC_LOCK"
        )
        if e in (errno.EPERM, errno.ENOMEM, errno.EAGAIN):
            raise MemoryLockRefused(e, f"mlock of {length} bytes refused: {hint}")
        raise MemoryLockRefused(e, f"mlock of {length} bytes failed: {os.strerror(e)}; {hint}")


def unlock_range(addr: int, length: int) -> None:
    """``munlock`` a range locked by `lock_range` (errors ignored)."""
    if length > 0:
        LIBC.munlock(addr, length)


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ``Cached``, ...)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def safety_margin(info: dict[str, int] | None = None) -> int:
    """Memory the background warm and the default budget leave free: 5 % of ``MemTotal``,
    at least 512 MiB."""
    info = meminfo() if info is None else info
    return max(_MIN_MARGIN, info.get("MemTotal", 0) // 20)
