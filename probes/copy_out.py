"""A decode step's last copy: rows from the step reader's staging buffer (where the device
wrote them) into the engine's buffer, by the compiled `copy_out` against the numpy gather a
reader uses where it is not built, in the same run.

    python probes/copy_out.py [--rows 128] [--row-bytes 320] [--reps 2000] [--gb 1] [--dir /tmp]

A ``--gb`` GB file of random bytes; each repetition reads ``--rows`` random 1 KiB-aligned
spans of it with ``O_DIRECT`` into the slots of a staging buffer (device-written lines, not in
this CPU's caches, as after a step's reads), then copies each row (at a random 64-byte
offset inside its slot) into a fresh ``[rows, row_bytes]`` array: `copy_out` on even
repetitions, the numpy gather of 64-byte units on odd ones. Both are checked against the
file. Printed: p50 / p90 of each and their ratio. JSON to probes/out/copy_out.json; the file
is deleted at exit.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from engramdb.io.sqpoll import step_compiled  # noqa: E402

SLOT = 1024
UNIT = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--row-bytes", type=int, default=320)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    copy = step_compiled("copy_out")
    if copy is None:
        raise SystemExit("engramdb.io._submitter is not built: nothing to compare")
    rb, n = args.row_bytes, args.rows
    if rb % UNIT or rb > SLOT - UNIT:
        raise SystemExit(f"--row-bytes must be a multiple of {UNIT} up to {SLOT - UNIT}")
    root = Path(tempfile.mkdtemp(prefix="engramdb-copy-", dir=args.dir))
    try:
        path = root / "rows.bin"
        size = int(args.gb * 1e9) // SLOT * SLOT
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for off in range(0, size, 64 << 20):
                f.write(rng.integers(0, 256, min(64 << 20, size - off), np.uint8).tobytes())
        src = np.memmap(path, np.uint8, "r")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        m = mmap.mmap(-1, n * SLOT)
        buf = np.frombuffer(m, np.uint8)
        units = buf.reshape(-1, UNIT)
        slot = np.arange(n, dtype=np.int64) * SLOT
        times: dict[str, list[float]] = {"copy_out": [], "numpy": []}
        for rep in range(args.reps):
            offs = rng.integers(0, size // SLOT, n) * SLOT
            ip = rng.integers(0, (SLOT - rb) // UNIT + 1, n).astype(np.int64) * UNIT
            for j in range(n):
                os.preadv(fd, [memoryview(m)[slot[j] : slot[j] + SLOT]], int(offs[j]))
            out = np.empty((n, rb // UNIT, UNIT), np.uint8)
            arm = "copy_out" if rep % 2 == 0 else "numpy"
            t0 = time.perf_counter_ns()
            if arm == "copy_out":
                copy(out, buf, slot, ip, 0)
            else:
                idx = ((slot + ip) // UNIT)[:, None] + np.arange(rb // UNIT)
                np.take(units, idx, 0, out=out)
            times[arm].append((time.perf_counter_ns() - t0) / 1e3)
            want = src[(offs + ip)[:, None] + np.arange(rb)]
            if not np.array_equal(out.reshape(n, rb), want):
                raise SystemExit(f"rep {rep} ({arm}): rows differ from the file")
        os.close(fd)
        del src
        doc: dict[str, object] = {"rows": n, "row_bytes": rb, "reps": args.reps}
        for arm, ts in times.items():
            t = np.array(ts[len(ts) // 10 :])  # the first tenth warms the code paths
            doc[arm] = {"p50_us": float(np.median(t)), "p90_us": float(np.percentile(t, 90))}
            print(f"{arm:9s} {n} rows of {rb} B: p50 {np.median(t):6.2f} us, p90 "
                  f"{np.percentile(t, 90):6.2f} us")  # fmt: skip
        ratio = doc["numpy"]["p50_us"] / doc["copy_out"]["p50_us"]  # type: ignore[index]
        doc["numpy_over_copy_out"] = ratio
        print(f"copy_out is {ratio:.2f}x the numpy gather's speed (p50); rows equal the file")
        print(f"wrote {write_json('copy_out', doc)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
