"""Units: human byte sizes (``"8G"`` -> 8 GiB), rates, and the shape of a run's summary."""

from __future__ import annotations

import re

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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


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
