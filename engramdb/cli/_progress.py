"""The one progress display of every long command (build, attach --checksum, index, view
build, warm, verify, publish), and the wait for another writer's lock.

`Progress` draws one line on stderr, only when stderr is a terminal: the phase, a bar, the
amount done of the total (sizes in binary units, counts with thousands separators), rows done
where the row size is known, the rate (decimal GB/s, or rows / tokens / records per second)
and the ETA. A ticker thread redraws it a few times a second, so a phase that reports
rarely still shows its elapsed time and ETA moving. When stderr or stdout is not a terminal
nothing is drawn: a command piped into a file (or ``--json | jq``) prints its result only.

It is every library ``progress`` callback at once: ``progress(done, total)`` (cumulative,
the index and view builders), ``update(n)`` (an increment, the table, warm and verify
writers) and ``phase(label, total, unit)`` (`engramdb.units.progress_phase`: a new phase
with its own total and unit, e.g. "populating" bytes before "gathering" records).
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import click

from engramdb.table_api import Closing
from engramdb.units import format_bytes, format_count, format_duration, format_rate

_LOCK_NAME = ".lock"  # engramdb.disk.publish.LOCK_NAME (a test keeps the two in step)


class Progress(Closing):
    """One progress line on stderr (see the module doc). ``unit``: ``"B"`` (bytes) or a
    count noun (``"tokens"``, ``"records"``); ``row_bytes`` also shows rows for byte
    progress; ``quiet`` or a non-terminal stderr draws nothing."""

    TICK_S = 0.2

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        unit: str = "B",
        row_bytes: int | None = None,
        quiet: bool = False,
        stream: IO[str] | None = None,
        force_draw: bool = False,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and (force_draw or (_isatty(self.stream) and _isatty(sys.stdout)))
        self.row_bytes = row_bytes
        self.draws = 0
        self.width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.phase(label, total, unit)

    # -- the callbacks ------------------------------------------------------------------------
    def phase(self, label: str, total: int | None, unit: str = "B") -> None:
        """Start a new phase: its own label, total, unit and clock."""
        with self._lock:
            if self.draws and self.enabled:
                self._draw(final=True)
            self.label, self.total, self.unit = label, total, unit
            self.done = 0
            self.t0 = time.perf_counter()
        self._start_ticker()

    def __call__(self, done: int, total: int) -> None:
        """Cumulative report: ``done`` of ``total``."""
        with self._lock:
            self.done, self.total = int(done), int(total)
            self._maybe_draw()

    def update(self, n: int) -> None:
        """Incremental report: ``n`` more done."""
        with self._lock:
            self.done += int(n)
            self._maybe_draw()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            if self.enabled and (self.draws or self.done):
                self._draw(final=True)

    # -- drawing ------------------------------------------------------------------------------
    def _start_ticker(self) -> None:
        if self.enabled and self._ticker is None:
            self._ticker = threading.Thread(
                target=self._tick, name="engramdb-progress", daemon=True
            )
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.TICK_S):
            with self._lock:
                self._draw()

    def _maybe_draw(self) -> None:
        if self.enabled and time.perf_counter() - getattr(self, "_last", 0.0) >= 0.05:
            self._draw()

    def text(self) -> str:
        """The line as drawn now."""
        elapsed = time.perf_counter() - self.t0
        parts = [self.label]
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * 24)
            parts.append(f"[{'#' * filled}{'.' * (24 - filled)}] {frac:4.0%}")
        if self.total or self.done:
            parts.append(self._amount())
        if self.done and elapsed > 0:
            rate = self.done / elapsed
            parts.append(format_rate(rate, self.unit))
            if self.total and self.done < self.total:
                parts.append(f"ETA {format_duration((self.total - self.done) / rate)}")
        parts.append(format_duration(elapsed))
        return "  ".join(parts)

    def _amount(self) -> str:
        fmt = format_bytes if self.unit == "B" else (lambda n: format_count(n, self.unit))
        text = fmt(self.done) if not self.total else f"{fmt(self.done)} / {fmt(self.total)}"
        if self.unit == "B" and self.row_bytes:
            text += f" ({format_count(self.done // self.row_bytes, 'rows')})"
        return text

    def _draw(self, final: bool = False) -> None:
        line = self.text()
        pad = max(0, self.width - len(line))
        self.width = len(line)
        self.stream.write("\r" + line + " " * pad + ("\n" if final else ""))
        self.stream.flush()
        self.draws += 1
        self._last = time.perf_counter()
        if final:
            self.width = 0
            self.draws = 0


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def lock_holder(db: str | os.PathLike[str]) -> int | None:
    """PID of the process holding the writer lock of ``db`` (from ``/proc/locks``), or None
    when nobody holds it or it cannot be told."""
    try:
        ino = os.stat(Path(db) / _LOCK_NAME).st_ino
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; blocked waiters carry "->"
        if "->" in fields or len(fields) < 6:
            continue
        dev_ino = fields[5].split(":")
        if len(dev_ino) == 3 and dev_ino[2].isdigit() and int(dev_ino[2]) == ino:
            return int(fields[4]) if fields[4].isdigit() else None
    return None


def wait_for_writer(db: str | os.PathLike[str], quiet: bool = False) -> float:
    """Wait until no other writer holds the lock of ``db``, saying so on stderr ("waiting for
    the writer lock held by PID n"), so that the wait is not timed as the command's own work.
    Returns the seconds waited (0.0 when the lock was free or ``db`` is not there yet).
    The lock is released again at once: the library call takes it itself."""
    path = Path(db) / _LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0.0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return 0.0
        except BlockingIOError:
            pass
        pid = lock_holder(db)
        who = f"PID {pid}" if pid is not None else "another process"
        if not quiet:
            click.echo(f"waiting for the writer lock of {db} held by {who} ...", err=True)
        t0 = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        waited = time.perf_counter() - t0
        if not quiet:
            click.echo(f"got the writer lock after {waited:.1f} s", err=True)
        return waited
    finally:
        os.close(fd)  # releases the lock


def json_ready(value: Any) -> Any:
    """``value`` with paths, tuples and numpy scalars made JSON-serialisable."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return None
    return value
