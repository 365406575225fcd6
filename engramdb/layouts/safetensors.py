"""The safetensors header: parsed and validated without reading any tensor byte.

A safetensors file is ``u64 little-endian header length N`` + ``N`` bytes of UTF-8 JSON +
the data area. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [b, e]}``
(offsets relative to the data area) plus an optional ``"__metadata__"`` string map.
`parse_header` applies the format's rules and raises `InvalidSafetensors` (a `SourceError`)
naming the file and the rule a hostile or damaged header breaks:

* the header length is at most `MAX_HEADER_BYTES` and inside the file;
* every tensor has a known dtype, a shape of non-negative ints, and
  ``e - b == prod(shape) * itemsize``;
* every data range lies inside the file; no two tensors overlap.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from engramdb.errors import InvalidSafetensors

#: Byte size of one element of every safetensors dtype (the F8 kinds included).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: safetensors caps its JSON header at 100 MB; so does this parser.
MAX_HEADER_BYTES = 100_000_000

__all__ = ["DTYPE_BYTES", "MAX_HEADER_BYTES", "Header", "TensorEntry", "parse_header"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: ``nbytes`` bytes at absolute file offset ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0


@dataclass(frozen=True)
class Header:
    """A validated header: ``header_bytes`` (length prefix + JSON) and the tensors by name."""

    header_bytes: int
    tensors: dict[str, TensorEntry]


def parse_header(prefix: bytes, file_size: int, label: str) -> Header:
    """Validate the header at the start of a file of ``file_size`` bytes.

    ``prefix`` holds at least the first 8 bytes, and the whole header once its length is
    known (callers read ``8 + N`` bytes; see `header_length`)."""
    n = header_length(prefix[:8], file_size, label)
    if len(prefix) < 8 + n:
        raise InvalidSafetensors(f"safetensors {label}: header is cut short")
    try:
        doc = json.loads(prefix[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidSafetensors(f"safetensors {label}: header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise InvalidSafetensors(f"safetensors {label}: header is not a JSON object")
    base = 8 + n
    tensors: dict[str, TensorEntry] = {}
    for name, t in doc.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(name, t, base, file_size, label)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InvalidSafetensors(f"safetensors {label}: tensors {n0!r} and {n1!r} overlap")
    return Header(header_bytes=base, tensors=tensors)


def header_length(first8: bytes, file_size: int, label: str) -> int:
    """The JSON header length from the first 8 bytes, checked against the size bound."""
    if len(first8) < 8 or file_size < 8:
        raise InvalidSafetensors(f"safetensors {label}: shorter than the 8-byte length prefix")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES:
        raise InvalidSafetensors(
            f"safetensors {label}: header length {n} exceeds {MAX_HEADER_BYTES} bytes"
        )
    if 8 + n > file_size:
        raise InvalidSafetensors(
            f"safetensors {label}: header length {n} runs past the end of the file "
            f"({file_size} bytes)"
        )
    return int(n)


def _tensor(name: str, t: object, base: int, file_size: int, label: str) -> TensorEntry:
    where = f"safetensors {label}: tensor {name!r}"
    if not isinstance(t, dict):
        raise InvalidSafetensors(f"{where} is not an object")
    dtype = t.get("dtype")
    shape = t.get("shape")
    offs = t.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise InvalidSafetensors(f"{where} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidSafetensors(f"{where} has a bad shape {shape!r}")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        or not 0 <= offs[0] <= offs[1]
    ):
        raise InvalidSafetensors(f"{where} has bad data_offsets {offs!r}")
    nbytes = offs[1] - offs[0]
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if nbytes != want:
        raise InvalidSafetensors(
            f"{where}: dtype {dtype} x shape {shape} is {want} bytes, data_offsets span {nbytes}"
        )
    if base + offs[1] > file_size:
        raise InvalidSafetensors(
            f"{where}: data ends at byte {base + offs[1]}, past the end of the file "
            f"({file_size} bytes)"
        )
    return TensorEntry(name, str(dtype), tuple(shape), base + offs[0], nbytes)
