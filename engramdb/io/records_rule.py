"""The read rule for fixed-size records (Store-P view slots): which path serves a batch.

Views read with the same rule as tables (`engramdb.io.select`): the mapping while the batch's
sampled pages are resident, else a cold backend picked by `choose_backend`, and batches too
small to be worth a residency check go to the mapping (AutoBackend's ``min_sampled``). What
differs for records is how the cold batch travels, measured on cold 2560 B records
(``docs/view.md``):

* nothing of the batch cached: every read through io_uring ``O_DIRECT`` (in-order replay
  420-560 k records/s against 190-240 k through buffered preadv once the page cache is full
  and every buffered read must reclaim first; device bytes = payload bytes; no cache
  pollution);
* partly cached: buffered reads, runs of adjacent slots through preadv with kernel read-ahead
  (585-745 k records/s against 330-400 k through buffered io_uring, whose buffered reads are
  punted to kernel workers), single slots through io_uring for its queue depth;
* where io_uring is unavailable, preadv takes every cold role.

`RecordRule` holds the backends of one open view and answers `choose` (per batch) and
`read` (the cold batch's requests). The view's file handling is `engramdb.read.records`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument
from engramdb.io.base import Backend
from engramdb.io.select import BACKENDS, AutoBackend, choose_backend, make_backend
from engramdb.io.uring import IoUringBackend

__all__ = [
    "DIRECT_BOUNCE_BYTES",
    "MAX_READ_BYTES",
    "MIN_SAMPLED",
    "SAMPLES",
    "RecordRule",
]

_AUTO_DEFAULTS = inspect.signature(AutoBackend.__init__).parameters
#: Batches of fewer records are served from the mapping unsampled: a stray cold fault in a
#: small batch costs less than checking for it. AutoBackend's ``min_sampled`` default.
MIN_SAMPLED: int = _AUTO_DEFAULTS["min_sampled"].default
#: Most slots a residency check samples (one ``mincore`` each). AutoBackend's ``samples``.
SAMPLES: int = _AUTO_DEFAULTS["samples"].default
#: Largest single read of a cold batch. Long runs of adjacent slots are split into reads of
#: this size so a syscall backend keeps several in flight (measured: see docs/view.md).
MAX_READ_BYTES = 16 * 1024 * 1024
#: Bounce buffer of the O_DIRECT backend (one per reading thread, allocated on first use):
#: a batch's reads are only in flight together if their spans fit it. 64 MiB holds a whole
#: 16,384 x 2560 B batch; 8 MiB read cold in-order batches ~15 % slower.
DIRECT_BOUNCE_BYTES = 64 * 1024 * 1024

#: `choose` answers: the mapping, or a cold read through one of `read`'s paths.
MAPPED = "mmap"
DIRECT = "io_uring_direct"


class RecordRule:
    """How the batches of one open view travel.

    ``backend``: ``"mmap"`` (copy out of the mapping: the warm path), ``"preadv"`` /
    ``"io_uring"`` (every batch through that backend, built with ``options``), or ``"auto"``
    (the module docstring's rule; ``options`` may only hold ``direct=`` to allow or forbid
    ``O_DIRECT``). Raises `InvalidArgument` for an unknown name or options and
    `BackendUnavailable` for ``"io_uring"`` where it cannot run.
    """

    def __init__(self, backend: str = "auto", options: dict[str, Any] | None = None):
        options = dict(options or {})
        self.backend = backend
        self._io: Backend | None = None  # "preadv" / "io_uring": every batch
        self._runs_io: Backend | None = None  # "auto", cold: runs of adjacent slots
        self._single_io: Backend | None = None  # "auto", cold: single slots, partly resident
        self._direct_io: Backend | None = None  # "auto", cold: nothing resident
        self._io_uring = False  # "auto": io_uring works here
        if backend not in BACKENDS:
            raise InvalidArgument(
                f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if backend == "mmap" and options:
            raise InvalidArgument(f"backend 'mmap' takes no options, got {sorted(options)}")
        if backend == "mmap":
            return
        if backend != "auto":
            self._io = make_backend(backend, **options)
            return
        direct = bool(options.pop("direct", True))
        if options:
            raise InvalidArgument(f"backend 'auto' takes only direct=, got {sorted(options)}")
        try:
            self._runs_io = make_backend("preadv")
            if IoUringBackend.availability()[0]:
                self._io_uring = True
                self._single_io = make_backend("io_uring")
                if direct:
                    self._direct_io = make_backend(
                        "io_uring", direct=True, direct_bounce_bytes=DIRECT_BOUNCE_BYTES
                    )
            else:
                self._single_io = self._runs_io
        except BaseException:
            self.close()
            raise

    def choose(self, n: int, resident_fraction: Callable[[int], float]) -> tuple[str, float]:
        """The path of a batch of ``n`` records and the resident share it was chosen on.

        ``resident_fraction(k)`` samples ``k`` of the batch's slots (evenly spread) and
        returns the share whose first page is resident; it is only called for ``auto``
        batches of at least `MIN_SAMPLED` records. Returns ``("mmap", 1.0)`` for the
        mapping, else the cold path (``"io_uring_direct"``, ``"io_uring"``, ``"preadv"`` or,
        for a fixed backend, its name) and the sampled fraction (0.0 for a fixed backend).
        """
        if self.backend == MAPPED:
            return MAPPED, 1.0
        if self.backend != "auto":
            return self.backend, 0.0
        if n < MIN_SAMPLED:
            return MAPPED, 1.0
        fraction = resident_fraction(min(SAMPLES, max(4, n // 64), n))
        name = choose_backend(
            fraction,
            mapped=True,
            io_uring=self._io_uring,
            direct=self._direct_io is not None,
        )
        return name, fraction

    def read(
        self,
        path: str,
        fds: tuple[int, int],
        offsets: np.ndarray,
        lengths: np.ndarray,
        dest: np.ndarray,
        dest_offsets: np.ndarray,
        runs: np.ndarray,
    ) -> None:
        """Read a cold batch along ``path`` (a `choose` answer other than ``"mmap"``).

        ``fds`` is ``(with read-ahead, without read-ahead)`` of the same file: requests
        flagged in ``runs`` (more than one slot) go through the first, single slots through
        the second. Request ``j`` reads ``lengths[j]`` bytes at ``offsets[j]`` into byte
        ``dest_offsets[j]`` of ``dest``."""
        fd_runs, fd_single = fds
        everything = self._io
        if everything is None and path == DIRECT:
            everything = self._direct_io
        if everything is not None:
            every_fd = np.where(runs, fd_runs, fd_single)
            everything.read(every_fd, offsets, lengths, dest, dest_offsets)
            return
        assert self._runs_io is not None and self._single_io is not None
        if bool(runs.any()):
            self._runs_io.read(fd_runs, offsets[runs], lengths[runs], dest, dest_offsets[runs])
        single = ~runs
        if bool(single.any()):
            self._single_io.read(
                fd_single, offsets[single], lengths[single], dest, dest_offsets[single]
            )

    def close(self) -> None:
        """Close the backends (idempotent)."""
        for attr in ("_io", "_runs_io", "_single_io", "_direct_io"):
            io = getattr(self, attr, None)
            if io is not None and not io.closed:
                io.close()
            setattr(self, attr, None)
