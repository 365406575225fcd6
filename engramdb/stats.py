"""One shape for counters: a dataclass of numbers with one `as_dict`.

The RAM tier (`CacheStats`), the I/O backends (`BackendStats`) and the prefetcher
(`PrefetchStats`) count with subclasses of `Stats`, so every ``stats()`` report is built the
same way: the fields in declaration order, then the derived figures a subclass names in
``derived`` (read-only properties such as a hit rate).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

_S = TypeVar("_S", bound="Stats")


@dataclasses.dataclass
class Stats:
    """Base of the counter dataclasses. Subclasses declare int fields (defaulting to 0) and
    may list property names in ``derived`` to add them to `as_dict`."""

    derived: ClassVar[tuple[str, ...]] = ()

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (fields first, then the ``derived`` figures)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in self.derived:
            out[name] = getattr(self, name)
        return out

    def copy(self: _S) -> _S:
        """A snapshot: an independent copy of the counters."""
        return dataclasses.replace(self)
