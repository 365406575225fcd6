"""`engramdb warm --watch` against a global ``drop_caches``: does a reader stay at warm speed?

    python probes/watch.py [--gib 1] [--seconds 3] [--dir D]

Builds a table of 160 B rows (``--gib`` GiB, deleted at the end), times ``populate`` from
cold (the table's files evicted with ``POSIX_FADV_DONTNEED``, nothing mapping them): that is
the warm time, and the bar is 2x it. Then starts ``engramdb warm --watch DB`` in a child
process, measures a reader's warm rate (this process, default ``open``, batches of 16,384
random ids through ``fetch_into``, 0.2 s windows), writes ``1`` to
``/proc/sys/vm/drop_caches`` (root) and samples the reader every 0.1 s for ``--seconds``:
the time until it is back at >= 0.9x the warm rate (for three windows in a row), the
table's residency (``mincore``) right after the drop and at the end. The reader's rows are
checked against the source before and after. JSON: ``probes/out/watch.json``.

The kernel's ``drop_caches`` frees only page-cache pages no process maps: the watcher holds
the table mapped (its warm populates its own mapping), so the drop should cost nothing.
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
from common import median, write_json  # noqa: E402

import engramdb  # noqa: E402, I001
from engramdb.testing.pages import drop_mapped_pages  # noqa: E402

ROW = 160
BATCH = 16_384


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("writing /proc/sys/vm/drop_caches needs root")
    work = Path(tempfile.mkdtemp(prefix="edb-watch-", dir=args.dir))
    watcher: subprocess.Popen[bytes] | None = None
    try:
        rows = int(args.gib * (1 << 30)) // ROW
        rng = np.random.default_rng(0)
        src = np.lib.format.open_memmap(
            work / "src.npy", mode="w+", dtype=np.uint8, shape=(rows, ROW)
        )
        for i in range(0, rows, 1 << 20):
            k = min(1 << 20, rows - i)
            src[i : i + k] = rng.integers(0, 256, (k, ROW), dtype=np.uint8)
        src.flush()
        dbp = work / "db"
        engramdb.build(dbp, "t", ROW, [work / "src.npy"], force=True)
        with engramdb.open(dbp) as db:
            shards = [db["t"].db_path / sh.path for sh in db["t"].info.shards]
        evict(shards)
        with engramdb.open(dbp, background_warm=False) as db:
            s = db["t"]
            t0 = time.perf_counter()
            s.populate()
            warm_s = time.perf_counter() - t0
        print(f"table {rows * ROW / 1e9:.2f} GB; populate from cold {warm_s:.2f} s "
              f"(bar: back at >= 0.9x within {2 * warm_s:.2f} s)")  # fmt: skip
        ids = [rng.integers(0, rows, BATCH) for _ in range(32)]
        out = np.empty((BATCH, ROW), np.uint8)
        phases = [
            # name, watcher, reader backend (preadv: the reader maps nothing itself; its
            # reads fill the page cache, which the drop then empties)
            ("control: no watcher, preadv reader", False, "preadv"),
            ("watcher, preadv reader", True, "preadv"),
            ("watcher, default reader", True, None),
        ]
        doc: dict = {"probe": "watch", "table_bytes": rows * ROW, "populate_cold_s": warm_s}
        for name, with_watcher, backend in phases:
            if with_watcher:
                watcher = subprocess.Popen(
                    [sys.executable, "-m", "engramdb", "warm", "--watch", str(dbp)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                time.sleep(2.0)  # the watcher has opened and warmed the table
            kw = {} if backend is None else {"backend": backend}
            with engramdb.open(dbp, **kw) as db:
                s = db["t"]
                if backend is not None:
                    # the reader maps nothing: its store's mapping lets go of its pages
                    drop_mapped_pages(s.array())
                for x in ids[:4]:
                    assert np.array_equal(s.fetch_into(x, out), src[x])
                k = [0]

                def rate(seconds: float, s=s, k=k) -> float:  # type: ignore[no-untyped-def]
                    n, t = 0, time.perf_counter()
                    while time.perf_counter() - t < seconds:
                        s.fetch_into(ids[k[0] % 32], out)
                        k[0] += 1
                        n += BATCH
                    return n / (time.perf_counter() - t)

                t_settle = time.perf_counter()
                while time.perf_counter() - t_settle < 2.0:
                    rate(0.2)
                base = median([rate(0.2) for _ in range(5)])
                Path("/proc/sys/vm/drop_caches").write_text("1")
                t_drop = time.perf_counter()
                res_after_drop = s.residency()
                samples = []
                back: float | None = None
                run = 0
                while time.perf_counter() - t_drop < args.seconds:
                    r = rate(0.1)
                    el = time.perf_counter() - t_drop
                    samples.append((round(el, 2), r))
                    run = run + 1 if r >= 0.9 * base else 0
                    if run == 3 and back is None:
                        back = samples[-3][0]
                res_end = s.residency()
                for x in ids[:4]:
                    assert np.array_equal(s.fetch_into(x, out), src[x])
            if watcher is not None:
                watcher.terminate()
                watcher.wait(10)
                watcher = None
            worst = min(r for _, r in samples) / base
            print(f"{name}:")
            print(f"  warm rate {base / 1e6:.2f} M rows/s; residency right after the drop "
                  f"{res_after_drop:.3f}, at the end {res_end:.3f}")  # fmt: skip
            print("  per 0.1 s after the drop (M rows/s): "
                  + " ".join(f"{r / 1e6:.1f}" for _, r in samples[:24]))  # fmt: skip
            print(f"  lowest window {worst:.2f}x the warm rate; back at >= 0.9x (3 windows in a "
                  f"row) after {f'{back} s' if back is not None else 'never'} "
                  f"(bar {2 * warm_s:.2f} s); rows equal the source: True")  # fmt: skip
            doc[name] = {
                "warm_rows_per_s": base,
                "residency_after_drop": res_after_drop,
                "residency_end": res_end,
                "samples": samples,
                "lowest_ratio": worst,
                "back_s": back,
                "bar_s": 2 * warm_s,
            }
        print(f"json: {write_json('watch', doc)}")
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
