"""Units: human byte sizes (``"8G"`` -> 8 GiB), rates, and the shape of a run's summary."""

from __future__ import annotations

import re
from typing import Any

from engramdb.errors import InvalidArgument

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes for ``"512M"``, ``"8G"``, ``"1.5GiB"``, ``"4096"`` (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgument(f"size must be >= 0, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise InvalidArgument(f"cannot parse size {text!r} (use e.g. 512M, 8G, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _three_digits(x: float) -> str:
    """``x`` with about three significant digits, without trailing zeros (``64``, ``1.5``)."""
    if x == int(x):
        return f"{int(x)}"
    text = f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_bytes(n: float) -> str:
    """A size in binary units, the one size formatter of every line EngramDB prints:
    ``512 B``, ``64 MiB`` (not ``67.1 MB``), ``1.5 GiB``; never ``0.000 GB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{_three_digits(n)} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover (the loop returns at TiB)


def format_rate(per_s: float, unit: str = "B") -> str:
    """A rate in decimal units: bytes always as ``GB/s`` (``1.23 GB/s``, ``0.012 GB/s``), counts as
    ``k`` / ``M`` per second (``12.3 M rows/s``)."""
    if per_s != per_s or per_s in (float("inf"), float("-inf")):
        return f"- {unit}/s" if unit != "B" else "- B/s"
    if unit == "B":  # always GB/s, so that lines compare at a glance
        g = per_s / 1e9
        return f"{g:.2f} GB/s" if abs(g) >= 0.1 or g == 0 else f"{g:.2g} GB/s"
    for div, name in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(per_s) >= div:
            return f"{per_s / div:.2f} {name} {unit}/s"
    return f"{per_s:.1f} {unit}/s"


def format_count(n: float, unit: str = "") -> str:
    """A count with thousands separators and its noun: ``1,234,567 rows``."""
    return f"{int(n):,} {unit}".rstrip()


def format_duration(seconds: float) -> str:
    """``0.25 s``, ``12.3 s``, ``4:05``, ``1:02:03``."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "-"
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_phase(progress: Any, label: str, total: int | None, unit: str = "B") -> None:
    """Tell a ``progress`` callback that a new phase begins (``label``, its ``total`` in
    ``unit``), where it can hear it (the CLI's `Progress` has ``phase``); a plain
    ``progress(done, total)`` function is left alone."""
    fn = getattr(progress, "phase", None)
    if callable(fn):
        fn(label, total, unit)


def per_second(amount: float, seconds: float) -> float:
    """``amount / seconds``; infinite for a run too short to time (``seconds <= 0``)."""
    return amount / seconds if seconds > 0 else float("inf")


class Summary:
    """Base of the result records a long call returns (build, warm, index, view build).

    Subclasses are frozen dataclasses with a ``bytes`` (or other amount) and a ``seconds``
    field and write `line`: one human line with units, which the CLI prints as it is.
    `gb_per_s` is written once here, from ``bytes`` and ``seconds``.
    """

    __slots__ = ()

    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Decimal gigabytes per second (``bytes / 1e9 / seconds``)."""
        return per_second(self.bytes / 1e9, self.seconds)

    def line(self) -> str:
        """One line for a human, with units."""
        raise NotImplementedError

    def size_and_rate(self) -> str:
        """``"1.5 GiB in 1.20 s, 1.34 GB/s"``: the size in binary units, the rate decimal."""
        return (
            f"{format_bytes(self.bytes)} in {self.seconds:.2f} s, "
            f"{format_rate(per_second(self.bytes, self.seconds))}"
        )
