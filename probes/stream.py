"""Corpus streaming from a cold table: `engramdb.stream` vs a plain np.memmap vs an in-RAM gather.

    python probes/stream.py [--gb 2.56] [--tokens 2000000] [--reps 2] [--batch-tokens 8192]
                            [--budget-gb B] [--arms a,b] [--dir D] [--keep] [--quick]
                            [--drop-caches]

Builds a Qwen-PLE-geometry table (16 heads x 160 B, ~--gb GB) and a Zipf token corpus, and
deletes both at the end. Every arm runs in a **fresh process**; every cold arm starts after
``POSIX_FADV_DONTNEED`` of the table's files (no mapping of ours holds them), with the
residency checked (mincore), once the disks have been idle for 0.5 s (``/proc/diskstats``).
Each rep runs the over-budget pair, then ``ram``, then the fitting cold pair in alternating
order (``stream_warm`` right after ``stream_cold``), so neither arm of the pair the bar
compares starts in the wake of the over-budget arms' 8 GB of reads. ``--drop-caches`` (root) also writes
``/proc/sys/vm/drop_caches`` first: it disturbs everything else on the machine, so it is off
by default. Arms:

  ram            keygen + np.take from the table loaded into RAM (the reference: every other
                 arm's per-batch xxh3 digests must equal its digests, i.e. bit-equal output)
  memmap_cold    keygen + plain np.memmap(shard)[rows], one fancy index per batch (what a
                 naive user writes), cold
  stream_cold    db.stream(...) defaults, cold: the table fits the page-cache budget, so it
                 is read sequentially in the background, batches gathered as their rows land
  stream_warm    db.stream(...) defaults, table resident (right after stream_cold)
  memmap_over / stream_over   the same two with the table over a page-cache budget
                 (--budget-gb, default half the table): both run in a memory cgroup (v1 or
                 v2) limited to budget + the interpreter's slack, the stream gets
                 page_cache_budget=budget (windows read in file order, O_DIRECT)

An arm stops after --max-seconds (a thrashing memmap would take minutes; memmap_over gets
5 s and indexes in slices of 64 rows so the cap holds): its figures and its bit-equality
check then cover the prefix it streamed. Per arm: tokens/s, rows/s (16 per token), time to
the first batch and the rate after it, device bytes read (/proc/self/io read_bytes) vs
payload bytes (tokens x 2560), peak RSS, the cgroup's peak usage, the stream's stats (mode,
calibration, windows, bytes read).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, proc_read_bytes, vm_hwm_mb, write_json  # noqa: E402
from workload_tables import EOS, LAYER, VOCAB, build_table, hasher_for_bytes  # noqa: E402

ROW = 160
HEADS = 16
SLACK = 320 << 20  # cgroup headroom for the interpreter, numpy, keygen arrays and the corpus


# --- the arms (run in a child process) -------------------------------------------------------
def _join_cgroup(path: str | None) -> None:
    if path:
        Path(path, "cgroup.procs").write_text(str(os.getpid()))


def _shard(dbp: Path) -> Path:
    import engramdb

    with engramdb.open(dbp) as db:
        s = db["ple"]
        assert len(s.info.shards) == 1
        return s.db_path / s.info.shards[0].path


def arm_main(a: argparse.Namespace) -> None:
    _join_cgroup(a.cgroup)
    import xxhash

    import engramdb

    h = hasher_for_bytes(int(a.gb * 1e9))
    corpus = np.load(a.corpus)
    bt = a.batch_tokens
    dbp = Path(a.db)
    digests: list[int] = []
    marks: list[tuple[float, int]] = []
    extra: dict[str, Any] = {}
    out = np.empty((bt, HEADS, ROW), np.uint8)
    io0 = proc_read_bytes()
    t0 = time.perf_counter()
    if a.arm == "ram":
        table = np.fromfile(_shard(dbp), dtype=np.uint8)
        table = table[: h.table_rows(LAYER) * ROW].reshape(-1, ROW)
        io0 = proc_read_bytes()
        t0 = time.perf_counter()
    if a.arm in ("ram", "memmap"):
        if a.arm == "memmap":
            mm = np.memmap(_shard(dbp), dtype=np.uint8, mode="r")
            table = mm[: h.table_rows(LAYER) * ROW].reshape(-1, ROW)
        ks = h.stream(layer=LAYER)
        for i in range(0, corpus.size, bt):
            ids = ks.push(corpus[i : i + bt])
            n = ids.shape[0]
            e = out[:n]
            if a.arm == "ram":
                np.take(table, ids.reshape(-1), axis=0, out=e.reshape(-1, ROW), mode="clip")
            elif not a.slices:  # the naive user's code: one fancy index per batch
                e[:] = table[ids]
            else:  # in slices, so the time cap holds even when one batch thrashes for minutes
                for j in range(0, n, 64):
                    e[j : j + 64] = table[ids[j : j + 64]]
                    if time.perf_counter() - t0 > a.max_seconds:
                        n = j + min(64, n - j)  # a partial batch: timed, not digested
                        break
                else:
                    n = -n
                if n > 0:
                    marks.append((time.perf_counter() - t0, n))
                    break
                n = -n
            digests.append(xxhash.xxh3_64_intdigest(e))
            marks.append((time.perf_counter() - t0, n))
            if marks[-1][0] > a.max_seconds:
                break
    else:
        budget = a.budget or None
        with engramdb.open(dbp) as db:
            st = db.stream(corpus, preset=h, batch_tokens=bt, page_cache_budget=budget)
            for tokens, e in st:
                digests.append(xxhash.xxh3_64_intdigest(e))
                marks.append((time.perf_counter() - t0, int(tokens.shape[0])))
                if marks[-1][0] > a.max_seconds:
                    break
            extra["stream_stats"] = st.stats()
            st.close()
    dt = time.perf_counter() - t0
    dev = proc_read_bytes() - io0
    tok = sum(n for _, n in marks)
    first_t = marks[0][0] if marks else dt
    after = (tok - marks[0][1]) / (dt - first_t) if len(marks) > 1 and dt > first_t else 0.0
    # time until the cumulative average over the last 1 s window reached 1 M tokens/s
    ts = np.array([m[0] for m in marks])
    cum = np.cumsum([m[1] for m in marks])
    res = {
        "arm": a.arm,
        "tokens": tok,
        "seconds": dt,
        "tokens_per_s": tok / dt,
        "rows_per_s": tok * HEADS / dt,
        "first_batch_s": first_t,
        "tokens_per_s_after_first": after,
        "device_bytes": dev,
        "payload_bytes": tok * HEADS * ROW,
        "vm_hwm_mb": vm_hwm_mb(),
        "t_1m_tokens": float(ts[np.searchsorted(cum, 1_000_000)]) if cum[-1] >= 1e6 else None,
        "digests": digests,
        **extra,
    }
    print("RESULT " + json.dumps(res, default=float))


# --- the driver ------------------------------------------------------------------------------
def drop_caches(files: list[Path], *, global_drop: bool = False) -> None:
    """Evict ``files`` (``POSIX_FADV_DONTNEED``; the arm runs in a fresh process, so no
    mapping of ours holds them). ``global_drop`` (``--drop-caches``, root) also writes
    ``/proc/sys/vm/drop_caches``, which disturbs everything else on the machine."""
    os.sync()
    if global_drop:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")
        except OSError:
            pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def disk_io_sectors() -> int:
    """Sectors read and written so far by this machine's whole disks (``/proc/diskstats``;
    the disks of ``/sys/block`` less loop, RAM and zram devices)."""
    disks = {d for d in os.listdir("/sys/block") if not d.startswith(("loop", "ram", "zram"))}
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] in disks:
                total += int(p[5]) + int(p[9])
    return total


def settle(quiet_s: float = 0.5, limit_s: float = 15.0) -> float:
    """Wait until the disks have moved no sector for ``quiet_s`` (at most ``limit_s``): a cold
    arm starts on an idle device, not in the tail of the arm before it (the over-budget arms
    read 8 GB in a memory cgroup); returns the seconds waited."""
    t0 = time.perf_counter()
    last, since = disk_io_sectors(), time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        time.sleep(0.1)
        now = disk_io_sectors()
        if now != last:
            last, since = now, time.perf_counter()
        elif time.perf_counter() - since >= quiet_s:
            break
    return time.perf_counter() - t0


def residency(f: Path) -> float:
    from engramdb.testing.pages import file_residency

    return float(file_residency(f))


def make_cgroup(limit: int) -> Path | None:
    """A memory cgroup limited to ``limit`` bytes (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``) under this process's own, or None where we may not make one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = next((ln for ln in lines if ":memory:" in ln), None)
        if v1 is not None:
            base = Path("/sys/fs/cgroup/memory") / v1.split(":", 2)[2].lstrip("/")
            knob = "memory.limit_in_bytes"
        else:
            v2 = next(ln for ln in lines if ln.startswith("0::"))
            base = Path("/sys/fs/cgroup") / v2.split(":", 2)[2].lstrip("/")
            knob = "memory.max"
        cg = base / f"edb-stream-probe-{os.getpid()}"
        cg.mkdir(exist_ok=True)
        (cg / knob).write_text(str(limit))
        return cg
    except (OSError, StopIteration):
        return None


