"""RAM tier: hit rate on a zipfian workload, and its cost on a uniform one, 5 % budget.

    python probes/tier.py [--gb 1.0] [--budget-frac 0.05] [--batch 4096] [--reps 5]
                          [--zipf 1.1,1.2] [--dir D] [--keep]
    python probes/tier.py --cold-start [--gb 0.5] [--ws-frac 0.05] [--seconds 10]

``--cold-start``: does the RAM tier rescue a cold start? The table is evicted (its files
``POSIX_FADV_DONTNEED``-ed, residency checked), opened with ``ram_budget`` above a working set
of ``--ws-frac`` of the rows and a page-cache budget of 1 MB (the table does not fit: cold
reads go to the device, no background warm, so only the tier can help). Batches of 16,384
ids drawn uniformly from the working set for ``--seconds``: per second, rows/s and the
tier's hit rate; the same batches through a store without a tier (also cold) for the
all-cold rate; the converged tier rate is the median of the last 3 seconds. Prints when the
rate first reached 0.8x the converged rate.

Builds a Qwen-PLE-geometry table (~--gb GB) and deletes it at the end. The tier gets
--budget-frac of the table's bytes (slab, index and presence bitmap all counted).

* zipfian (agent-like: a few contexts recur a lot): row ids are a random permutation of
  zipf(a) ranks, batches of --batch ids. Per exponent, two tiers: CLOCK only (starts empty),
  and hot set pinned from an index of a separate sample of the same workload (what
  `engramdb index` + `warm --hot` do). The table is evicted first: the tier is for tables
  the page cache does not hold (while the table is resident, large batches bypass the tier).
  Hit rate = tier hits / rows requested over --zipf-batches batches after as many warm-up
  batches (rows of batches that bypassed the tier count as misses). The bound is what any
  policy could reach: the probability mass of the `slots` most probable rows.
* throughput with and without the tier (hot set of the last exponent pinned), interleaved:
  uniform and zipf, warm and cold.
  Uniform: `fetch_into` of 16,384 uniform random ids; warm = table populated, cold = table
  evicted before every arm (both stores' mappings dropped, residency checked).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, vm_hwm_mb, write_json  # noqa: E402
from workload_tables import build_table, hasher_for_bytes, make_cold, residency  # noqa: E402

import engramdb  # noqa: E402
from engramdb.testing.pages import drop_mapped_pages  # noqa: E402


def zipf_ids(rng: np.random.Generator, a: float, perm: np.ndarray, n: int) -> np.ndarray:
    ranks = rng.zipf(a, n) - 1
    ranks = ranks[ranks < perm.size]
    while ranks.size < n:
        more = rng.zipf(a, n) - 1
        ranks = np.concatenate([ranks, more[more < perm.size]])
    return perm[ranks[:n]]


def per_second(s: engramdb.Store, sets: list[np.ndarray], seconds: int) -> list[dict]:
    """Batches from ``sets`` (cycled) for ``seconds``: rows/s and tier hit rate per second."""
    out = np.empty((sets[0].size, s.row_bytes), np.uint8)
    rows: list[dict] = []
    k = 0
    t_start = time.perf_counter()
    for sec in range(seconds):
        st0 = s.stats().get("cache") or {}
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t_start < sec + 1:
            s.fetch_into(sets[k % len(sets)], out)
            k += 1
            n += out.shape[0]
        dt = time.perf_counter() - t0
        st1 = s.stats().get("cache") or {}
        hits = st1.get("hits", 0) - st0.get("hits", 0)
        miss = st1.get("misses", 0) - st0.get("misses", 0)
        rows.append(
            {
                "t": sec + 1,
                "rows_per_s": n / dt,
                "hit_rate": hits / max(1, hits + miss),
                "choices": dict(s.stats().get("choices") or {}),
            }
        )
    return rows


def cold_start(args: argparse.Namespace) -> None:
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edb-tier-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    try:
        gb = args.gb if args.gb != 1.0 else 0.5
        h = hasher_for_bytes(int(gb * 1e9))
        db_path = build_table(work, h)
        with engramdb.open(db_path) as d0:
            n_rows, nbytes = d0["ple"].n_rows, d0["ple"].nbytes
            ref = d0["ple"]
            ws = rng.choice(n_rows, int(args.ws_frac * n_rows), replace=False).astype(np.int64)
            sets = [rng.choice(ws, 16_384) for _ in range(64)]
            check = ref.fetch(sets[0])
            make_cold(ref)
        budget = int(ws.size * 160 * 2.5) + (4 << 20)
        print(
            f"table {nbytes / 1e9:.2f} GB; working set {ws.size:,} rows "
            f"({ws.size * 160 / 1e6:.0f} MB); ram_budget {budget / 1e6:.0f} MB; "
            "page-cache budget 1 MB (the table does not fit)"
        )
        arms = {}
        for label, kw in (
            ("tier", {"ram_budget": budget}),
            ("no tier", {}),
        ):
            with engramdb.open(db_path, page_cache_budget="1M", background_warm=False, **kw) as db:
                s = db["ple"]
                left = make_cold(s)
                if left > 0.01:
                    raise SystemExit(f"eviction failed: {left:.1%} resident")
                assert np.array_equal(s.fetch(sets[0]), check)  # bytes equal the source
                secs = args.seconds if label == "tier" else max(2, args.seconds // 3)
                arms[label] = per_second(s, sets, secs)
                st = s.stats()
                print(f"{label}: choices {st.get('choices')}; cache {st.get('cache')}")
                for r in arms[label]:
                    print(
                        f"  {label:7s} t={r['t']:2d}s  {r['rows_per_s'] / 1e6:7.3f} M rows/s"
                        f"  tier hit rate {r['hit_rate']:.3f}"
                    )
        tier = arms["tier"]
        final = median([r["rows_per_s"] for r in tier[-3:]])
        cold = median([r["rows_per_s"] for r in arms["no tier"]])
        conv = next((r["t"] for r in tier if r["rows_per_s"] >= 0.8 * final), None)
        print(f"converged tier rate (median of the last 3 s) {final / 1e6:.3f} M rows/s")
        print(f"all-cold rate (no tier, O_DIRECT)           {cold / 1e6:.3f} M rows/s")
        print(f"RATIO tier converged / all-cold {final / cold:.1f}x")
        print(f"reached >= 0.8x the converged rate at: {'never' if conv is None else f'{conv} s'}")
        write_json(
            "tier_cold_start",
            {
                "probe": "tier --cold-start",
                "table_bytes": nbytes,
                "working_set_rows": int(ws.size),
                "ram_budget": budget,
                "per_second": arms,
                "converged_rows_per_s": final,
                "all_cold_rows_per_s": cold,
                "converged_at_s": conv,
                "peak_rss_mb": vm_hwm_mb(),
            },
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--budget-frac", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--zipf", default="1.1,1.2,1.3")
    ap.add_argument("--zipf-batches", type=int, default=100, help="warm-up = measured batches")
    ap.add_argument("--cold-batches", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--cold-start", action="store_true", help="only the cold-start arm")
    ap.add_argument("--ws-frac", type=float, default=0.05, help="working set, share of rows")
    ap.add_argument("--seconds", type=int, default=10)
    args = ap.parse_args()
    if args.cold_start:
        cold_start(args)
        return
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edb-tier-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    doc: dict[str, object] = {"probe": "tier", "budget_frac": args.budget_frac}
    try:
        h = hasher_for_bytes(int(args.gb * 1e9))
        db_path = build_table(work, h)
        plain = engramdb.open(db_path)
        s0 = plain["ple"]
        n_rows = s0.n_rows
        budget = int(args.budget_frac * s0.nbytes)
        doc.update(table_bytes=s0.nbytes, budget_bytes=budget)
        s0.populate()
        print(f"table {s0.nbytes / 1e9:.2f} GB, tier budget {budget / 1e6:.0f} MB")
        perm = rng.permutation(n_rows)

        # -- zipfian hit rate ----------------------------------------------------------------
        zdoc: dict[str, object] = {}
        hot_sets: dict[float, np.ndarray] = {}
        for a in (float(x) for x in args.zipf.split(",")):
            nb = 2 * args.zipf_batches
            wl = zipf_ids(rng, a, perm, nb * args.batch).reshape(nb, args.batch)
            train = zipf_ids(rng, a, perm, 2_000_000)
            uniq, counts = np.unique(train, return_counts=True)
            hot = uniq[np.argsort(-counts, kind="stable")]
            hot_sets[a] = hot
            out = np.empty((args.batch, 160), np.uint8)
            row: dict[str, object] = {}
            half = args.zipf_batches
            for label, pin in (("clock", False), ("hot+clock", True)):
                with engramdb.open(db_path, ram_budget=budget) as db:
                    s = db["ple"]
                    assert s.cache is not None
                    drop_mapped_pages(s0.array())
                    left = make_cold(s)  # the tier matters when reads go to the device
                    if left > 0.01:
                        raise SystemExit(f"eviction failed: {left:.1%} resident")
                    if pin:
                        s.load_hot(hot)
                    t0 = time.perf_counter()
                    for b in wl[:half]:
                        s.fetch_into(b, out)
                    st0 = s.stats()["cache"]
                    t1 = time.perf_counter()
                    for b in wl[half : 2 * half]:
                        s.fetch_into(b, out)
                    t2 = time.perf_counter()
                    st1 = s.stats()["cache"]
                    assert np.array_equal(s.fetch(wl[-1]), s0.fetch(wl[-1]))
                    hits = st1["hits"] - st0["hits"]
                    rate = hits / (half * args.batch)
                    row[label] = {
                        "hit_rate": rate,
                        "bypassed": st1["bypassed"] - st0["bypassed"],
                        "slots": s.cache.slots,
                        "pinned": s.cache.n_hot,
                        "rows_per_s_measured": half * args.batch / (t2 - t1),
                        "warmup_s": t1 - t0,
                        "resident_after": residency(s),
                        "choices": s.stats().get("choices"),
                    }
                    print(
                        f"  zipf a={a}: {label:9s} hit rate {rate:.3f} "
                        f"({s.cache.slots:,} slots = {s.cache.slots / n_rows:.1%} of rows, "
                        f"{s.cache.n_hot:,} pinned, bypassed {row[label]['bypassed']:,}, "
                        f"{row[label]['rows_per_s_measured'] / 1e6:.2f} M rows/s, table "
                        f"{row[label]['resident_after']:.1%} resident after)"
                    )
            # The best any policy can do on this stationary workload: hold the `slots` most
            # probable rows (zipf probabilities, truncated to the table).
            slots = row["clock"]["slots"]  # type: ignore[index]
            p = np.arange(1, n_rows + 1, dtype=np.float64) ** -a
            row["bound_top_slots"] = float(p[:slots].sum() / p.sum())
            print(
                f"  zipf a={a}: bound (the {slots:,} most probable rows held) "
                f"{row['bound_top_slots']:.3f}"
            )
            zdoc[str(a)] = row
        doc["zipf"] = zdoc

        # -- throughput: uniform warm / cold, zipf warm ----------------------------------------
        tiered = engramdb.open(db_path, ram_budget=budget)
        st = tiered["ple"]
        out = np.empty((16_384, 160), np.uint8)
        uni = np.stack([rng.integers(0, n_rows, 16_384) for _ in range(64)])
        for b in uni:
            st.fetch_into(b, out)
        a0 = float(args.zipf.split(",")[-1])
        zb = zipf_ids(rng, a0, perm, 64 * 16_384).reshape(64, 16_384)
        st.load_hot(hot_sets[a0])  # as `engramdb warm --hot` does from the index

        def rate(s: engramdb.Store, batches: list[np.ndarray] | np.ndarray) -> float:
            t0 = time.perf_counter()
            for b in batches:
                s.fetch_into(b, out)
            return len(batches) * 16_384 / (time.perf_counter() - t0)

        def interleave(arms: dict[str, object], label: str, cold: bool = False) -> dict:
            res: dict[str, list[float]] = {k: [] for k in arms}
            names = list(arms)
            print(f"\n{label} (M rows/s):")
            for r in range(args.reps):
                order = names if r % 2 == 0 else names[::-1]
                line = []
                for n in order:
                    s, batches = arms[n]  # type: ignore[misc]
                    if cold:  # fresh batches per repetition (the same for both arms)
                        cb = args.cold_batches
                        batches = batches[r * cb : (r + 1) * cb]
                    if cold:  # both stores map the file: drop both mappings first
                        drop_mapped_pages(s0.array())
                        left = make_cold(st)
                        if left > 0.01:
                            raise SystemExit(f"eviction failed: {left:.1%} resident")
                    v = rate(s, batches)
                    res[n].append(v)
                    line.append(f"{n} {v / 1e6:.3f}")
                print(f"  rep {r}: " + "  ".join(line))
            med = {k: median(v) for k, v in res.items()}
            print("  median: " + "  ".join(f"{k} {v / 1e6:.3f}" for k, v in med.items()))
            return {"reps": res, "median": med}

        st.populate()
        time.sleep(0.3)  # let both stores' read rules see the table resident (re-check 0.25 s)
        for b in uni[:4]:
            st.fetch_into(b, out)
            s0.fetch_into(b, out)
        warm_u = interleave({"no_tier": (s0, uni), "tier": (st, uni)}, "uniform, warm")
        c0 = st.stats()["cache"]
        warm_z = interleave({"no_tier": (s0, zb), "tier": (st, zb)}, f"zipf a={a0}, warm")
        cb = args.cold_batches
        cold_u = interleave(
            {"no_tier": (s0, uni), "tier": (st, uni)},
            f"uniform, cold ({cb} batches of 16,384 per arm)",
            cold=True,
        )
        cold_z = interleave(
            {"no_tier": (s0, zb), "tier": (st, zb)},
            f"zipf a={a0}, cold ({cb} batches of 16,384 per arm; the tier keeps what it learnt)",
            cold=True,
        )
        doc.update(
            uniform_warm=warm_u,
            zipf_warm=warm_z,
            uniform_cold=cold_u,
            zipf_cold=cold_z,
            tier_stats=st.stats(),
            plain_stats=s0.stats(),
            zipf_cache_before=c0,
            vm_hwm_mb=vm_hwm_mb(),
        )
        tiered.close()
        plain.close()
        uw, zw, uc, zc = warm_u["median"], warm_z["median"], cold_u["median"], cold_z["median"]
        print("\nsummary:")
        for a, row in zdoc.items():
            print(
                f"  zipf a={a}: hit rate clock {row['clock']['hit_rate']:.3f}, "  # type: ignore[index]
                f"hot+clock {row['hot+clock']['hit_rate']:.3f}, "  # type: ignore[index]
                f"bound {row['bound_top_slots']:.3f}"
            )  # type: ignore[index]
        print(f"  peak RSS {doc['vm_hwm_mb']:.0f} MB")
        print(
            f"ratio tier / no tier: uniform warm {uw['tier'] / uw['no_tier']:.2f}x, "
            f"uniform cold {uc['tier'] / uc['no_tier']:.2f}x, zipf warm "
            f"{zw['tier'] / zw['no_tier']:.2f}x, zipf cold {zc['tier'] / zc['no_tier']:.2f}x"
        )
        print(f"json: {write_json('tier', doc)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
