"""The manifest schema (``manifest.json``), parsed and checked without touching any file.

The manifest is the only source of truth about a database: which tables exist, their
geometry, and every shard's path, size and xxh3-64 checksum. Files it does not name are
invisible to readers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engramdb.errors import CorruptManifest, InvalidArgument
from engramdb.layouts.geometry import HUGE_PAGE, TableGeometry, plan_geometry

FORMAT_NAME = "engramdb"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: Manifests larger than this are refused before parsing (a 128-shard table is ~40 KB).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: Granularity of the per-block checksums each shard entry carries.
CHECK_BLOCK_BYTES = 64 * 1024 * 1024

_TABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")


def check_table_name(name: str) -> str:
    """Return ``name`` if it is a valid table name, else raise `InvalidArgument`."""
    if not isinstance(name, str) or not _TABLE_NAME.match(name) or name in (".", ".."):
        raise InvalidArgument(
            f"invalid table name {name!r}: use 1-128 characters from [A-Za-z0-9_.-], "
            "not starting with '.' or '-'"
        )
    return name


@dataclass(frozen=True)
class FileEntry:
    """One file as the manifest names it: path, size, xxh3-64 and per-block checksums.

    The one file-entry type: a table's shards (`ShardInfo`) and a view's files
    (``layouts.view.ViewFile``) are file entries, which `engramdb.disk.checksum` writes and
    checks.
    """

    path: str  # relative to the database directory, '/'-separated
    bytes: int
    xxh3_64: str
    #: xxh3-64 of each CHECK_BLOCK_BYTES block of the file, so `verify` can name a byte range.
    blocks: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "xxh3_64": self.xxh3_64,
            "blocks": list(self.blocks),
        }


@dataclass(frozen=True, kw_only=True)
class ShardInfo(FileEntry):
    """A table shard: a `FileEntry` plus the rows it holds (construct with keywords)."""

    first_row: int
    rows: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "first_row": self.first_row,
            "rows": self.rows,
            "bytes": self.bytes,
            "xxh3_64": self.xxh3_64,
            "blocks": list(self.blocks),
        }


@dataclass(frozen=True)
class SourceFile:
    """A file an attached table reads in place, with the identity recorded at attach.

    ``samples`` are ``(offset, length, xxh3_64)`` of a few blocks spread over the file's
    data; ``blocks`` (optional, ``attach --checksum``) the xxh3-64 of every
    `CHECK_BLOCK_BYTES` block of the whole file."""

    path: str  # absolute
    size: int
    mtime_ns: int
    ino: int
    dev: int
    header_bytes: int = 0  # bytes of the safetensors header (length prefix + JSON); 0: raw
    header_xxh3: str = ""
    samples: tuple[tuple[int, int, str], ...] = ()
    blocks: tuple[str, ...] = ()
    xxh3_64: str = ""  # whole file, with ``blocks`` (``attach --checksum``)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ino": self.ino,
            "dev": self.dev,
            "header_bytes": self.header_bytes,
            "header_xxh3": self.header_xxh3,
            "samples": [{"offset": o, "length": n, "xxh3_64": h} for o, n, h in self.samples],
            "blocks": list(self.blocks),
            "xxh3_64": self.xxh3_64,
        }


@dataclass(frozen=True)
class SourceRun:
    """``rows`` consecutive rows of one column: ``rows * width`` bytes at ``offset`` of file
    number ``file``."""

    file: int
    offset: int
    rows: int
    tensor: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.file, "offset": self.offset, "rows": self.rows}
        if self.tensor is not None:
            d["tensor"] = self.tensor
        return d


@dataclass(frozen=True)
class SourceColumn:
    """``width`` bytes of every row (columns are concatenated in order into a row), held by
    ``runs`` in row order."""

    width: int
    runs: tuple[SourceRun, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "runs": [r.to_dict() for r in self.runs]}


@dataclass(frozen=True)
class Attached:
    """Where an attached table's rows live: source files and the columns of a row."""

    files: tuple[SourceFile, ...]
    columns: tuple[SourceColumn, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [f.to_dict() for f in self.files],
            "columns": [c.to_dict() for c in self.columns],
        }


