"""Fetched table rows as torch values (the part of `engramdb.torch` below its modules).

`RowDecoder` turns raw rows ``uint8 [n, row_bytes]`` into values by the table's dtype hint
(`engramdb.rowcodec`): raw dtypes are reinterpreted without a copy, FP8 is widened, FP8 with
E8M0 block scales is dequantised; `ids_to_numpy` takes the ids a module is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engramdb.errors import InvalidDtype, MissingDependency
from engramdb.rowcodec import RowCodec

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise MissingDependency("engramdb.torch needs PyTorch: pip install 'engramdb[torch]'") from e

__all__ = ["Hot", "RowDecoder", "ids_to_numpy", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def ids_to_numpy(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise InvalidDtype(f"ids must be an integer tensor, got {ids.dtype}")
        if ids.device.type != "cpu":
            ids = ids.cpu()
        return ids.contiguous().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidDtype(f"ids must be integers, got dtype {arr.dtype}")
    return arr


class RowDecoder:
    """Turns fetched raw rows ``uint8 [n, row_bytes]`` (a torch view) into values."""

    def __init__(self, codec: RowCodec, out_dtype: torch.dtype | None, scale: float | None):
        self.codec = codec
        self.value_dtype = torch_dtype(codec.value_dtype)
        if codec.scaled or scale is not None:
            self.out_dtype = out_dtype or torch.float32
        else:
            self.out_dtype = out_dtype or self.value_dtype
        self.scale = scale
        #: True when decoding only reinterprets the fetched bytes (no new tensor).
        self.is_view = not codec.scaled and scale is None and self.out_dtype == self.value_dtype

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        c = self.codec
        if not c.scaled:
            vals = raw.view(self.value_dtype)
            if self.scale is not None:
                vals = vals.to(self.out_dtype) * self.scale
            elif self.out_dtype != self.value_dtype:
                vals = vals.to(self.out_dtype)
            return vals
        n = raw.shape[0]
        w = raw[:, : c.dim].view(self.value_dtype).to(torch.float32)
        s = raw[:, c.dim :].view(torch.float8_e8m0fnu).to(torch.float32)
        out = (w.view(n, c.n_scales, -1) * s.unsqueeze(-1)).view(n, c.dim)
        if self.scale is not None:
            out = out * self.scale
        return out.to(self.out_dtype)


class Hot:
    """A `DiskMultiHeadEmbedding`'s per-call state and counters (a plain object)."""

    __slots__ = (
        "mapped",
        "prefetched",
        "read",
        "prefetches",
        "from_prefetch",
        "resident_skips",
        "ticket",
        "ticket_ids",
        "ticket_src",
        "view_cache",
    )

    def __init__(self) -> None:
        self.mapped = self.prefetched = self.read = self.prefetches = self.from_prefetch = 0
        self.resident_skips = 0
        self.ticket: Any = None
        self.ticket_ids: np.ndarray | None = None
        #: the ids tensor the pending prefetch was given, its version and its rows' shape
        #: (None: not a CPU int64 ``[B, L, H]`` tensor): a forward of that very tensor,
        #: unchanged, needs no second check
        self.ticket_src: tuple[torch.Tensor, int, tuple[int, ...]] | None = None
        self.view_cache: tuple[Any, torch.Tensor, Any, torch.Tensor] | None = None
