"""Token corpora: a token file or a directory of them, read as ``[S, T]`` sequences.

What ``engramdb index`` and `engramdb.stream` read: ``.npy`` files (``[T]`` one sequence,
``[S, T]`` S sequences) and raw ``.bin`` token ids (one sequence), memory-mapped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engramdb.errors import InvalidArgument, SourceError

__all__ = ["BIN_DTYPES", "corpus_files", "open_tokens"]

BIN_DTYPES = {"uint32": np.dtype("<u4"), "int32": np.dtype("<i4")}


def corpus_files(corpus: str | os.PathLike[str]) -> list[Path]:
    """The token files of a corpus path: itself, or a directory's ``*.npy`` / ``*.bin`` by name."""
    src = Path(corpus)
    if src.is_dir():
        files = sorted(
            p for p in src.iterdir() if p.suffix in (".npy", ".bin") and not p.name.startswith(".")
        )
        if not files:
            raise SourceError(f"{src}: no .npy or .bin token files")
        return files
    if not src.exists():
        raise SourceError(f"{src}: no such corpus file or directory")
    if src.suffix not in (".npy", ".bin"):
        raise SourceError(f"{src}: corpus files must be .npy or raw .bin token ids")
    return [src]


def open_tokens(path: Path, bin_dtype: str | None) -> np.ndarray:
    """Memory-map one token file as ``[S, T]`` sequences (a 1-D file is one sequence)."""
    if path.suffix == ".bin":
        if bin_dtype not in BIN_DTYPES:
            raise InvalidArgument(
                f"{path}: a raw .bin corpus needs bin_dtype 'uint32' or 'int32', got {bin_dtype!r}"
            )
        dtype = BIN_DTYPES[bin_dtype]
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise SourceError(f"{path}: {size} bytes is not a whole number of {bin_dtype} ids")
        if size == 0:
            return np.zeros((1, 0), dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r").reshape(1, -1)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise SourceError(f"{path}: not a readable .npy file ({exc})") from exc
    if arr.dtype.kind not in "iu":
        raise SourceError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim == 1:
        return arr.reshape(1, -1)
    if arr.ndim != 2:
        raise SourceError(f"{path}: expected [T] or [S, T] token ids, got shape {arr.shape}")
    return arr
