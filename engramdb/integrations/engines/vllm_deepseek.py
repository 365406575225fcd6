"""vLLM DeepSeek V4.1 Engram tables (``--engram-config``) served from EngramDB.

vLLM builds one ``ParallelEngramEmbedding`` per Engram layer in ``Engram._create_embedding``
from ``vllm_config.engram_config`` (``vllm/config/engram.py``: ``cpu_offload``,
``dp_shared_memory``, ``use_thp``). Its ``_allocate_weights`` allocates the host table
(``[rows, dim]`` FP8 E4M3 + ``[rows, dim / 32]`` E8M0 scales, pinned, or DP-shared
``/dev/shm``, or huge pages) and ``lookup(indices, out)`` reads it with a Triton kernel.

`install_vllm_deepseek_v41` makes ``Engram._create_embedding`` build a
`DiskEngramEmbedding` instead: the engine's own class (a subclass, so its constructor,
head sharding, ``forward`` and every ``engram_config`` decision stay the engine's) whose

* ``_allocate_weights`` returns meta tensors of the engine's shapes and dtypes: no host
  table, no pinned / shared / huge-page memory is allocated;
* weight loader leaves the table alone (the checkpoint's ``engram.embed.weight`` /
  ``engram.embed.scale`` are EngramDB's rows; every other tensor loads as before);
* ``lookup(indices, out)`` reads this rank's heads from the EngramDB table of that layer
  (``engram_l{layer}``: 264 B rows, 256 FP8 values then 8 E8M0 scales, row = the global
  n-gram id, heads concatenated, the layout `EngramStore` and ``attach`` of the
  checkpoint's safetensors produce) and writes what the engine's kernel writes: packed
  ``uint8`` rows when ``out`` is ``uint8``, otherwise BF16 ``e4m3 * 2**(s - 127)``; ids
  outside this rank's shard, and padded heads, give zero rows. The host part is an eager
  break under vLLM's breakable CUDA-graph capture (``eager_break_during_capture``, as the
  engine's own prefetch is), so it runs on every replay, never captured;
* ``gather(indices, out)`` is the same into a caller-owned host (e.g. pinned) buffer, for an
  engine that stages the rows and copies them to the device itself.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, MissingDependency, ShapeMismatch
from engramdb.store import Store

__all__ = ["install_vllm_deepseek_v41", "engram_embedding_class"]

_FLOAT_HINTS = ("f32", "f16", "bf16", "float32", "float16", "bfloat16")
_classes: dict[int, Any] = {}
_HOOK = "_create_embedding"  # Engram builds its ParallelEngramEmbedding here


def _engram_module() -> Any:
    try:
        from vllm.models.deepseek_v41.common import engram
    except ImportError as e:
        raise MissingDependency(
            f"vLLM is not installed ({e}); install the extra: pip install 'engramdb[engines]'"
        ) from None
    return engram


def _no_load(param: Any, loaded_weight: Any, *args: Any) -> None:
    """The table is EngramDB's: the checkpoint's copy is not kept."""
    return None


def engram_embedding_class() -> Any:
    """`DiskEngramEmbedding`: a subclass of the installed vLLM's ``ParallelEngramEmbedding``."""
    E = _engram_module()
    base = E.ParallelEngramEmbedding
    cls = _classes.get(id(base))
    if cls is not None:
        return cls
    import torch
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    class DiskEngramEmbedding(base):  # type: ignore[misc, valid-type]
        """``ParallelEngramEmbedding`` whose rows live in an EngramDB table."""

        _weight_loader = staticmethod(_no_load)

        def __init__(self, store: Store, *args: Any, **kwargs: Any) -> None:
            object.__setattr__(self, "store", store)
            super().__init__(*args, **kwargs)
            width = self.dim + self.dim // self.block_size
            if store.row_bytes != width:
                raise ShapeMismatch(
                    f"table {store.name!r} rows are {store.row_bytes} B; the engine's Engram "
                    f"rows are {width} B ({self.dim} FP8 values + {self.dim // self.block_size}"
                    " E8M0 scales)"
                )
            if str(getattr(store, "dtype", "")).lower() in _FLOAT_HINTS:
                raise InvalidArgument(
                    f"table {store.name!r} holds {store.dtype} rows; the Engram table is FP8 "
                    "E4M3 values + E8M0 scales per row"
                )
            if store.n_rows < self.vocab_end_idx:
                raise ShapeMismatch(
                    f"table {store.name!r} has {store.n_rows} rows, this rank's heads read "
                    f"rows up to {self.vocab_end_idx}"
                )
            self._staging: Any = None

        def _allocate_weights(self) -> tuple[Any, Any]:
            rows, scale_dim = self.part_num_embeddings, self.dim // self.block_size
            return (
                torch.empty(rows, self.dim, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(rows, scale_dim, dtype=torch.uint8, device="meta"),
            )

        def _storage(self) -> tuple[Any, Any]:
            raise InvalidArgument(
                f"the Engram table is served by EngramDB ({self.store.name!r}): it has no "
                "device or UVA view; read rows with lookup() / gather()"
            )

        def collapse_huge_pages(self) -> None:
            return None

        # -- reads ----------------------------------------------------------------------
        def _packed_rows(self, indices: Any) -> Any:
            """This rank's rows for ``indices [T, heads]``: uint8 ``[T, local_heads, width]``
            on the host; rows the rank does not own are zero (the kernel's ``other=0``)."""
            heads = self.part_n_hash_cols
            ids = indices.detach().to("cpu", torch.int64)
            local = ids[:, self.head_start : self.head_start + heads]
            if local.shape[1] < heads:  # padded heads of the last shard
                local = torch.nn.functional.pad(local, (0, heads - local.shape[1]), value=-1)
            v = local.numpy().reshape(-1)
            owned = (v >= self.vocab_start_idx) & (v < self.vocab_end_idx)
            width = self.store.row_bytes
            raw = np.empty((v.size, width), dtype=np.uint8)
            all_owned = bool(owned.all())
            self.store.fetch_into(v if all_owned else np.where(owned, v, 0), raw)
            if not all_owned:
                raw[~owned] = 0
            return torch.from_numpy(raw).view(ids.shape[0], heads, width)

        def _decode(self, packed: Any) -> Any:
            """BF16 rows as the engine's kernel computes them: e4m3 -> fp32 times the E8M0
            byte shifted into the fp32 exponent field, rounded to BF16."""
            dim, block = self.dim, self.block_size
            values = packed[..., :dim].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
            scales = (packed[..., dim:].to(torch.int32) << 23).view(torch.float32)
            shape = values.shape
            values = values.view(*shape[:-1], dim // block, block) * scales.unsqueeze(-1)
            return values.view(shape).to(torch.bfloat16)

        def gather(self, indices: Any, out: Any) -> Any:
            """Rows for ``indices [T, heads]`` into the caller's host tensor ``out``: uint8
            ``[T, local_heads, width]`` (packed) or ``[T, local_heads, dim]`` (BF16)."""
            if indices.shape[0] == 0:
                return out
            packed = self._packed_rows(indices)
            rows = packed if out.dtype == torch.uint8 else self._decode(packed)
            if rows.numel() != out.numel():
                raise ShapeMismatch(
                    f"out has shape {tuple(out.shape)}, the rows are {tuple(rows.shape)}"
                )
            out.copy_(rows.view(out.shape))
            return out

        @eager_break_during_capture
        def lookup(self, indices: Any, out: Any, background: bool = False) -> None:
            """The engine's ``lookup``: this rank's heads into ``out`` (any device), packed
            uint8 or BF16. On CUDA the packed rows go through a reused pinned buffer and
            are dequantised on the device."""
            if indices.shape[0] * self.part_n_hash_cols == 0:
                return
            if out.device.type == "cpu":
                self.gather(indices, out)
                return
            packed = self._packed_rows(indices)
            staging = self._pinned(packed.numel())
            staging.copy_(packed.reshape(-1))
            dev = staging.view(packed.shape).to(out.device, non_blocking=True)
            self._staged_event = torch.cuda.Event()
            self._staged_event.record()
            rows = dev if out.dtype == torch.uint8 else self._decode(dev)
            out.copy_(rows.view(out.shape))

        def _pinned(self, n: int) -> Any:
            event = getattr(self, "_staged_event", None)
            if event is not None:
                event.synchronize()  # the previous copy out of the buffer has finished
            if self._staging is None or self._staging.numel() < n:
                self._staging = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            return self._staging[:n]

        def extra_repr(self) -> str:
            return f"{self.store.name!r}, heads {self.head_start}+{self.part_n_hash_cols}, disk"

    DiskEngramEmbedding.__module__ = __name__
    _classes[id(base)] = DiskEngramEmbedding
    return DiskEngramEmbedding


def _tables_for(tables: Any) -> Any:
    """A ``layer_id -> Store`` resolver for a dict, a `Database` or a database path."""
    if isinstance(tables, dict):
        if not tables:
            raise InvalidArgument("tables must map Engram layer ids to EngramDB Stores")
        for k, v in tables.items():
            if type(k) is not int:
                raise InvalidArgument(f"Engram layer ids are ints, got {k!r}")
            if not isinstance(v, Store):
                raise InvalidArgument(f"tables[{k!r}] must be an EngramDB Store")

        def from_dict(layer: int) -> Store:
            if layer not in tables:
                raise InvalidArgument(
                    f"no EngramDB table for Engram layer {layer} (have {sorted(tables)})"
                )
            store: Store = tables[layer]
            return store

        return from_dict
    if isinstance(tables, (str, os.PathLike)):
        from engramdb.database import open as open_database

        tables = open_database(tables)
    from engramdb.database import Database

    if not isinstance(tables, Database):
        raise InvalidArgument(
            "tables must be a dict layer -> Store, a Database or a database path, got "
            f"{type(tables).__name__}"
        )
    db = tables
    return lambda layer: db[f"engram_l{layer}"]


def install_vllm_deepseek_v41(tables: Any) -> Any:
    """Serve vLLM DeepSeek V4.1's Engram tables from EngramDB: ``tables`` maps each Engram
    layer id (``engram_layer_ids``, e.g. 1 and 14) to its Store, or is a `Database` (or
    path) holding ``engram_l{layer}`` tables. Call before vLLM builds the model; the
    ``--engram-config`` settings still apply (``cpu_offload`` keeps the engine's prefetch
    stream, and no table is allocated whatever they say). Returns an `Undo`."""
    E = _engram_module()
    resolve = _tables_for(tables)
    cls = engram_embedding_class()
    engram_cls = E.Engram
    original = engram_cls.__dict__[_HOOK]

    def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
        from vllm.config import get_current_vllm_config

        store = resolve(int(layout.layer_ids[layer_hash_index]))
        cfg = get_current_vllm_config().engram_config
        return cls(
            store,
            layout.num_embeddings[layer_hash_index],
            layout.head_dim,
            tuple(size for order in layout.primes[layer_hash_index] for size in order),
            cpu_offload=bool(cfg.cpu_offload) if cfg is not None else False,
            dp_shared_memory=bool(cfg.dp_shared_memory) if cfg is not None else False,
            use_thp=bool(cfg.use_thp) if cfg is not None else False,
        )

    setattr(engram_cls, _HOOK, _create_embedding)  # the engine's own construction point

    def restore() -> None:
        setattr(engram_cls, _HOOK, original)

    from engramdb.integrations.installers import Undo

    return Undo(restore, "vllm deepseek_v41 Engram._create_embedding")
