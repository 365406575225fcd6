"""Page readers for engines that bring their own file descriptors.

``PageReader(page_size=4096).read_pages(fds, offsets)`` returns the pages as one
``[n, page_size]`` uint8 array (one allocation, or none with ``out=``);
`IoUringPageReader` does the same through io_uring (optionally ``O_DIRECT``). Offsets must
be page-aligned and the descriptors open and readable; each violation raises the typed
error naming the first offending position.
"""

from __future__ import annotations

import errno as _errno
import os
import stat

import numpy as np
from numpy.typing import ArrayLike

from engramdb.errors import InvalidArgument, InvalidDtype, ShapeMismatch
from engramdb.io.base import Backend, check_dest, read_error
from engramdb.io.preadv import PreadvBackend
from engramdb.io.uring import IoUringBackend
from engramdb.table_api import Closing

__all__ = ["IoUringPageReader", "PageReader"]


class PageReader(Closing):
    """Reads whole pages at aligned offsets from caller-owned descriptors.

    ``page_size`` is a positive multiple of 512. ``backend`` defaults to a `PreadvBackend`
    owned by the reader (closed by `close`); pass any `Backend` to share one (the reader then
    does not close it). Thread-safe when the backend is (all of ours are).
    """

    def __init__(self, page_size: int = 4096, *, backend: Backend | None = None) -> None:
        if not isinstance(page_size, int) or page_size <= 0 or page_size % 512:
            raise InvalidArgument(f"page_size must be a positive multiple of 512, got {page_size}")
        self.page_size = page_size
        self._owns = backend is None
        self.backend: Backend = backend if backend is not None else self._default_backend()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(page_size={self.page_size})"

    def _default_backend(self) -> Backend:
        return PreadvBackend()

    def _validate(self, fds: ArrayLike, offsets: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        off = np.asarray(offsets)
        if off.dtype.kind not in "iu":
            raise InvalidDtype(f"offsets must be integers, got dtype {off.dtype}")
        if off.ndim != 1:
            raise ShapeMismatch(f"offsets must be 1-D, got shape {off.shape}")
        off = off.astype(np.int64, copy=False)
        fd = np.asarray(fds)
        if fd.dtype.kind not in "iu":
            raise InvalidDtype(f"fds must be integers, got dtype {fd.dtype}")
        if fd.ndim == 0:
            fd = np.full(off.shape[0], int(fd), dtype=np.int32)
        elif fd.shape != off.shape:
            raise ShapeMismatch(f"{fd.shape[0]} fds for {off.shape[0]} offsets")
        fd = fd.astype(np.int32, copy=False)
        if off.shape[0] == 0:
            return fd, off
        bad = (off < 0) | (off % self.page_size != 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(
                f"offset {int(off[i])} at position {i} is not a non-negative multiple of "
                f"the page size {self.page_size}"
            )
        for f in np.unique(fd).tolist():  # one fstat per distinct descriptor
            i = int(np.flatnonzero(fd == f)[0])
            try:
                mode = os.fstat(f).st_mode
            except OSError as e:
                raise read_error(e.errno or _errno.EBADF, f, int(off[i])) from e
            if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
                # a pipe or socket would block a reader forever; refuse it up front
                raise InvalidArgument(
                    f"fd {f} (position {i}) is not a regular file or block device"
                )
        return fd, off

    def read_pages(
        self, fds: ArrayLike, offsets: ArrayLike, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Pages ``offsets[i]`` of ``fds[i]`` (``fds`` may be one int) as ``[n, page_size]``.

        ``out`` (uint8, C-contiguous, ``[n, page_size]``) avoids the allocation. A page
        past the end of its file, or cut short by it, raises `ReadError`.
        """
        fd, off = self._validate(fds, offsets)
        n = off.shape[0]
        if out is None:
            out = np.empty((n, self.page_size), dtype=np.uint8)
        else:
            check_dest(out)
            if out.shape != (n, self.page_size):
                raise ShapeMismatch(f"out has shape {out.shape}, need {(n, self.page_size)}")
        if n:
            dofs = np.arange(n, dtype=np.int64) * self.page_size
            self.backend.read(fd, off, self.page_size, out, dofs)
        return out

    def read_pages_list(self, fds: ArrayLike, offsets: ArrayLike) -> list[bytes]:
        """`read_pages` as a list of ``bytes`` (one object per page: a convenience, not a
        fast path)."""
        pages = self.read_pages(fds, offsets)
        return [bytes(p) for p in pages]

    def close(self) -> None:
        if self._owns:
            self.backend.close()


class IoUringPageReader(PageReader):
    """`PageReader` over io_uring: ``entries`` in flight, ``direct=True`` for ``O_DIRECT``
    (pages bypass the page cache; ``page_size`` must then be a multiple of the device's
    direct-I/O alignment, 512 B or 4 KiB). Raises `BackendUnavailable` with the reason
    where io_uring cannot run."""

    def __init__(
        self,
        page_size: int = 4096,
        *,
        entries: int = 1024,
        direct: bool = False,
        backend: Backend | None = None,
    ) -> None:
        self._entries = entries
        self._direct = direct
        super().__init__(page_size, backend=backend)

    def _default_backend(self) -> Backend:
        return IoUringBackend(self._entries, direct=self._direct)
