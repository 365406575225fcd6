"""How much a decode step's cold reads cost the engine's thread: the step reader with its
polling kernel thread, the same reader submitting with ``io_uring_enter`` from the engine's
thread (``ENGRAMDB_SQPOLL=0``), and the table prefetcher (a background Python thread),
against the same loop gathering from RAM.

    python probes/step_reads.py [--rows 32] [--dim 900] [--steps 300] [--reps 3] [--gb 2]

A single-thread torch loop stands in for a model (``--dim``: four MLP blocks; 900 makes a
~4 ms step here). Each step draws ``--rows`` random row ids of a ``--gb`` GB table of 320 B
rows (a file built with random bytes, evicted before every arm), starts their read right
away, runs one block, takes the rows, then runs three more blocks (the rows are needed a
quarter into the step). Arms, each in a fresh process, interleaved (ABBA):

* ``ram``: ``np.take`` from the same rows held in anonymous memory (the baseline);
* ``sqpoll``: `StepReader` (O_DIRECT, the process's polling thread submits);
* ``enter``: `StepReader` with ``ENGRAMDB_SQPOLL=0`` (``io_uring_enter`` in the loop's thread);
* ``prefetcher``: the table's `Prefetcher` (``submit_trusted(keep_rows=True)``, its thread).

The rows of every arm are checked against the file first. Printed per arm: the loop's time
relative to ``ram`` (per repetition and median), the mean step, the time the loop spent
starting reads and waiting for rows. JSON to probes/out/step_reads.json. The table is
deleted at exit.
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

ROW = 320
ARMS = ("ram", "sqpoll", "enter", "prefetcher")


def child(args: argparse.Namespace) -> None:
    import torch

    import engramdb
    from engramdb.read.step_plan import StepTicket
    from engramdb.read.steps import StepReader
    from engramdb.testing.pages import evict

    torch.set_num_threads(1)
    root = Path(args.root)
    arm = args.child
    d = args.dim
    w1, w2, x0 = torch.randn(d, 4 * d), torch.randn(4 * d, d), torch.randn(1, d)

    def block(x: Any) -> Any:
        return x + torch.nn.functional.gelu(x @ w1) @ w2

    rng = np.random.default_rng(args.seed)
    with engramdb.open(root / "db", background_warm=False) as db:
        st = db["t"]
        n_rows = st.n_rows
        ram = np.fromfile(root / "rows.bin", np.uint8).reshape(n_rows, ROW) if arm == "ram" else None
        evict(root / "rows.bin")
        reader = StepReader()
        pf = st.prefetcher
        ids_all = rng.integers(0, n_rows, (args.steps, args.rows))
        check = np.fromfile(root / "rows.bin", np.uint8, count=ROW * 64).reshape(64, ROW)
        evict(root / "rows.bin")
        steps, starts, waits = [], [], []
        for s in range(args.steps):
            ids = ids_all[s]
            t0 = time.perf_counter()
            ticket: Any = None
            if arm in ("sqpoll", "enter"):
                ticket = StepTicket(ids)
                assert reader.submit([(st, ids, ticket)])
            elif arm == "prefetcher":
                ticket = pf.submit_trusted(ids, keep_rows=True)
            t1 = time.perf_counter()
            x = block(x0)
            t2 = time.perf_counter()
            if ram is not None:
                rows = ram.take(ids, 0)
            else:
                ticket.wait()
                if ticket.uids is None:
                    rows = ticket.rows
                else:
                    rows = ticket.rows.take(np.searchsorted(ticket.uids, ids), 0)
            t3 = time.perf_counter()
            if s == 0:  # correct rows first: rows below 64 are in `check`
                probe_ids = np.arange(64)
                if arm in ("sqpoll", "enter"):
                    t = StepTicket(probe_ids)
                    reader.submit([(st, probe_ids, t)])
                    t.wait()
                    assert np.array_equal(t.rows, check), "rows differ from the file"
                else:
                    assert np.array_equal(st.fetch(probe_ids), check)
            for _ in range(3):
                x = block(x)
            steps.append(time.perf_counter() - t0)
            starts.append(t1 - t0)
            waits.append(t3 - t2)
        reader.close()
    skip = 20
    print(
        "RESULT "
        + json.dumps(
            {
                "arm": arm,
                "loop_s": float(np.sum(steps[skip:])),
                "step_us": float(np.mean(steps[skip:]) * 1e6),
                "start_us": float(np.mean(starts[skip:]) * 1e6),
                "wait_us": float(np.mean(waits[skip:]) * 1e6),
                "rows_per_step": int(rows.shape[0]),
            }
        )
    )


def run_arm(args: argparse.Namespace, root: Path, arm: str, rep: int) -> dict[str, Any]:
    env = dict(os.environ)
    if arm == "enter":
        env["ENGRAMDB_SQPOLL"] = "0"
    cmd = [sys.executable, __file__, "--child", arm, "--root", str(root), "--seed", str(rep)]
    for k in ("rows", "dim", "steps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"arm {arm} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][7:])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--dim", type=int, default=900)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import engramdb

    root = Path(tempfile.mkdtemp(prefix="step_reads_", dir=args.dir))
    try:
        n = int(args.gb * 1e9) // ROW
        rng = np.random.default_rng(7)
        with open(root / "rows.bin", "wb") as f:
            for lo in range(0, n, 1 << 18):
                f.write(rng.integers(0, 256, (min(1 << 18, n - lo), ROW), np.uint8).tobytes())
        engramdb.attach(root / "db", "t", [root / "rows.bin"], row_bytes=ROW)
        arms = args.arms.split(",")
        res: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
        for rep in range(args.reps):
            order = arms if rep % 2 == 0 else arms[::-1]
            for arm in order:
                res[arm].append(run_arm(args, root, arm, rep))
        base = [r["loop_s"] for r in res[arms[0]]]
        print(f"{args.rows} cold rows a step, a {args.dim}-wide 4-block loop, {args.steps} steps")
        doc: dict[str, Any] = {"args": vars(args), "arms": {}}
        for arm in arms:
            rs = res[arm]
            ratios = [b / r["loop_s"] for b, r in zip(base, rs)]
            doc["arms"][arm] = {"runs": rs, "vs_ram": ratios, "vs_ram_median": median(ratios)}
            print(
                f"  {arm:10s} {median(ratios):.3f}x {arms[0]} (reps "
                + " ".join(f"{x:.3f}" for x in ratios)
                + f"); step {median([r['step_us'] for r in rs]):.0f} us, start "
                f"{median([r['start_us'] for r in rs]):.0f} us, wait {median([r['wait_us'] for r in rs]):.0f} us"
            )
        print(f"wrote {write_json('step_reads', doc)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
