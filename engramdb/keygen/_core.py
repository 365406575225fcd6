"""The shared hashed-n-gram machinery: per-layer constants, the vectorised kernel, the base class.

Row ids of one layer (see ``docs/keygen.md``)::

    mix_n      = XOR_{k<n} ( tok[t-k] * m[k] )           # int64, wrapping
    local[col] = floor_mod(mix_n, P[col])                 # col = (n-2)*H + j
    row[col]   = local[col] + OFF[col]

where ``tok[t-k]`` is the id ``k`` positions back, or the fill id (pad / EOS) once the look-back
is blocked (sequence start, a dead token, an EOS). The kinds differ only in how ids are
encoded (tokenizer compression, vocabulary checks) and where blocking happens; this module
implements everything else once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, ShapeMismatch, TokenIdOutOfRange
from engramdb.keygen._arith import INT64_MAX, wrap_int64
from engramdb.keygen._tables import (
    LayerTables,
    RowMode,
    as_mask,
    as_token_array,
    check_range,
    prepare_out,
    to_int64,
)
from engramdb.keygen.native import kernel_stats, native_fits, native_rows
from engramdb.keygen.stream import History, KeyStream, Step

# Re-exported for the kinds and older imports; they live in `engramdb.keygen._tables`.
__all__ = [
    "BLOCK_TOKENS",
    "Hasher",
    "LayerTables",
    "as_mask",
    "as_token_array",
    "check_range",
    "contexts_ext",
    "hash_ext",
    "hash_keys_into",
    "kernel_stats",
    "prepare_out",
    "to_int64",
]

# Positions hashed per kernel block. Measured on a 2-core EPYC: 8192 keeps the [columns, block]
# scratch (24 x 8192 x 8 B = 1.5 MiB) near L2 while the ~80 ufunc calls per block cost < 10 ns
# per token; 2048 doubles that overhead, 65536 spills the scratch to L3 and is ~25 % slower.
BLOCK_TOKENS = 8192


# --- the vectorised kernel ------------------------------------------------------------------
class _Scratch:
    """Reusable per-call buffers, sized for one block."""

    def __init__(self, n_heads: int, block: int) -> None:
        self.acc = np.empty(block, dtype=np.int64)
        self.tmp = np.empty(block, dtype=np.int64)
        self.quot = np.empty(block, dtype=np.int64)
        self.buf = np.empty((n_heads, block), dtype=np.int64)


def _block_contexts(
    ext: np.ndarray,
    ext_bar: np.ndarray,
    dead: np.ndarray | None,
    t0: int,
    t1: int,
    max_ngram: int,
    fill: int,
) -> list[np.ndarray]:
    """The fill-resolved look-back ids ``tok_k`` (k = 0..N-1) of positions ``[t0, t1)``.

    ``ext`` holds N-1 history columns then the chunk; ``ext_bar[q]`` says position q blocks
    every look-back reaching it or anything older (sticky). Returns views when nothing in the
    block is blocked, which is the common case inside a document.
    """
    h = max_ngram - 1
    toks = [ext[:, t0 + h - k : t1 + h - k] for k in range(max_ngram)]
    dead_blk = None if dead is None else dead[:, t0:t1]
    has_dead = dead_blk is not None and bool(dead_blk.any())
    if not has_dead and (h == 0 or not ext_bar[:, t0 : t1 + h - 1].any()):
        return toks
    blocked = (
        dead_blk.copy() if has_dead and dead_blk is not None else np.zeros(toks[0].shape, bool)
    )
    if has_dead:
        toks[0] = np.where(blocked, fill, toks[0])
    for k in range(1, max_ngram):
        blocked |= ext_bar[:, t0 + h - k : t1 + h - k]
        toks[k] = np.where(blocked, fill, toks[k])
    return toks


#: Blocks of at most this many positions take the broadcast modulo (one call per n-gram
#: order) instead of three calls per head.
_BROADCAST_MAX = 64


def _hash_block(
    toks: Sequence[np.ndarray],
    lt: LayerTables,
    out_cols_first: np.ndarray,
    local: bool,
    scratch: _Scratch,
) -> None:
    """Hash one block of contexts into ``out_cols_first`` (shape ``[C, *S]``, any strides).

    Columns are computed contiguous in ``scratch.buf`` and transposed once at the end: numpy's
    integer division by a scalar is SIMD (libdivide), by an array it is a scalar ``idiv`` per
    element, so ``mix // P_j`` one column at a time is ~3x faster than a broadcast ``%``.
    """
    shape = toks[0].shape
    n = math.prod(shape)
    acc = scratch.acc[:n].reshape(shape)
    tmp = scratch.tmp[:n].reshape(shape)
    acc_flat = scratch.acc[:n]
    quot = scratch.quot[:n]
    buf = scratch.buf[:, :n]
    mult = lt.multipliers
    primes = lt.primes
    heads = lt.heads_per_ngram
    n_max = lt.max_ngram
    emit: list[list[int]]
    if lt.peft_orders is None:
        # Order n = k+1 is complete once look-back k is in: its columns follow the orders.
        seq = list(toks)
        emit = [[]] + [[k - 1] for k in range(1, n_max)]
    else:
        # engram-peft: the oldest id of the window gets m[0]; after j+1 terms the mix is the
        # order-(j+1) window, which column groups with that order read.
        seq = [toks[n_max - 1 - j] for j in range(n_max)]
        emit = [[g for g, n in enumerate(lt.peft_orders) if n == j + 1] for j in range(n_max)]
    for j in range(n_max):
        if j == 0:
            np.multiply(seq[0], mult[0], out=acc)
        else:
            np.multiply(seq[j], mult[j], out=tmp)
            np.bitwise_xor(acc, tmp, out=acc)
        for group in emit[j]:
            lo, hi = group * heads, (group + 1) * heads
            if n <= _BROADCAST_MAX:
                # A few positions (a decode step): one floor modulo of the mix by the group's
                # primes as a column, broadcast (per-element division is slower, but 3 calls
                # per head would cost more than the arithmetic here).
                np.remainder(acc_flat, lt.prime_cols[lo:hi], out=buf[lo:hi])
                continue
            for col in range(lo, hi):
                p = int(primes[col])
                # floor(mix / p) then mix - q*p: exact floor modulo for any int64 mix, since
                # the wrap of q*p cancels modulo 2^64 and the true result lies in [0, p).
                np.floor_divide(acc_flat, p, out=quot)
                np.multiply(quot, -p, out=quot)
                np.add(acc_flat, quot, out=buf[col])
    kernel_stats["blocks"] += 1
    kernel_stats["positions"] += n
    shaped = buf.reshape((lt.n_heads, *shape))
    if local:
        np.copyto(out_cols_first, shaped)
    else:
        np.add(shaped, lt.offsets.reshape((-1,) + (1,) * len(shape)), out=out_cols_first)


def hash_ext(
    ext: np.ndarray,
    ext_bar: np.ndarray,
    dead: np.ndarray | None,
    lt: LayerTables,
    fill: int,
    out3: np.ndarray,
    local: bool,
) -> None:
    """Row ids of all chunk positions of ``ext`` (``[B, N-1+T]``) into ``out3`` (``[B, T, C]``)."""
    n_rows, n_pos = out3.shape[0], out3.shape[1]
    if n_rows * n_pos == 0:
        return
    if n_pos >= BLOCK_TOKENS:
        rows_per, cols_per = 1, BLOCK_TOKENS
    else:
        rows_per, cols_per = max(1, BLOCK_TOKENS // n_pos), n_pos
    scratch = _Scratch(lt.n_heads, min(rows_per, n_rows) * min(cols_per, n_pos))
    moved = np.moveaxis(out3, 2, 0)
    for r0 in range(0, n_rows, rows_per):
        r1 = min(r0 + rows_per, n_rows)
        for t0 in range(0, n_pos, cols_per):
            t1 = min(t0 + cols_per, n_pos)
            toks = _block_contexts(
                ext[r0:r1],
                ext_bar[r0:r1],
                None if dead is None else dead[r0:r1],
                t0,
                t1,
                lt.max_ngram,
                fill,
            )
            _hash_block(toks, lt, moved[:, r0:r1, t0:t1], local, scratch)


def contexts_ext(
    ext: np.ndarray,
    ext_bar: np.ndarray,
    dead: np.ndarray | None,
    max_ngram: int,
    fill: int,
    out3: np.ndarray,
) -> None:
    """Fill-resolved contexts (``out3[b, t, k]`` = id k back) of every chunk position."""
    n_pos = out3.shape[1]
    for t0 in range(0, n_pos, BLOCK_TOKENS):
        t1 = min(t0 + BLOCK_TOKENS, n_pos)
        toks = _block_contexts(ext, ext_bar, dead, t0, t1, max_ngram, fill)
        for k, tok in enumerate(toks):
            out3[:, t0:t1, k] = tok


def hash_keys_into(keys2: np.ndarray, lt: LayerTables, out2: np.ndarray, local: bool) -> None:
    """Row ids of context tuples ``keys2`` (``[M, N]`` int64) into ``out2`` (``[M, C]``)."""
    m = keys2.shape[0]
    if m == 0:
        return
    scratch = _Scratch(lt.n_heads, min(BLOCK_TOKENS, m))
    moved = out2.T
    for m0 in range(0, m, BLOCK_TOKENS):
        m1 = min(m0 + BLOCK_TOKENS, m)
        toks = [keys2[m0:m1, k] for k in range(lt.max_ngram)]
        _hash_block(toks, lt, moved[:, m0:m1], local, scratch)


# --- the base class -------------------------------------------------------------------------
class Hasher:
    """Row-id generator of one model: constants per layer plus the kind's boundary rules.

    Build one with :func:`engramdb.keygen.hasher` or :func:`engramdb.keygen.preset`. All
    methods are pure CPU work (no I/O); batched calls run the compiled loop (`native`; else
    vectorised numpy), tens of nanoseconds per token and layer, allocating their output.
    """

    kind: str = ""

    def __init__(
        self,
        *,
        name: str | None,
        tables: Mapping[int, LayerTables],
        max_ngram: int,
        heads_per_ngram: int,
        fill_id: int,
        id_bound: int | None,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self._tables = dict(tables)
        self.max_ngram = max_ngram
        self.heads_per_ngram = heads_per_ngram
        self.fill_id = int(fill_id)
        self.id_bound = id_bound
        self.info: dict[str, Any] = dict(info or {})

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<{type(self).__name__}{label} kind={self.kind!r} layers={list(self.layers)}>"

    # --- geometry ---------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """Layer ids covered, numbered as in the model's own config."""
        return tuple(self._tables)

    @property
    def n_heads(self) -> int:
        """Row ids per token and layer (all n-gram orders times heads; 1 for Gemma)."""
        return next(iter(self._tables.values())).n_heads

    def layer_tables(self, layer: int | None = None) -> LayerTables:
        """The hash constants of ``layer`` (None: the only table, if all layers share one)."""
        if layer is None:
            distinct = {id(t) for t in self._tables.values()}
            if len(distinct) == 1:
                return next(iter(self._tables.values()))
            raise InvalidArgument(
                f"{self.kind} has one table per layer {list(self.layers)}; pass layer="
            )
        try:
            return self._tables[int(layer)]
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(
                f"layer {layer!r} carries no table in this {self.kind} layout; "
                f"layers are {list(self.layers)}"
            ) from None

    def multipliers(self, layer: int | None = None) -> np.ndarray:
        """int64 ``[max_ngram]`` hash multipliers (``m[0]`` multiplies the current token)."""
        return self.layer_tables(layer).multipliers

    def primes(self, layer: int | None = None) -> np.ndarray:
        """int64 ``[n_heads]`` bucket moduli in column order (order-major, head-minor)."""
        return self.layer_tables(layer).primes

    def offsets(self, layer: int | None = None) -> np.ndarray:
        """int64 ``[n_heads]`` first global row of each column in the layer's table."""
        return self.layer_tables(layer).offsets

    def head_rows(self, layer: int | None = None) -> np.ndarray:
        """int64 ``[n_heads]`` rows of each column's segment (the primes for hashed kinds)."""
        return self.layer_tables(layer).primes

    def table_rows(self, layer: int | None = None) -> int:
        """Rows of the layer's table, including any padding rows that are never addressed."""
        return self.layer_tables(layer).table_rows

    # --- kind hooks -------------------------------------------------------------------------
    def _encode(self, arr: np.ndarray, compressed: bool, strict: bool) -> np.ndarray:
        """Token ids -> the int64 ids that get hashed (validated). Same shape."""
        raise NotImplementedError

    def _apply_mask(
        self, ids2: np.ndarray, mask2: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(ids, barrier, dead)``: barrier[q] blocks look-backs reaching q; dead blanks q."""
        raise NotImplementedError

    # --- batched API ------------------------------------------------------------------------
    def _encoded(
        self, token_ids: Any, compressed: bool, mask: Any, strict: bool
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, tuple[int, ...]]:
        """Hashed ids ``[S, T]``, the kind's barrier / dead flags (or None), the shape."""
        arr = as_token_array(token_ids)
        mask_arr = None if mask is None else as_mask(mask, arr.shape)
        ids = self._encode(arr, compressed, strict)
        shape = arr.shape
        n_seq, n_pos = math.prod(shape[:-1]), shape[-1]
        ids2 = ids.reshape(n_seq, n_pos)
        mask2 = None if mask_arr is None else mask_arr.reshape(n_seq, n_pos)
        ids2, bar, dead = self._apply_mask(ids2, mask2)
        return ids2, bar, dead, shape

    def _ext(
        self,
        token_ids: Any,
        compressed: bool,
        mask: Any,
        strict: bool,
        hist_ids: np.ndarray | None = None,
        hist_bar: np.ndarray | None = None,
        starts: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, ...]]:
        ids2, bar, dead, shape = self._encoded(token_ids, compressed, mask, strict)
        n_seq, n_pos = ids2.shape
        h = self.max_ngram - 1
        ext = np.empty((n_seq, h + n_pos), dtype=np.int64)
        ext[:, h:] = ids2
        ext_bar = np.empty((n_seq, h + n_pos), dtype=np.bool_)
        if hist_ids is None:
            ext[:, :h] = self.fill_id
            ext_bar[:, :h] = True
        else:
            ext[:, :h] = hist_ids
            ext_bar[:, :h] = hist_bar
        if bar is None:
            ext_bar[:, h:] = False
        else:
            ext_bar[:, h:] = bar
        if starts is not None and h > 0:
            # A sequence starting at r blocks look-backs reaching r-1: fold it into r-1's flag.
            ext_bar[:, h - 1 : h - 1 + n_pos] |= starts.reshape(n_seq, n_pos)
        return ext, ext_bar, dead, shape

    def row_ids(
        self,
        token_ids: Any,
        *,
        layer: int | None = None,
        compressed: bool = False,
        mask: Any = None,
        strict: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Global row ids (int64 ``[..., T, n_heads]``) of every position of ``token_ids``.

        ``token_ids`` is ``[..., T]``: each row along the last axis is one sequence starting
        fresh (use :meth:`stream` to continue one). ``compressed`` says the ids are already
        tokenizer-compressed (DeepSeek). ``mask`` (bool, same shape) marks dead positions.
        ``strict=False`` hashes out-of-range ids as the reference engine does instead of
        raising :class:`TokenIdOutOfRange`. ``out`` may supply the int64 output buffer.
        Cost: ~20-40 ns per token on one core for 16-24 columns, O(T) memory.
        """
        return self._rows(token_ids, layer, RowMode(compressed, strict, False), mask, out)

    def local_ids(
        self,
        token_ids: Any,
        *,
        layer: int | None = None,
        compressed: bool = False,
        mask: Any = None,
        strict: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Per-column local ids (int64 ``[..., T, n_heads]``, ``row_ids - offsets``)."""
        return self._rows(token_ids, layer, RowMode(compressed, strict, True), mask, out)

    def _rows(
        self, token_ids: Any, layer: int | None, mode: RowMode, mask: Any, out: np.ndarray | None
    ) -> np.ndarray:
        lt = self.layer_tables(layer)
        if native_fits(lt):
            return self._native_rows(lt, token_ids, mask, mode, None, out)[0]
        ext, ext_bar, dead, shape = self._ext(token_ids, mode.compressed, mask, mode.strict)
        res = prepare_out(out, (*shape, lt.n_heads))
        n_seq, n_pos = ext.shape[0], shape[-1]
        hash_ext(
            ext, ext_bar, dead, lt, self.fill_id, res.reshape(n_seq, n_pos, lt.n_heads), mode.local
        )
        return res

    def keys(
        self, token_ids: Any, *, compressed: bool = False, mask: Any = None, strict: bool = True
    ) -> np.ndarray:
        """Fill-resolved contexts, int64 ``[..., T, max_ngram]``: ``[..., k]`` = id k back.

        A context is everything that determines a position's row ids in every layer (after
        compression, pad / EOS fill and dead-token blocking), so equal contexts select equal
        rows. Cost: one pass per look-back distance.
        """
        ext, ext_bar, dead, shape = self._ext(token_ids, compressed, mask, strict)
        res = np.empty((*shape, self.max_ngram), dtype=np.int64)
        contexts_ext(
            ext,
            ext_bar,
            dead,
            self.max_ngram,
            self.fill_id,
            res.reshape(ext.shape[0], shape[-1], self.max_ngram),
        )
        return res

    def iter_keys(
        self,
        seq: Any,
        chunk_tokens: int,
        *,
        compressed: bool = False,
        doc_separator: int | None = None,
    ) -> Iterator[np.ndarray]:
        """Contexts (int64 ``[t, max_ngram]``, as :meth:`keys`) of one long sequence ``seq``
        (``[T]``, e.g. a memory-mapped file), ``chunk_tokens`` at a time, the look-back carried
        across chunks: the chunks concatenate to ``keys(seq)``. ``doc_separator`` starts a new
        sequence at each occurrence of that id (it is the new sequence's first token).
        Memory: one chunk's contexts; a `TokenIdOutOfRange` names the chunk's first token.
        """
        width = self.max_ngram
        hist_ids: np.ndarray | None = None
        hist_bar: np.ndarray | None = None
        for t0 in range(0, seq.shape[0], chunk_tokens):
            chunk = np.asarray(seq[t0 : t0 + chunk_tokens])
            starts = None if doc_separator is None else (chunk == doc_separator).reshape(1, -1)
            try:
                ext, ext_bar, dead, shape = self._ext(
                    chunk.reshape(1, -1), compressed, None, True, hist_ids, hist_bar, starts
                )
            except TokenIdOutOfRange as exc:
                raise TokenIdOutOfRange(f"{exc} [chunk starting at token {t0}]") from None
            keys = np.empty((1, shape[-1], width), dtype=np.int64)
            contexts_ext(ext, ext_bar, dead, width, self.fill_id, keys)
            keep = ext.shape[1] - (width - 1)
            hist_ids, hist_bar = ext[:, keep:].copy(), ext_bar[:, keep:].copy()
            yield keys[0]

    def hash_keys(
        self,
        keys: Any,
        *,
        layer: int | None = None,
        local: bool = False,
        strict: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Row ids (int64 ``[..., n_heads]``) of contexts from :meth:`keys` (``[..., max_ngram]``)."""
        lt = self.layer_tables(layer)
        return self._hash_keys(lt, as_token_array(keys, name="keys"), local, strict, out)

    def _hash_keys(
        self, lt: LayerTables, arr: np.ndarray, local: bool, strict: bool, out: np.ndarray | None
    ) -> np.ndarray:
        if arr.shape[-1] != self.max_ngram:
            raise ShapeMismatch(f"keys must be [..., {self.max_ngram}], got shape {arr.shape}")
        if strict and self.id_bound is not None:
            check_range(arr, 0, self.id_bound, f"{self.kind} key ids")
        keys2 = np.ascontiguousarray(to_int64(arr)).reshape(-1, self.max_ngram)
        res = prepare_out(out, (*arr.shape[:-1], lt.n_heads))
        hash_keys_into(keys2, lt, res.reshape(-1, lt.n_heads), local)
        return res

    def stream(
        self,
        layer: int | None = None,
        *,
        compressed: bool = False,
        local: bool = False,
        strict: bool = True,
    ) -> KeyStream:
        """A decode-time state: ``push`` returns the row ids of the pushed tokens only."""
        return KeyStream(
            self, self.layer_tables(layer), compressed=compressed, local=local, strict=strict
        )

    def stream_rows(
        self, lt: LayerTables, arr: np.ndarray, mask: Any, mode: RowMode, hist: History
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Batched continuation: rows of ``arr`` ``[B, T]`` after ``hist`` ``[B, N-1]``, new hist.

        What a `KeyStream` calls for a push of more than one token."""
        if native_fits(lt):
            return self._native_rows(lt, arr, mask, mode, hist, None)
        ext, ext_bar, dead, shape = self._ext(arr, mode.compressed, mask, mode.strict, *hist)
        res = np.empty((*shape, lt.n_heads), dtype=np.int64)
        n_seq, n_pos = ext.shape[0], shape[-1]
        hash_ext(
            ext, ext_bar, dead, lt, self.fill_id, res.reshape(n_seq, n_pos, lt.n_heads), mode.local
        )
        keep = ext.shape[1] - (self.max_ngram - 1)
        return res, ext[:, keep:].copy(), ext_bar[:, keep:].copy()

    def _native_rows(
        self, lt: LayerTables, arr: Any, mask: Any, mode: RowMode, hist: History | None, out: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids2, bar, dead, shape = self._encoded(arr, mode.compressed, mask, mode.strict)
        res = prepare_out(out, (*shape, lt.n_heads))
        new_ids, new_bar = native_rows(lt, ids2, bar, dead, hist, self.fill_id, mode.local, res)
        kernel_stats["native_positions"] += ids2.size
        return res, new_ids, new_bar

    # --- one token, pure Python ---------------------------------------------------------------
    # Kind rules for the one-token path: what a dead position becomes, which id is a barrier.
    _dead_blocks_self = True  # DeepSeek: a dead position hashes the all-fill n-grams
    _barrier_id: int | None = None  # Qwen: EOS ends the segment

    def _encode_fn(self, compressed: bool, strict: bool) -> Callable[[int], int]:
        """``tid -> hashed id`` for one Python int, with the same checks as :meth:`_encode`."""
        raise NotImplementedError

    def make_step(self, lt: LayerTables, *, compressed: bool, local: bool, strict: bool) -> Step:
        """A specialised one-token step: ``step(tid, dead, ids, bars) -> int64 [n_heads]``.

        ``ids`` / ``bars`` are the sequence's last N-1 hashed ids and barrier flags (oldest
        first) and are updated in place. The mix runs on Python ints (exact; wrapped to int64
        only when it leaves the range, which in-vocabulary ids never do); the 16-24 modulos
        run as one numpy call, which measured ~2x faster than Python-int ``%`` plus the list
        to array conversion.
        """
        encode = self._encode_fn(compressed, strict)
        mult = [int(m) for m in lt.multipliers]
        m0, rest = mult[0], tuple(enumerate(mult[1:], start=1))
        heads = lt.heads_per_ngram
        buf = np.empty(lt.n_heads, dtype=np.int64)
        views = [buf[i * heads : (i + 1) * heads] for i in range(lt.max_ngram - 1)]
        order_views = tuple(zip(rest, views, strict=True))
        primes, offsets = lt.primes, lt.offsets
        remainder, add = np.remainder, np.add
        fill = self.fill_id
        dead_blocks_self = self._dead_blocks_self
        barrier_id = self._barrier_id
        lo, hi = -(1 << 63), INT64_MAX

        def step(tid: int, dead: bool, ids: list[int], bars: list[bool]) -> np.ndarray:
            cid = encode(tid)
            blocked = False
            tok = cid
            if dead:
                if dead_blocks_self:
                    blocked = True
                    tok = fill
                else:
                    cid = tok = fill
            bar = blocked or cid == barrier_id
            mix = tok * m0
            for (k, mk), view in order_views:
                blocked = blocked or bars[-k]
                mix ^= (fill if blocked else ids[-k]) * mk
                view.fill(mix if lo <= mix <= hi else wrap_int64(mix))
            rows = remainder(buf, primes)
            if not local:
                add(rows, offsets, out=rows)
            if ids:
                del ids[0], bars[0]
                ids.append(cid)
                bars.append(bar)
            return rows

        return step
