"""Per-layer hash constants (`LayerTables`) and the input checks every keygen module shares.

The bottom of keygen: `_core` (the kernel and `Hasher`), `stream` (`KeyStream`), `kinds` and
`tokenmap` import from here; this module imports only `errors` and `_arith`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from engramdb.errors import (
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    ShapeMismatch,
    TokenIdOutOfRange,
)
from engramdb.keygen._arith import INT64_MAX, exclusive_prefix_sum

__all__ = [
    "LayerTables",
    "as_mask",
    "as_token_array",
    "check_range",
    "column_mixes",
    "prepare_out",
    "readonly_int64",
    "to_int64",
]


def readonly_int64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """A read-only int64 copy of ``values`` (frozen constants)."""
    arr = np.array(values, dtype=np.int64)
    arr.setflags(write=False)
    return arr


def _int_list(name: str, values: Any) -> list[int]:
    """Python ints from a list / tuple or any 1-D integer array (e.g. a checkpoint buffer)."""
    if not isinstance(values, (list, tuple)):
        values = np.asarray(values)
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise InvalidArgument(f"{name} must be a 1-D list of integers, got {values!r}")
        values = values.tolist()
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise InvalidArgument(f"{name} must be a 1-D list of integers, got {values!r}")
    return [int(v) for v in values]


class RowMode(NamedTuple):
    """How token ids become row ids: ``compressed`` (the ids are already tokenizer-compressed),
    ``strict`` (out-of-vocabulary ids raise), ``local`` (per-head local ids, not global)."""

    compressed: bool = False
    strict: bool = True
    local: bool = False


@dataclass(frozen=True, eq=False)
class LayerTables:
    """Hash constants of one layer's table: multipliers, bucket sizes, column offsets.

    ``primes[col]`` is the bucket count of column ``col`` (order-major, head-minor), ``offsets``
    its first global row, ``table_rows`` the table size (the sum of the buckets, possibly padded).

    ``peft_orders`` (None: the n-grams 2..N ending at the current token, ``m[0]`` on the
    current token) selects engram-peft's windows instead: column group ``i`` hashes the
    ``peft_orders[i]`` *oldest* ids of the last ``max_ngram`` positions, the oldest id times
    ``m[0]`` (``mix_n(t) = XOR_{k=N-n}^{N-1} tok[t-k] * m[N-1-k]``).
    """

    layer: int
    max_ngram: int
    heads_per_ngram: int
    multipliers: np.ndarray
    primes: np.ndarray
    offsets: np.ndarray
    table_rows: int
    peft_orders: tuple[int, ...] | None = None

    @cached_property
    def group_steps(self) -> np.ndarray:
        """Per head group (``heads_per_ngram`` columns each), the term of the mix after which
        it reads it: order ``n`` reads after ``n - 1`` (DeepSeek: the groups are orders 2..N;
        engram-peft: ``peft_orders``)."""
        if self.peft_orders is None:
            return readonly_int64(list(range(1, self.max_ngram)))
        return readonly_int64([n - 1 for n in self.peft_orders])

    @property
    def prime_cols(self) -> np.ndarray:
        """``primes`` as a column ``[n_cols, 1]`` (a view): the divisors of a broadcast
        modulo over a few positions."""
        return self.primes.reshape(-1, 1)

    @classmethod
    def build(
        cls,
        layer: int,
        max_ngram: int,
        heads_per_ngram: int,
        multipliers: Sequence[int],
        primes: Sequence[int],
        offsets: Sequence[int] | None = None,
        table_rows: int | None = None,
        *,
        peft_orders: Sequence[int] | None = None,
    ) -> LayerTables:
        """Validate and freeze one layer's constants (``offsets`` default to prefix sums)."""
        orders: tuple[int, ...] | None = None
        if peft_orders is None:
            n_cols = (max_ngram - 1) * heads_per_ngram
        else:
            orders = tuple(_int_list(f"layer {layer} n-gram orders", peft_orders))
            if not orders or min(orders) < 1 or max(orders) != max_ngram:
                raise InvalidArgument(
                    f"layer {layer}: n-gram orders {list(orders)} must be >= 1 with maximum "
                    f"{max_ngram}"
                )
            n_cols = len(orders) * heads_per_ngram
        mult = _int_list(f"layer {layer} multipliers", multipliers)
        prm = _int_list(f"layer {layer} primes", primes)
        if len(mult) != max_ngram:
            raise InvalidArgument(
                f"layer {layer}: {len(mult)} multipliers given, max n-gram order {max_ngram} "
                f"needs {max_ngram}"
            )
        if any(not -(1 << 63) <= m <= INT64_MAX for m in mult):
            raise InvalidArgument(f"layer {layer}: multipliers {mult} do not fit in int64")
        if len(prm) != n_cols:
            n_orders = max_ngram - 1 if orders is None else len(orders)
            raise InvalidArgument(
                f"layer {layer}: {len(prm)} bucket sizes given, {n_cols} columns "
                f"({n_orders} orders x {heads_per_ngram} heads) need {n_cols}"
            )
        if any(p <= 0 for p in prm):
            raise InvalidArgument(f"layer {layer}: bucket sizes must be positive, got {prm}")
        off = exclusive_prefix_sum(prm) if offsets is None else _int_list("offsets", offsets)
        if len(off) != n_cols:
            raise InvalidArgument(f"layer {layer}: {len(off)} offsets given, need {n_cols}")
        # Frozen offsets win over prefix sums, but two columns sharing rows would silently
        # alias different n-grams: reject overlap.
        spans = sorted(zip(off, prm, strict=True))
        end = 0
        for start, size in spans:
            if start < end:
                raise InvalidArgument(
                    f"layer {layer}: column at offset {start} overlaps the previous column "
                    f"(which ends at row {end})"
                )
            end = start + size
        rows = end if table_rows is None else int(table_rows)
        if rows < end:
            raise InvalidArgument(
                f"layer {layer}: table_rows {rows} is smaller than the last column's end {end}"
            )
        if end > INT64_MAX:
            raise InvalidArgument(f"layer {layer}: table of {end} rows does not fit int64 ids")
        return cls(
            layer=int(layer),
            max_ngram=max_ngram,
            heads_per_ngram=heads_per_ngram,
            multipliers=readonly_int64(mult),
            primes=readonly_int64(prm),
            offsets=readonly_int64(off),
            table_rows=rows,
            peft_orders=orders,
        )

    @property
    def n_heads(self) -> int:
        """Row ids per token: one per column, ``(max_ngram - 1) * heads_per_ngram`` if hashed."""
        return len(self.primes)


