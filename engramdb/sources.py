"""Build sources: ``.npy`` files, raw ``.bin`` files, safetensors files and in-memory arrays.

Each source resolves to one or more *segments*: a byte range of a file (or an array) that
holds whole rows. Nothing is read here except file headers; the bytes stream later.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from engramdb.errors import SourceError
from engramdb.layouts.safetensors import DTYPE_BYTES, Header, header_length, parse_header

SourceLike = Union[str, os.PathLike, np.ndarray]  # noqa: UP007 - used at runtime


@dataclass(frozen=True)
class Segment:
    """A run of whole rows: ``nbytes`` bytes at ``offset`` of ``path`` (or of ``array``)."""

    label: str
    nbytes: int
    path: str | None = None
    offset: int = 0
    array: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def rows(self, row_bytes: int) -> int:
        return self.nbytes // row_bytes


def natural_key(name: str) -> list[Any]:
    """Numeric-aware sort key: ``shard_2`` sorts before ``shard_10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise SourceError(f"source {path!r} does not exist") from None
    except OSError as e:
        raise SourceError(f"cannot stat source {path!r}: {e}") from None


def _check_rows(label: str, nbytes: int, row_bytes: int, shape_note: str = "") -> None:
    if nbytes % row_bytes:
        raise SourceError(
            f"source {label}: {nbytes} bytes{shape_note} is not a whole number of "
            f"{row_bytes} B rows"
        )


