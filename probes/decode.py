"""Decode-step latency: keygen + 16 rows of 160 B per sequence (Qwen PLE geometry).

    python probes/decode.py [--gb 2.0] [--reps 5] [--steps 10000] [--cold-steps 1000]
                            [--gap-ms 1.0] [--dir D] [--keep]

Builds a Qwen-PLE-geometry table (16 heads, 160 B rows, ~--gb GB) under a temp dir and deletes
it at the end. Correctness first: the decoder's rows equal keygen + `Store.fetch` for every
checked step. Arms, interleaved per repetition (order alternates), medians of the per-rep p50:

  warm, 1 sequence:  Decoder.push + fill  |  KeyStream.push + Store.fetch_into  |
                     KeyStream.push + numpy memmap[rows]           (table populated)
  warm, 32 seqs:     Decoder(batch=32)    |  KeyStream.push([32, 1]) + Store.fetch_into
  cold, 1 / 32 seqs: prefetch one step ahead  |  no prefetch (read at fill)  |
                     prefetch="auto" (must match the better of the two)

Cold arms evict the table before every repetition (drop our page-table entries, then
posix_fadvise DONTNEED; residency checked with mincore) and model an engine step: after each
step the engine computes for --gap-ms (the layers before the table's layer, here a sleep)
before it needs the rows; the timed part is fill + push of the next token, i.e. everything on
the critical path. With prefetch, push starts the reads of the next step's rows at once.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, proc_read_bytes, vm_hwm_mb, write_json  # noqa: E402
from workload_tables import (  # noqa: E402
    LAYER,
    build_table,
    hasher_for_bytes,
    make_cold,
    residency,
    token_stream,
)

import engramdb  # noqa: E402
from engramdb.decode import Decoder  # noqa: E402
from engramdb.testing.pages import drop_mapped_pages  # noqa: E402


def pct(xs: np.ndarray, q: float) -> float:
    return float(np.percentile(xs, q)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10_000, help="warm steps per arm per rep")
    ap.add_argument("--cold-steps", type=int, default=1000, help="cold 1-seq steps per arm per rep")
    ap.add_argument("--cold-batch-steps", type=int, default=100)
    ap.add_argument("--gap-ms", type=float, default=1.0, help="engine compute between steps")
    ap.add_argument("--batch-gap-ms", type=float, default=5.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (reuse with --dir)")
    args = ap.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edb-decode-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    doc: dict[str, object] = {"probe": "decode", "gap_ms": args.gap_ms, "reps": args.reps}
    try:
        h = hasher_for_bytes(int(args.gb * 1e9))
        db_path = build_table(work, h)
        db = engramdb.open(db_path)
        s = db["ple"]
        doc["table_bytes"] = s.nbytes
        print(f"table: {s.n_rows:,} rows x 160 B = {s.nbytes / 1e9:.2f} GB, 16 heads")

        # -- correctness --------------------------------------------------------------------
        s.populate()
        toks = token_stream(rng, 400)
        want = s.fetch(h.row_ids(toks, layer=LAYER))
        for pf in (True, False):
            dec = Decoder(s, h, prefetch=pf)
            out = np.empty(dec.out_shape, np.uint8)
            for t in range(toks.size):
                dec.push(int(toks[t]))
                dec.fill(out)
                assert np.array_equal(out, want[t]), f"decoder differs at step {t}"
        print("correctness: decoder rows == keygen + Store.fetch for 400 steps (both modes)")

        # -- warm, one sequence ----------------------------------------------------------------
        warm_toks = token_stream(rng, args.steps + 1).tolist()
        out1 = np.empty((16, 160), np.uint8)

        def arm_decoder() -> np.ndarray:
            dec = Decoder(s, h)  # prefetch="auto": the table is resident, no hand-off
            ts = np.empty(args.steps)
            pc = time.perf_counter
            for i in range(args.steps):
                t0 = pc()
                dec.push(warm_toks[i])
                dec.fill(out1)
                ts[i] = pc() - t0
            assert dec.prefetched <= args.steps // 100, "auto prefetch should stay off warm"
            return ts

        def arm_fetch_into() -> np.ndarray:
            ks = h.stream(layer=LAYER)
            ts = np.empty(args.steps)
            pc = time.perf_counter
            for i in range(args.steps):
                t0 = pc()
                s.fetch_into(ks.push(warm_toks[i]), out1)
                ts[i] = pc() - t0
            return ts

        mm = np.memmap(s.db_path / s.info.shards[0].path, dtype=np.uint8, mode="r")
        npt = mm[: s.n_rows * 160].reshape(s.n_rows, 160)
        np.take(npt, np.arange(0, s.n_rows, 256), axis=0)  # touch: page tables like ours

        def arm_numpy() -> np.ndarray:
            ks = h.stream(layer=LAYER)
            ts = np.empty(args.steps)
            pc = time.perf_counter
            for i in range(args.steps):
                t0 = pc()
                out1[...] = npt[ks.push(warm_toks[i])]
                ts[i] = pc() - t0
            return ts

        b = 32
        btoks = rng.integers(0, 248_320, (args.steps // 10 + 1, b))
        outb = np.empty((b, 16, 160), np.uint8)

        def arm_decoder32() -> np.ndarray:
            dec = Decoder(s, h, batch=b)
            n = args.steps // 10
            ts = np.empty(n)
            pc = time.perf_counter
            for i in range(n):
                t0 = pc()
                dec.push(btoks[i])
                dec.fill(outb)
                ts[i] = pc() - t0
            return ts

        def arm_fetch32() -> np.ndarray:
            ks = h.stream(layer=LAYER)
            n = args.steps // 10
            ts = np.empty(n)
            pc = time.perf_counter
            for i in range(n):
                t0 = pc()
                s.fetch_into(ks.push(btoks[i].reshape(b, 1)).reshape(b, 16), outb)
                ts[i] = pc() - t0
            return ts

        warm_arms: dict[str, Callable[[], np.ndarray]] = {
            "decoder": arm_decoder,
            "keygen+fetch_into": arm_fetch_into,
            "keygen+numpy": arm_numpy,
            "decoder_b32": arm_decoder32,
            "keygen+fetch_into_b32": arm_fetch32,
        }
        res: dict[str, list[np.ndarray]] = {k: [] for k in warm_arms}
        print(f"\nwarm (resident {residency(s):.0%}), {args.steps} steps per arm per rep (us):")
        names = list(warm_arms)
        for r in range(args.reps):
            order = names if r % 2 == 0 else names[::-1]
            row = []
            for n in order:
                ts = warm_arms[n]()
                res[n].append(ts)
                row.append(f"{n} p50 {pct(ts, 50):.2f} p99 {pct(ts, 99):.1f}")
            print(f"  rep {r}: " + " | ".join(row))
        ts = arm_decoder()  # baseline again, last: drift
        print(f"  baseline again: decoder p50 {pct(ts, 50):.2f}")
        warm = {
            n: {
                "p50_us": median([pct(t, 50) for t in res[n]]),
                "p99_us": median([pct(t, 99) for t in res[n]]),
            }
            for n in names
        }
        warm["decoder"]["p50_last_us"] = pct(ts, 50)
        doc["warm"] = warm
        doc["warm_stats"] = s.stats()
        drop_mapped_pages(npt)  # the numpy arm's own mapping would pin the pages

        # -- cold ----------------------------------------------------------------------------
        def cold_arm(prefetch: bool | str, batch: int | None, steps: int, gap_s: float) -> dict:
            left = make_cold(s)
            if left > 0.01:
                raise SystemExit(f"eviction failed: {left:.1%} still resident")
            dec = Decoder(s, h, prefetch=prefetch, batch=batch)
            out = np.empty(dec.out_shape, np.uint8)
            shape = () if batch is None else (batch,)
            toks = rng.integers(0, 248_320, (steps + 21, *shape))
            tok = (lambda i: int(toks[i])) if batch is None else (lambda i: toks[i])
            before = s.stats()
            io0 = proc_read_bytes()
            dec.push(tok(0))
            ts = np.empty(steps + 20)
            pc = time.perf_counter
            for i in range(steps + 20):  # the first 20 settle the read rule; not counted
                time.sleep(gap_s)
                t0 = pc()
                dec.fill(out)
                dec.push(tok(i + 1))
                ts[i] = pc() - t0
            dec.reset()  # cancel the last step's prefetch; let a running one land
            if prefetch:
                s.prefetcher.drain()
            n_steps = steps + 21
            after = s.stats()
            ts = ts[20:]
            pf = after.get("prefetch", {})
            pf0 = before.get("prefetch", {})
            return {
                "ts": ts,
                "resident_before": left,
                "resident_after": residency(s),
                "device_bytes": proc_read_bytes() - io0,
                "prefetched_steps": dec.prefetched,
                "prefetched_share": dec.prefetched / n_steps,
                "prefetch_completed": pf.get("completed", 0) - pf0.get("completed", 0),
                "fill_waits": pf.get("waits", 0) - pf0.get("waits", 0),
                "io_requests": after["io"]["requests"] - before["io"]["requests"],
                "read_paths": {  # which path served fills: proves the arm ran as labelled
                    k: v - before.get("choices", {}).get(k, 0)
                    for k, v in after.get("choices", {}).items()
                },
                "prefetched_gathers": after.get("prefetched_gathers", 0)
                - before.get("prefetched_gathers", 0),
            }

        cold: dict[str, object] = {}
        for label, batch, steps, gap in (
            ("b1", None, args.cold_steps, args.gap_ms / 1e3),
            ("b32", 32, args.cold_batch_steps, args.batch_gap_ms / 1e3),
        ):
            print(
                f"\ncold {label}: {steps} steps per arm per rep, engine gap {gap * 1e3:.1f} ms (us):"
            )
            runs: dict[str, list[dict]] = {"prefetch": [], "no_prefetch": [], "auto": []}
            modes: dict[str, bool | str] = {"prefetch": True, "no_prefetch": False, "auto": "auto"}
            for r in range(args.reps):
                order = ["prefetch", "no_prefetch", "auto"]
                order = order if r % 2 == 0 else order[::-1]
                row = []
                for n in order:
                    out = cold_arm(modes[n], batch, steps, gap)
                    runs[n].append(out)
                    ts = out["ts"]
                    row.append(
                        f"{n} p50 {pct(ts, 50):.1f} p99 {pct(ts, 99):.0f} "
                        f"(resident {out['resident_before']:.1%}->{out['resident_after']:.1%}, "
                        f"device {out['device_bytes'] / 1e6:.0f} MB)"
                    )
                print(f"  rep {r}: " + " | ".join(row))
            summary = {}
            for n, lst in runs.items():
                summary[n] = {
                    "p50_us": median([pct(o["ts"], 50) for o in lst]),
                    "p99_us": median([pct(o["ts"], 99) for o in lst]),
                    "all_steps_p50_us": pct(np.concatenate([o["ts"] for o in lst]), 50),
                    "all_steps_p99_us": pct(np.concatenate([o["ts"] for o in lst]), 99),
                    "max_resident_after": max(o["resident_after"] for o in lst),
                    "device_bytes": [o["device_bytes"] for o in lst],
                    "prefetched_steps": [o["prefetched_steps"] for o in lst],
                    "prefetch_completed": [o["prefetch_completed"] for o in lst],
                    "fill_waits": [o["fill_waits"] for o in lst],
                    "io_requests": [o["io_requests"] for o in lst],
                    "read_paths": [o["read_paths"] for o in lst],
                    "prefetched_gathers": [o["prefetched_gathers"] for o in lst],
                }
            summary["ratio_p50"] = summary["no_prefetch"]["p50_us"] / summary["prefetch"]["p50_us"]
            best = min(summary["prefetch"]["p50_us"], summary["no_prefetch"]["p50_us"])
            # auto must be at least as good as the better forced mode (>= 1.0 up to noise)
            summary["auto_vs_best_p50"] = best / summary["auto"]["p50_us"]
            cold[label] = summary
        doc["cold"] = cold
        doc["stats"] = s.stats()
        doc["vm_hwm_mb"] = vm_hwm_mb()
        db.close()

        # -- summary -------------------------------------------------------------------------
        w = doc["warm"]
        print("\nsummary (medians of per-rep figures):")
        for n in names:
            print(f"  warm {n:24s} p50 {w[n]['p50_us']:6.2f} us  p99 {w[n]['p99_us']:6.1f} us")
        for label in ("b1", "b32"):
            c = cold[label]
            print(
                f"  cold {label}: prefetch p50 {c['prefetch']['p50_us']:.1f} us p99 "
                f"{c['prefetch']['p99_us']:.0f} | no prefetch p50 {c['no_prefetch']['p50_us']:.1f}"
                f" us p99 {c['no_prefetch']['p99_us']:.0f}"
            )
        cold_b1 = cold["b1"]
        print(
            f"  cold/warm (no prefetch vs warm decoder): "
            f"{cold_b1['no_prefetch']['p50_us'] / w['decoder']['p50_us']:.0f}x"
        )
        print(f"  peak RSS {doc['vm_hwm_mb']:.0f} MB")
        print(
            f"ratio warm decoder vs keygen+fetch_into: "
            f"{w['keygen+fetch_into']['p50_us'] / w['decoder']['p50_us']:.2f}x faster"
        )
        print(f"ratio cold b32 no-prefetch / prefetch p50: {cold['b32']['ratio_p50']:.1f}x")
        print(f"ratio cold b1 no-prefetch / prefetch p50: {cold_b1['ratio_p50']:.1f}x")
        for label in ("b1", "b32"):
            c = cold[label]
            print(
                f"ratio cold {label} better-of(on, off) / auto p50: {c['auto_vs_best_p50']:.2f}x "
                f"(auto prefetched {median([o for o in c['auto']['prefetched_steps']])} steps)"
            )
        print(f"json: {write_json('decode', doc)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