def column_mixes(lt: LayerTables, keys2: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(column, mix)`` for every column of ``lt`` over contexts ``keys2`` (``[M, N]``, as
    `Hasher.keys`), columns ascending: ``floor_mod(mix, primes[column])`` is the column's
    local id. The heads of one order share (and must not modify) one ``mix`` array. For
    callers that reduce one column at a time (the corpus index counts rows per head)."""
    n_max = lt.max_ngram
    heads = lt.heads_per_ngram
    mult = lt.multipliers
    if lt.peft_orders is None:
        seq = [keys2[:, k] for k in range(n_max)]
        groups = {k: [k - 1] for k in range(1, n_max)}
    else:
        seq = [keys2[:, n_max - 1 - j] for j in range(n_max)]
        groups = {j: [g for g, n in enumerate(lt.peft_orders) if n == j + 1] for j in range(n_max)}
    mixes: dict[int, np.ndarray] = {}
    acc = np.multiply(seq[0], mult[0])
    tmp = np.empty_like(acc)
    for j in range(n_max):
        if j:
            np.multiply(seq[j], mult[j], out=tmp)
            np.bitwise_xor(acc, tmp, out=acc)
        for g in groups.get(j, []):
            mixes[g] = acc.copy()
    for g in sorted(mixes):
        for col in range(g * heads, (g + 1) * heads):
            yield col, mixes[g]


# --- input checks ---------------------------------------------------------------------------
def as_token_array(
    token_ids: Any, *, name: str = "token_ids", allow_scalar: bool = False
) -> np.ndarray:
    """``token_ids`` as an integer ndarray (no copy when it already is one)."""
    arr = np.asarray(token_ids)
    if arr.size == 0 and arr.dtype.kind == "f" and not isinstance(token_ids, np.ndarray):
        arr = arr.astype(np.int64)  # np.asarray([]) is float64; an empty list is fine
    if arr.dtype.kind not in "iu":
        raise InvalidDtype(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim == 0 and not allow_scalar:
        raise ShapeMismatch(f"{name} must have shape [..., T], got a scalar")
    return arr


def as_mask(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A boolean dead-position mask of exactly ``shape``."""
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise InvalidDtype(f"mask must be a boolean array (True = dead position), got {arr.dtype}")
    if arr.shape != shape:
        raise ShapeMismatch(f"mask shape {arr.shape} differs from token_ids shape {shape}")
    return arr


def check_range(arr: np.ndarray, lo: int, hi: int, what: str) -> None:
    """Raise ``TokenIdOutOfRange`` naming the first id outside ``[lo, hi)``. Two passes."""
    if arr.size == 0:
        return
    if int(arr.min()) >= lo and int(arr.max()) < hi:
        return
    flat = arr.reshape(-1)
    first = int(np.flatnonzero((flat < lo) | (flat >= hi))[0])
    where = tuple(int(i) for i in np.unravel_index(first, arr.shape))
    raise TokenIdOutOfRange(
        f"token id {int(flat[first])} at index {where} is outside [{lo}, {hi}) ({what}); "
        f"pass strict=False for the reference engine's behaviour"
    )


def to_int64(arr: np.ndarray) -> np.ndarray:
    """int64 view or copy; out-of-range uint64 values wrap like a C cast (reference mode)."""
    if arr.dtype == np.int64:
        return arr
    return arr.astype(np.int64, casting="unsafe")


def prepare_out(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """A caller-supplied int64 C-contiguous output of ``shape``, or a fresh one."""
    if out is None:
        return np.empty(shape, dtype=np.int64)
    if not isinstance(out, np.ndarray) or out.dtype != np.int64:
        raise InvalidDtype(f"out must be an int64 ndarray, got {getattr(out, 'dtype', type(out))}")
    if out.shape != shape:
        raise ShapeMismatch(f"out has shape {out.shape}, expected {shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidLayout("out must be C-contiguous and writeable")
    return out