@dataclass(frozen=True)
class TableInfo:
    name: str
    row_bytes: int
    heads: tuple[int, ...]
    geometry: TableGeometry
    shards: tuple[ShardInfo, ...]
    dtype: str = "u8"
    dim: int | None = None
    sources: tuple[dict[str, Any], ...] = ()
    provenance: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Set for an attached table (rows read in place from source files; ``shards`` is empty).
    attached: Attached | None = None

    @property
    def n_rows(self) -> int:
        return self.geometry.n_rows

    @property
    def head_offsets(self) -> np.ndarray:
        """Exclusive prefix sum of ``heads`` (int64): the global id of each head's row 0."""
        h = np.asarray(self.heads, dtype=np.int64)
        return np.concatenate([np.zeros(1, np.int64), np.cumsum(h)[:-1]]) if len(h) else h

    def to_dict(self) -> dict[str, Any]:
        offs = self.head_offsets.tolist()
        d: dict[str, Any] = {
            "row_bytes": self.row_bytes,
            "n_rows": self.n_rows,
            "dtype": self.dtype,
            "dim": self.dim,
            "heads": [{"rows": r, "offset": o} for r, o in zip(self.heads, offs)],
            "layout": {"kind": "attached"} if self.attached else self.geometry.to_dict(),
            "shards": [s.to_dict() for s in self.shards],
            "sources": list(self.sources),
            "provenance": dict(self.provenance),
        }
        if self.attached is not None:
            d["attached"] = self.attached.to_dict()
        d.update(self.extra)
        return d


@dataclass(frozen=True)
class Manifest:
    tables: dict[str, TableInfo]
    generation: int = 0

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "tables": {name: t.to_dict() for name, t in sorted(self.tables.items())},
        }
        return json.dumps(doc, indent=1, sort_keys=False) + "\n"

    def with_table(self, table: TableInfo) -> Manifest:
        tables = dict(self.tables)
        tables[table.name] = table
        return Manifest(tables=tables, generation=self.generation + 1)

    def without_table(self, name: str) -> Manifest:
        tables = {k: v for k, v in self.tables.items() if k != name}
        return Manifest(tables=tables, generation=self.generation + 1)


#: Deepest nesting of JSON containers a manifest may have (a real one nests 5 levels; views
#: a few more). Checked before parsing, so a hostile file cannot exhaust the stack.
MAX_MANIFEST_DEPTH = 64


def _req(d: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, dict):
        raise CorruptManifest(f"manifest: {where} must be a JSON object, got {type(d).__name__}")
    if key not in d:
        raise CorruptManifest(f"manifest: {where} lacks field {key!r}")
    v = d[key]
    ints = typ is int or (isinstance(typ, tuple) and int in typ and bool not in typ)
    if not isinstance(v, typ) or (isinstance(v, bool) and ints):
        raise CorruptManifest(
            f"manifest: {where}.{key} has the wrong type ({type(v).__name__} {str(v)[:60]!r})"
        )
    return v


def _opt(
    d: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str, default: Any
) -> Any:
    """An optional field: ``default`` when absent, else `_req` (a wrong type is refused)."""
    if key not in d:
        return default
    return _req(d, key, typ, where)


def check_rel_path(path: str, where: str) -> str:
    """A path a manifest names: relative, ``/``-separated plain names (no ``""``, ``.``,
    ``..``, NUL). `CorruptManifest` naming ``where`` otherwise."""
    if (
        not path
        or "\0" in path
        or path.startswith("/")
        or any(p in ("", ".", "..") for p in path.split("/"))
    ):
        raise CorruptManifest(
            f"manifest: {where} {path!r} leaves the database (a path must be relative plain "
            "names inside it)"
        )
    return path


def _depth_ok(text: bytes) -> bool:
    """True unless ``text`` nests more than `MAX_MANIFEST_DEPTH` containers (a C-speed pass;
    brackets inside strings count too, which only makes the bound stricter)."""
    if text.count(b"[") + text.count(b"{") <= MAX_MANIFEST_DEPTH:
        return True
    b = np.frombuffer(text, np.uint8)
    step = (b == ord("[")).astype(np.int8) + (b == ord("{"))
    step -= (b == ord("]")).astype(np.int8) + (b == ord("}"))
    return int(np.cumsum(step, dtype=np.int64).max()) <= MAX_MANIFEST_DEPTH


