"""``attach``: publish a table whose rows are read in place from existing files.

No row byte is copied: the table entry (``docs/format.md`` section 6) maps the rows onto
byte ranges of safetensors files (one or many tensors concatenated along rows, in
numeric-aware name order; a second tensor of the same row count appended to every row, e.g.
V4.1's 8 B scale row after its 256 B weight row) or of raw row files (a ``shard_NNN.bin``
directory). Each file's identity is recorded (size, mtime_ns, inode/dev, the header's xxh3
and a few sampled blocks; with ``checksum=True`` every 64 MiB block), and readers check it
at open. Publication is atomic under the writer lock, like `build`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engramdb._version import __version__
from engramdb.disk.checksum import BlockHasher
from engramdb.disk.files import open_sources, source_identity
from engramdb.disk.publish import (
    collect_garbage,
    database_lock,
    read_manifest,
    read_manifest_or_empty,
    write_manifest,
)
from engramdb.errors import InvalidArgument, SourceError, TableExists, TableNotFound
from engramdb.layouts.geometry import plan_geometry
from engramdb.layouts.manifest import (
    Attached,
    SourceColumn,
    SourceFile,
    SourceRun,
    TableInfo,
    check_table_name,
)
from engramdb.layouts.safetensors import TensorEntry
from engramdb.read.attached import SourceSegments
from engramdb.sources import natural_key
from engramdb.sources import read_safetensors_header as read_header

__all__ = ["AttachSummary", "attach", "preset_tables"]

_DTYPE_HINT = {
    "F8_E4M3": "fp8_e4m3",
    "F8_E5M2": "fp8_e5m2",
    "F8_E8M0": "ue8m0",
    "BF16": "bf16",
    "F16": "f16",
    "F32": "f32",
    "U8": "u8",
    "I8": "i8",
}


@dataclass(frozen=True)
class AttachSummary:
    table: str
    rows: int
    row_bytes: int
    files: int
    seconds: float
    path: str


def _expand(files: Sequence[str | os.PathLike[str]]) -> list[str]:
    out: list[str] = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            shards = sorted(
                (c for c in p.iterdir() if c.suffix == ".bin"), key=lambda c: natural_key(c.name)
            )
            if not shards:
                raise SourceError(f"source directory {str(p)!r} holds no .bin row files")
            out.extend(str(c.resolve()) for c in shards)
        elif p.exists():
            out.append(str(p.resolve()))
        else:
            raise SourceError(f"source {str(p)!r} does not exist")
    return out


def _match(
    all_tensors: list[tuple[int, TensorEntry]], globs: Sequence[str]
) -> list[tuple[int, TensorEntry]]:
    hit = [(i, t) for i, t in all_tensors if any(fnmatch.fnmatchcase(t.name, g) for g in globs)]
    if not hit:
        raise SourceError(f"no tensor matches {list(globs)}")
    return sorted(hit, key=lambda it: (natural_key(it[1].name), it[0]))


def _column(tensors: list[tuple[int, TensorEntry]], what: str) -> tuple[SourceColumn, list[int]]:
    widths = {t.row_bytes for _i, t in tensors}
    if len(widths) != 1 or 0 in widths:
        raise SourceError(
            f"{what} tensors have different row widths: "
            + ", ".join(f"{t.name} {t.shape} {t.dtype}" for _i, t in tensors[:4])
        )
    width = widths.pop()
    runs: list[SourceRun] = []
    for i, t in tensors:
        last = runs[-1] if runs else None
        if last is not None and last.file == i and last.offset + last.rows * width == t.offset:
            runs[-1] = SourceRun(i, last.offset, last.rows + t.rows, last.tensor)  # adjacent
        else:
            runs.append(SourceRun(i, t.offset, t.rows, t.name))
    return SourceColumn(width, tuple(runs)), [t.rows for _i, t in tensors]


def _npy_data(path: str) -> tuple[int, int] | None:
    """(data offset, data bytes) of a ``.npy`` file (C order, fixed-width dtype), or None
    when ``path`` is not one: its header is not row bytes."""
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            return None
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (
                np.lib.format.read_array_header_1_0(f)
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0(f)
            )
        except ValueError as e:
            raise SourceError(f"raw source {path!r}: unreadable .npy header ({e})") from None
        if fortran or dtype.hasobject:
            raise SourceError(
                f"raw source {path!r}: a .npy of {'Fortran order' if fortran else 'objects'} "
                "has no row-major rows"
            )
        return f.tell(), int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _raw_column(
    paths: list[str], row_bytes: int, rows_per_shard: int | None
) -> tuple[SourceColumn, list[int]]:
    runs = []
    for i, p in enumerate(paths):
        size = os.stat(p).st_size
        npy = _npy_data(p)
        offset, nbytes = npy if npy is not None else (0, size)
        if npy is not None and offset + nbytes > size:
            raise SourceError(
                f"raw source {p!r}: its .npy header describes {nbytes} data bytes, the file "
                f"holds {size - offset}"
            )
        if nbytes == 0 or nbytes % row_bytes:
            raise SourceError(
                f"raw source {p!r}: {nbytes} data bytes is not a whole number of "
                f"--row-bytes {row_bytes} rows"
            )
        rows = nbytes // row_bytes
        if rows_per_shard is not None and i < len(paths) - 1 and rows != rows_per_shard:
            raise SourceError(
                f"raw source {p!r} holds {rows} rows, --rows-per-shard says {rows_per_shard}"
            )
        runs.append(SourceRun(i, offset, rows, None))
    return SourceColumn(row_bytes, tuple(runs)), [sum(r.rows for r in runs)]


def _file_identity(
    path: str, header_bytes: int, checksum: bool, progress: Callable[[int], None] | None
) -> SourceFile:
    sf = source_identity(path, header_bytes)
    if not checksum:
        return sf
    h = BlockHasher()
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(16 << 20)
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            if progress is not None:
                progress(n)
    whole, blocks = h.finish()
    return SourceFile(**{**sf.__dict__, "blocks": blocks, "xxh3_64": whole})


def attach(
    db_path: str | os.PathLike[str],
    table: str,
    files: Sequence[str | os.PathLike[str]],
    *,
    tensor: str | Sequence[str] | None = None,
    scale_tensor: str | None = None,
    row_bytes: int | None = None,
    rows_per_shard: int | None = None,
    heads: Sequence[int] | None = None,
    dtype: str | None = None,
    dim: int | None = None,
    checksum: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> AttachSummary:
    """Attach table ``table`` of database ``db_path`` to ``files`` in place (see the module
    docstring). ``.safetensors`` files: ``tensor`` globs pick the row tensors (default: every
    tensor) and ``scale_tensor`` a second column (a scalar scale is recorded as metadata);
    other files / directories are raw rows of ``row_bytes``. Without ``heads`` each tensor is
    one head. Writes only ``manifest.json``."""
    check_table_name(table)
    t0 = time.perf_counter()
    if not force and table in read_manifest_or_empty(db_path).tables:
        raise TableExists(f"table {table!r} already exists in {str(db_path)!r}; use --force")
    paths = _expand(files)
    if not paths:
        raise SourceError("attach needs at least one source file")
    safet = [p.endswith(".safetensors") for p in paths]
    extra: dict[str, Any] = {}
    header_bytes = [0] * len(paths)
    if all(safet):
        headers = [read_header(p) for p in paths]
        header_bytes = [h.header_bytes for h in headers]
        every = [(i, t) for i, h in enumerate(headers) for t in h.tensors.values()]
        globs = [tensor] if isinstance(tensor, str) else list(tensor or ["*"])
        picked = _match(every, globs)
        col, head_rows = _column(picked, "row")
        columns = [col]
        hint = _DTYPE_HINT.get(picked[0][1].dtype, picked[0][1].dtype.lower())
        if dim is None:
            dim = int(np.prod(picked[0][1].shape[1:])) if len(picked[0][1].shape) > 1 else None
        if scale_tensor is not None:
            scales = _match(every, [scale_tensor])
            n_rows = sum(head_rows)
            if len(scales) == 1 and scales[0][1].nbytes <= 16 and scales[0][1].rows != n_rows:
                i, s = scales[0]
                with open(paths[i], "rb") as f:
                    f.seek(s.offset)
                    raw = f.read(s.nbytes)
                extra["scale"] = {
                    "tensor": s.name,
                    "dtype": s.dtype,
                    "shape": list(s.shape),
                    "hex": raw.hex(),
                }
            else:
                scol, srows = _column(scales, "scale")
                if sum(srows) != n_rows:
                    raise SourceError(
                        f"scale tensors hold {sum(srows)} rows, the row tensors {n_rows}"
                    )
                columns.append(scol)
                hint += "+" + _DTYPE_HINT.get(scales[0][1].dtype, scales[0][1].dtype.lower())
    elif not any(safet):
        if row_bytes is None:
            raise InvalidArgument("raw row files need row_bytes (--row-bytes)")
        if tensor is not None or scale_tensor is not None:
            raise InvalidArgument("tensor globs apply to .safetensors sources only")
        col, head_rows = _raw_column(paths, int(row_bytes), rows_per_shard)
        columns = [col]
        hint = "u8"
    else:
        raise SourceError("mix of .safetensors and raw sources; attach one kind per table")
    width = sum(c.width for c in columns)
    if row_bytes is not None and int(row_bytes) != width:
        raise SourceError(f"the sources give {width} B rows, row_bytes={row_bytes} was asked")
    n_rows = sum(head_rows)
    if heads is not None:
        head_rows = [int(h) for h in heads]
        if any(h <= 0 for h in head_rows) or sum(head_rows) != n_rows:
            raise SourceError(
                f"heads {head_rows} sum to {sum(head_rows)} rows, the sources hold {n_rows}"
            )
    used = sorted({r.file for c in columns for r in c.runs})
    remap = {old: new for new, old in enumerate(used)}
    columns = [
        SourceColumn(
            c.width, tuple(SourceRun(remap[r.file], r.offset, r.rows, r.tensor) for r in c.runs)
        )
        for c in columns
    ]
    idents = tuple(_file_identity(paths[i], header_bytes[i], checksum, progress) for i in used)
    sources = []
    first = 0
    for r in columns[0].runs:
        sources.append(
            {
                "first_row": first,
                "rows": r.rows,
                "file": idents[r.file].path,
                "tensor": r.tensor,
                "offset": r.offset,
            }
        )
        first += r.rows
    info = TableInfo(
        name=table,
        row_bytes=width,
        heads=tuple(head_rows),
        geometry=plan_geometry(n_rows, width),
        shards=(),
        dtype=dtype or hint,
        dim=dim,
        sources=tuple(sources),
        provenance={
            "engramdb_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "attached": True,
            "tensor_glob": tensor if tensor is None or isinstance(tensor, str) else list(tensor),
            "scale_glob": scale_tensor,
        },
        extra=extra,
        attached=Attached(files=idents, columns=tuple(columns)),
    )
    db = Path(db_path)
    db.mkdir(parents=True, exist_ok=True)
    with database_lock(db):
        current = read_manifest_or_empty(db)
        if table in current.tables and not force:
            raise TableExists(
                f"table {table!r} already exists in {str(db)!r}; use force=True / --force"
            )
        new = current.with_table(info)
        write_manifest(db, new)
        collect_garbage(db, new)
    return AttachSummary(table, n_rows, width, len(idents), time.perf_counter() - t0, str(db))


def preset_tables(preset: str, files: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Per table ``{"table", "tensor", "scale_tensor", "heads"}`` for a keygen preset; a
    ``config.json`` beside the first file overrides the preset's config fields (so its head
    sizes match the checkpoint). Presets: ``deepseek-v4.1-flash`` (``engram_l{L}`` from
    ``layers.{L}.engram.embed.weight`` + ``.scale``), ``qwen3.8-flash-next`` (``ple_l{L}``
    from the ``ngram_embedding.shard_*`` tensors + ``weight_scale``), ``gemma3n-*``
    (``ple`` from ``embed_tokens_per_layer.weight``)."""
    from engramdb.keygen import preset as keygen_preset  # keygen is below build

    cfg_path = Path(files[0]).resolve().parent / "config.json" if files else None
    overrides: dict[str, Any] = {}
    if cfg_path is not None and cfg_path.is_file():
        doc = json.loads(cfg_path.read_text())
        overrides = doc.get("text_config", doc)
    if preset.startswith("gemma3n"):
        return [
            {
                "table": "ple",
                "tensor": "*embed_tokens_per_layer.weight",
                "scale_tensor": None,
                "heads": None,
            }
        ]
    try:
        h = keygen_preset(preset, **{k: v for k, v in overrides.items() if isinstance(k, str)})
    except TypeError as e:
        raise InvalidArgument(f"preset {preset!r}: config.json does not fit: {e}") from None
    out = []
    for layer in h.layers:
        heads = [int(x) for x in h.head_rows(layer)]
        pad = int(h.table_rows(layer)) - sum(heads)
        if pad > 0:  # e.g. Qwen: the table is rounded up to split into equal shard tensors
            heads.append(pad)
        if preset.startswith("deepseek-v4.1"):
            out.append(
                {
                    "table": f"engram_l{layer}",
                    "tensor": f"*layers.{layer}.engram.embed.weight",
                    "scale_tensor": f"*layers.{layer}.engram.embed.scale",
                    "heads": heads,
                }
            )
        elif preset.startswith("qwen"):
            out.append(
                {
                    "table": f"ple_l{layer}",
                    "tensor": f"*layers.{layer}.*ngram_embedding.shard_*.weight",
                    "scale_tensor": f"*layers.{layer}.*weight_scale",
                    "heads": heads,
                }
            )
        else:
            raise InvalidArgument(f"preset {preset!r} has no attach mapping")
    return out


