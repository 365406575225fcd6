"""Warm gathers of Store-I against the limit, `np.take(out=)` on the same populated mapping.

    python probes/warm_gather.py [--rows-160 8000000] [--rows-264 4000000] [--reps 7] [--quick]

Builds two tables under a temp dir (deleted at the end): 160 B and 264 B rows, opened with
``populate=True`` (page cache warm, page tables filled). Arms, interleaved ABAB, same run,
every repetition printed; the baseline first, each labelled:

  * 16,384 random ids x 160 B: ``np.take(table, ids, axis=0, out=out, mode="clip")`` on the
    store's populated mapping, one thread (**the limit**) | ``Store.fetch_into`` |
    ``Store.fetch`` (allocating) | populated fancy indexing ``table[ids]`` | a never-populated
    ``np.memmap`` of the shard (mapped anew each repetition: what a naive user writes);
  * ``lookup_into`` [64, 256, 8] x 264 B: the same four columns;
  * one 16-row ``fetch_into`` (a decode step): p50 / p99 against ``np.take`` of 16 rows;
  * the same two large-batch ratios paired, per batch (A B / B A) and in blocks of 8
    consecutive batches per arm (each arm in its steady state, the drift still cancelled);
  * (not with ``--quick``) ``engramdb build`` of a .npy source vs a copy of it + fsync.

Every arm of the interleaved repetitions starts after a `CacheFlush` and cycles through 512
distinct batches (64 ``[64, 256, 8]`` id sets for 264 B): about one pass over each table,
so an arm's gathers come mostly from memory, not from the 480 MiB last-level cache (with 64
batches cycled for half a second they were mostly cache hits).
Correctness is checked before timing; the store's counters (fast-path calls, the rule's
choices, the split decision) prove which path ran. JSON: ``probes/out/warm_gather.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CacheFlush, interleave, median, rate, vm_hwm_mb, write_json  # noqa: E402

import engramdb  # noqa: E402


def make_source(path: Path, rows: int, row_bytes: int, seed: int) -> None:
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(rows, row_bytes))
    rng = np.random.default_rng(seed)
    step = 1 << 20
    for i in range(0, rows, step):
        k = min(step, rows - i)
        mm[i : i + k] = rng.integers(0, 256, size=(k, row_bytes), dtype=np.uint8)
    mm.flush()
    del mm


BUILD_CHILD = """
import sys, json, engramdb
from pathlib import Path
s = engramdb.build(sys.argv[1], sys.argv[2], int(sys.argv[3]), [sys.argv[4]], force=True,
                   shard_bytes=8 << 30)
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]
print(json.dumps({"seconds": s.seconds, "bytes": s.bytes, "vm_hwm_mb": int(hwm) / 1024}))
"""


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache: both arms read their source cold."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def timed_copy(src: Path, dst: Path) -> float:
    evict(src)
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    dst.unlink()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows-160", type=int, default=8_000_000)
    ap.add_argument("--rows-264", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.5, help="per arm per repetition")
    ap.add_argument("--dir", default=None, help="work dir (default: a new temp dir)")
    ap.add_argument("--lat-blocks", type=int, default=10, help="blocks of 1000 16-row calls")
    ap.add_argument("--pair-rounds", type=int, default=2000, help="paired 160 B batches")
    ap.add_argument("--quick", action="store_true", help="small tables, 5 reps, no build arm")
    args = ap.parse_args()
    if args.quick:
        args.rows_160, args.rows_264, args.reps, args.seconds = 4_000_000, 2_000_000, 5, 0.3
        args.lat_blocks, args.pair_rounds = 5, 1000
    work = Path(tempfile.mkdtemp(prefix="edb-warm-", dir=args.dir))
    report: dict[str, object] = {"probe": "warm_gather"}
    try:
        db_path = work / "db"
        srcs = {}
        for rb, rows, seed in ((160, args.rows_160, 1), (264, args.rows_264, 2)):
            src = work / f"src{rb}.npy"
            make_source(src, rows, rb, seed)
            srcs[rb] = src

        # --- build vs copy (build runs in a child so its peak RSS is its own) -------------
        if args.quick:
            engramdb.build(db_path, "t160", 160, [srcs[160]], force=True, shard_bytes=8 << 30)
        print(
            "build vs sequential copy (+fsync), 160 B source "
            f"{srcs[160].stat().st_size / 1e9:.2f} GB:"
        )
        b_rates, c_rates, hwms = [], [], []
        for r in range(0 if args.quick else 5):
            evict(srcs[160])
            out = subprocess.run(
                [sys.executable, "-c", BUILD_CHILD, str(db_path), "t160", "160", str(srcs[160])],
                check=True,
                capture_output=True,
                text=True,
            )
            import json

            doc = json.loads(out.stdout)
            b_rates.append(doc["bytes"] / doc["seconds"])
            hwms.append(doc["vm_hwm_mb"])
            c_rates.append(srcs[160].stat().st_size / timed_copy(srcs[160], work / "copy.bin"))
            print(
                f"  rep {r}: build {b_rates[-1] / 1e9:.2f} GB/s (peak RSS {hwms[-1]:.0f} MB)"
                f"  copy {c_rates[-1] / 1e9:.2f} GB/s"
            )
        if b_rates:
            report["build"] = {
                "build_gb_s": [x / 1e9 for x in b_rates],
                "copy_gb_s": [x / 1e9 for x in c_rates],
                "build_peak_rss_mb": max(hwms),
                "ratio": median(b_rates) / median(c_rates),
            }
            print(
                f"RATIO build / sequential copy: {report['build']['ratio']:.2f}x "  # type: ignore[index]
                f"(build peak RSS {max(hwms):.0f} MB)"
            )
        engramdb.build(
            db_path,
            "t264",
            264,
            [srcs[264]],
            force=True,
            shard_bytes=8 << 30,
            heads=[args.rows_264 // 8] * 7 + [args.rows_264 - 7 * (args.rows_264 // 8)],
        )

        with engramdb.open(db_path, populate=True) as db:
            s160, s264 = db["t160"], db["t264"]
            print(
                f"tables: {s160!r} residency {s160.residency():.0%}; "
                f"{s264!r} residency {s264.residency():.0%}"
            )
            mm160 = np.memmap(
                db_path / s160.info.shards[0].path,
                dtype=np.uint8,
                mode="r",
                shape=(s160.n_rows, 160),
            )
            mm264 = np.memmap(
                db_path / s264.info.shards[0].path,
                dtype=np.uint8,
                mode="r",
                shape=(s264.n_rows, 264),
            )
            ref160 = np.load(srcs[160], mmap_mode="r")
            ref264 = np.load(srcs[264], mmap_mode="r")
            rng = np.random.default_rng(7)
            batch = 16_384
            # Enough distinct batches that an arm's gathers are not served by the last-level
            # cache (480 MiB here): 64 batches (168 MB of 160 B rows), cycled for half a
            # second, were mostly cache hits after the first pass. 512 cover the 1.28 GB
            # table about once (the cache can then hold ~1/3 of the rows any gather asks
            # for), and every arm starts after a `CacheFlush`.
            n_batches = 512
            id_sets = [
                rng.integers(0, s160.n_rows, batch, dtype=np.int64) for _ in range(n_batches)
            ]
            sets264 = 64  # [64, 256, 8] each: 8.4 M rows over the 1.06 GB table, as above
            local_sets = [
                np.ascontiguousarray(
                    np.stack([rng.integers(0, h, size=(64, 256)) for h in s264.heads], axis=-1),
                    dtype=np.int64,
                )
                for _ in range(sets264)
            ]
            global_sets = [loc + s264.head_offsets for loc in local_sets]
            out160 = np.empty((batch, 160), np.uint8)
            out264 = np.empty((64, 256, 8, 264), np.uint8)

            # correctness first
            for ids in id_sets[:4]:
                s160.fetch_into(ids, out160)
                assert np.array_equal(out160, ref160[ids]) and np.array_equal(mm160[ids], out160)
            s264.lookup_into(local_sets[0], out264)
            assert np.array_equal(out264, ref264[global_sets[0]])
            assert np.array_equal(mm264[global_sets[0]], out264)
            print("correctness: Store rows == source bytes == memmap rows")
            # untimed passes per arm (warm caches, page tables; this VM's clock and page
            # placement settle over the first seconds)
            t_warm = time.perf_counter()
            while time.perf_counter() - t_warm < 3.0:
                for ids in id_sets[:8]:
                    s160.fetch_into(ids, out160)
                    mm160[ids]
                s264.lookup_into(local_sets[0], out264)
                mm264[global_sets[0]]
            calls0 = s160.stats()["fetch_calls"]
            t160, t264 = s160.array(), s264.array()  # the store's populated mapping
            # one CPU read of every page of both tables: on this VM the first CPU touch of
            # a page the device wrote is slow (seen as a first repetition at 0.5 M rows/s)
            for t in (t160, t264):
                int(t.reshape(-1)[::4096].sum())
            shard160 = db_path / s160.info.shards[0].path
            shard264 = db_path / s264.info.shards[0].path
            k = [0]

            def arm(fn):  # type: ignore[no-untyped-def]
                def run() -> float:
                    def once() -> int:
                        k[0] += 1
                        return fn(k[0])

                    return rate(once, args.seconds)

                return run

            def fresh_arm(path: Path, rows: int, rb: int, ids_of):  # type: ignore[no-untyped-def]
                """A never-populated np.memmap: mapped anew for every repetition."""

                def run() -> float:
                    box = [np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, rb))]

                    def once() -> int:
                        k[0] += 1
                        ids = ids_of(k[0])
                        box[0][ids]
                        return ids.size

                    v = rate(once, args.seconds)
                    box.clear()  # unmapped: the next repetition maps it anew
                    return v

                return run

            def ids160(i: int) -> np.ndarray:
                return id_sets[i % n_batches]

            def g264(i: int) -> np.ndarray:
                return global_sets[i % sets264]

            def take160(i: int) -> int:
                np.take(t160, id_sets[i % n_batches], axis=0, out=out160, mode="clip")
                return batch

            def store_fetch(i: int) -> int:
                s160.fetch_into(id_sets[i % n_batches], out160)
                return batch

            def store_fetch_alloc(i: int) -> int:
                s160.fetch(id_sets[i % n_batches])
                return batch

            def fancy160(i: int) -> int:
                t160[id_sets[i % n_batches]]
                return batch

            n264 = out264.shape[0] * out264.shape[1] * out264.shape[2]
            flat264 = out264.reshape(-1, 264)

            def take264(i: int) -> int:
                np.take(
                    t264, global_sets[i % sets264].reshape(-1), axis=0, out=flat264, mode="clip"
                )
                return n264

            def store_lookup(i: int) -> int:
                s264.lookup_into(local_sets[i % sets264], out264)
                return n264

            def fancy264(i: int) -> int:
                t264[global_sets[i % sets264]]
                return n264

            flush = CacheFlush()
            print(f"warm 160 B, batches of {batch:,} random ids (rows/s):")
            r1 = interleave(
                {
                    "np.take(out=) populated [limit]": arm(take160),
                    "fetch_into": arm(store_fetch),
                    "fetch": arm(store_fetch_alloc),
                    "fancy populated": arm(fancy160),
                    "np.memmap never populated": fresh_arm(shard160, s160.n_rows, 160, ids160),
                },
                args.reps,
                before=flush,
            )
            print("warm 264 B, lookup_into [64, 256, 8] (rows/s):")
            r2 = interleave(
                {
                    "np.take(out=) populated [limit]": arm(take264),
                    "lookup_into": arm(store_lookup),
                    "fancy populated": arm(fancy264),
                    "np.memmap never populated": fresh_arm(shard264, s264.n_rows, 264, g264),
                },
                args.reps,
                before=flush,
            )
            # 16-row decode step: p50 / p99 of single calls, interleaved in blocks of 1000.
            small = [rng.integers(0, s160.n_rows, 16, dtype=np.int64) for _ in range(64)]
            o16 = np.empty((16, 160), np.uint8)
            lat: dict[str, list[float]] = {"np.take 16 [limit]": [], "fetch_into 16": []}
            pc = time.perf_counter
            for blk in range(2 * args.lat_blocks):
                order = list(lat) if blk % 2 == 0 else list(lat)[::-1]
                for name in order:
                    xs = lat[name]
                    if name.startswith("np.take"):
                        for j in range(1000):
                            t0 = pc()
                            np.take(t160, small[j & 63], axis=0, out=o16, mode="clip")
                            xs.append(pc() - t0)
                    else:
                        for j in range(1000):
                            t0 = pc()
                            s160.fetch_into(small[j & 63], o16)
                            xs.append(pc() - t0)
            p50 = {n: float(np.percentile(v, 50)) * 1e6 for n, v in lat.items()}
            p99 = {n: float(np.percentile(v, 99)) * 1e6 for n, v in lat.items()}
            for n in lat:
                print(f"  {n:22s} p50 {p50[n]:.2f} us  p99 {p99[n]:.2f} us  ({len(lat[n])} calls)")

            # Paired per batch: A B / B A alternating, distinct id sets, median per-batch time.
            # Pairs adjacent batches, so the machine's drift (load 5-10 here) mostly cancels.
            def paired(fa, fb, sets: int, rounds: int) -> float:  # type: ignore[no-untyped-def]
                ta, tb = [], []
                for j in range(rounds):
                    first, second = (fa, fb) if j % 2 == 0 else (fb, fa)
                    t0 = pc()
                    first(2 * j % sets)
                    t1 = pc()
                    second((2 * j + 1) % sets)
                    t2 = pc()
                    (ta, tb)[j % 2].append(t1 - t0)
                    (tb, ta)[j % 2].append(t2 - t1)
                return float(np.median(tb) / np.median(ta))  # time B / time A

            # Paired in blocks: 8 consecutive batches per arm, arms alternated A B / B A, the
            # median block times compared. Each arm runs as a caller runs it (consecutive
            # batches: a split gather's pool thread is awake), while the machine's drift over
            # seconds (10-20 % here) still cancels, as in the per-batch pairing.
            def paired_blocks(fa, fb, sets: int, rounds: int, k: int = 8) -> float:  # type: ignore[no-untyped-def]
                ta, tb = [], []
                for j in range(rounds):
                    first, second = (fa, fb) if j % 2 == 0 else (fb, fa)
                    t0 = pc()
                    for q in range(k):
                        first((2 * j * k + q) % sets)
                    t1 = pc()
                    for q in range(k):
                        second(((2 * j + 1) * k + q) % sets)
                    t2 = pc()
                    (ta, tb)[j % 2].append(t1 - t0)
                    (tb, ta)[j % 2].append(t2 - t1)
                return float(np.median(tb) / np.median(ta))

            block_fetch = 1.0 / paired_blocks(
                take160, store_fetch, n_batches, args.pair_rounds // 4
            )
            block_lookup = 1.0 / paired_blocks(
                take264, store_lookup, sets264, args.pair_rounds // 16
            )
            print(
                f"paired in blocks of 8 batches ({args.pair_rounds // 4} / "
                f"{args.pair_rounds // 16} pairs): fetch_into / np.take {block_fetch:.3f}x, "
                f"lookup_into / np.take {block_lookup:.3f}x"
            )
            pair_fetch = 1.0 / paired(take160, store_fetch, n_batches, args.pair_rounds)
            pair_lookup = 1.0 / paired(take264, store_lookup, sets264, args.pair_rounds // 4)
            print(
                f"paired per batch ({args.pair_rounds} / {args.pair_rounds // 4} pairs, rate "
                f"ratio from median batch times): fetch_into / np.take {pair_fetch:.3f}x, "
                f"lookup_into / np.take {pair_lookup:.3f}x"
            )
            st = s160.stats()
            served = st["fetch_calls"] - calls0
            assert served > 0 and st["small_gathers"] > 0, "the store path did not run"
            lim1 = "np.take(out=) populated [limit]"
            m1 = {n: median(v) for n, v in r1.items()}
            m2 = {n: median(v) for n, v in r2.items()}
            per_rep = {
                "fetch_into": [a / b for a, b in zip(r1["fetch_into"], r1[lim1])],
                "fetch": [a / b for a, b in zip(r1["fetch"], r1[lim1])],
                "lookup_into": [a / b for a, b in zip(r2["lookup_into"], r2[lim1])],
            }
            ratios = {
                "fetch_into_vs_take": m1["fetch_into"] / m1[lim1],
                "fetch_vs_take": m1["fetch"] / m1[lim1],
                "fetch_vs_fetch_into": m1["fetch"] / m1["fetch_into"],
                "fetch_into_vs_fancy": m1["fetch_into"] / m1["fancy populated"],
                "fetch_into_vs_fresh_memmap": m1["fetch_into"] / m1["np.memmap never populated"],
                "lookup_into_vs_take": m2["lookup_into"] / m2[lim1],
                "lookup_into_vs_fancy": m2["lookup_into"] / m2["fancy populated"],
                "lookup_into_vs_fresh_memmap": m2["lookup_into"] / m2["np.memmap never populated"],
                "fetch_into16_p50_vs_take16": p50["fetch_into 16"] / p50["np.take 16 [limit]"],
                "fetch_into_vs_take_paired_batches": pair_fetch,
                "lookup_into_vs_take_paired_batches": pair_lookup,
                "fetch_into_vs_take_paired_blocks": block_fetch,
                "lookup_into_vs_take_paired_blocks": block_lookup,
            }
            report.update(
                {
                    "fetch_160": r1,
                    "lookup_264": r2,
                    "latency16_us": {"p50": p50, "p99": p99},
                    "per_rep_vs_take": per_rep,
                    "store_calls_during_timing": served,
                    "small_gathers": st["small_gathers"],
                    "gather_split": st["gather_split"],
                    "choices": st.get("choices"),
                    "residency": {"t160": s160.residency(), "t264": s264.residency()},
                    "ratios": {**ratios, "build_vs_copy": report.get("build", {}).get("ratio")},
                    "peak_rss_mb": vm_hwm_mb(),
                }
            )
        print(
            f"proof: {served} Store calls served during timing ({st['small_gathers']} by the "
            f"mapped fast path); choices {st.get('choices')}; split decision "
            f"{st['gather_split']}; peak RSS {vm_hwm_mb():.0f} MB"
        )
        path = write_json("warm_gather", report)
        print(f"json: {path}")
        print(
            "per-repetition fetch_into / np.take: "
            + " ".join(f"{x:.2f}" for x in per_rep["fetch_into"])
        )
        print(
            "per-repetition lookup_into / np.take: "
            + " ".join(f"{x:.2f}" for x in per_rep["lookup_into"])
        )
        for name, v in ratios.items():
            print(f"RATIO {name:34s} {v:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
