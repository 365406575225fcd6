"""``build``: stream sources into a Store-I table and publish it atomically.

Publication protocol (the only writer path; see docs/format.md):

1. take the database lock (``.lock``, ``flock``) for the whole build;
2. stream every row into shards in a hidden staging directory ``<table>/.staging-<id>``,
   hashing as they are written, then fsync files and directory;
3. rename the staging directory to ``<table>/g-<id>`` (still unreferenced, so invisible);
4. write the new manifest to a temporary file, fsync, ``rename`` over ``manifest.json``,
   fsync the database directory: this rename is the commit point;
5. delete what the manifest no longer names (the replaced generation, leftovers of
   builds that were killed).

A build killed at any step before 4 leaves ``manifest.json`` untouched, and readers only
ever open files the manifest names.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engramdb._version import __version__
from engramdb.disk.checksum import BlockHasher
from engramdb.disk.files import fsync_dir
from engramdb.disk.publish import (
    collect_garbage,
    database_lock,
    new_generation_id,
    new_staging_dir,
    read_manifest_or_empty,
    write_manifest,
)
from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    ReadError,
    SourceError,
    TableExists,
    TableNotFound,
)
from engramdb.layouts.geometry import DEFAULT_SHARD_BYTES, PAGE, plan_geometry
from engramdb.layouts.manifest import ShardInfo, TableInfo, check_table_name
from engramdb.sources import Segment, SourceLike, resolve_sources
from engramdb.units import Summary, format_bytes, format_rate, per_second

__all__ = [
    "CHUNK_BYTES",
    "STAGE_BYTES",
    "SYNTHETIC_BLOCK",
    "BuildSummary",
    "build",
    "drop_table",
    "synthetic_bytes",
]

#: Size of each of the two reusable read buffers: bounds build memory whatever the table size.
CHUNK_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class BuildSummary(Summary):
    """What one `build` did. Sizes in bytes, time in seconds."""

    table: str
    rows: int
    bytes: int
    shards: int
    seconds: float
    path: str

    def line(self) -> str:
        return (
            f"built table {self.table!r}: {self.rows:,} rows, {format_bytes(self.bytes)} in "
            f"{self.shards} shard(s), {self.seconds:.2f} s, "
            f"{format_rate(per_second(self.bytes, self.seconds))}"
        )


#: Bytes staged before one write; page-aligned memory so the write can bypass the page cache.
STAGE_BYTES = 8 * 1024 * 1024


class _ShardWriter:
    """Writes a byte stream into consecutive shard files of fixed size, hashing each.

    Data goes through a page-aligned staging buffer and is written with ``O_DIRECT`` where the
    filesystem allows it: on these machines buffered writes of a fresh file crawl at ~0.4 GB/s
    (page-cache allocation and writeback), direct writes run at device speed (~1.3 GB/s).
    A shard's last partial page is written buffered (``O_DIRECT`` needs aligned lengths).
    """

    def __init__(
        self,
        directory: Path,
        rel_dir: str,
        sizes: Sequence[int],
        rows: Sequence[int],
        rows_per_shard: int,
    ):
        self._dir, self._rel, self._sizes, self._rows = directory, rel_dir, sizes, rows
        self._rows_per_shard = rows_per_shard
        self._index = -1
        self._fd = -1
        self._direct = False
        self._left = 0
        self._stage = mmap.mmap(-1, STAGE_BYTES)  # anonymous mappings are page-aligned
        self._staged = 0
        self._hash = BlockHasher()
        self.shards: list[ShardInfo] = []
        self._next()

    def _write_all(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.write(self._fd, data[done:])

    def _flush(self, final: bool) -> None:
        """Write the staged bytes; at a shard's end the unaligned tail goes buffered."""
        staged = memoryview(self._stage)[: self._staged]
        aligned = len(staged) - len(staged) % PAGE if self._direct else len(staged)
        if aligned:
            try:
                self._write_all(staged[:aligned])
            except OSError as e:
                if not self._direct or e.errno != errno.EINVAL:
                    raise
                self._set_direct(False)  # the filesystem refused: stay buffered
                self._write_all(staged[:aligned])
        rest = len(staged) - aligned
        if rest:
            if not final:  # keep the tail for the next flush (only happens at shard end)
                self._stage[:rest] = bytes(staged[aligned:])
                self._staged = rest
                return
            self._set_direct(False)
            self._write_all(staged[aligned:])
        self._staged = 0

    def _set_direct(self, on: bool) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        flags = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
            self._direct = on
        except OSError:
            self._direct = False

    def _next(self) -> None:
        if self._fd >= 0:
            self._flush(final=True)
            os.fsync(self._fd)
            os.close(self._fd)
            i = self._index
            digest, blocks = self._hash.finish()
            self.shards.append(
                ShardInfo(
                    path=f"{self._rel}/shard-{i:05d}.edb",
                    first_row=i * self._rows_per_shard,
                    rows=self._rows[i],
                    bytes=self._sizes[i],
                    xxh3_64=digest,
                    blocks=blocks,
                )
            )
            self._fd = -1
        self._index += 1
        if self._index < len(self._sizes):
            name = self._dir / f"shard-{self._index:05d}.edb"
            self._fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._set_direct(hasattr(os, "O_DIRECT"))
            self._left = self._sizes[self._index]
            self._hash = BlockHasher()

    def write(self, data: memoryview) -> None:
        while len(data):
            n = min(len(data), self._left, STAGE_BYTES - self._staged)
            part = data[:n]
            self._hash.update(part)
            self._stage[self._staged : self._staged + n] = part
            self._staged += n
            data = data[n:]
            self._left -= n
            if self._left == 0:
                self._next()
            elif self._staged == STAGE_BYTES:
                self._flush(final=False)

    @property
    def shard_index(self) -> int:
        """The shard being written (0-based)."""
        return self._index

    def close(self) -> None:
        """Release the descriptor and the staging buffer. Never raises over the error that
        ended the build: after a failed write a view of the buffer may still be referenced
        by that error's traceback (`BufferError` on close); the mapping is then freed with
        the last view instead."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        try:
            self._stage.close()
        except BufferError:
            pass


def _stream_segment(seg: Segment, bufs: tuple[memoryview, memoryview]) -> Iterator[memoryview]:
    """Yield the segment's bytes in chunks. File segments alternate between the two
    buffers: the next chunk is read in a background thread (``readinto`` releases the GIL)
    while the caller hashes and writes the current one, so reading overlaps writing."""
    size = len(bufs[0])
    if seg.array is not None:
        flat = np.ascontiguousarray(seg.array).reshape(-1).view(np.uint8).data
        for start in range(0, seg.nbytes, size):
            yield flat[start : start + size]
        return
    assert seg.path is not None
    with open(seg.path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as reader:
        # Sources are read once, front to back: widen read-ahead.
        os.posix_fadvise(f.fileno(), seg.offset, seg.nbytes, os.POSIX_FADV_SEQUENTIAL)
        end = seg.offset + seg.nbytes

        def read(pos: int, buf: memoryview) -> memoryview:
            want = min(size, end - pos)
            got = 0
            while got < want:
                n = os.preadv(f.fileno(), [buf[got:want]], pos + got)
                if not n:
                    raise ReadError(
                        f"source {seg.label!r} ended early: {end - pos - got} bytes missing at "
                        f"offset {pos + got}"
                    )
                got += n
            return buf[:want]

        pos = seg.offset
        pending = reader.submit(read, pos, bufs[0])
        k = 0
        while pos < end:
            chunk = pending.result()
            pos += len(chunk)
            k += 1
            if pos < end:
                pending = reader.submit(read, pos, bufs[k % 2])
            yield chunk


#: The synthetic byte stream is made of blocks of this size, each from its own generator.
SYNTHETIC_BLOCK = 1 << 20


def synthetic_bytes(seed: int, start: int, nbytes: int) -> np.ndarray:
    """Bytes ``[start, start + nbytes)`` of the table a ``synthetic=seed`` build writes: the
    concatenation over ``b = 0, 1, ...`` of ``PCG64([seed, b]).random_raw(SYNTHETIC_BLOCK // 8)``
    viewed as little-endian bytes. Deterministic whatever the chunking; one generator per
    1 MiB block (no per-row work)."""
    out = np.empty(nbytes, dtype=np.uint8)
    done = 0
    while done < nbytes:
        block, skip = divmod(start + done, SYNTHETIC_BLOCK)
        raw = np.random.PCG64([seed, block]).random_raw(SYNTHETIC_BLOCK // 8)
        data = raw.astype("<u8", copy=False).view(np.uint8)[skip:]
        take = min(len(data), nbytes - done)
        out[done : done + take] = data[:take]
        done += take
    return out


def _synthetic_chunks(seed: int, nbytes: int) -> Iterator[memoryview]:
    for start in range(0, nbytes, CHUNK_BYTES):
        yield synthetic_bytes(seed, start, min(CHUNK_BYTES, nbytes - start)).data


def _check_seed(seed: Any) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidArgument(f"synthetic seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def _parse_heads(heads: Sequence[int] | None) -> list[int] | None:
    if heads is None:
        return None
    out = []
    for h in heads:
        if isinstance(h, (bool, np.bool_)) or not isinstance(h, (int, np.integer)) or h <= 0:
            raise InvalidArgument(f"head sizes must be positive integers, got {h!r}")
        out.append(int(h))
    if not out:
        raise InvalidArgument("heads must not be empty")
    return out


def preset_layout(
    preset: str, *, scale: str | None = None, layer: int | None = None
) -> dict[str, Any]:
    """What a table of keygen preset ``preset`` (at ``scale``) for ``layer`` looks like:
    ``{"heads", "row_bytes", "dtype", "dim", "keygen"}`` — the heads are the layer's columns
    plus its pad head (`keygen.presets.table_heads`), ``row_bytes`` / ``dtype`` / ``dim`` the
    preset's row format (None where it has none), ``keygen`` the record `build` stores.
    ``layer`` may be omitted when the preset has one table."""
    from engramdb.keygen.presets import preset as keygen_preset
    from engramdb.keygen.presets import table_heads

    h = keygen_preset(preset, scale=scale)
    if layer is None:
        tables = {id(h.layer_tables(lay)) for lay in h.layers}
        if len(tables) != 1:
            raise InvalidArgument(
                f"preset {preset!r} has one table per layer {list(h.layers)}: pass a layer "
                "(--layer)"
            )
        layer = int(h.layers[0])
    elif int(layer) not in h.layers:
        raise InvalidArgument(
            f"preset {preset!r} has no layer {layer}; layers are {list(h.layers)}"
        )
    fmt = str(h.info.get("row_format") or "")
    return {
        "heads": table_heads(h, layer),
        "row_bytes": h.info.get("row_bytes"),
        "dtype": re.sub(r"\[\d+\]", "", fmt) or None,
        "dim": h.info.get("row_dim"),
        "keygen": {"preset": h.name, "layer": int(layer)},
    }


def build(
    db_path: str | os.PathLike[str],
    table: str,
    row_bytes: int | None,
    sources: Sequence[SourceLike],
    *,
    heads: Sequence[int] | None = None,
    tensor: str | None = None,
    dtype: str = "u8",
    dim: int | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    rows_per_badge: int | None = None,
    progress: Callable[[int], None] | None = None,
    synthetic: int | None = None,
    preset: str | None = None,
    scale: str | None = None,
    layer: int | None = None,
) -> BuildSummary:
    """Build (or with ``force`` replace) table ``table`` of the database at ``db_path``.

    ``sources`` are ``.npy`` / ``.bin`` / ``.safetensors`` paths or numpy arrays. Without
    ``heads`` each source is one head; with ``heads`` the concatenated sources are split into
    heads of those row counts. ``tensor`` (a glob) selects safetensors tensors across all given
    files, concatenated in numeric-aware name order. Streams with one 16 MiB buffer;
    ``progress`` is called with the byte count of each written chunk. The database directory
    is created if missing. Publication is atomic (see the module docstring).

    ``synthetic=SEED`` (no ``sources``; ``heads`` required) fills the table with deterministic
    random bytes instead (`synthetic_bytes`), for trying and benchmarking without a checkpoint.
    ``preset`` (a keygen preset name; ``scale`` and ``layer`` as in `preset_layout`) derives
    the heads, pad head included, and the row format (``row_bytes`` None: the preset's) and
    records ``{"keygen": {"preset": "qwen3.8-flash-next@tiny", "layer": 2}}`` in the table's
    manifest entry: index, views, `Decoder` and `stream` given the bare preset name on this
    table then use its scale.
    """
    check_table_name(table)
    keygen: dict[str, Any] | None = None
    if preset is not None:
        if heads is not None:
            raise InvalidArgument("a preset build derives the heads: drop heads (--heads)")
        layout = preset_layout(preset, scale=scale, layer=layer)
        heads, keygen = layout["heads"], layout["keygen"]
        if row_bytes is None:
            row_bytes = layout["row_bytes"]
            if row_bytes is None:
                raise InvalidArgument(
                    f"preset {preset!r} has no fixed row format: give row_bytes (--row-bytes)"
                )
        if dtype == "u8" and layout["dtype"]:
            dtype = layout["dtype"]
        if dim is None:
            dim = layout["dim"]
    elif scale is not None or layer is not None:
        raise InvalidArgument("scale and layer (--scale, --layer) go with a preset (--preset)")
    if (
        isinstance(row_bytes, bool)
        or not isinstance(row_bytes, (int, np.integer))
        or row_bytes <= 0
    ):
        raise InvalidArgument(f"row_bytes must be a positive integer, got {row_bytes!r}")
    row_bytes = int(row_bytes)
    head_sizes = _parse_heads(heads)
    if synthetic is not None:
        synthetic = _check_seed(synthetic)
        if sources or tensor is not None:
            raise InvalidArgument("a synthetic build takes no sources and no tensor glob")
        if head_sizes is None:
            raise InvalidArgument("a synthetic build needs heads (the row count of each head)")
    groups = [] if synthetic is not None else resolve_sources(sources, row_bytes, tensor=tensor)
    group_rows = [sum(s.nbytes for s in g) // row_bytes for g in groups]
    total_rows = sum(group_rows) if synthetic is None else sum(head_sizes or ())
    if head_sizes is None:
        head_sizes = group_rows
        if any(r == 0 for r in head_sizes):
            raise SourceError(f"a source holds no rows (rows per source: {group_rows})")
    elif sum(head_sizes) != total_rows:
        raise SourceError(
            f"heads {head_sizes} sum to {sum(head_sizes)} rows but the sources hold {total_rows}"
        )
    segments = [s for g in groups for s in g if s.nbytes]
    geo = plan_geometry(
        total_rows, row_bytes, shard_bytes=shard_bytes, rows_per_badge=rows_per_badge
    )
    provenance_sources: list[dict[str, Any]] = []
    first = 0
    for seg in segments:
        rows = seg.nbytes // row_bytes
        provenance_sources.append({"first_row": first, "rows": rows, **seg.meta})
        first += rows
    if synthetic is not None:
        provenance_sources.append({"first_row": 0, "rows": total_rows, "synthetic": synthetic})

    db = Path(db_path)
    db.mkdir(parents=True, exist_ok=True)
    with database_lock(db):
        t0 = time.perf_counter()  # a wait for another writer's lock is not build time
        current = read_manifest_or_empty(db)
        if table in current.tables and not force:
            raise TableExists(
                f"table {table!r} already exists in {str(db)!r}; use force=True / --force"
            )
        collect_garbage(db, current)
        gen_id = new_generation_id()
        tdir = db / table
        staging = new_staging_dir(tdir, gen_id)
        final_rel = f"{table}/g-{gen_id}"
        try:
            writer = _ShardWriter(
                staging,
                final_rel,
                geo.shard_sizes(),
                [geo.shard_rows(s) for s in range(geo.n_shards)],
                geo.rows_per_shard,
            )
            written = 0
            try:
                bufs = (memoryview(bytearray(CHUNK_BYTES)), memoryview(bytearray(CHUNK_BYTES)))
                streams = (
                    [_stream_segment(seg, bufs) for seg in segments]
                    if synthetic is None
                    else [_synthetic_chunks(synthetic, total_rows * row_bytes)]
                )
                for stream in streams:
                    for chunk in stream:
                        writer.write(chunk)
                        written += len(chunk)
                        if progress is not None:
                            progress(len(chunk))
            except OSError as e:
                if isinstance(e, EngramDBError) or e.errno is None:
                    raise
                # the cause, with where it happened and what was still to write
                raise OSError(
                    e.errno,
                    f"{e.strerror or e} while writing shard {writer.shard_index} of "
                    f"{geo.n_shards} of table {table!r} (needs "
                    f"{format_bytes(max(0, geo.table_bytes - written))} more)",
                ) from e
            finally:
                writer.close()
            fsync_dir(staging)
            os.rename(staging, db / final_rel)
            fsync_dir(tdir)
            info = TableInfo(
                name=table,
                row_bytes=row_bytes,
                heads=tuple(head_sizes),
                geometry=geo,
                shards=tuple(writer.shards),
                dtype=dtype,
                dim=dim,
                sources=tuple(provenance_sources),
                # fields this writer does not know (e.g. views) are carried over: a rebuilt
                # table's views then open as stale instead of vanishing
                extra={
                    **(dict(current.tables[table].extra) if table in current.tables else {}),
                    **({"keygen": dict(keygen)} if keygen else {}),
                },
                provenance={
                    "engramdb_version": __version__,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "tensor_glob": tensor,
                },
            )
            new = current.with_table(info)
            write_manifest(db, new)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(db / final_rel, ignore_errors=True)
            raise
        collect_garbage(db, new)
    seconds = time.perf_counter() - t0
    return BuildSummary(
        table=table,
        rows=total_rows,
        bytes=geo.table_bytes,
        shards=geo.n_shards,
        seconds=seconds,
        path=str(db),
    )


def drop_table(db_path: str | os.PathLike[str], table: str) -> None:
    """Remove ``table`` from the database (atomic manifest update, then file removal)."""
    db = Path(db_path)
    with database_lock(db):
        current = read_manifest_or_empty(db)
        if table not in current.tables:
            raise TableNotFound(f"no table {table!r} in {str(db)!r}")
        new = current.without_table(table)
        write_manifest(db, new)
        shutil.rmtree(db / table, ignore_errors=True)
        collect_garbage(db, new)
