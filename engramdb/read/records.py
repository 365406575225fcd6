"""`RecordFile`: the files of one Store-P view, opened, checked, mapped and read by slot.

A view (``docs/view.md``, `engramdb.layouts.view`) is a ``.edv`` file of fixed-size slots,
plus a key index (``.keys``) or the row ids it was built from (``.rows``). `find_entry` picks
the manifest entry of a view (and says why one is stale or missing); `RecordFile` opens its
files with size and header checks, maps them, and reads records: `RecordFile.read_record`
slices a Python mmap (the warm single-record path), `RecordFile.read_records` gathers a
batch through the mapping or, cold, through syscall reads planned by `plan_slot_reads`, the
path picked by `engramdb.io.records_rule.RecordRule`. Key lookup and misses are the handle's
job (`engramdb.view.View`, a `RecordFile`).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from engramdb.disk.files import open_held
from engramdb.disk.publish import read_manifest
from engramdb.errors import (
    CorruptFile,
    EngramDBError,
    InvalidArgument,
    StaleView,
    StoreClosed,
    TableNotFound,
    TruncatedFile,
)
from engramdb.io.gather import SplitDecision
from engramdb.io.mapping import (
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    MADV_WILLNEED,
    ShardMapping,
    madvise,
)
from engramdb.io.records_rule import DIRECT, MAPPED, MAX_READ_BYTES, RecordRule
from engramdb.io.residency import resident_count
from engramdb.layouts.manifest import FileEntry, TableInfo
from engramdb.layouts.view import (
    HEADER_BYTES,
    KeyIndexHeader,
    RowsHeader,
    ViewEntry,
    ViewHeader,
    key_index_sections,
    parse_views,
    plan_slot_reads,
    source_hash,
)
from engramdb.read.cache import BufferPool
from engramdb.table_api import Closing
from engramdb.validate import as_rowids, check_bounds, check_output, record_id

__all__ = ["KeyIndex", "RecordFile", "Scratch", "find_entry", "read_header_page"]


def read_header_page(fd: int, what: str) -> bytes:
    """The first `HEADER_BYTES` of a view file (`TruncatedFile` if it is shorter)."""
    page = os.pread(fd, HEADER_BYTES, 0)
    if len(page) < HEADER_BYTES:
        raise TruncatedFile(f"{what}: {len(page)} bytes, shorter than its header page")
    return page


class Scratch(threading.local):
    """One growing uint8 buffer per thread (fresh allocations fault page by page)."""

    buf: np.ndarray | None = None

    def get(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of this thread's buffer (contents undefined)."""
        if self.buf is None or self.buf.size < nbytes:
            self.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return self.buf[:nbytes]


class KeyIndex(NamedTuple):
    """The mapped sections of a key index (read-only views of the ``.keys`` file): the
    sorted key hashes (``<u8 [K]``), the keys in that order (``<i8 [K, W]``) and each
    key's slot (``<u4 [K]``)."""

    hashes: np.ndarray
    keys: np.ndarray
    slot_of: np.ndarray


