"""`ReleasedEngramStore`: the single-layer EngramStore API of the released Mooncake wheel
(``mooncake-transfer-engine`` 0.3.13.post1), on EngramDB.

That API holds one layer per object and float32 rows::

    cfg = EngramStoreConfig(); cfg.table_vocab_sizes = [17, 19]; cfg.embedding_dim = 8
    es = EngramStore(layer_id=3, config=cfg, store=client_or_database)
    es.populate([np.float32 [17, 8], np.float32 [19, 8]])
    rows = es.lookup([[[0, 1]]])          # -> float32 [B, L, H, D], a new array
    es.remove_from_store(force=True)      # -> heads removed

It is served by an `EngramStore` over one layer whose rows are the float32 values' bytes
(``row_bytes = 4 * embedding_dim``), so every backing works: an EngramDB database or path,
or a Mooncake client (the adapter registers the arrays it allocates for the read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, LayerNotReady, LookupShapeError, LookupTypeError
from engramdb.integrations.engramstore import EngramStore, EngramStoreConfig
from engramdb.integrations.engramstore_parts import layer_key
from engramdb.integrations.mooncake import MooncakeError, registered


def _embedding_dim(config: Any) -> int:
    dim = getattr(config, "embedding_dim", None)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
        raise InvalidArgument(f"config.embedding_dim must be a positive integer, got {dim!r}")
    return int(dim)


class ReleasedEngramStore:
    """One Engram layer behind the released wheel's ``EngramStore(layer_id, config, store)``.

    ``store=None`` is metadata only (``lookup`` / ``populate`` / ``remove_from_store``
    raise a ``RuntimeError``, as the wheel does)."""

    def __init__(self, layer_id: int, config: Any, store: Any = None):
        key = layer_key(layer_id)
        if key < 0:
            raise InvalidArgument(f"layer ids must be non-negative integers, got {layer_id!r}")
        sizes = list(getattr(config, "table_vocab_sizes", None) or [])
        self._dim = _embedding_dim(config)
        cfg = EngramStoreConfig(sizes, 4 * self._dim)
        self._layer_id = key
        self._inner = EngramStore({key: cfg}, store)
        self._has_store = store is not None

    # -- metadata ----------------------------------------------------------------------------
    def get_embedding_dim(self) -> int:
        return self._dim

    def get_num_heads(self) -> int:
        return self._inner.get_num_heads(self._layer_id)

    def get_table_vocab_sizes(self) -> list[int]:
        return self._inner.get_table_vocab_sizes(self._layer_id)

    def get_store_keys(self) -> list[str]:
        return self._inner.get_store_keys(self._layer_id)

    @property
    def engram_store(self) -> EngramStore:
        """The multi-layer `EngramStore` serving this layer (uint8 rows of 4·D bytes)."""
        return self._inner

    def _need_store(self, what: str) -> None:
        if not self._has_store:
            raise LayerNotReady(f"EngramStore {what} failed: constructed without a store")

    # -- writes ------------------------------------------------------------------------------
    def populate(self, embedding_buffers: list[np.ndarray]) -> None:
        """One C-contiguous float32 ``[N_h, D]`` array per head (a list, as the binding's
        ``list`` parameter); create-only."""
        if not isinstance(embedding_buffers, list):
            raise LookupTypeError(
                f"populate: expected a list of arrays, got {type(embedding_buffers).__name__}"
            )
        self._need_store("populate")
        raw = []
        for h, buf in enumerate(embedding_buffers):
            if not isinstance(buf, np.ndarray) or buf.dtype != np.float32:
                raise LookupTypeError(f"populate: head {h} must be a float32 numpy array")
            if not buf.flags.c_contiguous or buf.ndim != 2 or buf.shape[1] != self._dim:
                raise LookupShapeError(
                    f"populate: head {h} must be C-contiguous [N, {self._dim}], got {buf.shape}"
                )
            raw.append(buf.view(np.uint8))
        self._inner.populate(self._layer_id, raw)

    def remove_from_store(self, force: bool = False) -> int:
        """Remove the layer's tables; returns the heads removed (0 when none were there)."""
        if not self._has_store:
            raise MooncakeError("remove_from_store failed, rc=-600 (no store)", -600)
        return self._inner.remove_from_store(self._layer_id, force)

    # -- reads -------------------------------------------------------------------------------
    def lookup(self, row_ids: Any) -> np.ndarray:
        """Rows for ``row_ids`` ``[B, L, H]`` (nested lists or an integer array) as a new
        float32 ``[B, L, H, D]`` array. Empty input, a wrong head count or an out-of-range
        id raise (``ValueError`` / ``IndexError``, each also a ``RuntimeError``)."""
        self._need_store("lookup")
        if isinstance(row_ids, np.ndarray):
            if row_ids.dtype.kind not in "iu":
                raise LookupTypeError(f"row_ids must be integers, got dtype {row_ids.dtype}")
            ids = np.ascontiguousarray(row_ids, dtype=np.int64)
        elif isinstance(row_ids, Sequence) and not isinstance(row_ids, (str, bytes)):
            if len(row_ids) == 0:
                raise LookupShapeError("row_ids must not be empty")
            try:
                ids = np.asarray(row_ids, dtype=np.int64)
            except (TypeError, ValueError, OverflowError) as e:
                raise LookupTypeError(f"row_ids must be nested lists of integers: {e}") from None
        else:
            raise LookupTypeError(f"row_ids must be a list or array, got {type(row_ids).__name__}")
        if ids.size == 0:
            raise LookupShapeError("row_ids must not be empty")
        if ids.ndim != 3 or ids.shape[2] != self.get_num_heads():
            raise LookupShapeError(
                f"row_ids must be [B, L, {self.get_num_heads()}], got shape {ids.shape}"
            )
        out = np.empty(ids.shape + (4 * self._dim,), dtype=np.uint8)
        layers = self._inner.mooncake_layers
        if layers is None:
            self._inner.lookup_into(self._layer_id, ids, out)
        else:
            with registered(layers.client, out):
                self._inner.lookup_into(self._layer_id, ids, out)
        return out.view(np.float32)

    def __repr__(self) -> str:
        return f"<ReleasedEngramStore layer={self._layer_id} over {self._inner!r}>"


__all__ = ["ReleasedEngramStore"]
