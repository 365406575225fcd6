"""`engramdb warm` (page cache) against fio sequential reads of the same file, same run.

    python probes/warm.py [--gb 2.0] [--reps 5] [--threads 4] [--dir D] [--keep]

Builds one table of ~--gb GB (one shard file) and deletes it at the end. Arms, interleaved
(order alternates per repetition), each starting from an evicted file (our page-table entries
dropped, posix_fadvise DONTNEED, residency checked with mincore < 1 %):

  fio    fio --rw=read --bs=4M --direct=1 --ioengine=io_uring --iodepth=8 over the file
  warm   engramdb.warm.warm_tables on a freshly opened database (MADV_POPULATE_READ from
         background threads, MADV_SEQUENTIAL during the populate); residency after must be
         100 %, and a gather over the whole table must equal the source rows

Also: a re-warm of a table that is already resident (the cost of `warm` when nothing is
missing). Prints every repetition, the medians, and the ratio warm / fio last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, vm_hwm_mb, write_json  # noqa: E402
from workload_tables import build_table, hasher_for_bytes, make_cold, shard_paths  # noqa: E402

import engramdb  # noqa: E402
from engramdb.testing.pages import evict, file_residency  # noqa: E402
from engramdb.warm import warm_tables  # noqa: E402


def fio_seq(path: Path, size: int) -> float:
    cmd = [
        "fio",
        "--name=seq",
        f"--filename={path}",
        "--rw=read",
        "--bs=4M",
        "--direct=1",
        "--ioengine=io_uring",
        "--iodepth=8",
        "--numjobs=1",
        f"--size={size}",
        "--output-format=json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(res.stdout)["jobs"][0]["read"]
    return float(job["bw_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed: the probe needs its peer")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edb-warmp-"))
    work.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {"probe": "warm", "reps": args.reps, "threads": args.threads}
    try:
        h = hasher_for_bytes(int(args.gb * 1e9))
        db_path = build_table(work, h)
        with engramdb.open(db_path) as db:
            s = db["ple"]
            (shard,) = shard_paths(s)
            size = shard.stat().st_size
            check_ids = np.random.default_rng(0).integers(0, s.n_rows, 100_000)
            reference = s.fetch(check_ids)  # read through the syscall path, before any warm
            nbytes = s.nbytes
        doc["file_bytes"] = size
        print(f"table file: {shard.name}, {size / 1e9:.2f} GB")

        def arm_fio() -> float:
            left = evict(shard)
            if left > 0.01:
                raise SystemExit(f"eviction failed: {left:.1%} resident")
            return fio_seq(shard, size)

        stats: list[dict[str, object]] = []

        def arm_warm() -> float:
            with engramdb.open(db_path) as db:
                s = db["ple"]
                left = make_cold(s)
                if left > 0.01:
                    raise SystemExit(f"eviction failed: {left:.1%} resident")
                (summary,) = warm_tables(db, ["ple"], threads=args.threads)
                if summary.resident_after < 0.999:
                    raise SystemExit(f"warm left the table {summary.resident_after:.1%} resident")
                t0 = time.perf_counter()
                got = s.fetch(check_ids)
                gather_s = time.perf_counter() - t0
                assert np.array_equal(got, reference), "rows after warm differ"
                stats.append({**s.stats(), "gather_100k_s": gather_s})
                return summary.bytes / summary.seconds

        res: dict[str, list[float]] = {"fio": [], "warm": []}
        print("\nGB/s per repetition (each arm from an evicted file):")
        for r in range(args.reps):
            order = ["fio", "warm"] if r % 2 == 0 else ["warm", "fio"]
            row = []
            for n in order:
                v = arm_fio() if n == "fio" else arm_warm()
                res[n].append(v)
                row.append(f"{n} {v / 1e9:.2f}")
            print(f"  rep {r}: " + "  ".join(row))
        last = arm_fio()
        print(f"  baseline again: fio {last / 1e9:.2f}")

        with engramdb.open(db_path) as db:
            s = db["ple"]
            warm_tables(db, ["ple"], threads=args.threads)  # resident now
            t0 = time.perf_counter()
            warm_tables(db, ["ple"], threads=args.threads)
            rewarm_s = time.perf_counter() - t0
            resident = file_residency(shard)
        print(
            f"  re-warm of a resident table: {rewarm_s:.2f} s ({nbytes / 1e9 / rewarm_s:.1f} GB/s),"
            f" residency {resident:.1%}"
        )
        fio_m, warm_m = median(res["fio"]), median(res["warm"])
        doc.update(
            fio_bytes_per_s=res["fio"],
            warm_bytes_per_s=res["warm"],
            fio_last=last,
            fio_median=fio_m,
            warm_median=warm_m,
            rewarm_seconds=rewarm_s,
            store_stats=stats[-1] if stats else {},
            vm_hwm_mb=vm_hwm_mb(),
            ratio=warm_m / fio_m,
        )
        print(
            f"\nsummary: fio {fio_m / 1e9:.2f} GB/s, warm {warm_m / 1e9:.2f} GB/s (medians); "
            f"peak RSS {doc['vm_hwm_mb']:.0f} MB"
        )
        print(f"ratio warm / fio sequential: {warm_m / fio_m:.2f}x")
        print(f"json: {write_json('warm', doc)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
