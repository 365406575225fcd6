"""DeepSeek tokenizer compression: the many-to-one ``raw id -> compressed id`` table.

Build it from a ``tokenizer.json`` with the optional ``tokenizers`` package (the reference
normaliser lives there, and a pure-Python mirror differs on hundreds of code points), or load
a frozen ``.npy`` map whose sidecar records the tokenizer's sha256 and the map's checksum.

File format (``docs/keygen.md``): ``<name>.npy`` holds the table as 1-D ``<u4`` (numpy
``.npy`` v1, no pickle); ``<name>.npy.json`` holds ``{"format": "engramdb-token-map",
"version": 1, "vocab_size", "compressed_vocab_size", "tokenizer_sha256", "xxh3_64"}`` where
``xxh3_64`` is the hex digest of the table's ``<u4`` bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from engramdb._durable import atomic_write_bytes
from engramdb.errors import (
    ChecksumMismatch,
    CorruptFile,
    InvalidArgument,
    InvalidDtype,
    MissingDependency,
    ShapeMismatch,
)
from engramdb.keygen._core import check_range, to_int64

SENTINEL = "\ue000"  # private-use char standing in for a whitespace-only token during Strip
FORMAT = "engramdb-token-map"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file (reads it in 1 MiB pieces)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for piece in iter(lambda: fh.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


class TokenMap:
    """A frozen compression table: ``table[raw_id]`` = compressed id.

    Compressed ids are numbered in order of first appearance (raw-id order), which the
    constructor checks; ``compressed_vocab_size`` is the number of distinct keys (``V_c``).
    Holds the table as int64 (8 B per raw id, ~1 MiB for a 129k vocabulary).
    """

    def __init__(self, table: Any, *, tokenizer_sha256: str | None = None) -> None:
        arr = np.asarray(table)
        if arr.ndim != 1 or arr.size == 0:
            raise ShapeMismatch(f"token map must be a non-empty 1-D table, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidDtype(f"token map must hold integers, got dtype {arr.dtype}")
        t = to_int64(arr).copy()
        running = np.maximum.accumulate(t)
        if t[0] != 0 or int(t.min()) < 0 or bool((t[1:] > running[:-1] + 1).any()):
            bad = (
                0
                if t[0] != 0
                else int(np.flatnonzero((t[1:] > running[:-1] + 1) | (t[1:] < 0))[0]) + 1
            )
            raise InvalidArgument(
                f"token map is not numbered in order of first appearance: raw id {bad} maps to "
                f"{int(t[bad])}"
            )
        t.setflags(write=False)
        self.table = t
        self.compressed_vocab_size = int(running[-1]) + 1
        self.tokenizer_sha256 = tokenizer_sha256

    def __len__(self) -> int:
        return int(self.table.shape[0])

    def __repr__(self) -> str:
        return f"<TokenMap {len(self)} -> {self.compressed_vocab_size} ids>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenMap):
            return NotImplemented
        return bool(np.array_equal(self.table, other.table))

    __hash__ = None  # type: ignore[assignment]

    def apply(self, token_ids: Any, *, strict: bool = True) -> np.ndarray:
        """Compressed ids (int64, same shape) of raw ``token_ids``. One gather pass.

        ``strict=False`` clamps ids outside the table into it (what serving engines do).
        """
        arr = np.asarray(token_ids)
        if arr.dtype.kind not in "iu":
            raise InvalidDtype(f"token ids must be integers, got dtype {arr.dtype}")
        if strict:
            check_range(arr, 0, len(self), "tokenizer vocabulary")
        else:
            arr = np.clip(to_int64(arr), 0, len(self) - 1)
        return np.take(self.table, arr)

    # --- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``path`` (``.npy``, ``<u4``) and its ``.json`` sidecar atomically. ~5 B per id."""
        target = Path(path)
        if self.compressed_vocab_size > 0xFFFFFFFF:
            raise InvalidArgument("compressed ids do not fit the uint32 map format")
        data = self.table.astype("<u4")
        buf = io.BytesIO()
        np.save(buf, data, allow_pickle=False)
        meta = {
            "format": FORMAT,
            "version": 1,
            "vocab_size": len(self),
            "compressed_vocab_size": self.compressed_vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            "xxh3_64": xxhash.xxh3_64_hexdigest(data.tobytes()),
        }
        atomic_write_bytes(target, buf.getvalue())
        atomic_write_bytes(_sidecar(target), (json.dumps(meta, indent=1) + "\n").encode())
        return target

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        tokenizer_sha256: str | None = None,
        vocab_size: int | None = None,
        compressed_vocab_size: int | None = None,
    ) -> TokenMap:
        """Read a frozen map and check it against what the caller expects.

        ``tokenizer`` (a ``tokenizer.json`` path, hashed here) or ``tokenizer_sha256`` must
        equal the hash recorded when the map was saved; ``vocab_size`` / ``compressed_vocab_size``
        must equal the map's. A mismatch raises :class:`InvalidArgument`; a damaged file raises
        :class:`CorruptFile` / :class:`ChecksumMismatch`. Cost: reads ~4 B per id.
        """
        src = Path(path)
        try:
            raw = np.load(src, allow_pickle=False)
        except FileNotFoundError:
            raise
        except (ValueError, OSError, EOFError) as exc:
            raise CorruptFile(f"{src}: not a readable .npy token map ({exc})") from exc
        meta: dict[str, Any] = {}
        side = _sidecar(src)
        if side.exists():
            try:
                meta = json.loads(side.read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise CorruptFile(f"{side}: unreadable sidecar ({exc})") from exc
            if meta.get("format") != FORMAT:
                raise CorruptFile(f"{side}: not an {FORMAT} sidecar")
        if raw.ndim != 1 or raw.dtype.kind not in "iu":
            raise CorruptFile(f"{src}: token map must be 1-D integers, got {raw.dtype} {raw.shape}")
        if meta:
            digest = xxhash.xxh3_64_hexdigest(raw.astype("<u4").tobytes())
            if meta.get("xxh3_64") not in (None, digest):
                raise ChecksumMismatch(
                    f"{src}: xxh3-64 {digest} differs from recorded {meta['xxh3_64']}"
                )
            if meta.get("vocab_size") not in (None, raw.shape[0]):
                raise CorruptFile(f"{src}: {raw.shape[0]} ids, sidecar says {meta['vocab_size']}")
        recorded = meta.get("tokenizer_sha256")
        expected = tokenizer_sha256
        if tokenizer is not None:
            actual = file_sha256(tokenizer)
            if expected is not None and expected != actual:
                raise InvalidArgument(f"tokenizer {tokenizer} has sha256 {actual}, not {expected}")
            expected = actual
        if expected is not None and recorded != expected:
            raise InvalidArgument(
                f"token map {src} was built for tokenizer sha256 {recorded}, not {expected}"
            )
        tmap = cls(raw, tokenizer_sha256=recorded)
        if vocab_size is not None and len(tmap) != vocab_size:
            raise InvalidArgument(f"token map {src} has {len(tmap)} ids, expected {vocab_size}")
        if (
            compressed_vocab_size is not None
            and tmap.compressed_vocab_size != compressed_vocab_size
        ):
            raise InvalidArgument(
                f"token map {src} compresses to {tmap.compressed_vocab_size} ids, expected "
                f"{compressed_vocab_size}"
            )
        if meta.get("compressed_vocab_size") not in (None, tmap.compressed_vocab_size):
            raise CorruptFile(f"{src}: sidecar compressed size differs from the table's")
        return tmap

    @classmethod
    def coerce(cls, value: Any) -> TokenMap:
        """A TokenMap from a TokenMap, a path to a frozen ``.npy`` map, or an int array."""
        if isinstance(value, TokenMap):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value)
        return cls(value)

    @classmethod
    def from_tokenizer(cls, tokenizer_json: str | os.PathLike[str]) -> TokenMap:
        """Build the map from a ``tokenizer.json`` (needs ``tokenizers``). ~1 s per 100k ids."""
        return build_token_map(tokenizer_json)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise MissingDependency(
            "building a token map needs the optional 'tokenizers' package: "
            "pip install 'engramdb[tokenizers]'"
        ) from exc
    return tokenizers