def npy_segment(path: str, row_bytes: int) -> Segment:
    """A ``.npy`` file: any dtype, viewed as bytes; shape ``[rows, ...]`` with
    ``prod(shape[1:]) * itemsize == row_bytes``. Fortran order and object arrays are refused."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise SourceError(f"source {path!r}: unsupported .npy version {version}")
            offset = f.tell()
    except FileNotFoundError:
        raise SourceError(f"source {path!r} does not exist") from None
    except ValueError as e:
        raise SourceError(f"source {path!r} is not a valid .npy file: {e}") from None
    if dtype.hasobject:
        raise SourceError(f"source {path!r}: object arrays cannot be stored")
    if fortran and len(shape) > 1:
        raise SourceError(f"source {path!r}: Fortran-ordered arrays are not row-contiguous")
    if len(shape) == 0:
        raise SourceError(f"source {path!r}: a 0-d array holds no rows")
    per_row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    if per_row != row_bytes:
        raise SourceError(
            f"source {path!r}: shape {tuple(shape)} of {dtype} gives {per_row} B per row, "
            f"expected row_bytes={row_bytes}"
        )
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = _file_size(path)
    if size < offset + nbytes:
        raise SourceError(
            f"source {path!r} is truncated: header promises {nbytes} data bytes, "
            f"file has {size - offset}"
        )
    return Segment(
        label=path,
        nbytes=nbytes,
        path=path,
        offset=offset,
        meta={"file": path, "dtype": dtype.str, "shape": list(shape)},
    )


def bin_segment(path: str, row_bytes: int) -> Segment:
    """A raw file of concatenated rows."""
    size = _file_size(path)
    _check_rows(repr(path), size, row_bytes)
    return Segment(label=path, nbytes=size, path=path, offset=0, meta={"file": path})


def read_safetensors_header(path: str) -> Header:
    """The validated safetensors header of ``path`` (reads only the header).

    The rules and their `InvalidSafetensors` messages are `layouts.safetensors.parse_header`'s."""
    _file_size(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = header_length(f.read(8), size, repr(path))
            f.seek(0)
            return parse_header(f.read(8 + n), size, repr(path))
    except OSError as e:
        raise SourceError(f"source {path!r} cannot be read: {e}") from None


def safetensors_segments(
    paths: Sequence[str], row_bytes: int, tensor_glob: str | None
) -> list[Segment]:
    """Tensors of safetensors files as segments.

    Without ``tensor_glob`` each file must hold exactly one tensor. With it, every tensor
    whose name matches, across all files, is taken in numeric-aware name order (so
    ``shard_2`` precedes ``shard_10``), which is how a table split over many tensors
    concatenates.
    """
    found: list[tuple[list[Any], Segment]] = []
    for path in paths:
        tensors = read_safetensors_header(path).tensors
        names = list(tensors)
        if tensor_glob is None:
            if len(names) != 1:
                raise SourceError(
                    f"source {path!r} holds {len(names)} tensors; pick them with --tensor GLOB"
                )
        else:
            names = [n for n in names if fnmatch.fnmatchcase(n, tensor_glob)]
        for name in names:
            t = tensors[name]
            shape, dtype = list(t.shape), t.dtype
            per_row = math.prod(shape[1:]) * DTYPE_BYTES[dtype] if shape else 0
            if per_row != row_bytes:
                raise SourceError(
                    f"source {path!r}: tensor {name!r} {shape} x {dtype} gives {per_row} B per "
                    f"row, expected row_bytes={row_bytes}"
                )
            seg = Segment(
                label=f"{path}:{name}",
                nbytes=t.nbytes,
                path=path,
                offset=t.offset,
                meta={"file": path, "tensor": name, "dtype": dtype, "shape": shape},
            )
            found.append((natural_key(name) + [path], seg))
    if tensor_glob is not None:
        if not found:
            raise SourceError(f"no tensor matches --tensor {tensor_glob!r} in {list(paths)}")
        found.sort(key=lambda x: x[0])
    return [s for _, s in found]


def array_segment(arr: np.ndarray, row_bytes: int, label: str) -> Segment:
    """An in-memory array (any dtype, C-contiguous), viewed as rows of bytes."""
    if not isinstance(arr, np.ndarray):
        raise SourceError(f"{label}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.hasobject:
        raise SourceError(f"{label}: object arrays cannot be stored")
    if not arr.flags.c_contiguous:
        raise SourceError(f"{label}: array must be C-contiguous")
    if arr.ndim == 0:
        raise SourceError(f"{label}: a 0-d array holds no rows")
    per_row = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
    if per_row != row_bytes:
        raise SourceError(
            f"{label}: shape {arr.shape} of {arr.dtype} gives {per_row} B per row, "
            f"expected row_bytes={row_bytes}"
        )
    return Segment(
        label=label,
        nbytes=arr.nbytes,
        array=arr,
        meta={"array": label, "dtype": arr.dtype.str, "shape": list(arr.shape)},
    )


def resolve_sources(
    sources: Iterable[SourceLike], row_bytes: int, *, tensor: str | None = None
) -> list[list[Segment]]:
    """Resolve sources to segment lists, one list per given source (in order).

    With ``tensor`` every source must be a safetensors file and all matching tensors form
    one list (one logical source).
    """
    items = list(sources)
    if not items:
        raise SourceError("no source given")
    if tensor is not None:
        paths = []
        for s in items:
            if isinstance(s, np.ndarray):
                raise SourceError("--tensor applies to safetensors files, not arrays")
            p = os.fspath(s)
            if not p.endswith(".safetensors"):
                raise SourceError(f"--tensor needs safetensors files, got {p!r}")
            paths.append(p)
        return [safetensors_segments(paths, row_bytes, tensor)]
    out: list[list[Segment]] = []
    for i, s in enumerate(items):
        if isinstance(s, np.ndarray):
            out.append([array_segment(s, row_bytes, f"array[{i}]")])
            continue
        p = os.fspath(s)
        suffix = Path(p).suffix.lower()
        if suffix == ".npy":
            out.append([npy_segment(p, row_bytes)])
        elif suffix == ".safetensors":
            out.append(safetensors_segments([p], row_bytes, None))
        elif suffix in (".bin", ".raw", ".dat", ""):
            out.append([bin_segment(p, row_bytes)])
        else:
            raise SourceError(
                f"source {p!r}: unknown kind {suffix!r} (use .npy, .bin or .safetensors)"
            )
    return out
