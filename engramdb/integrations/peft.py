"""engram-peft's ``MultiHeadEmbedding``, served from an EngramDB table (needs torch).

`DiskBackedMultiHeadEmbedding` has engram-peft's constructor ``(primes,
embedding_dim_per_head, sparse=True)``, its persistent ``offsets`` buffer (the exclusive prefix
sums of ``primes``) and its forward contract (int64 *local* ids ``[B, L, H]`` → ``[B, L, H,
dim]``). Layer ``i`` of a model reads rows ``[0, sum(primes))`` of its table, as engram-peft's
EngramDB path expects.

Two modes, chosen at construction:

* **embedding** (float rows, no scale, and the rows ``[0, sum(primes))`` map as one range of
  the table's files: a built table, or raw shards that are page multiples, one shard, or
  whose first shard holds those rows):
  ``.embedding`` is a real ``nn.Embedding`` (``sparse`` as asked) whose ``weight`` is a
  copy-on-write private mapping of the table's files, never a RAM copy. Forward, sparse
  gradients and the ``SparseAdam`` optimizer group of engram-peft work as with the in-memory
  table. Writes (``add_``, an optimizer step, ``load_state_dict``) go to private pages of this
  process; the files never change. ``.float()`` / ``.to(dtype)`` do not convert the mapped
  weight (that would copy the table): the output is cast in forward instead.
* **lookup** (FP8 or scaled rows, or a table that cannot be mapped as one range): forward
  reads through the table handle (``fetch_into``) and dequantises (``* scale`` in
  ``output_dtype``). There is no ``nn.Embedding``: reading ``.embedding`` raises
  ``NotImplementedError`` naming the feature (sparse gradients, optimizer grouping, weight
  transfer need an f32/f16/bf16 table).

State dict: ``offsets`` always; ``embedding.weight`` only when asked (``save_table=True``) or
when the weight was written in this process (then the table's source no longer describes
it). Otherwise the table's source reference is what engram-peft already persists in its
``config.json`` (``table_store_path`` and the ``table_*`` fields); ``table_source`` on the
module names it. Loading accepts a state dict with or without ``embedding.weight``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from engramdb.errors import InvalidArgument, ShapeMismatch
from engramdb.io.mapping import LIBC
from engramdb.layouts.geometry import PAGE
from engramdb.table_api import RowTable

__all__ = ["DiskBackedMultiHeadEmbedding", "TableEmbedding", "cow_rows", "serve_from_decoder"]

_MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x02, 0x10, 0x20, 0x4000
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_FAILED = ctypes.c_void_p(-1).value
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


class _Region:
    """A private (copy-on-write) mapping of several files laid end to end; unmapped when the
    last array over it goes away."""

    def __init__(self, paths: list[Path], sizes: list[int]):
        spans = [-(-s // PAGE) * PAGE for s in sizes]
        self.length = max(PAGE, sum(spans))
        base = LIBC.mmap(None, self.length, 0, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0)
        if base in (None, _FAILED):
            raise OSError(ctypes.get_errno(), "cannot reserve address space for the table")
        self.base: int | None = int(base)
        pos = self.base
        try:
            for path, span in zip(paths, spans):
                fd = os.open(path, os.O_RDONLY)
                try:
                    got = LIBC.mmap(pos, span, _PROT_RW, _MAP_PRIVATE | _MAP_FIXED, fd, 0)
                finally:
                    os.close(fd)
                if got in (None, _FAILED) or got != pos:
                    raise OSError(ctypes.get_errno(), f"cannot map {str(path)!r}")
                pos += span
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.base is not None:
            LIBC.munmap(self.base, self.length)
            self.base = None

    def __del__(self) -> None:
        self.close()


def _files_in_row_order(info: Any, root: Path) -> list[tuple[Path, int]]:
    """``(path, bytes)`` of the files holding the rows in row order, each file's rows from
    its byte 0 (a built table's shards; an attached table of one column whose runs are whole
    files at offset 0, e.g. raw row shards); ``[]`` when the rows are not laid out so."""
    att = info.attached
    if att is None:
        return [(root / sh.path, int(sh.bytes)) for sh in info.shards]
    if len(att.columns) != 1:
        return []
    col = att.columns[0]
    out = []
    for r in col.runs:
        f = att.files[r.file]
        if r.offset != 0 or r.rows * col.width != f.size:
            return []
        out.append((Path(f.path), int(f.size)))
    return out


def cow_rows(store: RowTable, n_rows: int) -> np.ndarray | None:
    """Rows ``[0, n_rows)`` of ``store`` as a writable copy-on-write ``[n_rows, row_bytes]``
    uint8 array over its files (no RAM copy; writes stay private to this process), or None
    when the handle has no local files or the rows do not map as one range."""
    info = getattr(store, "info", None)
    root = getattr(store, "db_path", None)
    if info is None or root is None or n_rows <= 0:
        return None
    nbytes = n_rows * store.row_bytes
    paths: list[Path] = []
    sizes: list[int] = []
    covered = 0
    for path, size in _files_in_row_order(info, Path(root)):
        if covered >= nbytes:
            break
        if covered % PAGE:
            return None  # the previous file was not a page multiple
        paths.append(path)
        sizes.append(size)
        covered += size
    if covered < nbytes:
        return None
    if len(paths) == 1:  # one file: Python's mmap owns the lifetime
        fd = os.open(paths[0], os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, sizes[0], flags=mmap.MAP_PRIVATE, prot=_PROT_RW)
        finally:
            os.close(fd)
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes).reshape(n_rows, store.row_bytes)
    region = _Region(paths, sizes)
    assert region.base is not None
    buf = (ctypes.c_uint8 * nbytes).from_address(region.base)
    buf.engramdb_region = region  # type: ignore[attr-defined]  # keeps the mapping alive
    return np.frombuffer(memoryview(buf), dtype=np.uint8).reshape(n_rows, store.row_bytes)


class TableEmbedding(nn.Embedding):
    """``nn.Embedding`` over a mapped table: leaves ``weight`` out of the state dict unless
    ``save_table`` is set or the weight was written; loads with or without it."""

    def __init__(self, weight: torch.Tensor, *, sparse: bool, save_table: bool):
        super().__init__(weight.shape[0], weight.shape[1], sparse=sparse, _weight=weight)
        self.save_table = save_table
        self.cast_to: torch.dtype | None = None
        self._clean_version = self.weight._version  # noqa: SLF001  (torch's write counter)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        w = cast(nn.Parameter, self.weight)
        probe = fn(torch.empty(1, dtype=w.dtype, device=w.device))
        if probe.device != w.device:  # moving to an accelerator copies, as asked
            return super()._apply(fn, recurse)
        # Converting the mapped weight would copy the table: keep it, cast outputs instead.
        del self._parameters["weight"]
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = w
        self.cast_to = None if probe.dtype == w.dtype else probe.dtype
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        return out if self.cast_to is None else out.to(self.cast_to)

    @property
    def written(self) -> bool:
        """Whether the weight was written in place in this process (private pages)."""
        return bool(self.weight._version != self._clean_version)  # noqa: SLF001

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        if self.save_table or self.written:
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        key = prefix + "weight"
        if key in missing_keys:  # saved by reference: the table is the weight
            missing_keys.remove(key)


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class DiskBackedMultiHeadEmbedding(nn.Module):
    """engram-peft's ``MultiHeadEmbedding`` over an EngramDB table (see the module doc).

    ``store``: any `RowTable` (a `Store`, raw row shards, a remote table) with at least
    ``sum(primes)`` rows of ``embedding_dim_per_head`` values of ``dtype``. ``dtype`` None
    takes the table's dtype hint (raw ``u8`` tables: float32). ``scale`` (1.0: none) and
    ``output_dtype`` dequantise. ``cache_size`` is accepted for the published API; rows are
    cached by the page cache and the table's RAM tier (``ram_budget=`` at open), not per
    module."""

    offsets: torch.Tensor

    def __init__(
        self,
        primes: list[int],
        embedding_dim_per_head: int,
        sparse: bool = True,
        *,
        store: RowTable,
        dtype: torch.dtype | None = None,
        scale: float | None = None,
        output_dtype: torch.dtype | None = None,
        cache_size: int | None = None,
        save_table: bool = False,
        source: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            sparse = False  # as engram-peft: no sparse gradients under DDP
        heads = [int(p) for p in primes]
        if not heads or min(heads) <= 0:
            raise InvalidArgument(f"primes must be positive row counts, got {list(primes)[:4]}")
        n = sum(heads)
        dim = int(embedding_dim_per_head)
        if dtype is None:
            hint = (store.dtype or "u8").lower()
            dtype = torch.float32 if hint in ("u8", "uint8") else None
            if dtype is None:
                from engramdb.rowcodec import codec_for

                dtype = getattr(torch, codec_for(hint, store.row_bytes).value_dtype)
        assert dtype is not None
        if dim * _nbytes(dtype) != store.row_bytes:
            raise ShapeMismatch(
                f"table {store.name!r} rows are {store.row_bytes} B, {dim} values of {dtype} "
                f"need {dim * _nbytes(dtype)} B"
            )
        if store.n_rows < n:
            raise ShapeMismatch(
                f"table {store.name!r} has {store.n_rows} rows, the primes need {n}"
            )
        self.store = store
        self.primes = heads
        self.embedding_dim_per_head = dim
        self.sparse = sparse
        self.value_dtype = dtype
        self.scale = None if scale is None or float(scale) == 1.0 else float(scale)
        self.output_dtype = output_dtype
        self.cache_size = cache_size
        self.table_source = source or str(getattr(store, "db_path", store.name))
        offs = np.zeros(len(heads), dtype=np.int64)
        np.cumsum(heads[:-1], out=offs[1:])
        self.register_buffer("offsets", torch.from_numpy(offs))
        self._cast: torch.dtype | None = None
        rows = None
        if dtype in _FLOAT and self.scale is None and output_dtype in (None, dtype):
            rows = cow_rows(store, n)
        self.mode = "lookup" if rows is None else "embedding"
        if rows is not None:
            weight = torch.from_numpy(rows.view(np.uint8)).view(dtype)
            self.embedding = TableEmbedding(weight, sparse=sparse, save_table=save_table)

    def __getattr__(self, name: str) -> Any:
        if name == "embedding" and self.__dict__.get("mode") == "lookup":
            raise NotImplementedError(
                "DiskBackedMultiHeadEmbedding.embedding (sparse gradients, optimizer grouping, "
                "weight transfer) needs float32/float16/bfloat16 rows without a scale that map "
                "as one range; this table is read through lookups only"
            )
        return super().__getattr__(name)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        super()._apply(fn, recurse)  # the mapped weight takes care of itself (TableEmbedding)
        if self.mode == "lookup":
            out_dtype = self._lookup_dtype()
            probe = fn(torch.empty(1, dtype=out_dtype))
            self._cast = None if probe.dtype == out_dtype else probe.dtype
        return self

    def _lookup_dtype(self) -> torch.dtype:
        if self.scale is not None or self.output_dtype is not None:
            return self.output_dtype or torch.float32
        return self.value_dtype

    def forward(self, hash_indices: torch.Tensor) -> torch.Tensor:
        ids = hash_indices.to(self.offsets.device) + self.offsets
        if self.mode == "embedding":
            return self.embedding(ids)  # type: ignore[no-any-return]
        flat = ids.reshape(-1).cpu().numpy()
        raw = torch.empty((flat.size, self.store.row_bytes), dtype=torch.uint8)
        self.store.fetch_into(flat, raw.numpy())
        vals = raw.view(self.value_dtype)
        if self.scale is not None or self.output_dtype is not None:
            vals = vals.to(self._lookup_dtype())
            if self.scale is not None:
                vals = vals * self.scale
        if self._cast is not None:
            vals = vals.to(self._cast)
        return vals.reshape(*hash_indices.shape, self.embedding_dim_per_head)

    def extra_repr(self) -> str:
        return (
            f"heads={len(self.primes)}, rows={sum(self.primes)}, "
            f"dim={self.embedding_dim_per_head}, mode={self.mode}, source={self.table_source!r}"
        )


def serve_from_decoder(model: nn.Module, decoder: Any, *, layers: Any = None) -> Any:
    """Serve an engram-peft model's ``EngramLayer`` tables from ``decoder``'s filled rows.

    Every ``EngramLayer`` of ``model`` (any module with ``layer_id`` and a
    ``multi_head_embedding``) whose ``layer_id`` is one of the decoder's layers (or of
    ``layers``) gets the pre-fetched-rows hook, `engramdb.torch.DiskMultiHeadEmbedding`
    ``(decoder=decoder, layer=layer_id)``, in place of its ``multi_head_embedding``: when the
    layer's local ids ``[B, L, H]`` equal the rows the decoder's last ``fill`` wrote for that
    layer (every id compared), the output is a view of the fill buffer (no copy, no read);
    any other ids are read synchronously from the decoder's table of that layer. Outputs are
    bit-identical to the in-memory table the EngramDB table was built from.

    The decoder's table must have the layer's heads (the primes its ``offsets`` buffer was
    built from): checked here, `ShapeMismatch` otherwise. Returns an `Undo` that puts the
    original modules back. Per step: ``decoder.push(tokens)`` right after sampling, then
    ``decoder.fill(buf, layer=lay)`` before layer ``lay`` runs (or one ``fill(buf)``)."""
    from engramdb.integrations.installers import Undo
    from engramdb.torch import DiskMultiHeadEmbedding

    wanted = set(decoder.layers if layers is None else (int(x) for x in layers))
    missing = wanted - set(decoder.layers)
    if missing:
        raise InvalidArgument(f"layers {sorted(missing)} are not the decoder's {decoder.layers}")
    swapped: list[tuple[nn.Module, nn.Module]] = []
    for mod in model.modules():
        lay = getattr(mod, "layer_id", None)
        old = getattr(mod, "multi_head_embedding", None)
        if lay is None or old is None or int(lay) not in wanted:
            continue
        hook = DiskMultiHeadEmbedding(decoder=decoder, layer=int(lay))
        offs = getattr(old, "offsets", None)
        if isinstance(offs, torch.Tensor) and offs.device.type != "meta":
            theirs = offs.detach().cpu().numpy().astype(np.int64)
            ours = hook.store.head_offsets
            if theirs.shape != ours.shape or not np.array_equal(theirs, ours):
                raise ShapeMismatch(
                    f"layer {lay}: the model's head offsets {theirs.tolist()[:4]}... differ "
                    f"from table {hook.store.name!r}'s {ours.tolist()[:4]}..."
                )
        mod.multi_head_embedding = hook
        swapped.append((mod, old))
    if not swapped:
        raise InvalidArgument(f"no EngramLayer with layer_id in {sorted(wanted)} in the model")

    def restore() -> None:
        for mod, old in swapped:
            mod.multi_head_embedding = old

    return Undo(restore, f"engram-peft layers {sorted(wanted)} served from a Decoder")