def materialize(
    db_path: str | os.PathLike[str],
    table: str,
    into: str | os.PathLike[str] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> Any:
    """``build --from-attached``: copy attached table ``table`` into a built (compact) table
    of ``into`` (default: the same database, replacing the attached entry)."""
    from engramdb.build.table import build  # sibling writer

    info = read_manifest(db_path).tables.get(table)
    if info is None:
        raise TableNotFound(f"no table {table!r} in {str(db_path)!r}")
    if info.attached is None:
        raise InvalidArgument(f"table {table!r} is built already, not attached")
    dest = Path(into) if into is not None else Path(db_path)
    dest.mkdir(parents=True, exist_ok=True)
    fds = open_sources(info)
    seg = SourceSegments(info, fds)
    tmp = dest / f".attach-copy-{table}-{os.getpid()}.bin"
    try:
        n, rb = info.n_rows, info.row_bytes
        chunk = max(1, (16 << 20) // rb)
        buf = np.empty((chunk, rb), np.uint8)
        with open(tmp, "wb") as f:
            for lo in range(0, n, chunk):
                part = buf[: min(chunk, n - lo)]
                seg.read_range(lo, part.shape[0], part)
                f.write(part.data)
        return build(
            dest,
            table,
            rb,
            [str(tmp)],
            heads=list(info.heads),
            dtype=info.dtype,
            dim=info.dim,
            force=True,
            progress=progress,
        )
    finally:
        tmp.unlink(missing_ok=True)
        seg.close()
        for fd in fds:
            os.close(fd)