def _parse_table(name: str, d: dict[str, Any]) -> TableInfo:
    where = f"table {name!r}"
    try:
        check_table_name(name)
    except InvalidArgument as e:
        raise CorruptManifest(f"manifest: {e}") from None
    row_bytes = _req(d, "row_bytes", int, where)
    n_rows = _req(d, "n_rows", int, where)
    heads_doc = _req(d, "heads", list, where)
    heads = tuple(_req(h, "rows", int, f"{where}.heads[{i}]") for i, h in enumerate(heads_doc))
    if not heads or any(h <= 0 for h in heads) or sum(heads) != n_rows:
        raise CorruptManifest(
            f"manifest: {where} heads {list(heads)} do not sum to n_rows {n_rows}"
        )
    offset = 0
    for i, h in enumerate(heads_doc):
        if _opt(h, "offset", int, f"{where}.heads[{i}]", offset) != offset:
            raise CorruptManifest(f"manifest: {where}.heads[{i}].offset is not the prefix sum")
        offset += h["rows"]
    layout = _req(d, "layout", dict, where)
    if layout.get("kind") == "attached":
        return _parse_attached(name, d, row_bytes, heads)
    if layout.get("kind") != "compact":
        raise CorruptManifest(f"manifest: {where} has unknown layout kind {layout.get('kind')!r}")
    if layout.get("alignment", HUGE_PAGE) != HUGE_PAGE:
        raise CorruptManifest(f"manifest: {where} has unsupported alignment")
    try:
        geo = TableGeometry(
            n_rows=n_rows,
            row_bytes=row_bytes,
            rows_per_badge=_req(layout, "rows_per_badge", int, f"{where}.layout"),
            rows_per_shard=_req(layout, "rows_per_shard", int, f"{where}.layout"),
        )
    except InvalidArgument as e:
        raise CorruptManifest(f"manifest: {where}: {e}") from None
    shards_doc = _req(d, "shards", list, where)
    if len(shards_doc) != geo.n_shards:
        raise CorruptManifest(
            f"manifest: {where} lists {len(shards_doc)} shards, geometry needs {geo.n_shards}"
        )
    shards = []
    for i, s in enumerate(shards_doc):
        sw = f"{where}.shards[{i}]"
        blocks = _opt(s, "blocks", list, sw, [])
        if not all(isinstance(b, str) for b in blocks):
            raise CorruptManifest(f"manifest: {sw}.blocks must be a list of hex strings")
        info = ShardInfo(
            path=check_rel_path(_req(s, "path", str, sw), f"{sw}.path"),
            first_row=_req(s, "first_row", int, sw),
            rows=_req(s, "rows", int, sw),
            bytes=_req(s, "bytes", int, sw),
            xxh3_64=_req(s, "xxh3_64", str, sw),
            blocks=tuple(blocks),
        )
        if (
            info.first_row != i * geo.rows_per_shard
            or info.rows != geo.shard_rows(i)
            or info.bytes != info.rows * row_bytes
        ):
            raise CorruptManifest(f"manifest: {sw} disagrees with the table geometry")
        n_blocks = -(-info.bytes // CHECK_BLOCK_BYTES)
        if info.blocks and (
            len(info.blocks) != n_blocks or not all(_HEX64.match(b) for b in info.blocks)
        ):
            raise CorruptManifest(f"manifest: {sw}.blocks does not hold {n_blocks} checksums")
        if not _HEX64.match(info.xxh3_64):
            raise CorruptManifest(f"manifest: {sw}.xxh3_64 is not 16 hex digits")
        if info.path.startswith("/") or ".." in info.path.split("/"):
            raise CorruptManifest(f"manifest: {sw}.path {info.path!r} leaves the database")
        shards.append(info)
    known = {
        "row_bytes",
        "n_rows",
        "dtype",
        "dim",
        "heads",
        "layout",
        "shards",
        "sources",
        "provenance",
    }
    dim = _opt(d, "dim", (int, type(None)), where, None)
    sources = _opt(d, "sources", list, where, [])
    for i, src in enumerate(sources):
        if not isinstance(src, dict):
            raise CorruptManifest(
                f"manifest: {where}.sources[{i}] must be an object, got {type(src).__name__}"
            )
    return TableInfo(
        name=name,
        row_bytes=row_bytes,
        heads=heads,
        geometry=geo,
        shards=tuple(shards),
        dtype=_opt(d, "dtype", str, where, "u8"),
        dim=dim,
        sources=tuple(sources),
        provenance=dict(_opt(d, "provenance", dict, where, {})),
        extra={k: v for k, v in d.items() if k not in known},
    )


def _int(d: Any, key: str, where: str, lo: int = 0) -> int:
    v = _req(d, key, int, where)
    if v < lo:
        raise CorruptManifest(f"manifest: {where}.{key} = {v} must be >= {lo}")
    return int(v)


def _parse_attached(
    name: str, d: dict[str, Any], row_bytes: int, heads: tuple[int, ...]
) -> TableInfo:
    where = f"table {name!r}"
    if d.get("shards", []) != []:
        raise CorruptManifest(f"manifest: {where} is attached and lists shards")
    doc = _req(d, "attached", dict, where)
    files = []
    for i, f in enumerate(_req(doc, "files", list, f"{where}.attached")):
        fw = f"{where}.attached.files[{i}]"
        path = _req(f, "path", str, fw)
        if not path.startswith("/"):
            raise CorruptManifest(f"manifest: {fw}.path {path!r} is not absolute")
        samples = []
        for j, s in enumerate(_req(f, "samples", list, fw)):
            sw = f"{fw}.samples[{j}]"
            h = _req(s, "xxh3_64", str, sw)
            if not _HEX64.match(h):
                raise CorruptManifest(f"manifest: {sw}.xxh3_64 is not 16 hex digits")
            samples.append((_int(s, "offset", sw), _int(s, "length", sw, 1), h))
        blocks = tuple(f.get("blocks", []))
        size = _int(f, "size", fw)
        if blocks and (
            len(blocks) != -(-size // CHECK_BLOCK_BYTES) or not all(_HEX64.match(b) for b in blocks)
        ):
            raise CorruptManifest(f"manifest: {fw}.blocks does not cover the file")
        files.append(
            SourceFile(
                path=path,
                size=size,
                mtime_ns=_int(f, "mtime_ns", fw),
                ino=_int(f, "ino", fw),
                dev=_int(f, "dev", fw),
                header_bytes=_int(f, "header_bytes", fw),
                header_xxh3=str(f.get("header_xxh3", "")),
                samples=tuple(samples),
                blocks=blocks,
                xxh3_64=str(f.get("xxh3_64", "")),
            )
        )
    columns = []
    for i, c in enumerate(_req(doc, "columns", list, f"{where}.attached")):
        cw = f"{where}.attached.columns[{i}]"
        width = _int(c, "width", cw, 1)
        runs = []
        for j, r in enumerate(_req(c, "runs", list, cw)):
            rw = f"{cw}.runs[{j}]"
            run = SourceRun(
                file=_int(r, "file", rw),
                offset=_int(r, "offset", rw),
                rows=_int(r, "rows", rw, 1),
                tensor=r.get("tensor") if isinstance(r.get("tensor"), str) else None,
            )
            if run.file >= len(files):
                raise CorruptManifest(f"manifest: {rw}.file {run.file} names no file")
            if run.offset + run.rows * width > files[run.file].size:
                raise CorruptManifest(f"manifest: {rw} runs past the end of its file")
            runs.append(run)
        if sum(r.rows for r in runs) != sum(heads):
            raise CorruptManifest(f"manifest: {cw} does not hold n_rows rows")
        columns.append(SourceColumn(width=width, runs=tuple(runs)))
    if not columns or sum(c.width for c in columns) != row_bytes:
        raise CorruptManifest(f"manifest: {where} column widths do not sum to row_bytes")
    known = {"row_bytes", "n_rows", "dtype", "dim", "heads", "layout", "shards", "sources"}
    known |= {"provenance", "attached"}
    dim = d.get("dim")
    return TableInfo(
        name=name,
        row_bytes=row_bytes,
        heads=heads,
        geometry=plan_geometry(sum(heads), row_bytes),
        shards=(),
        dtype=str(d.get("dtype", "u8")),
        dim=int(dim) if isinstance(dim, int) else None,
        sources=tuple(d.get("sources", [])),
        provenance=dict(d.get("provenance", {})),
        extra={k: v for k, v in d.items() if k not in known},
        attached=Attached(files=tuple(files), columns=tuple(columns)),
    )


def parse_manifest(text: str | bytes) -> Manifest:
    """Parse and validate manifest JSON; any violation raises `CorruptManifest` naming the
    field (a wrong JSON type, a missing field, a hostile path, nesting past
    `MAX_MANIFEST_DEPTH`, a ``format_version`` that is not the integer 1)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if not _depth_ok(raw):
        raise CorruptManifest(f"manifest nests JSON deeper than {MAX_MANIFEST_DEPTH} levels")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptManifest(f"manifest is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptManifest("manifest: 'format' is not 'engramdb'")
    version = doc.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise CorruptManifest(
            f"manifest: format_version {version!r} is not supported (this engine reads "
            f"{FORMAT_VERSION})"
        )
    tables_doc = _req(doc, "tables", dict, "top level")
    tables = {}
    for name, t in tables_doc.items():
        try:
            tables[name] = _parse_table(name, t)
        except CorruptManifest:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
            # a backstop: a value of a shape no check above foresaw is still a typed error
            raise CorruptManifest(
                f"manifest: table {str(name)[:60]!r} has a malformed field "
                f"({type(e).__name__}: {str(e)[:120]})"
            ) from None
    gen = _opt(doc, "generation", int, "top level", 0)
    if gen < 0:
        raise CorruptManifest(f"manifest: generation {gen} is negative")
    return Manifest(tables=tables, generation=gen)


EMPTY = Manifest(tables={}, generation=0)
