"""Exact integer helpers shared by the hashers: primes, multipliers, int64 wrap.

Everything here runs once per hasher construction (microseconds to milliseconds); nothing
is on a per-token path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

INT64_MAX = (1 << 63) - 1
_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# Deterministic Miller-Rabin witnesses: this set is exact for every n < 3.3e24, far above
# any bucket size a table can have.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def wrap_int64(value: int) -> int:
    """Reduce a Python int to the int64 value two's-complement hardware would hold."""
    return ((value + (1 << 63)) & _U64) - (1 << 63)


def is_prime(n: int) -> bool:
    """Exact primality for any ``n`` below 3.3e24 (deterministic Miller-Rabin)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """The smallest prime strictly greater than ``n``."""
    c = max(n + 1, 2)
    while not is_prime(c):
        c += 1
    return c


def deepseek_primes(
    layer_ids: Sequence[int], bases: Sequence[int], heads: int
) -> dict[int, list[int]]:
    """Bucket primes of every DeepSeek Engram layer, in column order (order-major, head-minor).

    One ``used`` set is shared by all layers, orders and heads (in config order), so every
    modulus is distinct: for order ``n`` the search restarts at ``bases[n-2] - 1`` and takes
    the next unused prime above the previous head's.
    """
    used: set[int] = set()
    result: dict[int, list[int]] = {}
    for layer in layer_ids:
        cols: list[int] = []
        for base in bases:
            cur = int(base) - 1
            for _ in range(heads):
                p = next_prime(cur)
                while p in used:
                    p = next_prime(p)
                used.add(p)
                cols.append(p)
                cur = p
        result[int(layer)] = cols
    return result


def consecutive_primes(base: int, count: int) -> list[int]:
    """The first ``count`` primes strictly greater than ``base - 1`` (Qwen PLE rule)."""
    out: list[int] = []
    cur = int(base) - 1
    for _ in range(count):
        cur = next_prime(cur)
        out.append(cur)
    return out


def multiplier_half_bound(id_space: int) -> int:
    """``max(1, floor(floor((2^63-1) / V) / 2))``: keeps ``id * m < 2^63`` for ``id < V``."""
    return max(1, (INT64_MAX // max(int(id_space), 1)) // 2)


def deepseek_multipliers(seed: int, layer_id: int, order: int, compressed_vocab: int) -> list[int]:
    """DeepSeek Engram multipliers: numpy PCG64 seeded with ``seed + 10007 * layer_id``.

    Reproducing them needs numpy's Generator stream; presets freeze the published values so
    that a future numpy cannot change them silently.
    """
    half = multiplier_half_bound(compressed_vocab)
    rng = np.random.default_rng(int(seed) + 10007 * int(layer_id))
    r = rng.integers(0, half, size=order, dtype=np.int64)
    return [2 * int(v) + 1 for v in r]


def splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (all arithmetic mod 2^64)."""
    z = (x + _GOLDEN) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def qwen_multipliers(seed: int, ple_index: int, order: int, vocab_size: int) -> list[int]:
    """Qwen4-Exp PLE multipliers: splitmix64 of ``seed + 10007 * k + G * (i + 1)``."""
    half = multiplier_half_bound(vocab_size)
    base = int(seed) + 10007 * int(ple_index)
    return [2 * (splitmix64((base + _GOLDEN * (i + 1)) & _U64) % half) + 1 for i in range(order)]


def exclusive_prefix_sum(values: Iterable[int]) -> list[int]:
    """``[0, v0, v0 + v1, ...]`` without the total."""
    out: list[int] = []
    acc = 0
    for v in values:
        out.append(acc)
        acc += int(v)
    return out
