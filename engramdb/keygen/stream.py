"""Decode-time keygen state: the last N-1 hashed ids (and barrier flags) of each sequence.

Chunked prefill and one-token decode through a :class:`KeyStream` return exactly what one
full pass over the concatenated tokens returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from engramdb.errors import EngramDBError, InvalidDtype, ShapeMismatch
from engramdb.keygen._tables import LayerTables, RowMode, as_token_array
from engramdb.keygen.native import NativeStep, kernel_stats, native_fits, native_step

__all__ = ["KeyStream", "Step", "StepSource"]

#: A specialised one-token step: ``step(tid, dead, ids, bars) -> int64 [n_heads]``; ``ids`` /
#: ``bars`` (the last N-1 hashed ids and barrier flags, oldest first) are updated in place.
Step = Callable[[int, bool, list[int], list[bool]], np.ndarray]


_INT64 = np.dtype(np.int64)

#: A stream's look-back state: ids and barrier flags, ``[B, N-1]`` each.
History = tuple[np.ndarray, np.ndarray]


class StepSource(Protocol):
    """What a `KeyStream` needs from its hasher (`engramdb.keygen.Hasher` is one)."""

    fill_id: int
    max_ngram: int

    def make_step(self, lt: LayerTables, *, compressed: bool, local: bool, strict: bool) -> Step:
        """The one-token step of layer ``lt``."""
        ...

    def stream_rows(
        self, lt: LayerTables, arr: np.ndarray, mask: Any, mode: RowMode, hist: History
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of ``arr`` ``[B, T]`` after the look-back ``hist`` ``[B, N-1]``, new hist."""
        ...


