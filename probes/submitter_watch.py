"""The submitter's watch: what a step's hand-over costs the engine's thread, off / spin / nap.

    python probes/submitter_watch.py [--table-gb 5.1] [--batch 8] [--step-ms 10] [--jitter 0.1]
        [--steps 400] [--rounds 2] [--modes off,spin,nap] [--spin-us 1000] [--nap-us 50]
        [--engine-cpu 0] [--dir D] [--keep]

The end-to-end probe's two attached engram tables (``e2e_decode.build_tables``: raw f32
rows, ``--table-gb`` in all; reused from ``--dir`` when there), evicted before every child.
Each child process opens them (no background warm: they stay cold), pins its decoding
thread to ``--engine-cpu`` and runs ``--steps`` paced steps of a `Decoder` with prefetch on:
``push`` (hash the next step, hand its reads over), then a stand-in for the model's step
(``--step-ms`` +- ``--jitter`` of it, a loop over a 4 MB buffer that evicts the caches as a
step would), then every layer's ``fill``. The children alternate the watch's modes
(``--modes``), ``--rounds`` times, in one run: ``off`` (``ENGRAMDB_SUBMITTER_SPIN_US=0``: the
engine rings the eventfd every step), ``spin`` (a window of up to ``--spin-us``, spinning:
the default from 4 CPUs up) and ``nap`` (the same window, sleeping ``--nap-us`` at a time:
the default below 4 CPUs).

Per child: ``push`` and ``fill`` p50 / mean (the first 20 steps left out), one hand-over's
cost split into those the watch caught (no system call) and those that rang the eventfd
(``_submitter.notify`` timed in place), the submitter's counts, and the process's CPU time
per step beyond the engine thread's (the watch's price). Rows are checked against the
tables' files at the last step. The ratios printed are push p50 against ``off``, per round.
JSON: ``probes/out/submitter_watch.json``.
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
from common import median, write_json  # noqa: E402

WARMUP = 20


def child(args: argparse.Namespace) -> None:
    import e2e_decode as e2e

    import engramdb
    from engramdb import keygen
    from engramdb.decode import Decoder
    from engramdb.io import sqpoll

    notify = sqpoll.step_compiled("notify")
    if notify is None:
        raise SystemExit("engramdb.io._submitter is not built (or turned off)")
    calls: dict[int, list[float]] = {0: [], 1: []}  # notify's result: 1 rang, 0 caught

    def timed(addr: int, efd: int, count: int, *order: int) -> int:
        t0 = time.perf_counter()
        r = notify(addr, efd, count, *order)  # order: first, lead, after (`Submitter.wake`)
        calls[int(r > 0)].append(time.perf_counter() - t0)
        return int(r)

    subs: list[Any] = []
    init = sqpoll.Submitter.__init__

    def tracked_init(self: Any, ring: Any) -> None:
        init(self, ring)
        self._notify = timed
        subs.append(self)

    sqpoll.Submitter.__init__ = tracked_init  # type: ignore[method-assign]
    root = Path(args.dir)
    cfg = e2e.engram_config(args)
    h = keygen.hasher("engram-peft", cfg)
    db = engramdb.open(root / "db", background_warm=False)
    stores = {lay: db[f"l{lay}"] for lay in e2e.ENGRAM_AFTER}
    dec = Decoder(stores, h, batch=args.batch, prefetch=True, compressed=True)
    out = np.empty(dec.out_shape, np.uint8)
    rng = np.random.default_rng(1)
    os.sched_setaffinity(0, {args.engine_cpu})
    work = np.ones(1 << 20, np.float32)
    pushes, fills = [], []
    cpu0 = [0.0, 0.0]
    at_warmup: dict[int, dict[str, int]] = {}  # per submitter: its counts when timing began
    ids: list[np.ndarray] = []
    for t in range(args.steps):
        if t == WARMUP:
            cpu0 = [time.process_time(), time.thread_time()]
            at_warmup = {id(s): s.counts() for s in subs}
            calls[0].clear()
            calls[1].clear()
        toks = rng.integers(1, args.vocab - 1, args.batch)
        t0 = time.perf_counter()
        ids = dec.push(toks)
        t1 = time.perf_counter()
        end = t1 + args.step_ms / 1e3 * (1 + args.jitter * (2 * rng.random() - 1))
        while time.perf_counter() < end:
            work *= 1.0000001
        t2 = time.perf_counter()
        for lay in dec.layers:
            dec.fill(out, layer=lay)
        t3 = time.perf_counter()
        if t >= WARMUP:
            pushes.append(t1 - t0)
            fills.append(t3 - t2)
    n = args.steps - WARMUP
    extra_cpu = (time.process_time() - cpu0[0]) - (time.thread_time() - cpu0[1])
    ok = check_rows(out, ids, root)
    counts: dict[str, int] = {"caught": 0, "rung": 0, "watched_ns": 0, "held": 0}  # printed
    for s in subs:
        for k, v in s.counts().items():
            counts[k] = counts.get(k, 0) + v - at_warmup.get(id(s), {}).get(k, 0)
    db.close()
    print(
        json.dumps(
            {
                "push_p50_us": median(pushes) * 1e6,
                "push_mean_us": float(np.mean(pushes)) * 1e6,
                "fill_p50_us": median(fills) * 1e6,
                "fill_mean_us": float(np.mean(fills)) * 1e6,
                "caught_us": median(calls[0]) * 1e6 if calls[0] else None,
                "rung_us": median(calls[1]) * 1e6 if calls[1] else None,
                "caught": counts["caught"],
                "rung": counts["rung"],
                "held": counts["held"],
                "watched_ms_per_step": counts["watched_ns"] / 1e6 / n,
                "other_cpu_ms_per_step": extra_cpu * 1e3 / n,
                "spin_ns": sqpoll.spin_ns(),
                "nap_ns": sqpoll.nap_ns(),
                "submitters": len(subs),
                "prefetched": int(dec.prefetched),
                "rows_equal": ok,
            }
        )
    )


def check_rows(out: np.ndarray, ids: list[np.ndarray], root: Path) -> bool:
    """The last step's rows, read from each layer's file with ``os.pread`` per row id (the
    ids that step's ``push`` returned), equal what ``fill`` wrote (``out``: ``[B, L, H, rb]``)."""
    import e2e_decode as e2e

    for i, lay in enumerate(e2e.ENGRAM_AFTER):
        row = e2e.ROW_BYTES
        fd = os.open(e2e.table_path(root, lay), os.O_RDONLY)
        try:
            want = b"".join(os.pread(fd, row, int(r) * row) for r in ids[i].reshape(-1))
        finally:
            os.close(fd)
        if out[:, i].tobytes() != want:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table-gb", type=float, default=5.1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jitter", type=float, default=0.1, help="step length +- this share")
    ap.add_argument("--spin-us", type=float, default=1000.0)
    ap.add_argument("--nap-us", type=float, default=50.0)
    ap.add_argument("--modes", default="off,spin,nap", help="of off, spin, nap")
    ap.add_argument("--engine-cpu", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=448)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import e2e_decode as e2e

    from engramdb import keygen

    root = Path(args.dir or tempfile.mkdtemp(prefix="engramdb-watch-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        cfg = e2e.engram_config(args)
        h = keygen.hasher("engram-peft", cfg)
        if not (root / "db").exists():
            t0 = time.perf_counter()
            e2e.build_tables(args, root, h)
            print(f"tables: {args.table_gb} GB built in {time.perf_counter() - t0:.0f} s")
        modes = {  # the watch's settings per mode: window cap, nap
            "off": ("0", "0"),
            "spin": (f"{args.spin_us:g}", "0"),
            "nap": (f"{args.spin_us:g}", f"{args.nap_us:g}"),
        }
        names = [m.strip() for m in args.modes.split(",")]
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
        env0 = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        for r in range(args.rounds):
            for mode in names if r % 2 == 0 else names[::-1]:
                e2e.evict_tables(root)
                spin, nap = modes[mode]
                env = dict(env0, ENGRAMDB_SUBMITTER_SPIN_US=spin, ENGRAMDB_SUBMITTER_NAP_US=nap)
                cmd = [sys.executable, __file__, "--child", "--dir", str(root)]
                for k in (
                    "table_gb",
                    "batch",
                    "step_ms",
                    "jitter",
                    "steps",
                    "engine_cpu",
                    "hidden",
                    "vocab",
                ):
                    cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if res.returncode != 0:
                    raise SystemExit(f"child ({mode}) failed:\n{res.stderr[-3000:]}")
                doc = json.loads(res.stdout.strip().splitlines()[-1])
                runs[mode].append(doc)
                show(r, mode, doc)
        print_summary(args, runs)
        write_json("submitter_watch", {"args": vars(args), "runs": runs})
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def show(r: int, mode: str, d: dict[str, Any]) -> None:
    def us(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"round {r} watch {mode:3s}: push p50 {d['push_p50_us']:.0f} us (mean "
        f"{d['push_mean_us']:.0f}), fill p50 {d['fill_p50_us']:.0f} us; hand-overs caught "
        f"{d['caught']} / rang {d['rung']} ({us(d['caught_us'])} / {us(d['rung_us'])} us "
        f"each); watched {d['watched_ms_per_step']:.2f} ms, other threads' CPU "
        f"{d['other_cpu_ms_per_step']:.2f} ms a step; rows equal: {d['rows_equal']}"
    )


def print_summary(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    base = runs.get("off")
    print(f"B={args.batch}, {args.step_ms:g} ms steps, {args.steps - WARMUP} timed steps a child")
    for mode, ds in runs.items():
        caught = [d["caught"] / max(1, d["caught"] + d["rung"]) for d in ds]
        push = ", ".join(f"{d['push_p50_us']:.0f}" for d in ds)
        cpu = ", ".join(f"{d['other_cpu_ms_per_step']:.2f}" for d in ds)
        share = ", ".join(f"{x:.0%}" for x in caught)
        line = (
            f"  {mode:5s} push p50 {push} us; caught {share} of hand-overs; "
            f"other threads' CPU {cpu} ms a step"
        )
        if base and mode != "off":
            ratios = [d["push_p50_us"] / b["push_p50_us"] for d, b in zip(ds, base)]
            line += f"; push p50 vs off per round {', '.join(f'{x:.2f}x' for x in ratios)}"
        print(line)
    print(f"rows equal in every child: {all(d['rows_equal'] for v in runs.values() for d in v)}")


if __name__ == "__main__":
    main()
