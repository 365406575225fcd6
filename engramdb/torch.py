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

from engramdb.errors import InvalidArgument, InvalidDtype, MissingDependency
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
    multi-head embeddings it replaces. A local table (`Store`) is read with its trusted
    small-gather path (one ``np.take`` from the mapping while resident, the read rule
    otherwise) after one bounds check; other tables with `RowTable.lookup_into`.

    **Pre-fetched rows** (``decoder=``, a `engramdb.decode.Decoder` over this table, and
    ``layer=`` when it serves several): when the ids equal the rows the decoder's last
    `Decoder.fill` wrote (the same step, ``[B, 1, H]``, or a prefill, ``[B, T, H]``), the
    output is a view of that fill buffer (no copy, no read); otherwise it falls back to a
    synchronous read. ``served_prefetched`` / ``served_read`` count the two. The view is valid
    until the next `fill` overwrites the buffer (the layer consumes it within the step).
    """

    offsets: torch.Tensor

    def __init__(
        self,
        store: RowTable | None = None,
        *,
        out_dtype: torch.dtype | None = None,
        scale: float | None = None,
        dim: int | None = None,
        decoder: Any = None,
        layer: int | None = None,
    ):
        self._slot = 0
        if decoder is not None:
            layers = list(decoder.layers)
            if layer is None:
                if len(layers) != 1:
                    raise InvalidArgument(f"the decoder serves layers {layers}: pass layer=")
                layer = layers[0]
            if layer not in layers:
                raise InvalidArgument(f"layer {layer!r} is not one of the decoder's {layers}")
            slot = layers.index(layer)
            if store is None:
                store = decoder.stores[slot]
            elif store is not decoder.stores[slot]:
                raise InvalidArgument("store= differs from the decoder's table of that layer")
            self._slot = slot
        if store is None:
            raise InvalidArgument("DiskMultiHeadEmbedding needs a store (or a decoder=)")
        super().__init__(store, out_dtype=out_dtype, scale=scale, dim=dim)
        self.decoder = decoder
        self.layer = layer
        self.register_buffer(
            "offsets", torch.from_numpy(self.store.head_offsets.copy()), persistent=False
        )
        self._offsets_np = store.head_offsets.copy()
        self._heads_u64 = np.asarray(store.heads, dtype=np.uint64)
        self._min_head = int(self._heads_u64.min()) if self._heads_u64.size else 0
        self._n_heads = store.n_heads
        self._rb = self.codec.row_bytes
        # The trusted small gather of a local table (duck-typed: any table offering it).
        small = getattr(store, "gather_small", None)
        self._small = small if callable(small) and store.n_heads == len(store.heads) else None
        self._view_cache: tuple[Any, torch.Tensor] | None = None
        self.served_prefetched = 0
        self.served_read = 0

    def _prefetched(self, ids: np.ndarray) -> torch.Tensor | None:
        """A view of the decoder's last fill if it holds exactly the rows of ``ids``."""
        dec = self.decoder
        want = dec.filled_rows[self._slot]
        out = dec.filled_out[self._slot]
        if want is None or out is None or want.size != ids.size:
            return None
        h = self._n_heads
        glob = ids.reshape(-1, h) + self._offsets_np
        if not np.array_equal(glob, want.reshape(-1, h)):
            return None
        cached = self._view_cache
        if cached is not None and cached[0] is out:
            view = cached[1]
        else:
            n_layers = len(dec.layers)
            raw = torch.from_numpy(out).view(-1, n_layers, h, self._rb)[:, self._slot]
            if not self._decode.is_view:  # decoding makes a new tensor (FP8, scaled rows)
                with torch.no_grad():
                    vals = self._decode(raw.reshape(-1, self._rb))
                return vals.view(*ids.shape, self.codec.dim)
            view = raw.view(self._decode.value_dtype)  # [N, H, dim]: strided, no copy
            self._view_cache = (out, view)
        return view.view(*ids.shape, self.codec.dim)

    def forward(self, local_ids: Any) -> torch.Tensor:
        if type(local_ids) is torch.Tensor and local_ids.dtype is torch.int64:
            t = local_ids if local_ids.device.type == "cpu" else local_ids.cpu()
            ids = t.numpy() if t.is_contiguous() else t.contiguous().numpy()
        else:
            ids = _ids_to_numpy(local_ids)
            if ids.dtype != np.int64:
                ids = ids.astype(np.int64)
            ids = np.ascontiguousarray(ids)
        if self.decoder is not None and ids.ndim >= 1 and ids.shape[-1] == self._n_heads:
            hit = self._prefetched(ids)
            if hit is not None:
                self.served_prefetched += 1
                return hit
            self.served_read += 1
        small = self._small
        h = self._n_heads
        if small is not None and ids.ndim == 3 and ids.shape[-1] == h:
            u = ids.view(np.uint64)  # negative ids become huge: one comparison checks both ends
            if u.max(initial=0) < self._min_head or (u < self._heads_u64).all():
                # Validated in one pass: straight to the table's trusted small gather (the
                # mapping while resident, the read rule otherwise), into the output's bytes.
                flat = np.add(ids, self._offsets_np).reshape(-1)
                raw_np = np.empty((*ids.shape, self._rb), dtype=np.uint8)
                small(flat, raw_np.reshape(-1, self._rb))
                raw = torch.from_numpy(raw_np)
                if self._decode.is_view:
                    return raw.view(self._decode.value_dtype)  # [B, L, H, dim], no copy
                with torch.no_grad():
                    return self._decode(raw.view(-1, self._rb)).view(*ids.shape, self.codec.dim)
        raw = torch.empty(ids.shape + (self._rb,), dtype=torch.uint8)
        self.store.lookup_into(ids, raw.numpy())
        with torch.no_grad():
            out = self._decode(raw.view(-1, self._rb))
        return out.view(*ids.shape, self.codec.dim)


def prefetched_multi_head_embedding(
    decoder: Any, layer: int | None = None, **options: Any
) -> DiskMultiHeadEmbedding:
    """The pre-fetched-rows hook: a `DiskMultiHeadEmbedding` over ``decoder``'s table of
    ``layer`` that serves the decoder's filled rows without a copy (see the class). Put it
    where the model calls its multi-head embedding, e.g. engram-peft's
    ``engram_layer.multi_head_embedding = prefetched_multi_head_embedding(dec, layer_id)``."""
    return DiskMultiHeadEmbedding(decoder=decoder, layer=layer, **options)


__all__ = ["DiskEmbedding", "DiskMultiHeadEmbedding", "prefetched_multi_head_embedding"]