def cgroup_peak(cg: Path | None) -> int | None:
    """The cgroup's peak memory since the last call (v1: reset after reading; v2:
    ``memory.peak`` is reset by writing to it on kernels that allow it)."""
    if cg is None:
        return None
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        f = cg / name
        if f.exists():
            v = int(f.read_text().split()[0])
            try:
                f.write_text("0")
            except OSError:
                pass
            return v
    return None


def run_arm(args: argparse.Namespace, arm: str, kind: str, work: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable, __file__, "--arm", kind, "--db", str(work / "db"),
        "--corpus", str(work / "corpus.npy"), "--gb", str(args.gb),
        "--batch-tokens", str(args.batch_tokens), "--max-seconds", str(args.max_seconds), *extra,
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"arm {arm} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return dict(json.loads(line[7:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.56)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument(
        "--max-seconds", type=float, default=60.0, help="an arm stops after this (a prefix)"
    )
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="1 GB table, 600 k tokens, 1 rep")
    ap.add_argument(
        "--arms", default=None, help="comma-separated subset of the arms (ram always runs)"
    )
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="also write /proc/sys/vm/drop_caches (root; disturbs a shared machine)",
    )
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--db", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--slices", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="page-cache budget of the over-budget arms (default: half the table)",
    )
    args = ap.parse_args()
    if args.arm:
        arm_main(args)
        return
    if args.quick:
        args.gb, args.tokens, args.reps, args.max_seconds = 1.0, 600_000, 1, 20.0
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edb-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    cg: Path | None = None
    doc: dict[str, Any] = {"probe": "stream", "args": {k: v for k, v in vars(args).items()}}
    try:
        h = hasher_for_bytes(int(args.gb * 1e9))
        dbp = build_table(work, h)
        shard = _shard(dbp)
        table_bytes = shard.stat().st_size
        rng = np.random.default_rng(0)
        corpus = (rng.zipf(args.zipf, args.tokens) - 1) % VOCAB
        corpus[rng.random(args.tokens) < 1 / 2000] = EOS
        np.save(work / "corpus.npy", corpus)
        budget = int(args.budget_gb * 1e9) if args.budget_gb else table_bytes // 2
        cg = make_cgroup(budget + SLACK)
        print(
            f"table {table_bytes / 1e9:.2f} GB; corpus {args.tokens:,} Zipf({args.zipf}) tokens, "
            f"batches of {args.batch_tokens:,}; over-budget arms: budget {budget / 1e9:.2f} GB, "
            f"cgroup limit {(budget + SLACK) / 1e9:.2f} GB"
            + ("" if cg else " (NO cgroup: memmap_over is not memory-bounded)")
        )
        arms: dict[str, tuple[str, list[str], bool]] = {
            # name: (kind, extra args, cold)
            "ram": ("ram", [], False),
            "memmap_cold": ("memmap", [], True),
            "stream_cold": ("stream", [], True),
            "stream_warm": ("stream", [], False),
            # a plain memmap thrashes in the cgroup (~1 GB/s of device reads for a few rows):
            # a few seconds show it without hammering a shared disk for a minute
            "memmap_over": (
                "memmap",
                ["--slices", "--max-seconds", str(min(5.0, args.max_seconds))]
                + (["--cgroup", str(cg)] if cg else []),
                True,
            ),
            "stream_over": (
                "stream",
                ["--budget", str(budget)] + (["--cgroup", str(cg)] if cg else []),
                True,
            ),
        }
        if args.arms:
            keep = {"ram", *args.arms.split(",")}
            arms = {k: v for k, v in arms.items() if k in keep}
        res: dict[str, list[dict]] = {k: [] for k in arms}
        ref: list[int] | None = None
        for r in range(args.reps):
            # The over-budget pair first, then the in-RAM arm, then the fitting cold pair (its
            # order alternating by rep): neither cold arm of the pair the bar compares starts
            # right after the over-budget arms' 8 GB of reads (an earlier order put
            # stream_cold there every other rep, and those reps read the table ~1 s slower).
            flip = r % 2 == 1
            over = [k for k in ("memmap_over", "stream_over") if k in arms]
            fits = [k for k in ("memmap_cold", "stream_cold") if k in arms]
            order = (over[::-1] if flip else over) + ["ram"] + (fits[::-1] if flip else fits)
            if "stream_warm" in arms:  # warm follows stream_cold (the table is resident)
                at = order.index("stream_cold") + 1 if "stream_cold" in order else len(order)
                order.insert(at, "stream_warm")
            print(f"rep {r}:")
            for name in order:
                kind, extra, cold = arms[name]
                if cold:
                    drop_caches([shard], global_drop=args.drop_caches)
                    waited = settle()
                    left = residency(shard)
                    if left > 0.01:
                        raise SystemExit(f"eviction failed: {left:.1%} still resident")
                else:
                    left = residency(shard)
                cgroup_peak(cg)
                out = run_arm(args, name, kind, work, extra)
                out["resident_before"] = left
                out["settle_s"] = waited if cold else 0.0
                out["resident_after"] = residency(shard)
                out["cgroup_peak_bytes"] = cgroup_peak(cg) if "--cgroup" in extra else None
                digests = out.pop("digests")
                if ref is None and name == "ram":
                    ref = digests
                out["bit_equal"] = None if ref is None else digests == ref[: len(digests)]
                out["complete"] = ref is None or len(digests) == len(ref)
                if ref is None:  # an arm before the first ram arm: checked at the end
                    out["_digests"] = digests
                res[name].append(out)
                ss = out.get("stream_stats", {})
                cgp = out["cgroup_peak_bytes"]
                print(
                    f"  {name:12s} {out['tokens_per_s'] / 1e3:9.1f} k tok/s "
                    f"{out['rows_per_s'] / 1e6:6.2f} M rows/s  first batch {out['first_batch_s']:5.2f} s, "
                    f"then {out['tokens_per_s_after_first'] / 1e3:8.1f} k tok/s  "
                    f"device {out['device_bytes'] / 1e9:5.2f} GB = "
                    f"{out['device_bytes'] / out['payload_bytes']:.2f}x payload  "
                    f"resident {left:.0%}->{out['resident_after']:.0%}  "
                    f"RSS {out['vm_hwm_mb']:.0f} MB"
                    + (f"  cgroup peak {cgp / 1e9:.2f} GB" if cgp else "")
                    + (f"  mode {ss.get('mode')}" if ss else "")
                    + f"  bit-equal {out['bit_equal']}"
                    + ("" if out["complete"] else f" (first {out['tokens']:,} tokens: time cap)")
                )
        # the ram arm may not run first: the arms before it are checked against it here
        for name, v in res.items():
            for o in v:
                if "_digests" in o:
                    dg = o.pop("_digests")
                    o["bit_equal"] = ref is not None and dg == ref[: len(dg)]
                    o["complete"] = ref is not None and len(dg) == len(ref)
                    print(f"  {name} (before the first ram arm): bit-equal {o['bit_equal']}")
        med = {k: median([o["tokens_per_s"] for o in v]) for k, v in res.items()}
        all_equal = all(o["bit_equal"] is True for v in res.values() for o in v)
        for name in ("stream_over", "stream_cold"):
            if res.get(name):
                ss = res[name][-1].get("stream_stats")
                print(f"\n{name} stats:", json.dumps(ss, default=float))
        print("\nsummary (medians, tokens/s):")
        for k, v in med.items():
            print(f"  {k:12s} {v / 1e3:9.1f} k")
        cold_s = res.get("stream_cold") or []
        if cold_s:
            t1m = median([o["t_1m_tokens"] or float("nan") for o in cold_s])
            print(
                f"  stream_cold: first batch after {median([o['first_batch_s'] for o in cold_s]):.2f} s, "
                f"then {median([o['tokens_per_s_after_first'] for o in cold_s]) / 1e6:.2f} M tok/s; "
                f"1 M tokens served after {t1m:.2f} s"
            )
        over_s = res.get("stream_over") or []
        if over_s:
            over = over_s[-1]
            oss = over.get("stream_stats", {})
            dev_over = median([o["device_bytes"] / o["payload_bytes"] for o in over_s])
            cgp = over.get("cgroup_peak_bytes")
            print(
                f"  stream_over: device {dev_over:.2f}x payload; stream memory "
                f"{oss.get('memory_bytes', 0) / 1e9:.2f} GB of budget {budget / 1e9:.2f} GB; "
                f"cgroup peak {(cgp or 0) / 1e9:.2f} GB (limit {(budget + SLACK) / 1e9:.2f} GB); "
                f"resident after {over['resident_after']:.0%} of the table"
            )
        print(f"  bit-equal in every arm: {all_equal}")
        ratios = [
            (a, b) for a, b in (("stream_cold", "memmap_cold"), ("stream_over", "memmap_over"),
                                ("stream_warm", "ram")) if a in med and b in med
        ]  # fmt: skip
        print("ratio " + "; ".join(f"{a} / {b}: {med[a] / med[b]:.2f}x" for a, b in ratios))
        doc.update(results=res, medians=med, table_bytes=table_bytes, budget=budget,
                   bit_equal=all_equal)  # fmt: skip
        print(f"json: {write_json('stream', doc)}")
    finally:
        if cg is not None:
            try:
                cg.rmdir()
            except OSError:
                pass
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