class KeyStream:
    """Row ids for tokens pushed one chunk (or one token) at a time, per sequence.

    The batch shape is fixed by the first push (``[T]`` pushes: one sequence; ``[B, T]``:
    B sequences). A single-sequence push of one token takes a pure-Python path (a few
    microseconds, no numpy dispatch); larger pushes take the vectorised kernel. A decode step
    of a batch (int64 ``[*batch, 1]``, no mask) of a kind that hashes ids as given (DeepSeek,
    engram-peft) goes straight to the compiled step (`engramdb.keygen.native.native_step`):
    one call, the look-back advanced in place. The counters ``fast_steps``,
    ``batched_pushes`` and ``native_steps`` say which path served the calls.
    """

    def __init__(
        self,
        hasher: StepSource,
        lt: LayerTables,
        *,
        compressed: bool,
        local: bool,
        strict: bool,
    ) -> None:
        self._h = hasher
        self._lt = lt
        self.layer = lt.layer
        self.compressed = compressed
        self.local = local
        self.strict = strict
        self._hist_len = hasher.max_ngram - 1
        self._step = hasher.make_step(lt, compressed=compressed, local=local, strict=strict)
        self.n_heads = lt.n_heads  # row ids per token
        self._n_heads = lt.n_heads  # the old name, read by engramdb.decode until it reads n_heads
        self.fast_steps = 0
        self.batched_pushes = 0
        self.native_steps = 0
        self.reset()

    def __repr__(self) -> str:
        return (
            f"KeyStream(hasher={getattr(self._h, 'name', None) or type(self._h).__name__!r}, layer={self.layer}, "
            f"n_heads={self.n_heads}, position={self.position}, compressed={self.compressed})"
        )

    def reset(self) -> None:
        """Forget every sequence: the next push starts fresh (any batch shape)."""
        self.batch_shape: tuple[int, ...] | None = None
        self.position = 0
        h = self._hist_len
        # Single-sequence state lives in Python lists so the one-token path needs no numpy.
        self._ids: list[int] = [self._h.fill_id] * h
        self._bar: list[bool] = [True] * h
        self._np_ids: np.ndarray | None = None
        self._np_bar: np.ndarray | None = None
        #: The compiled decode step of the bound batch (None: none) and the shapes it takes.
        self._native: NativeStep | None = None
        self._native_in: tuple[int, ...] = ()
        self._native_out: tuple[int, ...] = ()

    @property
    def history(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, blocked)``: int64 / bool ``[*batch, N-1]`` look-back state (copies)."""
        shape = self.batch_shape or ()
        if self._np_ids is None:
            ids = np.array(self._ids, dtype=np.int64).reshape((*shape, self._hist_len))
            bar = np.array(self._bar, dtype=np.bool_).reshape((*shape, self._hist_len))
            return ids, bar
        assert self._np_bar is not None
        return (
            self._np_ids.reshape((*shape, self._hist_len)).copy(),
            self._np_bar.reshape((*shape, self._hist_len)).copy(),
        )

    def _bind(self, batch: tuple[int, ...]) -> None:
        if self.batch_shape is None:
            self.batch_shape = batch
            n_seq = math.prod(batch)
            step = self._native_step() if batch and n_seq else None
            if n_seq != 1 or step is not None:
                self._np_ids = np.full((n_seq, self._hist_len), self._h.fill_id, dtype=np.int64)
                self._np_bar = np.ones((n_seq, self._hist_len), dtype=np.bool_)
            if step is not None:
                self._native = step
                self._native_in = (*batch, 1)
                self._native_out = (*batch, 1, self.n_heads)
        elif batch != self.batch_shape:
            raise ShapeMismatch(
                f"stream holds sequences of batch shape {self.batch_shape}, pushed {batch}"
            )

    def push(
        self, token_ids: Any, *, mask: Any = None, local_out: np.ndarray | None = None
    ) -> np.ndarray:
        """Row ids (int64 ``[*batch, T, n_heads]``; ``[n_heads]`` for a scalar) of the tokens.

        ``mask`` (bool like ``token_ids``) marks dead positions, with the hasher's rules.
        ``local_out`` (C-contiguous int64 of as many ids) also receives the per-head local
        ids (the rows less each head's offset: what a model's multi-head embedding takes),
        in the compiled step's own pass where it serves, else by one subtraction.
        Advances every sequence by T tokens.
        """
        step = self._native
        if (
            step is not None
            and mask is None
            and type(token_ids) is np.ndarray
            and token_ids.shape == self._native_in
            and token_ids.dtype is _INT64
            and token_ids.flags.c_contiguous
            and (
                local_out is None
                or (
                    type(local_out) is np.ndarray
                    and local_out.dtype is _INT64
                    and local_out.size == token_ids.size * self.n_heads
                )
            )
        ):
            rows = np.empty(self._native_out, dtype=np.int64)
            assert self._np_ids is not None and self._np_bar is not None
            try:  # the compiled step checks local_out's layout before it hashes
                done = step(token_ids, self._np_ids, self._np_bar, rows, local_out) < 0
            except (ValueError, BufferError) as e:
                raise ShapeMismatch(f"local_out is not writable C-contiguous: {e}") from None
            if done:
                self.position += 1
                self.native_steps += 1
                kernel_stats["native_positions"] += token_ids.size
                return rows
            # an id outside the vocabulary (nothing written): the general path raises
        if local_out is not None and not self._fits(local_out, int(np.size(token_ids))):
            raise ShapeMismatch(
                f"local_out must be writable C-contiguous int64 of {np.size(token_ids)} x "
                f"{self.n_heads} ids, got {getattr(local_out, 'dtype', type(local_out).__name__)}"
                f" {getattr(local_out, 'shape', '')}"
            )
        rows = self._push(token_ids, mask)
        if local_out is not None:
            dst = local_out.reshape(rows.shape)
            if self.local:
                np.copyto(dst, rows)
            else:
                np.subtract(rows, self._lt.offsets, out=dst)
        return rows

    def push_native(self, token_ids: np.ndarray, local_out: np.ndarray | None) -> np.ndarray | None:
        """`push` of one position per sequence by the compiled step alone, for a caller that
        checked ``token_ids`` itself (int64, C-contiguous, of the bound batch's shape + ``(1,)``:
        `native_shape`) and gives its own ``local_out`` (C-contiguous int64 of as many ids; the
        compiled step checks its layout) or None. Returns None, with nothing advanced or
        written, where no compiled step is bound or an id lies outside the vocabulary: `push`
        then serves (and raises)."""
        step = self._native
        if step is None or token_ids.shape != self._native_in:
            return None
        rows = np.empty(self._native_out, dtype=np.int64)
        try:
            done = step(token_ids, self._np_ids, self._np_bar, rows, local_out) < 0
        except (ValueError, BufferError):
            return None
        if not done:
            return None
        self.position += 1
        self.native_steps += 1
        kernel_stats["native_positions"] += token_ids.size
        return rows

    @property
    def native_shape(self) -> tuple[int, ...]:
        """The token shape `push_native` takes (``()``: no compiled step bound yet)."""
        return self._native_in

    def _fits(self, out: Any, positions: int) -> bool:
        """Whether ``out`` can take the local ids of ``positions`` positions."""
        return (
            type(out) is np.ndarray
            and out.dtype is _INT64
            and out.size == positions * self.n_heads
            and out.flags.c_contiguous
            and out.flags.writeable
        )

    def _push(self, token_ids: Any, mask: Any) -> np.ndarray:
        """`push` past the compiled step (scalars, chunks, masks, the numpy kernel)."""
        if type(token_ids) is int or (
            isinstance(token_ids, (int, np.integer)) and not isinstance(token_ids, bool)
        ):
            if self.batch_shape != ():
                self._bind(())
            rows = self._step(int(token_ids), _scalar_mask(mask), self._ids, self._bar)
            self.position += 1
            self.fast_steps += 1
            return rows
        arr = as_token_array(token_ids, allow_scalar=True)
        if arr.ndim == 0:
            return self._push(int(arr), mask)
        batch = arr.shape[:-1]
        self._bind(batch)
        if arr.size == 1 and self._np_ids is None:
            dead = False
            if mask is not None:
                m = np.asarray(mask)
                if m.shape != arr.shape:
                    raise ShapeMismatch(f"mask shape {m.shape} differs from token_ids {arr.shape}")
                dead = _scalar_mask(m.reshape(()))
            rows = self._step(int(arr.reshape(-1)[0]), dead, self._ids, self._bar)
            self.position += 1
            self.fast_steps += 1
            return rows.reshape((*arr.shape, self.n_heads))
        return self._batched(arr, mask)

    def _native_step(self) -> NativeStep | None:
        """The compiled decode step for this stream's layer, where its kind hashes unmasked
        ids as given (`step_bound`) and the loop is built and fits; else None."""
        bound_of = getattr(self._h, "step_bound", None)
        if bound_of is None or not native_fits(self._lt):
            return None
        try:
            ok, bound = bound_of(self.compressed, self.strict)
        except EngramDBError:  # an unusable combination: the general path raises it
            return None
        if not ok:
            return None
        return native_step(self._lt, self._h.fill_id, self.local, bound)

    def _batched(self, arr: np.ndarray, mask: Any) -> np.ndarray:
        n_seq = math.prod(arr.shape[:-1])
        if self._np_ids is None:
            hist_ids = np.array([self._ids], dtype=np.int64).reshape(1, self._hist_len)
            hist_bar = np.array([self._bar], dtype=np.bool_).reshape(1, self._hist_len)
        else:
            assert self._np_bar is not None
            hist_ids, hist_bar = self._np_ids, self._np_bar
        arr2 = arr.reshape(n_seq, arr.shape[-1])
        mask2 = None
        if mask is not None:
            m = np.asarray(mask)
            if m.shape != arr.shape:
                raise ShapeMismatch(f"mask shape {m.shape} differs from token_ids {arr.shape}")
            mask2 = m.reshape(arr2.shape)
        mode = RowMode(self.compressed, self.strict, self.local)
        rows, new_ids, new_bar = self._h.stream_rows(
            self._lt, arr2, mask2, mode, (hist_ids, hist_bar)
        )
        if self._np_ids is None:
            self._ids = [int(v) for v in new_ids[0].tolist()]
            self._bar = [bool(v) for v in new_bar[0].tolist()]
        else:
            self._np_ids, self._np_bar = new_ids, new_bar
        self.position += arr.shape[-1]
        self.batched_pushes += 1
        return rows.reshape((*arr.shape, self.n_heads))


def _scalar_mask(mask: Any) -> bool:
    if mask is None or mask is False:
        return False
    if isinstance(mask, (bool, np.bool_)):
        return bool(mask)
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise InvalidDtype(f"mask must be boolean (True = dead position), got {arr.dtype}")
    if arr.shape != ():
        raise ShapeMismatch(f"mask of one token must be a scalar, got shape {arr.shape}")
    return bool(arr)
