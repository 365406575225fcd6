"""The backend interface: read a batch of ``(fd, offset, length) -> dest[dest_offset:]``.

A batch is described by arrays, never by Python objects per request, so every backend can
validate, split and submit it with numpy. Backends differ only in how the bytes travel
(one ``pread`` per request in a thread pool, one ``io_uring_enter`` per ~1024 requests, or a
gather from a mapping); they all promise the same contract:

* every request is read completely into ``dest`` or the call raises;
* short reads are continued, ``EINTR`` / ``EAGAIN`` are retried;
* end of file before the end of a request, ``EIO``, ``EBADF`` -> `ReadError` naming the file
  (resolved through ``/proc/self/fd``) and the offset;
* a call that raises has no request still in flight: no kernel write lands in ``dest`` after
  the call returns or raises;
* calls are thread-safe; after `close` a call raises `StoreClosed`.

Capabilities are class attributes (``supports_direct``, ``wants_plan``) so callers branch on
what a backend can do rather than on its type.
"""

from __future__ import annotations

import abc
import errno as _errno
import os
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike

from engramdb.errors import (
    InvalidArgument,
    InvalidDtype,
    ReadError,
    ShapeMismatch,
    StoreClosed,
)
from engramdb.stats import Stats
from engramdb.table_api import Closing
from engramdb.validate import check_output

__all__ = [
    "Backend",
    "BackendStats",
    "Batch",
    "copy_segments",
    "fd_path",
    "prepare_batch",
    "read_error",
]


# --- errors ---------------------------------------------------------------------------------
def fd_path(fd: int) -> str:
    """The path an open descriptor refers to (``/proc/self/fd``), or ``"fd N"``."""
    try:
        return os.readlink(f"/proc/self/fd/{int(fd)}")
    except OSError:
        return f"fd {int(fd)}"


def read_error(err: int, fd: int, offset: int, what: str = "") -> ReadError:
    """A `ReadError` for a failed read of ``fd`` at ``offset`` (``err`` is an errno value)."""
    path = fd_path(fd)
    detail = what or os.strerror(err)
    exc = ReadError(err, f"{detail} (reading {path} at offset {int(offset)})")
    exc.filename = path
    return exc


def eof_error(fd: int, offset: int, wanted: int, got: int) -> ReadError:
    """A `ReadError` for a read that met the end of file ``got`` bytes into ``wanted``."""
    try:
        size = f", file size {os.fstat(int(fd)).st_size}"
    except OSError:
        size = ""
    return read_error(
        _errno.EIO,
        fd,
        offset,
        f"unexpected end of file: wanted {int(wanted)} bytes, got {int(got)}{size}",
    )


# --- batches --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """A validated batch: 1-D arrays of equal length, zero-length requests dropped."""

    fds: np.ndarray  # int32
    offsets: np.ndarray  # int64, >= 0
    lengths: np.ndarray  # int64, > 0
    dest_offsets: np.ndarray  # int64, ranges inside dest

    @property
    def n(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum()) if self.n else 0


