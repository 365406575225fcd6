"""`DiskPleEmbedding`: an engine's per-layer embedding (PLE) table served from EngramDB.

The published EngramDB API's vLLM module builds ``DiskPleEmbedding(store, num_embeddings,
embedding_dim, dtype, cache_size)`` in place of ``embed_tokens_per_layer``. Here it is an
``nn.Module`` with ``nn.Embedding``'s forward contract (global ids ``[...]`` → ``[..., dim]``)
whose rows are read from the table and reinterpreted as ``dtype`` (no copy beyond the
gather). Needs torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from engramdb.errors import InvalidArgument, InvalidDtype, ShapeMismatch
from engramdb.rowcodec import codec_for
from engramdb.table_api import RowTable

__all__ = ["DiskPleEmbedding"]


class DiskPleEmbedding(nn.Module):
    """Rows of ``store`` as ``[*ids.shape, embedding_dim]`` values of ``dtype``.

    ``dtype`` None takes the table's dtype hint (a raw ``u8`` table needs ``dtype``).
    ``num_embeddings`` (default: the table's rows) must not exceed the table. ``scale`` /
    ``out_dtype`` dequantise (``values.to(out_dtype or float32) * scale``). ``cache_size`` is
    accepted for the published signature; repeated rows are served by the page cache and
    the table's RAM tier (``ram_budget=`` at open)."""

    def __init__(
        self,
        store: RowTable,
        num_embeddings: int | None = None,
        embedding_dim: int | None = None,
        dtype: torch.dtype | None = None,
        cache_size: int | None = None,
        *,
        scale: float | None = None,
        out_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if dtype is None:
            codec = codec_for(store.dtype, store.row_bytes, embedding_dim)
            if codec.scaled or codec.value_dtype == "uint8":
                raise InvalidArgument(
                    f"table {store.name!r} has dtype hint {store.dtype!r}: pass dtype="
                )
            dtype = getattr(torch, codec.value_dtype)
        if not isinstance(dtype, torch.dtype):
            raise InvalidDtype(f"dtype must be a torch dtype, got {dtype!r}")
        size = torch.empty(0, dtype=dtype).element_size()
        dim = store.row_bytes // size if embedding_dim is None else int(embedding_dim)
        if dim * size != store.row_bytes:
            raise ShapeMismatch(
                f"table {store.name!r} rows are {store.row_bytes} B, embedding_dim={dim} of "
                f"{dtype} needs {dim * size} B"
            )
        n = store.n_rows if num_embeddings is None else int(num_embeddings)
        if n > store.n_rows:
            raise ShapeMismatch(f"num_embeddings={n} exceeds the table's {store.n_rows} rows")
        self.store = store
        self.num_embeddings = n
        self.embedding_dim = dim
        self.dtype = dtype
        self.cache_size = cache_size
        self.scale = scale
        self.out_dtype = out_dtype

    def forward(self, ids: Any) -> torch.Tensor:
        t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidDtype(f"ids must be integers, got {t.dtype}")
        flat = t.reshape(-1).to("cpu", torch.int64).numpy()
        if flat.size and int(flat.max()) >= self.num_embeddings:
            from engramdb.errors import RowIdOutOfRange

            raise RowIdOutOfRange(
                f"row id {int(flat.max())} is out of range [0, {self.num_embeddings})"
            )
        raw = torch.empty((flat.size, self.store.row_bytes), dtype=torch.uint8)
        self.store.fetch_into(flat, raw.numpy())
        vals = raw.view(self.dtype)
        if self.scale is not None or self.out_dtype is not None:
            vals = vals.to(self.out_dtype or torch.float32)
            if self.scale is not None:
                vals = vals * self.scale
        return vals.reshape(*t.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"
