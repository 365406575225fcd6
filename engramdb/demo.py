"""``engramdb demo``: build a small PLE-like database and run batched lookups on it."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engramdb.build import build
from engramdb.database import open as open_db

#: Scaled-down Qwen-PLE geometry: orders 2..3 x 8 heads, 160 B FP8 rows.
DEMO_HEADS = 16
DEMO_ROW_BYTES = 160
DEMO_PRIME_BASE = 60_000


def primes_after(base: int, count: int) -> list[int]:
    """The ``count`` smallest primes >= ``base`` (sieve over a window; pure)."""
    span = max(1024, count * 64)
    while True:
        lo, hi = base, base + span
        is_p = np.ones(hi - lo, dtype=bool)
        for p in range(2, int(hi**0.5) + 1):
            start = max(p * p, -(-lo // p) * p)
            is_p[start - lo :: p] = False
        found = (np.flatnonzero(is_p) + lo).tolist()
        found = [p for p in found if p >= 2]
        if len(found) >= count:
            return found[:count]
        span *= 2


def demo_rows(first: int, n: int, row_bytes: int) -> np.ndarray:
    """Deterministic row contents: row r is a hash-like function of r (vectorised)."""
    r = np.arange(first, first + n, dtype=np.uint64)[:, None]
    c = np.arange(row_bytes, dtype=np.uint64)[None, :]
    x = (r * np.uint64(0x9E3779B97F4A7C15)) ^ (c * np.uint64(0xBF58476D1CE4E5B9))
    x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def run_demo(
    directory: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] = print,
    *,
    seconds: float = 1.0,
) -> dict[str, float]:
    """Build the demo database under ``directory`` (default: the temp dir) and measure
    batched lookups. Returns the figures it printed."""
    root = Path(directory) if directory else Path(tempfile.gettempdir()) / "engramdb-demo"
    root.mkdir(parents=True, exist_ok=True)
    heads = primes_after(DEMO_PRIME_BASE, DEMO_HEADS)
    n_rows = sum(heads)
    src = root / "ple_table.npy"
    echo(
        f"[1/4] writing a synthetic PLE-like source: {DEMO_HEADS} heads, {n_rows:,} rows x "
        f"{DEMO_ROW_BYTES} B = {n_rows * DEMO_ROW_BYTES / 1e6:.0f} MB -> {src}"
    )
    mm = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(n_rows, DEMO_ROW_BYTES))
    step = 1 << 18
    for i in range(0, n_rows, step):
        k = min(step, n_rows - i)
        mm[i : i + k] = demo_rows(i, k, DEMO_ROW_BYTES)
    mm.flush()
    del mm

    db_path = root / "db"
    echo(
        f"[2/4] engramdb build {db_path} --table ple --row-bytes {DEMO_ROW_BYTES} "
        f"--heads <{DEMO_HEADS} primes> {src.name}"
    )
    summary = build(
        db_path,
        "ple",
        DEMO_ROW_BYTES,
        [src],
        heads=heads,
        dtype="fp8_e4m3",
        dim=DEMO_ROW_BYTES,
        force=True,
    )
    echo("      " + summary.line())

    figures: dict[str, float] = {"build_gb_per_s": summary.gb_per_s}
    rng = np.random.default_rng(0)
    with open_db(db_path, populate=True) as db:
        store = db["ple"]
        echo(f"[3/4] opened {store!r}; page-cache residency {store.residency():.0%}")
        batch = 16_384
        ids = rng.integers(0, n_rows, size=batch, dtype=np.int64)
        out = np.empty((batch, DEMO_ROW_BYTES), dtype=np.uint8)
        store.fetch_into(ids, out)
        if not np.array_equal(out, np.load(src, mmap_mode="r")[ids]):
            raise AssertionError("demo: fetched rows differ from the source")
        plain = np.load(src, mmap_mode="r")

        def rate(fn: Callable[[], object]) -> float:
            n = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds / 2:
                fn()
                n += batch
            return n / (time.perf_counter() - t0)

        r_store = rate(lambda: store.fetch_into(ids, out))
        r_numpy = rate(lambda: plain[ids])
        figures.update(fetch_rows_per_s=r_store, numpy_rows_per_s=r_numpy)
        echo(
            f"[4/4] Store.fetch_into, {batch:,} random rows of {DEMO_ROW_BYTES} B: "
            f"{r_store / 1e6:.1f} M rows/s ({r_store * DEMO_ROW_BYTES / 1e9:.2f} GB/s); "
            f"numpy memmap fancy-indexing: {r_numpy / 1e6:.1f} M rows/s; "
            f"ratio {r_store / r_numpy:.2f}x"
        )
        local = np.stack([rng.integers(0, h, size=(64, 16)) for h in heads], axis=-1)
        local = np.ascontiguousarray(local, dtype=np.int64)
        lout = np.empty(local.shape + (DEMO_ROW_BYTES,), dtype=np.uint8)
        store.lookup_into(local, lout)
        if not np.array_equal(
            lout[0, 0, 3], store.fetch([store.head_offsets[3] + local[0, 0, 3]])[0]
        ):
            raise AssertionError("demo: lookup_into disagrees with fetch")
        r_lookup = rate(lambda: store.lookup_into(local, lout))
        figures["lookup_rows_per_s"] = r_lookup
        echo(
            f"      Store.lookup_into [64, 16, {DEMO_HEADS}] per-head ids: "
            f"{r_lookup / 1e6:.1f} M rows/s"
        )
    echo("next:")
    echo(f"  engramdb info {db_path}")
    echo(f"  engramdb verify {db_path}")
    echo(
        f"  python -c \"import engramdb; db = engramdb.open('{db_path}'); "
        "print(db['ple'].fetch([0, 1, 2]).shape)\""
    )
    return figures
