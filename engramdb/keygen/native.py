"""keygen's compiled loop (``_native.c``): the row ids of a batch of positions after each
sequence's look-back, in one pass.

The numpy kernel (`engramdb.keygen._core`) costs ~40 ufunc calls a call whatever its size:
~30 us for one step of 8 sequences on its own, and 2.5-4x that inside a decode loop, where
the model's step has just evicted numpy's code and data from the caches. The loop does the
same arithmetic (look-back blocking, the wrapping multiply-XOR mixes, a floor modulo per
head) in one pass, with no scratch: 3-4x faster than the numpy kernel for a decode step,
1.2-1.3x for chunks of 16 k to 256 k positions (`python probes/keygen.py`). Every stream
push and `row_ids` / `local_ids` call of a hashed kind takes it.

Optional: built by ``pip install`` where a C compiler is present; without it, or with
``ENGRAMDB_NATIVE=0``, the numpy kernel serves every call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import numpy as np

from engramdb.keygen._tables import LayerTables

_native: ModuleType | None
try:
    from engramdb.keygen import _native
except ImportError:  # pragma: no cover - built without a C compiler
    _native = None

__all__ = [
    "NATIVE_ENV",
    "kernel_stats",
    "native_enabled",
    "native_fits",
    "native_rows",
    "native_step",
    "use_native",
]

#: ``0`` turns the compiled parts off (this loop, and the column gather of
#: ``engramdb.io.columns``); the numpy paths run instead.
NATIVE_ENV = "ENGRAMDB_NATIVE"

#: The loop's bounds (its per-position scratch): longer n-grams, or more head groups, take
#: the numpy kernel.
MAX_NGRAM = 16
MAX_GROUPS = 64

_enabled: bool | None = None

#: Positions and blocks served by the numpy kernel, positions by the compiled loop (its
#: batched `native_rows` and its decode `native_step`), for tests and probes.
kernel_stats = {"blocks": 0, "positions": 0, "native_positions": 0}


def native_enabled() -> bool:
    """Whether the compiled loop is built and not turned off by ``ENGRAMDB_NATIVE=0`` (read
    once per process)."""
    global _enabled
    if _enabled is None:
        _enabled = _native is not None and os.environ.get(NATIVE_ENV, "").strip() != "0"
    return _enabled


def use_native(on: bool | None) -> None:
    """Force the compiled loop on (where built) or off for this process; None goes back to
    the build and ``ENGRAMDB_NATIVE``. For probes that time both paths in one run."""
    global _enabled
    _enabled = None if on is None else bool(on) and _native is not None


def native_fits(lt: LayerTables) -> bool:
    """Whether layer ``lt`` is hashed by the compiled loop: it is built and on, and the
    layer's n-grams fit its bounds."""
    return 2 <= lt.max_ngram <= MAX_NGRAM and lt.group_steps.size <= MAX_GROUPS and native_enabled()


def native_rows(
    lt: LayerTables,
    ids2: np.ndarray,
    bar: np.ndarray | None,
    dead: np.ndarray | None,
    hist: tuple[np.ndarray, np.ndarray] | None,
    fill: int,
    local: bool,
    out: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Row ids of the encoded ids ``ids2`` ``[S, T]`` (``bar`` / ``dead``: the kind's barrier
    flags and dead positions, or None) after the look-back ``hist`` (ids, flags ``[S, N-1]``;
    None: fresh sequences) into ``out`` (int64, C-contiguous, ``S * T * n_heads``; local ids
    when ``local``). Returns the look-back after them. Call only where `native_fits`."""
    n_seq = ids2.shape[0]
    h = lt.max_ngram - 1
    if hist is None:
        hist = np.full((n_seq, h), fill, dtype=np.int64), np.ones((n_seq, h), dtype=np.bool_)
    if n_seq == 0:
        return hist
    new_ids = np.empty((n_seq, h), dtype=np.int64)
    new_bar = np.empty((n_seq, h), dtype=np.bool_)
    assert _native is not None
    _native.rows(
        np.ascontiguousarray(ids2, dtype=np.int64),
        None if bar is None else np.ascontiguousarray(bar, dtype=np.bool_),
        None if dead is None else np.ascontiguousarray(dead, dtype=np.bool_),
        np.ascontiguousarray(hist[0], dtype=np.int64),
        np.ascontiguousarray(hist[1], dtype=np.bool_),
        out,
        new_ids,
        new_bar,
        lt.multipliers,
        lt.primes,
        None if local else lt.offsets,
        lt.group_steps,
        lt.heads_per_ngram,
        fill,
        lt.peft_orders is not None,
    )
    return new_ids, new_bar


#: ``step(ids [S], hist_ids [S, N-1], hist_bar [S, N-1], out [S, C], local_out=None) -> int``:
#: see `native_step`.
NativeStep = Callable[..., int]


def native_step(lt: LayerTables, fill: int, local: bool, bound: int | None) -> NativeStep:
    """The compiled one-position decode step of layer ``lt`` (call only where `native_fits`),
    its constants bound: ``step(ids, hist_ids, hist_bar, out, local_out=None)`` hashes int64
    ``ids`` ``[S]`` (one new position per sequence, unmasked) after the look-back
    ``hist_ids`` / ``hist_bar`` ``[S, N-1]``, which it advances in place, into ``out``
    ``[S, C]`` (local ids when ``local``), and the local ids into ``local_out`` in the same
    pass where given. With ``bound``, every id must lie in ``[0, bound)``: the index of
    the first that does not comes back before anything is written; -1 when done."""
    assert _native is not None
    fn = _native.step
    mult, primes, steps = lt.multipliers, lt.primes, lt.group_steps
    offsets = None if local else lt.offsets
    heads, peft = lt.heads_per_ngram, lt.peft_orders is not None
    check, hi = bound is not None, 0 if bound is None else int(bound)

    def step(
        ids: np.ndarray,
        hist_ids: np.ndarray,
        hist_bar: np.ndarray,
        out: np.ndarray,
        local_out: np.ndarray | None = None,
    ) -> int:
        return fn(
            ids,
            hist_ids,
            hist_bar,
            out,
            mult,
            primes,
            offsets,
            steps,
            heads,
            fill,
            peft,
            check,
            0,
            hi,
            local_out,
        )  # type: ignore[no-any-return]

    return step
