"""Warm gathers and build throughput of Store-I, against numpy on the same bytes.

    python probes/warm_gather.py [--rows-160 8000000] [--rows-264 4000000] [--reps 7]

Builds two tables under a temp dir (deleted at the end): >= 2 M rows x 160 B and x 264 B,
both page-cache warm. Arms, interleaved, same process:
  * Store.fetch_into (16,384 random global ids, 160 B)  vs  np.memmap(shard)[ids]
  * Store.lookup_into ([64, 256, 8] local ids, 264 B)   vs  np.memmap(shard)[global ids]
  * engramdb build of a .npy source                     vs  copy of the same bytes + fsync
Correctness is checked before timing; the store's counters prove its path ran.
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
from common import interleave, median, rate, vm_hwm_mb, write_json  # noqa: E402

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
    args = ap.parse_args()
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
        print(
            "build vs sequential copy (+fsync), 160 B source "
            f"{srcs[160].stat().st_size / 1e9:.2f} GB:"
        )
        b_rates, c_rates, hwms = [], [], []
        for r in range(5):
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
        build_ratio = median(b_rates) / median(c_rates)
        report["build"] = {
            "build_gb_s": [x / 1e9 for x in b_rates],
            "copy_gb_s": [x / 1e9 for x in c_rates],
            "build_peak_rss_mb": max(hwms),
            "ratio": build_ratio,
        }
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
            n_batches = 64
            id_sets = [
                rng.integers(0, s160.n_rows, batch, dtype=np.int64) for _ in range(n_batches)
            ]
            local_sets = [
                np.ascontiguousarray(
                    np.stack([rng.integers(0, h, size=(64, 256)) for h in s264.heads], axis=-1),
                    dtype=np.int64,
                )
                for _ in range(8)
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

            k = [0]

            def arm(fn):  # type: ignore[no-untyped-def]
                def run() -> float:
                    def once() -> int:
                        k[0] += 1
                        return fn(k[0])

                    return rate(once, args.seconds)

                return run

            def store_fetch(i: int) -> int:
                s160.fetch_into(id_sets[i % n_batches], out160)
                return batch

            def store_fetch_alloc(i: int) -> int:
                s160.fetch(id_sets[i % n_batches])
                return batch

            def numpy_fetch(i: int) -> int:
                mm160[id_sets[i % n_batches]]
                return batch

            def store_lookup(i: int) -> int:
                s264.lookup_into(local_sets[i % 8], out264)
                return out264.shape[0] * out264.shape[1] * out264.shape[2]

            def numpy_lookup(i: int) -> int:
                mm264[global_sets[i % 8]]
                return out264.shape[0] * out264.shape[1] * out264.shape[2]

            print(f"warm 160 B, batches of {batch:,} random ids (rows/s):")
            r1 = interleave(
                {
                    "numpy": arm(numpy_fetch),
                    "fetch_into": arm(store_fetch),
                    "fetch": arm(store_fetch_alloc),
                },
                args.reps,
            )
            print("warm 264 B, lookup_into [64, 256, 8] (rows/s):")
            r2 = interleave(
                {"numpy": arm(numpy_lookup), "lookup_into": arm(store_lookup)}, args.reps
            )
            served = s160.stats()["fetch_calls"] - calls0
            assert served > 0, "the store path did not run"
            fetch_ratio = median(r1["fetch"]) / median(r1["numpy"])
            fetch_into_ratio = median(r1["fetch_into"]) / median(r1["numpy"])
            lookup_ratio = median(r2["lookup_into"]) / median(r2["numpy"])
            report.update(
                {
                    "fetch_160": {k2: [x for x in v] for k2, v in r1.items()},
                    "lookup_264": {k2: [x for x in v] for k2, v in r2.items()},
                    "store_calls_during_timing": served,
                    "residency": {"t160": s160.residency(), "t264": s264.residency()},
                    "ratios": {
                        "fetch_vs_numpy": fetch_ratio,
                        "fetch_into_vs_numpy": fetch_into_ratio,
                        "lookup_into_vs_numpy": lookup_ratio,
                        "build_vs_copy": build_ratio,
                    },
                    "peak_rss_mb": vm_hwm_mb(),
                }
            )
        print(
            f"proof: {served} Store gather calls served during timing; "
            f"peak RSS of this probe {vm_hwm_mb():.0f} MB"
        )
        print(
            "medians: "
            f"fetch {median(r1['fetch']) / 1e6:.1f} M/s, fetch_into "
            f"{median(r1['fetch_into']) / 1e6:.1f} M/s, numpy {median(r1['numpy']) / 1e6:.1f} M/s; "
            f"lookup_into {median(r2['lookup_into']) / 1e6:.1f} M/s, numpy "
            f"{median(r2['numpy']) / 1e6:.1f} M/s"
        )
        path = write_json("warm_gather", report)
        print(f"json: {path}")
        print(f"RATIO Store.fetch / numpy memmap fancy-index (160 B):      {fetch_ratio:.2f}x")
        print(f"RATIO Store.fetch_into / numpy (160 B):                    {fetch_into_ratio:.2f}x")
        print(
            f"RATIO Store.lookup_into / numpy fancy-index (264 B, [64,256,8]): {lookup_ratio:.2f}x"
        )
        print(
            f"RATIO build / sequential copy:                             {build_ratio:.2f}x "
            f"(build peak RSS {max(hwms):.0f} MB)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
