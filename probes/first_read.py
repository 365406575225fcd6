"""The user's default path: a fresh build, a default `open`, no `warm` — does it converge?

    python probes/first_read.py [--gib 1] [--seconds 30] [--quick]

Builds a table of 160 B rows (the build writes with O_DIRECT: nothing in the page cache;
checked with mincore), then, in one run, each phase on a cold table (the store closed and
the files evicted before it, residency checked):

  * ``all-cold``: `open(direct=True, background_warm=False)`: every cold batch through
    O_DIRECT io_uring — what the `auto` rule did before it knew a page-cache budget (the
    "today" rate);
  * ``default``: `open()`; per second: rows/s, page-cache residency, the rule's choices, the
    background warm's state;
  * ``post-warm``: the same store after `engramdb warm` (populate): the rate to converge to;
  * ``budget 50%``: `open(page_cache_budget=nbytes / 2)`: the table does not fit, so cold
    reads stay O_DIRECT and no background warm starts; per second rows/s and the page-cache
    bytes it added; then the ratio to ``all-cold`` paired (both stores open on one cold
    table, batches alternated, so the device's drift between phases cancels);
  * ``rss25``: `open(rss_budget=nbytes / 4)` on the resident table, populated: per second the
    table's mapped RSS (smaps) and VmRSS while the watcher trims;
  * ``kw``: `open(keep_warm=True)`, populated, then the pages are lost (the mapping's pages
    dropped and the files evicted, what a checkpoint load's pressure does): seconds until
    the rate is back at >= 0.9x, against the time a warm from cold takes.

Batches: 16,384 random ids into a reused buffer (`fetch_into`). Bytes are checked against
the row formula before anything is timed. Prints the convergence time (first second at
>= 0.8x post-warm), the ratios, and writes ``probes/out/first_read.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, vm_hwm_mb, write_json  # noqa: E402

import engramdb  # noqa: E402
from engramdb.io.tiers import process_rss  # noqa: E402
from engramdb.testing.pages import drop_mapped_pages, evict, file_residency  # noqa: E402

ROW = 160
BATCH = 16_384


def rows_of(ids: np.ndarray) -> np.ndarray:
    """The bytes of rows ``ids``: byte j of row r is (r * 131 + j * 7) mod 256."""
    j = np.arange(ROW, dtype=np.int64)
    return ((ids.astype(np.int64)[:, None] * 131 + j * 7) & 255).astype(np.uint8)


def build(path: Path, n_rows: int) -> None:
    step = 1 << 20
    chunks = [rows_of(np.arange(i, min(n_rows, i + step))) for i in range(0, n_rows, step)]
    engramdb.build(path, "t", ROW, chunks)


def shard_paths(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix == ".edb")


def make_cold(path: Path) -> float:
    paths = shard_paths(path)
    for p in paths:
        evict(p)
    sizes = [p.stat().st_size for p in paths]
    res = [file_residency(p) for p in paths]
    return float(sum(r * s for r, s in zip(res, sizes)) / max(1, sum(sizes)))


def _delta(now: dict[str, int], seen: dict[str, int]) -> dict[str, int]:
    """Batches per path since the last call (updates ``seen``)."""
    d = {k: v - seen.get(k, 0) for k, v in now.items()}
    seen.update(now)
    return d


#: Resolution of the keep_warm phase (its target, twice the populate time, is ~0.5 s here).
KW_STEP = 0.1


def run_phase(
    name: str,
    store: Any,
    seconds: float,
    rng: np.random.Generator,
    echo: bool = True,
    step: float = 1.0,
) -> list[dict[str, Any]]:
    out = np.empty((BATCH, ROW), dtype=np.uint8)
    n = store.n_rows
    ids = rng.integers(0, n, BATCH)
    store.fetch_into(ids, out)
    assert np.array_equal(out, rows_of(ids)), f"{name}: bytes differ"
    per_s = []
    seen: dict[str, int] = dict(store.stats().get("choices", {}))
    t_start = time.perf_counter()
    last = 0.0
    tick = 1
    done = 0
    while True:
        ids = rng.integers(0, n, BATCH)
        store.fetch_into(ids, out)
        done += BATCH
        now = time.perf_counter() - t_start
        if now >= tick * step:
            mem = store.memory()
            row = {
                "t": round(tick * step, 3),
                "vm_rss": process_rss()["VmRSS"],
                "rss_file_table": mem["rss_file_bytes"],
                "rows_per_s": done / (now - last),
                "resident": mem["page_cache_resident_bytes"] / mem["table_bytes"],
                "choices": _delta(store.stats().get("choices", {}), seen),
                "warm": mem["warm"]["state"],
            }
            per_s.append(row)
            if echo:
                print(
                    f"  {name:10s} t={row['t']:5.2f}s {row['rows_per_s'] / 1e6:6.2f} M rows/s  "
                    f"resident {row['resident']:.3f}  mapped RSS "
                    f"{row['rss_file_table'] / 1e6:5.0f} MB  warm {row['warm']:9s} "
                    + " ".join(f"{k}={v}" for k, v in row["choices"].items() if v)
                )
            done = 0
            last = time.perf_counter() - t_start
            tick += 1
            if tick * step > seconds + 1e-9:
                break
    assert np.array_equal(out, rows_of(ids)), f"{name}: bytes differ"
    return per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="0.5 GiB, 10 s phases")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    if a.quick:
        a.gib, a.seconds = 0.5, 10
    n_rows = int(a.gib * (1 << 30)) // ROW
    tmp = Path(tempfile.mkdtemp(prefix="first_read_", dir=a.dir))
    rng = np.random.default_rng(0)
    doc: dict[str, Any] = {"gib": a.gib, "seconds": a.seconds, "rows": n_rows, "row_bytes": ROW}
    try:
        t0 = time.perf_counter()
        build(tmp, n_rows)
        print(
            f"built {n_rows:,} x {ROW} B in {time.perf_counter() - t0:.1f} s; "
            f"resident after build {make_cold(tmp):.4f} (evicted)"
        )
        nbytes = n_rows * ROW

        short = max(3, a.seconds // 3)
        print(
            f"all-cold (direct=True, no background warm), {short} s; resident "
            f"{make_cold(tmp):.4f} before"
        )
        with engramdb.open(tmp, direct=True, background_warm=False) as db:
            cold = run_phase("all-cold", db["t"], short, rng)
        cold_rate = median([r["rows_per_s"] for r in cold])

        print(f"default open, {a.seconds} s; resident {make_cold(tmp):.4f} before")
        with engramdb.open(tmp) as db:
            s = db["t"]
            default = run_phase("default", s, a.seconds, rng)
            fits = s.memory()["fits"]
            s.populate()
            warm = run_phase("post-warm", s, short, rng)
        warm_rate = median([r["rows_per_s"] for r in warm])
        conv = next((r["t"] for r in default if r["rows_per_s"] >= 0.8 * warm_rate), None)

        budget = nbytes // 2
        before = make_cold(tmp)
        print(
            f"page_cache_budget = 50 % ({budget / 1e6:.0f} MB), {a.seconds} s; resident "
            f"{before:.4f} before"
        )
        with engramdb.open(tmp, page_cache_budget=budget) as db:
            s = db["t"]
            half = run_phase("budget50", s, a.seconds, rng)
            added = s.memory()["page_cache_resident_bytes"] - before * nbytes
            fits_half = s.memory()["fits"]
        half_rate = median([r["rows_per_s"] for r in half])

        # --- the same two, paired: one cold device, batches alternated A B / B A, so the
        # device's drift over a run (10-15 % here) cancels; neither warms the page cache
        make_cold(tmp)
        with (
            engramdb.open(tmp, direct=True, background_warm=False) as db1,
            engramdb.open(tmp, page_cache_budget=budget) as db2,
        ):
            pair_t: dict[str, list[float]] = {"all-cold": [], "budget50": []}
            arms = {"all-cold": db1["t"], "budget50": db2["t"]}
            buf = np.empty((BATCH, ROW), dtype=np.uint8)
            t_end = time.perf_counter() + short
            j = 0
            while time.perf_counter() < t_end:
                order = list(arms) if j % 2 == 0 else list(arms)[::-1]
                for name in order:
                    ids = rng.integers(0, n_rows, BATCH)
                    t0 = time.perf_counter()
                    arms[name].fetch_into(ids, buf)
                    pair_t[name].append(time.perf_counter() - t0)
                j += 1
            assert np.array_equal(buf, rows_of(ids)), "paired: bytes differ"
            pair_added = arms["budget50"].memory()["page_cache_resident_bytes"]
        pair_ratio = median(pair_t["all-cold"]) / median(pair_t["budget50"])
        print(
            f"  paired {len(pair_t['budget50'])} batch pairs: budget50 / all-cold rate "
            f"{pair_ratio:.2f}x; page cache resident after {pair_added / 1e6:.1f} MB"
        )

        # --- rss_budget: a quarter of the table, table resident, random reads ---------------
        rss_budget = nbytes // 4
        print(f"rss_budget = 25 % ({rss_budget / 1e6:.0f} MB), table resident, {short} s")
        with engramdb.open(tmp, rss_budget=rss_budget) as db:
            s = db["t"]
            s.populate()  # everything mapped: the watcher must trim it
            rss = run_phase("rss25", s, short, rng)
            trims = s.tiers.trims
        rss_max = max(r["rss_file_table"] for r in rss)
        rss_rate = median([r["rows_per_s"] for r in rss])

        # --- keep_warm: residency lost under a live store, re-warmed in the background ------
        make_cold(tmp)
        with engramdb.open(tmp, keep_warm=True, background_warm=False) as db:
            s = db["t"]
            t0 = time.perf_counter()
            s.populate()
            warm_s = time.perf_counter() - t0
            before_loss = run_phase("kw-warm", s, 3, rng)
            kw_warm = median([r["rows_per_s"] for r in before_loss])
            drop_mapped_pages(s.array())  # what a checkpoint load's memory pressure does
            for p in shard_paths(tmp):
                evict(p)
            print(
                f"  residency after the loss {s.residency():.3f}; warm from cold took {warm_s:.2f} s"
            )
            after = run_phase("kw-after", s, max(3, int(4 * warm_s) + 2), rng, step=KW_STEP)
        restored = next((r["t"] for r in after if r["rows_per_s"] >= 0.9 * kw_warm), None)

        print()
        print(
            f"table {nbytes / 1e9:.2f} GB; fits the default budget: {fits}; fits 50 %: {fits_half}"
        )
        print(f"all-cold median          {cold_rate / 1e6:7.3f} M rows/s")
        print(f"post-warm median         {warm_rate / 1e6:7.3f} M rows/s  (populated mapping)")
        last = default[-1]["rows_per_s"]
        print(
            f"default, last second     {last / 1e6:7.3f} M rows/s  = "
            f"{last / warm_rate:.2f}x post-warm"
        )
        print(
            f"default converged (>= 0.8x post-warm) at: {'never' if conv is None else f'{conv} s'}"
        )
        print(
            f"budget 50 % median       {half_rate / 1e6:7.3f} M rows/s  = "
            f"{half_rate / cold_rate:.2f}x all-cold; page cache added "
            f"{added / 1e6:.1f} MB of a {budget / 1e6:.0f} MB budget"
        )
        print(
            f"budget 50 % paired          {pair_ratio:.2f}x all-cold (batches alternated, "
            f"{len(pair_t['budget50'])} pairs)"
        )
        print(
            f"rss_budget 25 %            mapped table RSS max {rss_max / 1e6:.0f} MB of a "
            f"{rss_budget / 1e6:.0f} MB budget (sampled each second; {trims} trims), "
            f"{rss_rate / 1e6:.3f} M rows/s = {rss_rate / warm_rate:.2f}x post-warm"
        )
        print(
            f"keep_warm                  warm {kw_warm / 1e6:.3f} M rows/s; after losing the "
            f"pages >= 0.9x again at {'never' if restored is None else f'{restored} s'} "
            f"(warm from cold: {warm_s:.2f} s; target within 2x = {2 * warm_s:.2f} s, "
            f"measured at {KW_STEP} s resolution)"
        )
        print(f"peak RSS {vm_hwm_mb():.0f} MB")
        doc.update(
            all_cold=cold,
            default=default,
            post_warm=warm,
            budget_half=half,
            cold_rate=cold_rate,
            warm_rate=warm_rate,
            convergence_s=conv,
            half_rate=half_rate,
            half_paired_ratio=pair_ratio,
            half_paired_pairs=len(pair_t["budget50"]),
            half_added_bytes=added,
            half_budget=budget,
            rss_budget=rss_budget,
            rss_phase=rss,
            rss_max=rss_max,
            keep_warm_before=before_loss,
            keep_warm_after=after,
            keep_warm_restored_s=restored,
            warm_from_cold_s=warm_s,
            vm_hwm_mb=vm_hwm_mb(),
        )
        print(f"json: {write_json('first_read', doc)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
