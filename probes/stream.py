"""Corpus streaming: tokens/s of `engramdb.stream` (16 rows x 160 B per token), warm and cold.

    python probes/stream.py [--gb 1.6] [--tokens 4000000] [--cold-tokens 10000] [--reps 5]
                            [--batch-tokens 8192] [--dir D] [--keep]

Builds a Qwen-PLE-geometry table (~--gb GB) and deletes it at the end. First an untimed pass
checks every streamed batch against keygen + `Store.fetch` of the same positions. Arms,
interleaved (order alternates per repetition), medians:

  warm (table populated):  stream (background keygen + gather, bounded queue)
                           | sync (keygen then Store.fetch_into on the consumer's thread)
                           | numpy (keygen then memmap[rows])
  warm, busy consumer:     the consumer spends --consumer-ms per batch (a sleep, like a GPU
                           step): stream overlaps it, sync adds it
  cold (table evicted before each arm, residency checked): stream | sync
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
from engramdb.testing.pages import drop_mapped_pages  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.6)
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--cold-tokens", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--consumer-ms", type=float, default=4.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edb-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    bt = args.batch_tokens
    doc: dict[str, object] = {"probe": "stream", "batch_tokens": bt, "reps": args.reps}
    try:
        h = hasher_for_bytes(int(args.gb * 1e9))
        db = engramdb.open(build_table(work, h))
        s = db["ple"]
        doc["table_bytes"] = s.nbytes
        print(f"table: {s.n_rows:,} rows x 160 B = {s.nbytes / 1e9:.2f} GB")
        corpus = token_stream(rng, args.tokens)
        s.populate()

        # -- correctness: every batch of the whole corpus ------------------------------------
        t0 = time.perf_counter()
        pos = 0
        for tokens, e in db.stream(corpus, preset=h, batch_tokens=bt):
            n = tokens.shape[0]
            assert np.array_equal(tokens, corpus[pos : pos + n])
            lo = max(0, pos - 2)
            want = s.fetch(h.row_ids(corpus[lo : pos + n], layer=LAYER)[pos - lo :])
            assert np.array_equal(e, want), f"batch at token {pos} differs"
            pos += n
        assert pos == corpus.size
        print(
            f"correctness: {pos:,} tokens streamed == keygen + Store.fetch "
            f"({time.perf_counter() - t0:.1f} s)"
        )

        def arm_stream(toks: np.ndarray, consumer_s: float = 0.0) -> float:
            t0 = time.perf_counter()
            n = 0
            for tokens, e in db.stream(toks, preset=h, batch_tokens=bt):
                n += tokens.shape[0] + 0 * int(e[-1, -1, -1])  # the consumer touches its rows
                if consumer_s:
                    time.sleep(consumer_s)
            return n / (time.perf_counter() - t0)

        out = np.empty((bt, 16, 160), np.uint8)

        def arm_sync(toks: np.ndarray, consumer_s: float = 0.0) -> float:
            t0 = time.perf_counter()
            ks = h.stream(layer=LAYER)
            for i in range(0, toks.size, bt):
                rows = ks.push(toks[i : i + bt])
                s.fetch_into(rows, out[: rows.shape[0]])
                if consumer_s:
                    time.sleep(consumer_s)
            return toks.size / (time.perf_counter() - t0)

        mm = np.memmap(s.db_path / s.info.shards[0].path, dtype=np.uint8, mode="r")
        npt = mm[: s.n_rows * 160].reshape(s.n_rows, 160)

        def arm_numpy(toks: np.ndarray) -> float:
            t0 = time.perf_counter()
            ks = h.stream(layer=LAYER)
            for i in range(0, toks.size, bt):
                out[: min(bt, toks.size - i)] = npt[ks.push(toks[i : i + bt])]
            return toks.size / (time.perf_counter() - t0)

        arm_numpy(corpus[: 20 * bt])  # fill the numpy mapping's page tables once

        def run(arms: dict[str, Callable[[], float]], label: str) -> dict[str, list[float]]:
            res: dict[str, list[float]] = {k: [] for k in arms}
            names = list(arms)
            print(f"\n{label} (M tokens/s):")
            for r in range(args.reps):
                order = names if r % 2 == 0 else names[::-1]
                row = []
                for n in order:
                    v = arms[n]()
                    res[n].append(v)
                    row.append(f"{n} {v / 1e6:.3f}")
                print(f"  rep {r}: " + "  ".join(row))
            first = names[0]
            print(f"  baseline again: {first} {arms[first]() / 1e6:.3f}")
            return res

        before = s.stats()
        warm = run(
            {
                "stream": lambda: arm_stream(corpus),
                "sync": lambda: arm_sync(corpus),
                "numpy": lambda: arm_numpy(corpus),
            },
            f"warm, {corpus.size:,} tokens (resident {residency(s):.0%})",
        )
        after = s.stats()
        doc["warm_served_rows"] = after["rows_fetched"] - before["rows_fetched"]
        doc["warm_io_requests"] = after["io"]["requests"] - before["io"]["requests"]
        part = corpus[: 100 * bt]
        cs = args.consumer_ms / 1e3
        busy = run(
            {"stream": lambda: arm_stream(part, cs), "sync": lambda: arm_sync(part, cs)},
            f"warm, consumer busy {args.consumer_ms} ms per {bt}-token batch",
        )
        drop_mapped_pages(npt)

        cold_toks = token_stream(rng, args.cold_tokens)
        cold_res: dict[str, list[float]] = {"stream": [], "sync": []}
        cold_info: dict[str, list[dict[str, float]]] = {"stream": [], "sync": []}
        print(f"\ncold, {cold_toks.size:,} tokens per arm (M tokens/s):")
        for r in range(args.reps):
            order = ["stream", "sync"] if r % 2 == 0 else ["sync", "stream"]
            row = []
            for n in order:
                left = make_cold(s)
                if left > 0.01:
                    raise SystemExit(f"eviction failed: {left:.1%} still resident")
                io0 = proc_read_bytes()
                st0 = s.stats()
                v = arm_stream(cold_toks) if n == "stream" else arm_sync(cold_toks)
                st1 = s.stats()
                cold_res[n].append(v)
                info = {
                    "device_bytes": proc_read_bytes() - io0,
                    "io_requests": st1["io"]["requests"] - st0["io"]["requests"],
                    "resident_after": residency(s),
                }
                cold_info[n].append(info)
                row.append(
                    f"{n} {v / 1e6:.4f} (device {info['device_bytes'] / 1e6:.0f} MB, "
                    f"{info['io_requests']:,} reads)"
                )
            print(f"  rep {r}: " + "  ".join(row))
        doc["cold_choices"] = s.stats().get("choices")

        def med(res: dict[str, list[float]]) -> dict[str, float]:
            return {k: median(v) for k, v in res.items()}

        doc.update(
            warm_tokens_per_s=med(warm),
            busy_tokens_per_s=med(busy),
            cold_tokens_per_s=med(cold_res),
            cold_info=cold_info,
            warm_reps=warm,
            vm_hwm_mb=vm_hwm_mb(),
            stats=s.stats(),
        )
        db.close()
        w, b, c = med(warm), med(busy), med(cold_res)
        print("\nsummary (medians):")
        print(
            f"  warm: stream {w['stream'] / 1e6:.3f} M tokens/s = {w['stream'] * 16 / 1e6:.1f} M rows/s"
            f" = {w['stream'] * 2560 / 1e9:.2f} GB/s; sync {w['sync'] / 1e6:.3f}; "
            f"numpy {w['numpy'] / 1e6:.3f}"
        )
        print(
            f"  busy consumer: stream {b['stream'] / 1e6:.3f} vs sync {b['sync'] / 1e6:.3f} M tokens/s"
        )
        print(f"  cold: stream {c['stream'] / 1e3:.1f} k tokens/s vs sync {c['sync'] / 1e3:.1f} k")
        print(f"  peak RSS {doc['vm_hwm_mb']:.0f} MB")
        print(
            f"ratio warm stream / numpy: {w['stream'] / w['numpy']:.2f}x; "
            f"stream / sync: {w['stream'] / w['sync']:.2f}x; "
            f"busy stream / sync: {b['stream'] / b['sync']:.2f}x; "
            f"cold stream / sync: {c['stream'] / c['sync']:.2f}x"
        )
        print(f"json: {write_json('stream', doc)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
