"""torch modules over EngramDB tables (optional extra ``torch``).

`DiskEmbedding` has ``nn.Embedding``'s forward contract (ids ``[...]`` → ``[..., dim]``) but
its weight stays in an EngramDB table; `DiskMultiHeadEmbedding` maps per-head local ids
``[B, L, H]`` to ``[B, L, H, dim]``. Rows are decoded from the table's dtype hint
(`engramdb.rowcodec`): raw dtypes are reinterpreted without a copy, FP8 is widened, FP8 with
E8M0 block scales is dequantised. No gradients: the table is read-only.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from engramdb.errors import InvalidDtype, MissingDependency
from engramdb.rowcodec import RowCodec, codec_for
from engramdb.table_api import RowTable

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise MissingDependency("engramdb.torch needs PyTorch: pip install 'engramdb[torch]'") from e


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def _ids_to_numpy(ids: Any) -> np.ndarray:
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


class _Decoder:
    """Turns fetched raw rows ``uint8 [n, row_bytes]`` (a torch view) into values."""

    def __init__(self, codec: RowCodec, out_dtype: torch.dtype | None, scale: float | None):
        self.codec = codec
        self.value_dtype = _torch_dtype(codec.value_dtype)
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


class _DiskTable(nn.Module):
    """A read-only EngramDB table decoded by its dtype hint (shared by the modules below)."""

    def __init__(
        self,
        store: RowTable,
        *,
        out_dtype: torch.dtype | None = None,
        scale: float | None = None,
        dim: int | None = None,
    ):
        super().__init__()
        self.store = store
        self.codec = codec_for(store.dtype, store.row_bytes, dim if dim is not None else store.dim)
        self._decode = _Decoder(self.codec, out_dtype, scale)
        self._setup()

    def _setup(self) -> None:
        """What a module adds once the table and codec are set (the constructor is shared)."""


class DiskEmbedding(_DiskTable):
    """``nn.Embedding`` whose weight is an EngramDB table (global row ids).

    ``forward(ids)`` returns ``[*ids.shape, dim]`` in the table's dtype (or ``out_dtype``).
    Cost: one batched gather into a fresh output tensor (raw dtypes: no further copy);
    scaled FP8 rows are staged in a reused per-thread buffer, then dequantised. Bad ids raise
    `RowIdOutOfRange` (an ``IndexError``, as ``nn.Embedding`` raises).
    """

    def _setup(self) -> None:
        self.num_embeddings = self.store.n_rows
        self.embedding_dim = self.codec.dim
        self._staging = threading.local()

    def _raw(self, n: int) -> torch.Tensor:
        if self._decode.is_view:  # the output aliases the fetched bytes: fresh each call
            return torch.empty((n, self.codec.row_bytes), dtype=torch.uint8)
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 256), self.codec.row_bytes), dtype=torch.uint8)
            self._staging.buf = buf
        return buf[:n]

    def forward(self, ids: Any) -> torch.Tensor:
        flat = _ids_to_numpy(ids)
        shape = tuple(flat.shape)
        flat = flat.reshape(-1)
        raw = self._raw(flat.size)
        with torch.no_grad():
            self.store.fetch_into(flat, raw.numpy())
            out = self._decode(raw)
        return out.reshape(*shape, self.codec.dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, table={self.store.name!r}, "
            f"hint={self.codec.hint!r}"
        )


class DiskMultiHeadEmbedding(_DiskTable):
    """Per-head lookup: int64 local ids ``[B, L, H]`` → ``[B, L, H, dim]``.

    Keeps an ``offsets`` buffer (the global id of each head's row 0) like the in-memory
    multi-head embeddings it replaces; reads with `Store.lookup_into` (one gather)."""

    offsets: torch.Tensor

    def _setup(self) -> None:
        self.register_buffer(
            "offsets", torch.from_numpy(self.store.head_offsets.copy()), persistent=False
        )

    def forward(self, local_ids: Any) -> torch.Tensor:
        ids = _ids_to_numpy(local_ids)
        if ids.dtype != np.int64:
            ids = ids.astype(np.int64)
        ids = np.ascontiguousarray(ids)
        raw = torch.empty(ids.shape + (self.codec.row_bytes,), dtype=torch.uint8)
        with torch.no_grad():
            self.store.lookup_into(ids, raw.numpy())
            out = self._decode(raw.view(-1, self.codec.row_bytes))
        return out.reshape(*ids.shape, self.codec.dim)


__all__ = ["DiskEmbedding", "DiskMultiHeadEmbedding"]
