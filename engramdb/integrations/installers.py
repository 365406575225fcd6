"""Class patches that put EngramDB tables into engines without editing the engines.

Each installer patches a class (or a module attribute) *before* the engine builds its
model and returns an `Undo` handle that restores exactly what was there.

* `install_vllm_ple` / `install_sglang_ple`: the model's per-layer embedding attribute
  (``embed_tokens_per_layer`` by default) becomes a `DiskEmbedding` at the moment the
  constructor assigns it, and ``load_weights`` skips that tensor, so the engine never
  materialises or loads the table in RAM.
* `install_disk_multi_head_embedding`: ``engram_peft.layer.MultiHeadEmbedding`` is replaced by
  a disk-backed class with the same constructor ``(primes, embedding_dim_per_head, sparse)``,
  the same ``offsets`` buffer and the same forward contract (int64 ``[B, L, H]`` local ids
  → ``[B, L, H, dim]``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any, cast

from engramdb.database import Database
from engramdb.errors import InvalidArgument, MissingDependency, ShapeMismatch, TableNotFound
from engramdb.store import Store


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


def _as_store(store: Any, table: str | None = None) -> Store:
    if isinstance(store, Store):
        return store
    if isinstance(store, (Database, str, os.PathLike)):
        db = store if isinstance(store, Database) else Database(store)
        if table is None:
            if len(db.tables) != 1:
                raise InvalidArgument(f"name the table: the database holds {db.tables}")
            table = db.tables[0]
        return db[table]
    raise InvalidArgument(f"expected a Store, Database or path, got {type(store).__name__}")


def _install_embedding_attr(
    model_cls: type,
    store: Any,
    attr_name: str,
    embedding_dim: int | None,
    engine: str,
    **disk_kwargs: Any,
) -> Undo:
    from engramdb.torch import DiskEmbedding  # needs the torch extra

    if not isinstance(model_cls, type):
        raise InvalidArgument(f"model_cls must be a class, got {type(model_cls).__name__}")
    table = _as_store(store)
    disk = DiskEmbedding(table, **disk_kwargs)
    if embedding_dim is not None and disk.embedding_dim != embedding_dim:
        raise ShapeMismatch(
            f"table {table.name!r} decodes to {disk.embedding_dim} values per row, the model "
            f"expects embedding_dim={embedding_dim}"
        )
    marker = f"_engramdb_{engine}_{attr_name}"
    if getattr(model_cls, marker, False):
        raise InvalidArgument(f"{model_cls.__name__}.{attr_name} is already patched for {engine}")

    had_setattr = "__setattr__" in model_cls.__dict__
    # the class's own or inherited instance __setattr__ (unbound: self, name, value)
    orig_setattr = cast(Callable[[Any, str, Any], None], model_cls.__setattr__)
    had_load = "load_weights" in model_cls.__dict__
    orig_load = getattr(model_cls, "load_weights", None)

    def patched_setattr(self: Any, name: str, value: Any) -> None:
        # Swap at assignment time: the engine's own module is dropped at once.
        if name == attr_name and value is not disk:
            old_dim = getattr(value, "embedding_dim", None)
            if isinstance(old_dim, int) and old_dim != disk.embedding_dim:
                raise ShapeMismatch(
                    f"{type(self).__name__}.{attr_name} has embedding_dim {old_dim}, table "
                    f"{table.name!r} decodes to {disk.embedding_dim}"
                )
            value = disk
        orig_setattr(self, name, value)

    model_cls.__setattr__ = patched_setattr  # type: ignore[method-assign,assignment]
    if orig_load is not None:

        @functools.wraps(orig_load)
        def load_weights(self: Any, weights: Iterable[tuple[str, Any]], *a: Any, **kw: Any) -> Any:
            # The table is served from disk: never copy its tensor into the model.
            kept = ((n, w) for n, w in weights if f"{attr_name}." not in f".{n}")
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
    **disk_kwargs: Any,
) -> Undo:
    """Serve a vLLM model's per-layer embedding (PLE) table from EngramDB.

    ``store``: a `Store`, or a `Database` / path holding one table. Patch before the engine
    constructs ``model_cls``; call the returned `Undo` to restore the class."""
    return _install_embedding_attr(
        model_cls, store, attr_name, embedding_dim, "vllm", **disk_kwargs
    )


def install_sglang_ple(
    model_cls: type,
    store: Any,
    attr_name: str = "embed_tokens_per_layer",
    embedding_dim: int | None = None,
    **disk_kwargs: Any,
) -> Undo:
    """Same contract as `install_vllm_ple`, for SGLang model classes."""
    return _install_embedding_attr(
        model_cls, store, attr_name, embedding_dim, "sglang", **disk_kwargs
    )


def install_disk_multi_head_embedding(
    db: Any, table: str | None = None, *, module: Any = None, **disk_kwargs: Any
) -> Undo:
    """Replace ``engram_peft.layer.MultiHeadEmbedding`` with a disk-backed class.

    ``db``: a `Database` or path. Each constructed embedding serves the table named
    ``table`` or, when omitted, the table whose heads equal the constructor's ``primes``
    (one table per Engram layer). Raises `TableNotFound` at construction when no table
    matches, `ShapeMismatch` when the row width is not ``embedding_dim_per_head``."""
    import torch
    from torch import nn

    from engramdb.torch import DiskMultiHeadEmbedding

    if module is None:
        try:
            import engram_peft.layer as module
        except ImportError as e:
            raise MissingDependency(
                "install_disk_multi_head_embedding needs engram-peft (pip install engram-peft)"
            ) from e
    database = db if isinstance(db, Database) else Database(db)
    original = module.MultiHeadEmbedding

    def pick(primes: list[int]) -> Store:
        if table is not None:
            return database[table]
        for name in database.tables:
            s = database[name]
            if s.heads.tolist() == [int(p) for p in primes]:
                return s
        raise TableNotFound(
            f"no table in {str(database.path)!r} has heads equal to the primes "
            f"{list(primes)[:4]}..."
        )

    class DiskBackedMultiHeadEmbedding(nn.Module):
        """Disk-backed stand-in for engram-peft's MultiHeadEmbedding."""

        offsets: torch.Tensor

        def __init__(
            self, primes: list[int], embedding_dim_per_head: int, sparse: bool = True, **kwargs: Any
        ):
            super().__init__(**kwargs)
            store = pick(primes)
            if store.heads.tolist() != [int(p) for p in primes]:
                raise ShapeMismatch(
                    f"table {store.name!r} heads {store.heads.tolist()[:4]}... "
                    "differ from the primes"
                )
            self.lookup = DiskMultiHeadEmbedding(store, **disk_kwargs)
            if self.lookup.codec.dim != embedding_dim_per_head:
                raise ShapeMismatch(
                    f"table {store.name!r} rows decode to {self.lookup.codec.dim} values, "
                    f"embedding_dim_per_head is {embedding_dim_per_head}"
                )
            self.sparse = sparse
            self.register_buffer("offsets", self.lookup.offsets.clone())

        def forward(self, hash_indices: torch.Tensor) -> torch.Tensor:
            return self.lookup(hash_indices)

    module.MultiHeadEmbedding = DiskBackedMultiHeadEmbedding

    def restore() -> None:
        module.MultiHeadEmbedding = original

    return Undo(restore, f"{module.__name__}.MultiHeadEmbedding")