def compression_normalizer() -> Any:
    """The reference key normaliser as a ``tokenizers.normalizers.Sequence``.

    NFKC, NFD, strip every mark, lowercase per character, collapse ``[ \\t\\r\\n]`` runs to one
    space, keep a lone space (via a private-use sentinel) so whitespace-only tokens share the
    key ``" "``, strip Unicode whitespace, restore the sentinel.
    """
    tk = _tokenizers()
    n = tk.normalizers
    return n.Sequence(
        [
            n.NFKC(),
            n.NFD(),
            n.StripAccents(),
            n.Lowercase(),
            n.Replace(tk.Regex(r"[ \t\r\n]+"), " "),
            n.Replace(tk.Regex(r"^ $"), SENTINEL),
            n.Strip(),
            n.Replace(SENTINEL, " "),
        ]
    )


def build_token_map(tokenizer_json: str | os.PathLike[str]) -> TokenMap:
    """The compression map of a ``tokenizer.json``, following the DeepSeek Engram rule.

    For every id (added and special tokens included) the single-id decode is normalised; a
    decode containing U+FFFD (a partial UTF-8 byte token) keys on the raw vocabulary string
    instead, and an empty normalised key falls back to the decode. Ids are numbered by first
    appearance of their key. Needs ``tokenizers``; one decode and normalise per id.
    """
    tk = _tokenizers()
    path = Path(tokenizer_json)
    tok = tk.Tokenizer.from_file(str(path))
    norm = compression_normalizer()
    n_ids = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n_ids)], skip_special_tokens=False)
    seen: dict[str, int] = {}
    table = np.empty(n_ids, dtype=np.int64)
    for tid, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(tid) or text
        else:
            key = norm.normalize_str(text) or text
        table[tid] = seen.setdefault(key, len(seen))
    return TokenMap(table, tokenizer_sha256=file_sha256(path))


def load_token_map(path: str | os.PathLike[str], **checks: Any) -> TokenMap:
    """:meth:`TokenMap.load` (keyword checks: tokenizer, tokenizer_sha256, vocab_size, ...)."""
    return TokenMap.load(path, **checks)
