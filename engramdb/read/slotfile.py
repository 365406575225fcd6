"""Raw slot files of the published EngramDB API: ``view.manifest.json`` + slots + keys.

A published Store-P view is a directory holding

* ``view.manifest.json`` — ``{"grans": N, "heads": H, "slot_bytes": S, ...}``: ``N`` slots
  (one per n-gram), each ``S`` bytes, holding the ``H`` table rows of that gram back to
  back (optional ``"width"`` / ``"row_bytes"``: bytes per row, so a record is ``H *
  width`` bytes of the slot; optional ``"record_bytes"``; without either the whole slot is
  the record);
* the slot file (``"slots"`` / ``"file"`` in the manifest, default ``view.bin``): no
  header, slot ``i`` at byte ``i * S``;
* the keys file (``"keys"``, default ``view.keys.txt`` when present): the ``H`` row ids of
  every slot, one slot per line (whitespace- or comma-separated), or ``.npy`` / raw
  little-endian int64 (``.i64``, ``.bin``) ``[N, H]``.

`RawSlotFile` reads it in place (one read-only mapping, no copy): `read_record`,
`read_records`, `slot_keys`, `find`. ``engramdb.View(path)`` returns one for such a path.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.errors import (
    CorruptFile,
    CorruptManifest,
    InvalidArgument,
    ShapeMismatch,
    StoreClosed,
    TruncatedFile,
)
from engramdb.io.gather import take_rows
from engramdb.layouts.keys import default_key_hash, match_keys
from engramdb.validate import as_rowids, check_bounds, check_output, record_id

__all__ = ["RAW_VIEW_MANIFEST", "RawSlotFile", "raw_view_manifest"]

RAW_VIEW_MANIFEST = "view.manifest.json"
_MAX_MANIFEST = 1 << 20


def raw_view_manifest(path: str | os.PathLike[str]) -> Path | None:
    """The ``view.manifest.json`` that describes ``path`` (the directory, the manifest
    itself, or a slot file next to it), or None when ``path`` is not a raw slot view."""
    p = Path(path)
    if p.is_dir():
        m = p / RAW_VIEW_MANIFEST
    elif p.name == RAW_VIEW_MANIFEST:
        m = p
    else:
        m = p.parent / RAW_VIEW_MANIFEST
    return m if m.is_file() else None


def _field(doc: dict[str, Any], names: tuple[str, ...], where: Path, default: Any = None) -> Any:
    for n in names:
        if n in doc:
            v = doc[n]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CorruptManifest(f"{where}: {n!r} must be a positive integer, got {v!r}")
            return v
    if default is None:
        raise CorruptManifest(f"{where}: missing field {names[0]!r}")
    return default


class RawSlotFile:
    """A published raw slot view, read in place (see the module doc). Thread-safe reads."""

    def __init__(self, path: str | os.PathLike[str]):
        manifest = raw_view_manifest(path)
        if manifest is None:
            raise InvalidArgument(f"no {RAW_VIEW_MANIFEST} describes {str(path)!r}")
        if manifest.stat().st_size > _MAX_MANIFEST:
            raise CorruptManifest(f"{manifest}: larger than {_MAX_MANIFEST} bytes")
        try:
            doc = json.loads(manifest.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptManifest(f"{manifest}: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise CorruptManifest(f"{manifest}: expected a JSON object")
        root = manifest.parent
        self.manifest_path = manifest
        self.n_records = int(_field(doc, ("grans",), manifest))
        self.heads = int(_field(doc, ("heads",), manifest))
        self.slot_bytes = int(_field(doc, ("slot_bytes",), manifest))
        width = doc.get("width", doc.get("row_bytes"))
        default_record = self.slot_bytes if width is None else self.heads * int(width)
        self.record_bytes = int(_field(doc, ("record_bytes",), manifest, default_record))
        self.width = None if width is None else int(width)
        if self.record_bytes > self.slot_bytes:
            raise CorruptManifest(
                f"{manifest}: records of {self.record_bytes} B do not fit slots of "
                f"{self.slot_bytes} B"
            )
        p = Path(path)
        named = doc.get("slots", doc.get("file"))
        if named is not None:
            data = root / str(named)
        elif p.is_file() and p.name != RAW_VIEW_MANIFEST:
            data = p
        else:
            data = root / "view.bin"
        keys = doc.get("keys")
        self.keys_path: Path | None = (
            root / str(keys)
            if keys is not None
            else (root / "view.keys.txt" if (root / "view.keys.txt").is_file() else None)
        )
        self.path = data
        self.name = data.name
        self._keys: np.ndarray | None = None
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        need = self.n_records * self.slot_bytes
        try:
            fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TruncatedFile(f"raw view slot file {str(data)!r} is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size < need:
                raise TruncatedFile(
                    f"raw view {str(data)!r} has {size} bytes, {self.n_records} slots of "
                    f"{self.slot_bytes} B need {need} (slots from {size // self.slot_bytes} "
                    "are missing)"
                )
            if size > need:
                raise CorruptFile(f"raw view {str(data)!r} has {size} bytes, expected {need}")
            self._mm: mmap.mmap | None = mmap.mmap(fd, need, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._mm.madvise(mmap.MADV_RANDOM)
        slots = np.frombuffer(self._mm, dtype=np.uint8).reshape(self.n_records, self.slot_bytes)
        self._records: np.ndarray | None = slots[:, : self.record_bytes]

    def __len__(self) -> int:
        return self.n_records

    @property
    def closed(self) -> bool:
        return self._records is None

    def _check_open(self) -> np.ndarray:
        r = self._records
        if r is None:
            raise StoreClosed(f"raw view {str(self.path)!r} is closed")
        return r

    def read_record(self, i: int) -> bytes:
        """Record ``i`` as ``record_bytes`` bytes (`RowIdOutOfRange` outside the view)."""
        records = self._check_open()
        j = record_id(i, self.n_records)
        return records[j].tobytes()

    def read_records(self, ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records ``ids`` (any integer array or list) as uint8 ``ids.shape +
        (record_bytes,)``, one gather from the mapping; validated before any byte is
        written (``out``: a C-contiguous writable buffer to fill)."""
        records = self._check_open()
        arr = as_rowids(ids)
        flat = arr.reshape(-1)
        check_bounds(flat, self.n_records, shape=arr.shape, what="record id")
        shape = arr.shape + (self.record_bytes,)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        else:
            check_output(out, shape)
        if flat.size:
            take_rows(records, flat, out.reshape(-1, self.record_bytes))
        return out

    def slot_keys(self) -> np.ndarray:
        """The row ids of every slot, int64 ``[n_records, heads]`` (read once, then kept)."""
        if self._keys is None:
            if self.keys_path is None:
                raise InvalidArgument(f"raw view {str(self.path)!r} has no keys file")
            kp = self.keys_path
            try:
                if kp.suffix == ".npy":
                    keys = np.load(kp, mmap_mode="r")
                elif kp.suffix in (".i64", ".bin"):
                    keys = np.memmap(kp, dtype="<i8", mode="r")
                else:
                    text = kp.read_text().replace(",", " ")
                    keys = np.array(text.split(), dtype=np.int64)
            except (OSError, ValueError) as e:
                raise CorruptFile(f"raw view keys {str(kp)!r}: {e}") from None
            keys = np.asarray(keys, dtype=np.int64)
            if keys.size != self.n_records * self.heads:
                raise CorruptFile(
                    f"raw view keys {str(kp)!r} hold {keys.size} ids, {self.n_records} slots x "
                    f"{self.heads} heads need {self.n_records * self.heads}"
                )
            self._keys = keys.reshape(self.n_records, self.heads)
        return self._keys

    def find(self, rowids: Any) -> np.ndarray:
        """Slot of every row-id tuple ``[..., heads]`` (int64 ``[...]``, -1 where the view
        has no slot for it): one hash search, confirmed by the ids."""
        q = np.ascontiguousarray(as_rowids(rowids))
        if q.ndim == 0 or q.shape[-1] != self.heads:
            raise ShapeMismatch(f"row-id tuples need a last axis of {self.heads}, got {q.shape}")
        if self._index is None:
            keys = np.ascontiguousarray(self.slot_keys())
            hashes = default_key_hash(keys)
            order = np.argsort(hashes, kind="stable")
            self._index = (hashes[order], keys[order], order.astype(np.uint32))
        sh, sk, so = self._index
        q2 = q.reshape(-1, self.heads)
        return match_keys(sh, sk, so, q2, default_key_hash(q2)).reshape(q.shape[:-1])

    def close(self) -> None:
        self._records = None
        self._index = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # an array returned earlier still views it; GC unmaps
                pass

    def __enter__(self) -> RawSlotFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<RawSlotFile {str(self.path)!r} {self.n_records} slots x {self.slot_bytes} B, "
            f"{self.heads} heads>"
        )