def find_entry(
    db: Path,
    info: TableInfo,
    name: str | None,
    file: Path | None,
    held: Mapping[str, int] | None = None,
) -> ViewEntry:
    """The manifest entry of view ``name`` of table ``info`` (or of the view whose data file
    is ``file``). Raises `TableNotFound` for a view (file) the manifest does not name and
    `StaleView` for a view built from another version of the table.

    ``held`` (path -> fd, the descriptors an open `Database` took at open): a view of the
    snapshot ``info`` whose files are all held is served as the snapshot names it (the
    generation opened); any other view by name comes from the latest manifest while the
    table is unchanged (a view built after the snapshot)."""
    views = parse_views(info)
    current_hash = source_hash(info)
    if file is not None:
        rel = f"{info.name}/views/{file.name}"
        hit = [e for e in views.values() if e.data.path == rel]
        if hit:
            entry = hit[0]
        else:
            # Not (or no longer) named by the manifest: say why from its header.
            try:
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise TableNotFound(f"no view file {str(file)!r}") from None
            try:
                hdr = ViewHeader.unpack(read_header_page(fd, str(file)), str(file))
            finally:
                os.close(fd)
            if f"{hdr.source_hash:016x}" != current_hash:
                raise StaleView(
                    f"view file {str(file)!r} was built from another version of table "
                    f"{info.name!r} (source hash {hdr.source_hash:016x}, table now "
                    f"{current_hash}); rebuild the view"
                )
            raise TableNotFound(
                f"view file {str(file)!r} is not named by the manifest of {str(db)!r}"
            )
    else:
        assert name is not None
        entry_or_none = views.get(name)
        pinned = (
            entry_or_none is not None
            and held is not None
            and all(f.path in held for f in entry_or_none.files)
        )
        # Unless the snapshot's files are held open, the latest manifest wins while the table is unchanged: the view may have been
        # built (or rebuilt, its old files deleted) after this snapshot was taken.
        try:
            latest = None if pinned else read_manifest(db).tables.get(info.name)
        except EngramDBError:
            latest = None
        if latest is not None and source_hash(latest) == current_hash:
            entry_or_none = parse_views(latest).get(name, entry_or_none)
        if entry_or_none is None:
            raise TableNotFound(f"no view {name!r} of table {info.name!r} (views: {sorted(views)})")
        entry = entry_or_none
    if entry.source_hash != current_hash:
        raise StaleView(
            f"view {entry.name!r} was built from another version of table {info.name!r} "
            f"(source hash {entry.source_hash}, table now {current_hash}); rebuild it with "
            "`engramdb view build ... --force`"
        )
    return entry


