"""Workload A through a Mooncake store: a training corpus's lookups, replayed through a
published Store-P view, against the local EngramDB store and plain ranged reads, same run.

    python probes/mooncake_view.py [--batches 24] [--zipf 1.1] [--reps 3]

Starts ``mooncake_master`` and one storage host in a private network namespace (loopback
only, TCP transport), like probes/mooncake.py, then:

* hashes a synthetic corpus (Zipf-distributed token ids, ``--batches`` batches of
  ``[64, 256]`` tokens) with the DeepSeek Engram demo hasher cut to 8 heads of ~500,000 rows
  (two n-gram orders x 4 heads), so every batch is a real ``[64, 256, 8]`` lookup;
* builds the table (264 B rows, 1.06 GB) and a row view of the corpus's distinct row tuples
  in first-access order (what ``engramdb index`` + ``engramdb view build`` store for it), and
  publishes both (``engramdb publish``: record objects plus a row index);
* replays the epoch's batches in order through ``lookup_into``:
  ``local`` — the local EngramDB store (page cache warm; the baseline, first and last),
  ``view`` — `open_mooncake(..., view="corpus")`: one ``get_into_ranges`` per batch, records
  in merged runs (records read earlier come from the reader's 64 MiB cache), unmatched
  positions row by row,
  ``ranged`` — the same table through the store without the view (one range per row; a
  couple of batches only: it runs at tens of thousands of rows/s),
  ``held_out`` — the view on batches of a *different* corpus of the same distribution (only
  the n-grams both corpora share hit), to show what the view does not cover;
* checks every arm's bytes against the local store, prints the counters that prove the path
  (calls, ranges, hits, misses, records read), and the ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
# This directory holds a probe named mooncake.py: keep it off sys.path so that
# `import mooncake` finds the wheel, and load the probe helpers by file path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
sys.path.insert(0, str(ROOT.parent / "tests"))
_spec = importlib.util.spec_from_file_location("probe_common", ROOT / "common.py")
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
from mooncake_harness import Cluster, enter_private_netns  # noqa: E402

import engramdb  # noqa: E402
from engramdb import keygen  # noqa: E402
from engramdb.build.view import build_view  # noqa: E402
from engramdb.integrations import mooncake as mc  # noqa: E402

ROW = 264
B, T = 64, 256


def corpus_ids(h: keygen.Hasher, layer: int, batches: int, zipf: float, seed: int) -> np.ndarray:
    """Per-head local ids ``[batches, B, T, H]`` of a Zipf token corpus (32,000 ids)."""
    rng = np.random.default_rng(seed)
    tok = ((rng.zipf(zipf, size=(batches * B, T)) - 1) % 32_000).astype(np.int64)
    ids = h.local_ids(tok, layer=layer, compressed=True)
    return np.ascontiguousarray(ids.reshape(batches, B, T, -1))


def first_access_tuples(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Distinct global row tuples of ``ids`` in first-access order: int64 ``[K, H]``."""
    g = ids.reshape(-1, ids.shape[-1]) + offsets
    _, first = np.unique(g, axis=0, return_index=True)
    return g[np.sort(first)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=24, help="[64, 256] batches per epoch")
    ap.add_argument("--zipf", type=float, default=1.1, help="token distribution exponent")
    ap.add_argument("--reps", type=int, default=3, help="interleaved epoch replays per arm")
    ap.add_argument("--ranged-batches", type=int, default=2)
    ap.add_argument("--segment", default="4GB", help="storage host memory")
    args = ap.parse_args()

    h = keygen.preset(
        "deepseek-engram-demo",
        engram_vocab_size=[500_000, 500_000],
        n_head_per_ngram=4,
        compressed_vocab_size=32_000,
        compressed_pad_id=2,
    )
    layer = h.layers[0]
    heads = h.primes(layer).astype(np.int64)
    offsets = h.offsets(layer).astype(np.int64)
    epoch = corpus_ids(h, layer, args.batches, args.zipf, seed=1)
    other = corpus_ids(h, layer, 2, args.zipf, seed=2)
    tuples = first_access_tuples(epoch, offsets)
    n_pos = epoch.shape[0] * B * T
    print(
        f"corpus: {n_pos:,} positions in {args.batches} batches of [64, 256, 8] (zipf "
        f"{args.zipf}); {tuples.shape[0]:,} distinct row tuples ({tuples.shape[0] / n_pos:.0%})"
    )

    restore = enter_private_netns()
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    work = Path(tempfile.mkdtemp(prefix="edb-mcv-"))
    cluster = Cluster(segment=args.segment, lease_ms=10_000)
    report: dict[str, object] = {
        "probe": "mooncake_view",
        "row_bytes": ROW,
        "batches": args.batches,
        "zipf": args.zipf,
        "positions": n_pos,
        "distinct_tuples": int(tuples.shape[0]),
        "heads": heads.tolist(),
    }
    client = None
    try:
        rng = np.random.default_rng(0)
        db_path = work / "db"
        arrays = [rng.integers(0, 256, (int(n), ROW), dtype=np.uint8) for n in heads]
        engramdb.build(db_path, "engram", ROW, arrays)
        table_bytes = sum(a.nbytes for a in arrays)
        del arrays
        t0 = time.perf_counter()
        build_view(db_path, table="engram", name="corpus", rows=tuples)
        view_s = time.perf_counter() - t0
        print(
            f"table {table_bytes / 1e9:.2f} GB; view of {tuples.shape[0]:,} records x "
            f"{8 * ROW} B = {tuples.shape[0] * 8 * ROW / 1e9:.2f} GB built in {view_s:.1f} s"
        )
        cluster.start()
        client = cluster.connect()
        summary = mc.publish(db_path, client=client, name="a", views=["corpus"])
        print(summary.line())
        report["publish_gbs"] = summary.gb_per_s

        local_db = engramdb.open(db_path, populate=True)
        local = local_db["engram"]
        db_view = mc.open_mooncake(client=client, name="a", view="corpus")
        db_rows = mc.open_mooncake(client=client, name="a")
        t_view, t_rows = db_view["engram"], db_rows["engram"]
        outs = {k: np.empty((B, T, 8, ROW), np.uint8) for k in ("local", "view", "ranged")}
        for k in ("view", "ranged"):
            assert client.register_buffer(outs[k].ctypes.data, outs[k].nbytes) == 0

        def run(arm: str, batch: np.ndarray) -> None:
            if arm == "local":
                local.lookup_into(batch, outs["local"])
            elif arm == "ranged":
                t_rows.lookup_into(batch, outs["ranged"])
            else:
                t_view.lookup_into(batch, outs["view"])

        # correctness first: two batches of the epoch, one held-out batch, every arm
        for batch in (epoch[0], epoch[-1], other[0]):
            run("local", batch)
            for arm in ("view", "ranged"):
                run(arm, batch)
                if not np.array_equal(outs[arm], outs["local"]):
                    raise SystemExit(f"MISMATCH: {arm} differs from the local store")
        print(
            "correctness: view == ranged == local store on 3 batches (2 of the epoch, 1 held out)"
        )

        # replay the epoch: local and view interleaved, whole epochs
        rows_per_batch = B * T * 8
        rates: dict[str, list[float]] = {"local": [], "view": []}
        base = t_view.stats()
        for r in range(args.reps):
            seq = ("local", "view") if r % 2 == 0 else ("view", "local")
            line = []
            for arm in seq:
                t0 = time.perf_counter()
                for batch in epoch:
                    run(arm, batch)
                rate = epoch.shape[0] * rows_per_batch / (time.perf_counter() - t0)
                rates[arm].append(rate)
                line.append(f"{arm}={rate / 1e6:.2f}M")
            print(f"  epoch replay rep {r}: rows/s " + "  ".join(line))
        t0 = time.perf_counter()
        for batch in epoch:
            run("local", batch)
        last_local = epoch.shape[0] * rows_per_batch / (time.perf_counter() - t0)
        s = t_view.stats()
        calls = s["get_into_ranges_calls"] - base["get_into_ranges_calls"]
        per_batch = {
            k: (s[f"view_{k}"] - base[f"view_{k}"]) / (args.reps * epoch.shape[0])
            for k in ("hits", "misses", "cache_hits", "runs", "records_read")
        }
        print(
            f"  view path per batch: {calls / (args.reps * epoch.shape[0]):.1f} get_into_ranges "
            f"call(s), {per_batch['runs']:.0f} record runs, {per_batch['records_read']:.0f} "
            f"records read for {per_batch['hits']:.0f} hits ({per_batch['cache_hits']:.0f} "
            f"from the reader's cache), {per_batch['misses']:.0f} positions read row by row"
        )

        # the arms that the view does not help: plain ranged reads, a held-out corpus
        ranged_rates = []
        r0 = t_rows.stats()
        for batch in epoch[: args.ranged_batches]:
            t0 = time.perf_counter()
            run("ranged", batch)
            ranged_rates.append(rows_per_batch / (time.perf_counter() - t0))
        r1 = t_rows.stats()
        held = []
        h0 = t_view.stats()
        for batch in other:
            t0 = time.perf_counter()
            run("view", batch)
            held.append(rows_per_batch / (time.perf_counter() - t0))
        h1 = t_view.stats()
        held_hit = (h1["view_hits"] - h0["view_hits"]) / max(
            1, h1["view_hits"] - h0["view_hits"] + h1["view_misses"] - h0["view_misses"]
        )
        print(
            f"  ranged (no view): {', '.join(f'{x / 1e6:.4f}M' for x in ranged_rates)} rows/s "
            f"({(r1['ranges'] - r0['ranges']) / len(ranged_rates):,.0f} ranges per batch)"
        )
        print(
            f"  held-out corpus through the view: {', '.join(f'{x / 1e6:.4f}M' for x in held)} "
            f"rows/s, {held_hit:.0%} of positions in the view"
        )

        med = {k: float(np.median(v)) for k, v in rates.items()}
        ranged_med = float(np.median(ranged_rates))
        ratios = {
            "view_vs_local": med["view"] / med["local"],
            "view_vs_ranged": med["view"] / ranged_med,
            "held_out_vs_ranged": float(np.median(held)) / ranged_med,
        }
        report.update(
            {
                "rows_per_s": {
                    "local": rates["local"],
                    "view": rates["view"],
                    "ranged": ranged_rates,
                    "held_out_view": held,
                    "local_last": last_local,
                },
                "view_per_batch": {"calls": calls / (args.reps * epoch.shape[0]), **per_batch},
                "held_out_hit_fraction": held_hit,
                "ratios": ratios,
                "acceptance_view_ge_1M_rows_per_s": med["view"] >= 1e6,
            }
        )
        print(
            f"RATE  [64,256,8] epoch replay: view {med['view'] / 1e6:.2f}M  local "
            f"{med['local'] / 1e6:.2f}M (last {last_local / 1e6:.2f}M)  ranged "
            f"{ranged_med / 1e6:.4f}M rows/s"
        )
        print("RATIO " + "  ".join(f"{k}={v:.3g}x" for k, v in ratios.items()))
        print(f"json: {common.write_json('mooncake_view', report)}")
        for k in ("view", "ranged"):
            client.unregister_buffer(outs[k].ctypes.data)
        db_view.close()
        db_rows.close()
        local_db.close()
        mc.unpublish("a", client=client)
    finally:
        if client is not None:
            client.close()
        cluster.stop()
        restore()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