def _int_array(name: str, value: ArrayLike, dtype: type) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise InvalidDtype(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim > 1:
        raise ShapeMismatch(f"{name} must be 1-D or a scalar, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(dtype).max:
        raise InvalidArgument(f"{name} holds {int(arr.max())}, above the {np.dtype(dtype)} range")
    return arr.astype(dtype, copy=False)


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_dest(dest: Any) -> np.ndarray:
    """``dest`` as a flat writable uint8 view; raises the typed error for anything else
    (`engramdb.validate.check_output` with any shape)."""
    return check_output(dest, None, name="dest").reshape(-1)


def prepare_batch(
    fds: ArrayLike,
    offsets: ArrayLike,
    lengths: ArrayLike,
    dest: np.ndarray,
    dest_offsets: ArrayLike,
) -> Batch:
    """Validate a batch (vectorised; a few passes over the arrays) and drop empty requests.

    ``fds`` and ``lengths`` may be scalars (broadcast); ``offsets`` and ``dest_offsets`` are
    1-D. Destination ranges must lie inside ``dest``; overlapping destination ranges are
    allowed but which request's bytes win is unspecified.
    """
    flat = check_dest(dest)
    off = _int_array("offsets", offsets, np.int64)
    dof = _int_array("dest_offsets", dest_offsets, np.int64)
    if off.ndim != 1 or dof.ndim != 1:
        raise ShapeMismatch("offsets and dest_offsets must be 1-D arrays")
    n = off.shape[0]
    if dof.shape[0] != n:
        raise ShapeMismatch(f"{n} offsets but {dof.shape[0]} dest_offsets")
    lens = _int_array("lengths", lengths, np.int64)
    fd = _int_array("fds", fds, np.int32)
    if lens.ndim == 0:
        lens = np.full(n, int(lens), dtype=np.int64)
    if fd.ndim == 0:
        fd = np.full(n, int(fd), dtype=np.int32)
    if lens.shape[0] != n or fd.shape[0] != n:
        raise ShapeMismatch(f"{n} offsets but {lens.shape[0]} lengths and {fd.shape[0]} fds")
    if n == 0:
        return Batch(fd, off, lens, dof)
    if int(off.min()) < 0:
        i = _first_bad(off < 0)
        raise InvalidArgument(f"offset {int(off[i])} at position {i} is negative")
    if int(lens.min()) < 0:
        i = _first_bad(lens < 0)
        raise InvalidArgument(f"length {int(lens[i])} at position {i} is negative")
    if int(dof.min()) < 0:
        i = _first_bad(dof < 0)
        raise InvalidArgument(f"dest_offset {int(dof[i])} at position {i} is negative")
    ends = dof + lens
    if int(ends.max()) > flat.shape[0]:
        i = _first_bad(ends > flat.shape[0])
        raise InvalidArgument(
            f"request {i} writes dest[{int(dof[i])}:{int(ends[i])}] past its {flat.shape[0]} bytes"
        )
    if int(fd.min()) < 0:
        i = _first_bad(fd < 0)
        raise read_error(_errno.EBADF, int(fd[i]), int(off[i]), "negative file descriptor")
    if int(lens.min()) == 0:
        keep = lens > 0
        fd, off, lens, dof = fd[keep], off[keep], lens[keep], dof[keep]
    return Batch(fd, off, lens, dof)


# --- copying ranges between buffers (vectorised) ----------------------------------------------
def _regular_rows(offsets: np.ndarray, length: int) -> tuple[int, np.ndarray] | None:
    """``(base, rows)`` when every offset is ``base + rows * length`` (``0 <= base < length``)."""
    base = int(offsets[0]) % length
    rows, rem = np.divmod(offsets - base, length)
    if rem.any():
        return None
    return base, rows


def _rows_view(buf: np.ndarray, base: int, length: int) -> np.ndarray:
    count = (buf.shape[0] - base) // length
    return buf[base : base + count * length].reshape(count, length)


def _windows(buf: np.ndarray, length: int) -> np.ndarray:
    """Overlapping ``[len - length + 1, length]`` view: row ``i`` is ``buf[i:i+length]``."""
    return np.lib.stride_tricks.as_strided(
        buf,
        shape=(buf.shape[0] - length + 1, length),
        strides=(1, 1),
        writeable=buf.flags.writeable,
    )


_BYTE_INDEX_CHUNK = 1 << 22  # bytes per step of the byte-index fallback (32 MiB of int64 index)


def copy_segments(
    src: np.ndarray,
    src_offsets: np.ndarray,
    lengths: np.ndarray | int,
    dest: np.ndarray,
    dest_offsets: np.ndarray,
) -> None:
    """``dest[dest_offsets[i]:+lengths[i]] = src[src_offsets[i]:+lengths[i]]`` for every ``i``.

    ``src`` and ``dest`` are flat uint8 arrays; bounds are the caller's responsibility (they
    are not re-checked here). Vectorised: equal lengths on a regular grid become one
    ``np.take(..., mode="clip")`` (the fast path for compact tables); equal lengths elsewhere
    use fancy indexing over overlapping windows; mixed lengths are grouped by length (when
    there are few) or copied through a byte index in bounded chunks. Allocates at most one
    temporary of the batch's payload size.
    """
    n = int(src_offsets.shape[0])
    if n == 0:
        return
    if np.ndim(lengths) == 0 or int(np.min(lengths)) == int(np.max(lengths)):
        length = int(lengths) if np.ndim(lengths) == 0 else int(np.asarray(lengths)[0])
        if length > 0:
            _copy_equal(src, src_offsets, length, dest, dest_offsets)
        return
    lens = np.asarray(lengths, dtype=np.int64)
    distinct = np.unique(lens)
    if distinct.shape[0] <= 16:
        for length in distinct.tolist():
            if length == 0:
                continue
            sel = np.flatnonzero(lens == length)
            _copy_equal(src, src_offsets[sel], int(length), dest, dest_offsets[sel])
        return
    _copy_by_byte_index(src, src_offsets, lens, dest, dest_offsets)


def _copy_equal(
    src: np.ndarray, src_off: np.ndarray, length: int, dest: np.ndarray, dest_off: np.ndarray
) -> None:
    s = _regular_rows(src_off, length)
    d = _regular_rows(dest_off, length)
    n = int(src_off.shape[0])
    if d is not None:
        dview = _rows_view(dest, d[0], length)
        drows = d[1]
        first = int(drows[0])
        consecutive = int(drows[-1]) - first == n - 1 and bool(np.all(np.diff(drows) == 1))
        if s is not None:
            sview = _rows_view(src, s[0], length)
            if consecutive:
                np.take(sview, s[1], axis=0, out=dview[first : first + n], mode="clip")
            else:
                dview[drows] = np.take(sview, s[1], axis=0, mode="clip")
        else:
            got = _windows(src, length)[src_off]
            if consecutive:
                dview[first : first + n] = got
            else:
                dview[drows] = got
        return
    if s is not None:
        got = np.take(_rows_view(src, s[0], length), s[1], axis=0, mode="clip")
    else:
        got = _windows(src, length)[src_off]
    _windows(dest, length)[dest_off] = got


def _copy_by_byte_index(
    src: np.ndarray, src_off: np.ndarray, lens: np.ndarray, dest: np.ndarray, dest_off: np.ndarray
) -> None:
    ends = np.cumsum(lens)
    starts = ends - lens
    lo = 0
    n = int(lens.shape[0])
    while lo < n:
        hi = int(np.searchsorted(ends, int(starts[lo]) + _BYTE_INDEX_CHUNK, side="right"))
        hi = max(hi, lo + 1)
        seg = slice(lo, hi)
        total = int(ends[hi - 1] - starts[lo])
        within = np.arange(total, dtype=np.int64) - np.repeat(starts[seg] - starts[lo], lens[seg])
        dest[np.repeat(dest_off[seg], lens[seg]) + within] = src[
            np.repeat(src_off[seg], lens[seg]) + within
        ]
        lo = hi


# --- the interface --------------------------------------------------------------------------
@dataclass
class BackendStats(Stats):
    """Counters that prove which backend served a workload (snapshot via `Backend.stats`).

    ``bytes`` is the payload delivered into callers' buffers; ``device_bytes`` the bytes the
    backend asked the kernel to read from the files: the request lengths for buffered
    syscalls, the aligned spans for ``O_DIRECT`` (which round each request out to the
    device's alignment), 0 for gathers from a mapping (their page faults are the kernel's).
    ``syscalls`` counts ``preadv`` / ``io_uring_enter`` calls.
    """

    batches: int = 0
    requests: int = 0
    bytes: int = 0
    device_bytes: int = 0
    syscalls: int = 0

    def add(self, other: BackendStats) -> None:
        """Add ``other``'s counters into these."""
        self.batches += other.batches
        self.requests += other.requests
        self.bytes += other.bytes
        self.device_bytes += other.device_bytes
        self.syscalls += other.syscalls


class Backend(Closing, abc.ABC):
    """Reads batches of byte ranges from open files into caller memory.

    Subclasses implement `_read` (called with a validated, non-empty `Batch`) and may
    override `_close`. Class attributes describe capabilities:

    * ``name`` — ``"preadv"``, ``"io_uring"``, ``"mmap"`` (or ``"auto"``);
    * ``supports_direct`` — can read through ``O_DIRECT`` (device bytes = payload bytes for
      sector-aligned rows, no page-cache pollution);
    * ``wants_plan`` — sorted, deduplicated batches pay off (syscall backends); ``False``
      for gathers from memory, where sorting costs more than it saves.
    """

    name: ClassVar[str] = "?"
    supports_direct: ClassVar[bool] = False
    wants_plan: ClassVar[bool] = True
    _availability: ClassVar[tuple[bool, str] | None] = None

    def __init__(self) -> None:
        self._closed = False
        self._stats = BackendStats()
        self._stats_lock = threading.Lock()

    # capabilities
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """``(True, "")`` when the backend can run here, else ``(False, why)``. Cached."""
        return True, ""

    @property
    def direct(self) -> bool:
        """Whether this instance reads through ``O_DIRECT``."""
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> BackendStats:
        """A snapshot of the counters (batches, requests, bytes, syscalls)."""
        with self._stats_lock:
            return self._stats.copy()

    def parts(self) -> tuple[Backend, ...]:
        """The backends this one hands batches to (a composite such as ``auto``: its mapped,
        buffered and ``O_DIRECT`` paths); () for a backend that reads itself. Found among the
        instance's attributes, so a composite needs no registration."""
        seen: list[Backend] = []
        for value in vars(self).values():
            if isinstance(value, Backend) and value is not self and value not in seen:
                seen.append(value)
        return tuple(seen)

    def total_stats(self, *, mapped: bool = True) -> BackendStats:
        """The counters of every path that read for this backend: its own for a plain
        backend, the sum over `parts` for a composite (whose own count would repeat its
        parts' bytes, and misses the batches callers hand to a part directly).
        ``mapped=False`` leaves a composite's gathers from a mapping out (its syscall paths)."""
        parts = self.parts()
        if not parts:
            return self.stats
        total = BackendStats()
        for p in parts:
            if mapped or p.name != "mmap":
                total.add(p.total_stats(mapped=mapped))
        return total

    def _count(
        self, requests: int, nbytes: int, syscalls: int, device_bytes: int | None = None
    ) -> None:
        """Count one batch; ``device_bytes`` defaults to ``nbytes`` (buffered reads)."""
        with self._stats_lock:
            self._stats.batches += 1
            self._stats.requests += requests
            self._stats.bytes += nbytes
            self._stats.device_bytes += nbytes if device_bytes is None else device_bytes
            self._stats.syscalls += syscalls

    # choosing (only `AutoBackend` overrides these; callers can treat every backend alike)
    def choose(
        self,
        fds: ArrayLike,
        offsets: ArrayLike,
        lengths: ArrayLike | None = None,
        *,
        batch_rows: int | None = None,
    ) -> Backend:
        """The backend that should serve a batch; ``fds``/``offsets``/``lengths`` may be a
        sample of it (``batch_rows`` is then the full batch size). A plain backend returns
        itself; `AutoBackend` applies the auto rule (`_choose`)."""
        n = int(np.size(offsets)) if batch_rows is None else int(batch_rows)
        return self._choose(fds, offsets, lengths, n)

    def _choose(
        self, fds: ArrayLike, offsets: ArrayLike, lengths: ArrayLike | None, n: int
    ) -> Backend:
        """`choose` for a batch of ``n`` requests (``fds``/``offsets`` may be a sample)."""
        return self

    def feedback(self, chosen: Backend, requests: int, seconds: float) -> None:
        """Report how long ``chosen`` took for a batch (used by `AutoBackend`)."""
        return None

    # reading
    def read(
        self,
        fds: ArrayLike,
        offsets: ArrayLike,
        lengths: ArrayLike,
        dest: np.ndarray,
        dest_offsets: ArrayLike,
    ) -> None:
        """Read ``(fds[i], offsets[i], lengths[i])`` into ``dest[dest_offsets[i]:]`` for all ``i``.

        Blocks until every byte has arrived. ``fds``/``lengths`` may be scalars; ``dest`` is a
        writable C-contiguous uint8 array. Raises `ReadError` (file and offset named) when a
        read fails or meets the end of file; the contents of ``dest`` are then unspecified.
        Raises `StoreClosed` after `close`.
        """
        if self._closed:
            raise StoreClosed(f"{self.name} backend is closed")
        batch = prepare_batch(fds, offsets, lengths, dest, dest_offsets)
        if batch.n == 0:
            return
        self._read(batch, dest.reshape(-1))

    def read_batch(self, batch: Batch, dest: np.ndarray) -> None:
        """`read` for a batch already validated by `prepare_batch` (non-empty) into the flat
        ``dest`` it was validated against: a backend that delegates (``auto``) hands its
        batch on without validating it twice. Raises `StoreClosed` after `close`."""
        if self._closed:
            raise StoreClosed(f"{self.name} backend is closed")
        self._read(batch, dest)

    @abc.abstractmethod
    def _read(self, batch: Batch, dest: np.ndarray) -> None:
        """Read a validated, non-empty batch into the flat ``dest``."""

    def close(self) -> None:
        """Release threads, rings and descriptors the backend owns (never the caller's fds).
        Idempotent; later reads raise `StoreClosed`."""
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:
        return None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.name} {state}>"