class RecordFile(Closing):
    """The open files of view ``entry`` of table ``info`` in database ``db``.

    Opening checks every file's size against the manifest and each header page against the
    manifest entry and the other files (`TruncatedFile` / `CorruptFile`), then maps them; no
    data is read. ``backend`` / ``backend_options`` choose how batches travel (see
    `RecordRule`). Thread-safe for concurrent reads. Counters (`counters`) count records,
    batches per path and bytes.
    """

    def __init__(
        self,
        db: str | os.PathLike[str],
        info: TableInfo,
        entry: ViewEntry,
        *,
        backend: str = "auto",
        backend_options: dict[str, Any] | None = None,
        held: Mapping[str, int] | None = None,
    ):
        self._db = Path(db)
        self._held = held  # descriptors opened earlier (path -> fd), duplicated, never closed
        self._fds: list[int] = []
        self._maps: list[ShardMapping] = []
        self._pymm: mmap.mmap | None = None
        self._rule: RecordRule | None = None
        self._scratch = Scratch()
        self._out_pool = BufferPool()  # results of read_records without out=
        self._split = SplitDecision()  # whether large mapped gathers split (measured)
        self._closed = True
        self.table = info.name
        self.name = entry.name
        self.info = info
        self.entry = entry
        self.source = entry.source
        try:
            self._open_files(self._db, info, entry)
            self._check_options()
            self.backend = backend
            self._rule = RecordRule(backend, backend_options)
        except BaseException:
            self._release()
            raise
        self._counters: dict[str, int] = {
            "records": 0,
            "mmap_batches": 0,
            "io_batches": 0,
            "direct_batches": 0,
            "io_requests": 0,
            "bytes_requested": 0,
            "bytes_returned": 0,
        }
        self._closed = False

    # -- opening -------------------------------------------------------------------------------
    def _check_options(self) -> None:
        """Called once the files are open and checked, before the read rule is built: a
        subclass checks what it was given against the view's header here."""

    def _open_files(self, db: Path, info: TableInfo, entry: ViewEntry) -> None:
        what = f"view {entry.name!r} of table {info.name!r}"
        fd = open_held(self._held, db, entry.data.path, entry.data.bytes, what)
        self._fds.append(fd)
        hdr = ViewHeader.unpack(read_header_page(fd, f"{what} ({entry.data.path})"), what)
        expect = {
            "n_slots": entry.slots,
            "slot_bytes": entry.slot_bytes,
            "record_bytes": entry.record_bytes,
            "rows_per_record": entry.rows_per_record,
            "key_width": entry.key_width,
            "build_id": entry.build_id,
            "source_hash": entry.source_hash,
            "table": info.name,
            "row_bytes": info.row_bytes,
        }
        got = {
            "n_slots": hdr.n_slots,
            "slot_bytes": hdr.slot_bytes,
            "record_bytes": hdr.record_bytes,
            "rows_per_record": hdr.rows_per_record,
            "key_width": hdr.key_width,
            "build_id": f"{hdr.build_id:016x}",
            "source_hash": f"{hdr.source_hash:016x}",
            "table": hdr.table,
            "row_bytes": hdr.row_bytes,
        }
        bad = [k for k in expect if got[k] != expect[k]]
        if bad:
            raise CorruptFile(
                f"{what}: header field(s) {', '.join(bad)} "
                f"{[got[k] for k in bad]} disagree with the manifest {[expect[k] for k in bad]}"
            )
        self.header = hdr
        self.n_records = hdr.n_slots
        self.slot_bytes = hdr.slot_bytes
        self.record_bytes = hdr.record_bytes
        self.rows_per_record = hdr.rows_per_record
        self.key_width = hdr.key_width
        self.layer: int | None = None if hdr.layer < 0 else hdr.layer
        data_map = ShardMapping([fd], [entry.data.bytes])
        self._maps.append(data_map)
        flat = data_map.array(1, entry.data.bytes).reshape(-1)
        self._slots: np.ndarray | None = flat[HEADER_BYTES:].reshape(hdr.n_slots, hdr.slot_bytes)
        self._records: np.ndarray | None = self._slots[:, : hdr.record_bytes]
        # read_record slices a Python mmap of the same file: one C call returning bytes, ~0.1
        # us (8 %) faster than slicing a memoryview of the mapping and copying it out.
        self._pymm = mmap.mmap(fd, entry.data.bytes, prot=mmap.PROT_READ)
        self._pymm.madvise(mmap.MADV_RANDOM)
        probe = np.frombuffer(self._pymm, dtype=np.uint8, count=1)
        self._pymm_addr = int(probe.ctypes.data)
        del probe  # release the buffer export so the mmap can be closed
        self._fd = fd
        # Single-slot reads go through a second descriptor without read-ahead: measured on
        # random 2560 B records, read-ahead pulled 4.2x the returned bytes from the device,
        # 2.0x without it (the page-granularity minimum). Runs of adjacent slots keep
        # read-ahead on the first descriptor: without it 1 MiB sequential reads ran ~2x
        # slower on these disks.
        # (A new open file description of the same file, not a second open by path: the path
        # may name another build by now, or nothing.)
        self._fd_random = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(self._fd_random)
        os.posix_fadvise(self._fd_random, 0, 0, os.POSIX_FADV_RANDOM)
        self._hashes: np.ndarray | None = None
        self._keys: np.ndarray | None = None
        self._slot_of: np.ndarray | None = None
        self._rows: np.ndarray | None = None
        if entry.index is not None:
            want = {"n_keys": hdr.n_slots, "key_width": hdr.key_width, "build_id": hdr.build_id}
            ih, iflat = self._map_sidecar(db, entry.index, what, KeyIndexHeader, "key index", want)
            h_off, k_off, s_off = key_index_sections(ih.n_keys, ih.key_width)
            n, w = ih.n_keys, ih.key_width
            self._hashes = iflat[h_off:k_off].view("<u8")
            self._keys = iflat[k_off:s_off].view("<i8").reshape(n, w)
            self._slot_of = iflat[s_off : s_off + 4 * n].view("<u4")
        if entry.rows is not None:
            want = {
                "n_records": hdr.n_slots,
                "rows_per_record": hdr.rows_per_record,
                "build_id": hdr.build_id,
            }
            rh, rflat = self._map_sidecar(db, entry.rows, what, RowsHeader, "rows file", want)
            self._rows = rflat[HEADER_BYTES:].view("<i8").reshape(rh.n_records, rh.rows_per_record)

    def _map_sidecar(
        self, db: Path, vf: FileEntry, what: str, header_cls: Any, label: str, want: dict[str, int]
    ) -> tuple[Any, np.ndarray]:
        """Open a side file of the view (key index, rows), parse its header page, check that
        it belongs to this build (its header fields equal ``want``, the view's figures)
        and map it whole; returns the header and the file's bytes as a flat uint8 array."""
        fd = open_held(self._held, db, vf.path, vf.bytes, what)
        self._fds.append(fd)
        header = header_cls.unpack(read_header_page(fd, f"{what} ({vf.path})"), what)
        if any(getattr(header, k) != v for k, v in want.items()):
            raise CorruptFile(f"{what}: {label} {vf.path!r} belongs to another build")
        mapping = ShardMapping([fd], [vf.bytes])
        self._maps.append(mapping)
        return header, mapping.array(1, vf.bytes).reshape(-1)

    # -- properties ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n_records

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """Bytes of the slot area of the view file."""
        return self.n_records * self.slot_bytes

    @property
    def counters(self) -> dict[str, int]:
        """A copy of the counters since open (or the last reset)."""
        return dict(self._counters)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"view {self.name!r} of table {self.table!r} is closed")

    # -- records -------------------------------------------------------------------------------
    def read_record(self, i: int) -> bytes:
        """Record ``i`` as ``record_bytes`` bytes: one slice of the mapping (no syscall when
        resident; warm ~0.5-1 us including the call). A cold record faults 1-2 pages in."""
        if i.__class__ is int and 0 <= i < self.n_records:
            mm = self._pymm
            if mm is not None:
                o = HEADER_BYTES + i * self.slot_bytes
                return mm[o : o + self.record_bytes]
        return self._read_record_slow(i)

    def _read_record_slow(self, i: Any) -> bytes:
        self._check_open()
        j = record_id(i, self.n_records)
        return self.read_record(j)

    def read_records(self, ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records ``ids`` (any integer array) as uint8 ``ids.shape + (record_bytes,)``.

        ``out`` (C-contiguous, writable) avoids the allocation (without it, a large result
        comes from a pool of buffers reused once the caller dropped them). Validation happens
        before any byte is written. Warm: one gather from the mapping (`take_one`, split across the
        gather pool only while measured timings say it pays); cold (syscall
        backends): sorted, deduplicated, adjacent slots merged into reads of up to 16 MiB.
        """
        self._check_open()
        arr = as_rowids(ids)
        flat = arr.reshape(-1)
        check_bounds(flat, self.n_records, shape=arr.shape, what="record id")
        shape = arr.shape + (self.record_bytes,)
        if out is None:
            out = self._out_pool.empty(shape, flat.size * self.record_bytes)
        else:
            check_output(out, shape)
        self._gather(flat, out.reshape(-1, self.record_bytes))
        return out

    def read_slots(self, ids: Any) -> np.ndarray:
        """Whole slots ``ids`` (record and zero padding) as uint8 ``[len(ids), slot_bytes]``,
        copied from the mapping (verification: the padding must be zeros)."""
        self._check_open()
        flat = as_rowids(ids).reshape(-1)
        check_bounds(flat, self.n_records, what="record id")
        assert self._slots is not None
        return np.asarray(self._slots)[flat]

    def _resident_fraction(self, slots: np.ndarray, k: int) -> float:
        """Share of ``k`` evenly spread slots of the batch whose first page is in the page
        cache: ``mincore`` on each (~2 us)."""
        n = slots.shape[0]
        pick = slots[(np.arange(k) * (n - 1)) // max(1, k - 1)]
        base = self._maps[0].address + HEADER_BYTES
        addrs = (pick * self.slot_bytes + base).tolist()
        return resident_count(addrs) / k

    def _gather(self, slots: np.ndarray, out2d: np.ndarray) -> None:
        """Validated slots -> ``out2d`` rows, through the mapping or syscall reads."""
        n = slots.shape[0]
        if n == 0:
            return
        c = self._counters
        assert self._rule is not None
        path, fraction = self._rule.choose(n, lambda k: self._resident_fraction(slots, k))
        if path == MAPPED:
            assert self._records is not None
            self._split.take(self._records, slots, out2d)
            c["mmap_batches"] += 1
            c["bytes_requested"] += n * self.record_bytes
        else:
            self._read_cold(slots, out2d, path)
        c["records"] += n
        c["bytes_returned"] += n * self.record_bytes

    def _read_cold(self, slots: np.ndarray, out2d: np.ndarray, path: str) -> None:
        n = slots.shape[0]
        c = self._counters
        plan = plan_slot_reads(slots, self.slot_bytes, max_request=MAX_READ_BYTES)
        in_place = plan.inverse is None and self.slot_bytes == self.record_bytes
        if in_place:
            dest = out2d
        else:
            u = plan.unique.shape[0]
            dest = self._scratch.get(u * self.slot_bytes).reshape(u, self.slot_bytes)
        runs = plan.lengths > self.slot_bytes
        if path == DIRECT:
            c["direct_batches"] += 1
        assert self._rule is not None
        self._rule.read(
            path,
            (self._fd, self._fd_random),
            plan.offsets,
            plan.lengths,
            dest,
            plan.dest_offsets,
            runs,
        )
        if not in_place:
            inv = plan.inverse if plan.inverse is not None else np.arange(n)
            np.take(dest[:, : self.record_bytes], inv, axis=0, out=out2d, mode="clip")
        c["io_batches"] += 1
        c["io_requests"] += plan.offsets.shape[0]
        c["bytes_requested"] += plan.nbytes

    # -- the side files ------------------------------------------------------------------------
    def key_index(self) -> KeyIndex:
        """The mapped key index (no copy): `InvalidArgument` for a view of explicit rows."""
        self._check_open()
        if self._hashes is None or self._keys is None or self._slot_of is None:
            raise InvalidArgument(f"view {self.name!r} was built from explicit row ids: no keys")
        return KeyIndex(self._hashes, self._keys, self._slot_of)

    def slot_keys(self) -> np.ndarray:
        """The stored keys in slot (= access) order: int64 ``[n_records, key_width]``, a new
        array (reads the whole key index)."""
        self._check_open()
        if self._keys is None or self._slot_of is None:
            raise InvalidArgument(f"view {self.name!r} was built from explicit row ids: no keys")
        inv = np.empty(self.n_records, dtype=np.int64)
        inv[self._slot_of.astype(np.int64)] = np.arange(self.n_records)
        return np.asarray(self._keys)[inv]

    # -- residency -----------------------------------------------------------------------------
    def populate(self, *, threads: int = 2) -> None:
        """Fault the view (and its key index) into the page tables: device speed when cold,
        ~0.1 s/GB when resident. Afterwards warm reads run at memory speed."""
        self._check_open()
        for m in self._maps:
            m.populate(threads=threads)
        self._advise_pymm(MADV_POPULATE_READ)

    def _advise_pymm(self, advice: int) -> None:
        if self._pymm is None:
            return
        try:
            madvise(self._pymm_addr, len(self._pymm), advice)
        except OSError as e:
            if e.errno != errno.EINVAL or advice != MADV_POPULATE_READ:
                raise
            madvise(self._pymm_addr, len(self._pymm), MADV_WILLNEED)  # kernel < 5.14

    def residency(self) -> float:
        """Fraction (0..1) of the view file's pages in the page cache (``mincore``)."""
        self._check_open()
        return self._maps[0].residency()

    def evict(self) -> float:
        """Drop this view's pages from this process's mappings (``MADV_DONTNEED``) and from
        the page cache (``posix_fadvise(DONTNEED)``); returns the residency afterwards. Pages
        other processes map stay cached."""
        self._check_open()
        # Pages a live mapping holds cannot be dropped: release ours first.
        for m in self._maps:
            m.advise(MADV_DONTNEED)
        self._advise_pymm(MADV_DONTNEED)
        for fd in self._fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return self.residency()

    # -- lifetime ------------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        for k in self._counters:
            self._counters[k] = 0

    def _release(self) -> None:
        pymm, self._pymm = self._pymm, None
        if pymm is not None:
            pymm.close()
        rule, self._rule = self._rule, None
        if rule is not None:
            rule.close()
        for m in self._maps:
            m.close()
        self._maps = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def close(self) -> None:
        """Release mappings, descriptors and the backends. Later calls raise `StoreClosed`.
        Arrays returned earlier stay valid (they are copies)."""
        if self._closed:
            return
        self._closed = True
        self._slots = self._records = None
        self._hashes = self._keys = self._slot_of = self._rows = None
        self._release()
