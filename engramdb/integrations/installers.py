"""Class patches that put EngramDB tables into engines without editing the engines.

Each installer patches a class (or a module attribute) *before* the engine builds its
model and returns an `Undo` handle that restores exactly what was there.

* `install_vllm_ple` / `install_sglang_ple`: the model's per-layer embedding attribute
  (``embed_tokens_per_layer`` by default) becomes a `DiskEmbedding` at the moment the
  constructor assigns it, and ``load_weights`` skips that tensor, so the engine never
  materialises or loads the table in RAM.
* `install_disk_multi_head_embedding` / `install_real_qwen_ple_embedding`:
  ``engram_peft.layer.MultiHeadEmbedding`` is replaced by `DiskBackedMultiHeadEmbedding`
  (``engramdb.integrations.peft``): the same constructor ``(primes, embedding_dim_per_head,
  sparse)``, ``offsets`` buffer, ``embedding`` (an ``nn.Embedding`` over a copy-on-write
  mapping of the table) and forward contract (int64 ``[B, L, H]`` local ids → ``[B, L, H,
  dim]``). The signatures are the ones engram-peft 1.2.7 calls.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np

from engramdb.database import Database
from engramdb.errors import InvalidArgument, MissingDependency, ShapeMismatch, TableNotFound
from engramdb.table_api import RowTable


class Undo:
    """Restores what an installer patched. Call it (or use as a context manager); idempotent."""

    def __init__(self, restore: Callable[[], None], what: str):
        self._restore: Callable[[], None] | None = restore
        self.what = what

    @property
    def active(self) -> bool:
        return self._restore is not None

    def __call__(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    undo = __call__

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, *exc: object) -> None:
        self()

    def __repr__(self) -> str:
        return f"<Undo {self.what} {'active' if self.active else 'undone'}>"


def _as_store(store: Any, table: str | None = None) -> RowTable:
    if isinstance(store, RowTable):
        return store
    if isinstance(store, (Database, str, os.PathLike)):
        db = store if isinstance(store, Database) else Database(store)
        if table is None:
            if len(db.tables) != 1:
                raise InvalidArgument(f"name the table: the database holds {db.tables}")
            table = db.tables[0]
        return db[table]
    raise InvalidArgument(f"expected a Store, Database or path, got {type(store).__name__}")


def _module_scale(module: Any) -> Any:
    """The engine module's own output scale: SGLang's ``Gemma3TextScaledWordEmbedding`` (and
    Gemma 4's, the same class) multiplies its rows by ``embed_scale`` in ``forward``. None
    when the module has none (or it is 1)."""
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        return None
    if hasattr(scale, "numel"):  # a tensor or buffer
        if scale.numel() != 1:
            raise InvalidArgument(f"embed_scale of {type(module).__name__} is not a scalar")
        return scale.detach().clone()
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return None if float(scale) == 1.0 else scale
    raise InvalidArgument(f"embed_scale of {type(module).__name__} is {scale!r}, not a number")


class _ScaledRows:
    """Marker base: the disk table times the engine module's ``embed_scale``."""

    @staticmethod
    def make(disk: Any, scale: Any) -> Any:
        import torch

        class ScaledDiskEmbedding(torch.nn.Module, _ScaledRows):
            """``disk(ids) * embed_scale``: the engine module's forward, rows from disk."""

            def __init__(self) -> None:
                super().__init__()
                self.disk = disk
                self.embed_scale = scale
                self.embedding_dim = disk.embedding_dim

            def forward(self, ids: Any) -> Any:
                return self.disk(ids) * self.embed_scale

        return ScaledDiskEmbedding()


def _install_embedding_attr(
    model_cls: type,
    store: Any,
    attr_name: str,
    embedding_dim: int | None,
    engine: str,
    dtype: Any = None,
    cache_size: int | None = None,
    **disk_kwargs: Any,
) -> Undo:
    if not isinstance(model_cls, type):
        raise InvalidArgument(f"model_cls must be a class, got {type(model_cls).__name__}")
    table = _as_store(store)
    disk: Any
    if dtype is not None or cache_size is not None:  # the published signature
        from engramdb.integrations.ple import DiskPleEmbedding

        disk = DiskPleEmbedding(table, None, embedding_dim, dtype, cache_size, **disk_kwargs)
    else:
        from engramdb.torch import DiskEmbedding  # needs the torch extra

        disk = DiskEmbedding(table, **disk_kwargs)
    if embedding_dim is not None and disk.embedding_dim != embedding_dim:
        raise ShapeMismatch(
            f"table {table.name!r} decodes to {disk.embedding_dim} values per row, the model "
            f"expects embedding_dim={embedding_dim}"
        )
    marker = f"_engramdb_{engine}_{attr_name}"
    if getattr(model_cls, marker, False):
        raise InvalidArgument(f"{model_cls.__name__}.{attr_name} is already patched for {engine}")

    # exactly [prefix.]attr.weight: companions (attr.weight_scale, x_attr.weight) still load
    table_weight = re.compile(rf"(^|\.){re.escape(attr_name)}\.weight$")
    had_setattr = "__setattr__" in model_cls.__dict__
    # the class's own or inherited instance __setattr__ (unbound: self, name, value)
    orig_setattr = cast(Callable[[Any, str, Any], None], model_cls.__setattr__)
    had_load = "load_weights" in model_cls.__dict__
    orig_load = getattr(model_cls, "load_weights", None)

    def patched_setattr(self: Any, name: str, value: Any) -> None:
        # Swap at assignment time: the engine's own module is dropped at once.
        if name == attr_name and value is not disk and not isinstance(value, _ScaledRows):
            old_dim = getattr(value, "embedding_dim", None)
            if isinstance(old_dim, int) and old_dim != disk.embedding_dim:
                raise ShapeMismatch(
                    f"{type(self).__name__}.{attr_name} has embedding_dim {old_dim}, table "
                    f"{table.name!r} decodes to {disk.embedding_dim}"
                )
            scale = _module_scale(value)
            value = disk if scale is None else _ScaledRows.make(disk, scale)
        orig_setattr(self, name, value)

    model_cls.__setattr__ = patched_setattr  # type: ignore[method-assign,assignment]
    if orig_load is not None:

        @functools.wraps(orig_load)
        def load_weights(self: Any, weights: Iterable[tuple[str, Any]], *a: Any, **kw: Any) -> Any:
            # The table is served from disk: never copy its tensor into the model.
            kept = ((n, w) for n, w in weights if not table_weight.search(n))
            return orig_load(self, kept, *a, **kw)

        model_cls.load_weights = load_weights  # type: ignore[attr-defined]
    setattr(model_cls, marker, True)

    def restore() -> None:
        if had_setattr:
            model_cls.__setattr__ = orig_setattr  # type: ignore[method-assign,assignment]
        else:
            del model_cls.__setattr__
        if orig_load is not None:
            if had_load:
                model_cls.load_weights = orig_load  # type: ignore[attr-defined]
            else:
                del model_cls.load_weights  # type: ignore[attr-defined]
        delattr(model_cls, marker)

    return Undo(restore, f"{engine}:{model_cls.__name__}.{attr_name}")


def install_vllm_ple(
    model_cls: type,
    store: Any,
    attr_name: str = "embed_tokens_per_layer",
    embedding_dim: int | None = None,
    dtype: Any = None,
    cache_size: int | None = None,
    **disk_kwargs: Any,
) -> Undo:
    """Serve a vLLM model's per-layer embedding (PLE) table from EngramDB.

    ``store``: a table handle (`Store`, raw row shards, any `RowTable`), or a `Database` /
    path holding one table. Patch before the engine constructs ``model_cls``; call the
    returned `Undo` to restore the class. ``dtype`` / ``cache_size`` (the published
    signature) serve a `DiskPleEmbedding` whose rows are read as ``dtype``; without them a
    ``DiskEmbedding`` decodes rows by the table's dtype hint."""
    return _install_embedding_attr(
        model_cls, store, attr_name, embedding_dim, "vllm", dtype, cache_size, **disk_kwargs
    )


def install_sglang_ple(
    model_cls: type,
    store: Any,
    attr_name: str = "embed_tokens_per_layer",
    embedding_dim: int | None = None,
    dtype: Any = None,
    cache_size: int | None = None,
    **disk_kwargs: Any,
) -> Undo:
    """Same contract as `install_vllm_ple`, for SGLang model classes."""
    return _install_embedding_attr(
        model_cls, store, attr_name, embedding_dim, "sglang", dtype, cache_size, **disk_kwargs
    )


def _engram_peft_layer(module: Any) -> Any:
    if module is not None:
        return module
    if "engram_peft" not in sys.modules:
        # engram-peft imports transformers' trainer, which imports torchvision: with a
        # torchvision built for another torch it fails; mark such extensions absent first
        from engramdb.integrations.engines._env import hide_broken_torch_extensions

        hide_broken_torch_extensions()
    try:
        import engram_peft.layer as layer
    except ImportError as e:
        raise MissingDependency(
            "install_disk_multi_head_embedding needs engram-peft (pip install engram-peft)"
        ) from e
    return layer


def install_disk_multi_head_embedding(
    store: Any,
    table: str | None = None,
    *,
    cache_size: int | None = None,
    dtype: Any = None,
    scale: float | None = None,
    output_dtype: Any = None,
    save_table: bool = False,
    module: Any = None,
) -> Undo:
    """Replace ``engram_peft.layer.MultiHeadEmbedding`` with `DiskBackedMultiHeadEmbedding`
    (``engramdb.integrations.peft``), the call engram-peft 1.2.7 makes for
    ``EngramConfig(table_source="engramdb:store")``.

    ``store``: a table handle (a `Store`, raw row shards ``engramdb.Store(path, shards,
    rows_per_shard, width)``, any `RowTable`): every Engram layer reads rows ``[0,
    sum(primes))`` of it, as engram-peft expects. Or a `Database` / database path: each layer
    serves the table named ``table`` or, when omitted, the table whose heads equal its
    ``primes`` (`TableNotFound` when none does). ``dtype`` (torch dtype of the stored values;
    None: the table's dtype hint), ``scale`` (1.0 or None: none) and ``output_dtype``
    dequantise; ``cache_size`` is accepted and unused (the page cache and the table's RAM
    tier cache rows); ``save_table=True`` puts the table bytes in ``state_dict()`` (default:
    only when written). Installing again stacks (the `Undo` restores the class that was
    there); engram-peft ignores the handle and never uninstalls."""
    from engramdb.integrations.peft import DiskBackedMultiHeadEmbedding

    layer = _engram_peft_layer(module)
    handle: RowTable | None = store if isinstance(store, RowTable) else None
    database = None
    if handle is None:
        if not isinstance(store, (Database, str, os.PathLike)):
            raise InvalidArgument(
                f"expected a table handle, Database or path, got {type(store).__name__}"
            )
        database = store if isinstance(store, Database) else Database(store)
    options: dict[str, Any] = {
        "dtype": dtype,
        "scale": scale,
        "output_dtype": output_dtype,
        "cache_size": cache_size,
        "save_table": save_table,
    }

    def pick(primes: list[int]) -> RowTable:
        want = [int(p) for p in primes]
        if handle is not None:
            if handle.n_heads > 1 and handle.heads.tolist() != want:
                raise ShapeMismatch(
                    f"table {handle.name!r} heads {handle.heads.tolist()[:4]}... differ from "
                    f"the primes {want[:4]}..."
                )
            return handle
        assert database is not None
        if table is not None:
            s = database[table]
            if s.heads.tolist() != want:
                raise ShapeMismatch(
                    f"table {s.name!r} heads {s.heads.tolist()[:4]}... differ from the primes"
                )
            return s
        for name in database.tables:
            s = database[name]
            if s.heads.tolist() == want:
                return s
        raise TableNotFound(
            f"no table in {str(database.path)!r} has heads equal to the primes {want[:4]}..."
        )

    original = layer.MultiHeadEmbedding

    class DiskMultiHeadEmbeddingForPeft(DiskBackedMultiHeadEmbedding):
        def __init__(
            self, primes: list[int], embedding_dim_per_head: int, sparse: bool = True, **kw: Any
        ):
            super().__init__(
                primes, embedding_dim_per_head, sparse, store=pick(primes), **options, **kw
            )

    DiskMultiHeadEmbeddingForPeft.__name__ = "DiskBackedMultiHeadEmbedding"
    DiskMultiHeadEmbeddingForPeft.__qualname__ = "DiskBackedMultiHeadEmbedding"
    layer.MultiHeadEmbedding = DiskMultiHeadEmbeddingForPeft

    def restore() -> None:
        layer.MultiHeadEmbedding = original

    return Undo(restore, f"{layer.__name__}.MultiHeadEmbedding")


#: The published default of the FP8 Qwen PLE table's weight scale is not assumed here: pass
#: ``scale=`` or ``model_dir=`` (read from the checkpoint).
_PLE_SCALE_SUFFIX = "embed_tokens_per_layer.weight_scale"


def load_ple_weight_scale(model_dir: str | os.PathLike[str]) -> float:
    """The FP8 weight scale of a Qwen checkpoint's per-layer embedding: the one-element tensor
    named ``*embed_tokens_per_layer.weight_scale`` in ``model_dir``'s ``*.safetensors``.
    Raises `InvalidArgument` when no file holds it."""
    from safetensors import safe_open

    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for key in st.keys():
                if key.endswith(_PLE_SCALE_SUFFIX):
                    value = np.asarray(st.get_tensor(key), dtype=np.float64).reshape(-1)
                    if value.size != 1:
                        raise InvalidArgument(
                            f"{key} in {f.name} has {value.size} values, expected one scale"
                        )
                    return float(value[0])
    raise InvalidArgument(
        f"no tensor ending in {_PLE_SCALE_SUFFIX!r} in the {len(files)} safetensors files of "
        f"{str(root)!r}"
    )


def install_real_qwen_ple_embedding(
    store: Any,
    scale: float | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    cache_size: int | None = None,
    *,
    module: Any = None,
) -> Undo:
    """`install_disk_multi_head_embedding` for the real Qwen PLE table: FP8 E4M3 rows,
    dequantised to float32 times ``scale`` (or the scale read from ``model_dir``'s
    checkpoint, `load_ple_weight_scale`). One of the two is required (`InvalidArgument`)."""
    import torch

    if scale is None:
        if model_dir is None:
            raise InvalidArgument("install_real_qwen_ple_embedding needs scale= or model_dir=")
        scale = load_ple_weight_scale(model_dir)
    return install_disk_multi_head_embedding(
        store,
        cache_size=cache_size,
        dtype=torch.float8_e4m3fn,
        scale=float(scale),
        output_dtype=torch.float32,
        module=module,
    )
