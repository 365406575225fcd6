"""A warm table left idle: locked by the default ``lock="auto"`` vs left to the page cache.

    python probes/resident_lock.py [--gb 1.5] [--idle 0,15,30,60] [--batches 200] [--dir D]

Builds two tables of 160 B rows (random bytes, ``--gb`` each, under a temp dir deleted at the
end) and warms both (``engramdb warm``). One process then opens table A with the defaults
(its background warm finishes and ``lock="auto"`` ``mlock``s it) and table B with
``lock=False``, and copies A into anonymous memory. After each ``--idle`` wait (nothing
touches the tables meanwhile) it gathers ``--batches`` batches of 256 random rows from each,
in blocks of 25 batches rotated between the arms, and prints the median per batch:

* ``np.take(out=)`` from the anonymous copy, one thread: **the limit** (memory no reclaim
  policy touches: a host without swap never reclaims anonymous pages);
* ``np.take(out=)`` on B's populated mapping (the page cache, unlocked): the guide's warm
  baseline;
* ``Store.fetch_into`` of A (locked) and of B (unlocked).

Ratios are printed against the limit (and B's ``np.take``). A host that reclaims idle page
cache (a DAMON ``pageout`` scheme, ``memory.reclaim``; the probe prints any DAMON scheme it
finds) slows B and not A. Rows are checked against the source first. JSON:
``probes/out/resident_lock.json``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_json  # noqa: E402

import engramdb  # noqa: E402
from engramdb.io.tiers import process_rss  # noqa: E402

ROW = 160
BATCH = 256
BLOCK = 25


def make_table(root: Path, name: str, gb: float, seed: int) -> None:
    """A table of random 160 B rows, built from a .npy source written in 64 MiB chunks."""
    rows = int(gb * 1e9) // ROW
    src = root / f"{name}.npy"
    mm = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(rows, ROW))
    rng = np.random.default_rng(seed)
    step = (64 << 20) // ROW
    for i in range(0, rows, step):
        k = min(step, rows - i)
        mm[i : i + k] = rng.integers(0, 256, size=(k, ROW), dtype=np.uint8)
    mm.flush()
    del mm
    engramdb.build(root / "db", name, ROW, [str(src)])
    src.unlink()


def damon_schemes() -> list[str]:
    """Each DAMON scheme on this host: its action and access pattern (empty: none)."""
    out = []
    for s in sorted(Path("/sys/kernel/mm/damon/admin/kdamonds").glob("*/contexts/*/schemes/*")):
        try:
            acc = (s / "access_pattern" / "nr_accesses" / "max").read_text().strip()
            age = (s / "access_pattern" / "age" / "min").read_text().strip()
            action = (s / "action").read_text().strip()
        except OSError:
            continue
        out.append(f"{action} (nr_accesses <= {acc}, age >= {age} aggregations)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.5, help="size of each table (GB)")
    ap.add_argument("--idle", default="0,15,30,60", help="seconds idle before each round")
    ap.add_argument("--batches", type=int, default=200, help="batches per arm per round")
    ap.add_argument("--dir", default=None, help="where to build (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="engramdb-lock-", dir=args.dir))
    try:
        run(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    make_table(root, "a", args.gb, 1)
    make_table(root, "b", args.gb, 2)
    subprocess.run(
        [sys.executable, "-m", "engramdb", "warm", str(root / "db"), "-q"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"two {args.gb} GB tables built and warmed in {time.perf_counter() - t0:.0f} s")
    schemes = damon_schemes()
    print("DAMON schemes on this host: " + ("; ".join(schemes) if schemes else "none"))
    vm_lck0 = process_rss()["VmLck"]
    da = engramdb.open(root / "db")  # the defaults: lock="auto"
    db = engramdb.open(root / "db", lock=False)
    a, b = da["a"], db["b"]
    rng = np.random.default_rng(0)
    check = rng.integers(0, a.n_rows, 4096)
    first = {n: np.array(s.array()[check]) for n, s in (("a", a), ("b", b))}
    for s in (a, b):  # a first read through the read rule starts each table's pass
        s.fetch(check)
        s.tiers.warm_once()  # (where that read did not: it never runs twice)
        assert s.tiers.warm.wait(120), "background warm did not finish"
    anon = np.empty_like(a.array())
    anon[:] = a.array()
    lock_a, lock_b = a.memory()["lock"], b.memory()["lock"]
    print(
        f"table A: lock {lock_a!r}, {a.memory()['locked_bytes'] / 1e9:.2f} GB locked; "
        f"table B: lock {lock_b!r}; VmLck +{(process_rss()['VmLck'] - vm_lck0) / 1e9:.2f} GB"
    )
    assert np.array_equal(a.fetch(check), first["a"]) and np.array_equal(anon[check], first["a"])
    assert np.array_equal(b.fetch(check), first["b"])
    b_map = b.array()
    out = np.empty((BATCH, ROW), np.uint8)
    arms = {
        "np.take, anonymous copy (the limit)": lambda i: np.take(anon, i, 0, out=out),
        "np.take, B's populated mapping": lambda i: np.take(b_map, i, 0, out=out),
        "fetch_into, A (lock='auto': locked)": lambda i: a.fetch_into(i, out),
        "fetch_into, B (lock=False)": lambda i: b.fetch_into(i, out),
    }
    names = list(arms)
    rounds = []
    for r, idle in enumerate(float(x) for x in args.idle.split(",")):
        time.sleep(idle)
        times: dict[str, list[float]] = {n: [] for n in names}
        order = names[r % len(names) :] + names[: r % len(names)]
        for _ in range(max(1, args.batches // BLOCK)):
            for n in order:
                f = arms[n]
                for _ in range(BLOCK):
                    ids = rng.integers(0, a.n_rows, BATCH)
                    t = time.perf_counter()
                    f(ids)
                    times[n].append(time.perf_counter() - t)
        med = {n: median(v) * 1e6 for n, v in times.items()}
        lim, base = med[names[0]], med[names[1]]
        print(f"after {idle:.0f} s idle (median us per {BATCH} rows; x the limit | x B's np.take):")
        for n in names:
            print(f"  {n:38s} {med[n]:8.1f}  {med[n] / lim:6.2f}x  {med[n] / base:6.2f}x")
        rounds.append({"idle_s": idle, "median_us": med})
    print(
        f"at the end: table A lock {a.memory()['lock']!r}, resident {a.residency():.1%}; "
        f"table B resident {b.residency():.1%}"
    )
    write_json(
        "resident_lock", {"gb": args.gb, "damon": schemes, "lock_a": lock_a, "rounds": rounds}
    )
    da.close()
    db.close()


if __name__ == "__main__":
    main()
