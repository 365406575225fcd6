"""Row decoding from a table's dtype hint: which bytes of a row are values, which are scales.

Pure descriptions, no torch here: `engramdb.torch` turns them into tensors.

| hint | row layout | decoded |
|---|---|---|
| ``u8`` | ``row_bytes`` raw bytes | uint8 ``[row_bytes]`` |
| ``f32`` / ``float32`` | ``dim`` float32 | float32 |
| ``f16`` / ``float16`` | ``dim`` float16 | float16 |
| ``bf16`` / ``bfloat16`` | ``dim`` bfloat16 | bfloat16 |
| ``fp8_e4m3`` | ``dim`` FP8 E4M3 | float8_e4m3fn (or scaled to a float dtype) |
| ``fp8_e4m3+ue8m0`` | ``dim`` FP8 E4M3, then ``dim / 32`` E8M0 scales | float: ``e4m3(w[c]) * 2**(s[c // 32] - 127)`` |
"""

from __future__ import annotations

from dataclasses import dataclass

from engramdb.errors import InvalidArgument

_PLAIN = {
    "u8": ("uint8", 1),
    "uint8": ("uint8", 1),
    "f32": ("float32", 4),
    "float32": ("float32", 4),
    "f16": ("float16", 2),
    "float16": ("float16", 2),
    "bf16": ("bfloat16", 2),
    "bfloat16": ("bfloat16", 2),
    "fp8_e4m3": ("float8_e4m3fn", 1),
    "f8_e4m3": ("float8_e4m3fn", 1),
    "fp8_e5m2": ("float8_e5m2", 1),
}
SCALE_BLOCK = 32


@dataclass(frozen=True)
class RowCodec:
    """How to decode one row: ``dim`` values of ``value_dtype`` followed by
    ``n_scales`` E8M0 block scales (0 when the row has none)."""

    hint: str
    row_bytes: int
    value_dtype: str
    dim: int
    n_scales: int = 0

    @property
    def scaled(self) -> bool:
        return self.n_scales > 0


def codec_for(hint: str, row_bytes: int, dim: int | None = None) -> RowCodec:
    """The `RowCodec` of a table. Raises `InvalidArgument` for an unknown hint or a row
    size that does not fit it."""
    h = (hint or "u8").lower()
    if h in ("fp8_e4m3+ue8m0", "fp8+ue8m0", "f8_e4m3+e8m0"):
        # row = dim FP8 bytes + dim/32 scale bytes  =>  dim = row_bytes * 32 / 33
        d = dim if dim is not None else row_bytes * SCALE_BLOCK // (SCALE_BLOCK + 1)
        if d % SCALE_BLOCK or d + d // SCALE_BLOCK != row_bytes:
            raise InvalidArgument(
                f"dtype hint {hint!r}: row_bytes {row_bytes} is not dim + dim/32 for dim={d}"
            )
        return RowCodec(
            hint=h,
            row_bytes=row_bytes,
            value_dtype="float8_e4m3fn",
            dim=d,
            n_scales=d // SCALE_BLOCK,
        )
    if h not in _PLAIN:
        raise InvalidArgument(
            f"unknown dtype hint {hint!r} (known: {sorted(_PLAIN)} and fp8_e4m3+ue8m0)"
        )
    name, size = _PLAIN[h]
    if row_bytes % size:
        raise InvalidArgument(
            f"dtype hint {hint!r}: row_bytes {row_bytes} is not a multiple of {size}"
        )
    d = row_bytes // size
    if dim is not None and dim != d:
        raise InvalidArgument(
            f"dtype hint {hint!r}: dim {dim} does not match row_bytes {row_bytes}"
        )
    return RowCodec(hint=h, row_bytes=row_bytes, value_dtype=name, dim=d)
