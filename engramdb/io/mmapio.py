"""``mmap`` backend: gathers from mapped files with numpy, behind the backend interface.

The backend does not map anything itself: the owner of the mapping (the `Store`, through
``engramdb.io.mapping``; tests, through ``np.memmap``) registers, per file descriptor, a
flat uint8 view that starts at file offset 0. A read is then a copy out of that view:
compact rows (every offset on one ``row_bytes`` grid) become one ``np.take(mode="clip")``,
split across cores for large batches; other shapes use the vectorised segment copy.

Only use it for resident data: a cold page faults synchronously, one at a time (with
``MADV_RANDOM`` ~4 KiB and ~50-100 us per fault; without it, megabytes of read-ahead per
row). The `auto` rule (``engramdb.io.select``) checks residency before choosing it.

Before every batch the file sizes are checked with ``fstat`` so a file truncated under a
live mapping raises `ReadError` instead of killing the process with ``SIGBUS`` (a truncation
racing with the copy itself cannot be caught this way).
"""

from __future__ import annotations

import errno as _errno
import os
import threading
from collections.abc import Callable, Mapping

import numpy as np

from engramdb.errors import InvalidDtype, InvalidLayout
from engramdb.io.base import Backend, Batch, _regular_rows, _rows_view, copy_segments, eof_error
from engramdb.io.base import read_error as _read_error

_TakeRows = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
_take_rows: _TakeRows | None
try:  # the parallel warm gather of the mapping module, when present
    from engramdb.io.gather import take_rows as _take_rows
except ImportError:  # pragma: no cover - older tree
    _take_rows = None

__all__ = ["MmapBackend"]


class MmapBackend(Backend):
    """Reads by copying out of mapped views (one per file descriptor).

    ``regions`` maps an fd to a flat (or C-contiguous) uint8 array whose byte ``i`` is file
    byte ``i``; more can be added with `register`. The backend never unmaps anything; the
    caller must keep the mapping alive until `close`.
    """

    name = "mmap"
    supports_direct = False
    wants_plan = False

    def __init__(self, regions: Mapping[int, np.ndarray] | None = None) -> None:
        super().__init__()
        self._regions: dict[int, np.ndarray] = {}
        self._addrs: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        for fd, view in (regions or {}).items():
            self.register(fd, view)

    def register(self, fd: int, view: np.ndarray) -> None:
        """Serve reads of ``fd`` from ``view`` (uint8, C-contiguous, file offset 0 first)."""
        if not isinstance(view, np.ndarray) or view.dtype != np.uint8:
            raise InvalidDtype("a mapped region must be a numpy uint8 array")
        if not view.flags.c_contiguous:
            raise InvalidLayout("a mapped region must be C-contiguous")
        flat = view.reshape(-1)
        with self._lock:
            self._regions[int(fd)] = flat
            self._addrs[int(fd)] = (int(flat.__array_interface__["data"][0]), flat.shape[0])

    def unregister(self, fd: int) -> None:
        with self._lock:
            self._regions.pop(int(fd), None)
            self._addrs.pop(int(fd), None)

    def region(self, fd: int) -> np.ndarray:
        """The flat view registered for ``fd``; `ReadError` (EBADF) if there is none."""
        view = self._regions.get(int(fd))
        if view is None:
            raise _read_error(_errno.EBADF, fd, 0, "no mapping registered for this descriptor")
        return view

    def address(self, fd: int) -> tuple[int, int]:
        """``(address, size)`` of the region registered for ``fd``; `ReadError` if none."""
        hit = self._addrs.get(int(fd))
        if hit is None or hit[1] == 0:
            raise _read_error(_errno.EBADF, fd, 0, "no mapping registered for this descriptor")
        return hit

    def _read(self, batch: Batch, dest: np.ndarray) -> None:
        fds = batch.fds
        if int(fds.min()) == int(fds.max()):
            self._gather(int(fds[0]), batch.offsets, batch.lengths, dest, batch.dest_offsets)
        else:
            uniq, where = np.unique(fds, return_inverse=True)
            for k, fd in enumerate(uniq.tolist()):  # one step per distinct file
                sel = np.flatnonzero(where == k)
                self._gather(
                    fd, batch.offsets[sel], batch.lengths[sel], dest, batch.dest_offsets[sel]
                )
        self._count(batch.n, batch.nbytes, 0, device_bytes=0)  # memory reads: no syscall

    def _gather(
        self, fd: int, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dofs: np.ndarray
    ) -> None:
        view = self.region(fd)
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise _read_error(e.errno or _errno.EBADF, fd, int(offsets[0])) from e
        limit = min(size, view.shape[0])
        ends = offsets + lengths
        if int(ends.max()) > limit:
            i = int(np.flatnonzero(ends > limit)[0])
            got = max(0, limit - int(offsets[i]))
            raise eof_error(fd, int(offsets[i]), int(lengths[i]), got)
        length = int(lengths[0])
        if _take_rows is not None and int(lengths.min()) == int(lengths.max()):
            s = _regular_rows(offsets, length)
            d = _regular_rows(dofs, length)
            if s is not None and d is not None:
                drows = d[1]
                first, n = int(drows[0]), int(drows.shape[0])
                if int(drows[-1]) - first == n - 1 and bool(np.all(np.diff(drows) == 1)):
                    out = _rows_view(dest, d[0], length)[first : first + n]
                    _take_rows(_rows_view(view, s[0], length), s[1], out)
                    return
        copy_segments(view, offsets, lengths, dest, dofs)
