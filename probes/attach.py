"""Attached tables: attach/open time of a sparse 50 GB checkpoint, and warm/cold rows/s of
attached tables against the same tables built, in the same run.

    python probes/attach.py [--quick] [--gib 1] [--sparse-gb 50] [--reps 5] [--batches 64]
        [--pairs 512] [--dir /tmp]

1. Sparse: a V4.1-shaped safetensors file (``layers.1.engram.embed.weight`` F8_E4M3
   ``[N, 256]`` + ``.scale`` F8_E8M0 ``[N, 8]``, ``--sparse-gb`` GB, made with ``truncate``:
   holes, no data). Times ``engramdb.attach`` and ``engramdb.open`` + the table handle
   (median of 5), and checks that no data byte was written (the file's allocated blocks do
   not change; the database directory holds only ``manifest.json`` and ``.lock``).
2. Real data (``--gib`` GiB of random rows in one safetensors file): table ``w`` attaches the
   weight tensor (one column: 256 B rows), ``ws`` weight + scale (264 B rows from two
   tensors); ``w_built`` / ``ws_built`` are the same rows built (``build --from-attached``).
   Warm (populated; ``ws`` also loads its RAM record into RAM: the 8 B scale and the bytes
   of each weight row on a cache line of their own, engramdb.read.resident; checked; single-thread
   baseline ``np.take`` on the built mapping first): ``--batches`` (64) batches of 16,384
   random ids through ``fetch_into`` per repetition (at 16, ~6 ms an arm, one rep's ratio
   strayed 0.5-1.3x), the CPU caches flushed before every arm (`CacheFlush`: the
   arms read the same rows, and the 480 MiB last-level cache here would otherwise hand an
   arm the rows the arm before it read). Cold: a fresh process per arm and repetition opens the
   database (an attached ``ws`` loads its RAM record, timed and reported, not in the
   timed batch), drops its own mapped pages, evicts the files with POSIX_FADV_DONTNEED (no
   global drop_caches), checks residency < 1 %, then times one batch of 16,384 random ids
   (default ``auto`` backend). Arms interleaved ABBA; per-repetition and median
   attached/built ratios last. Then the **paired** warm figure, the one to quote: each
   attached table and its built copy alternate batch by batch (AB, BA, ...) on the same ids,
   ``--pairs`` batches a table, pooled into one ratio with a 95 % bootstrap interval (the
   shared VM's rates drift over a run, up to 1.5x rep after rep, which moves the per-rep
   ratios above more than the tables do). ``--gib 3`` or more for a table the 32 MiB
   last-level cache here holds little of (at 1 GiB the scale record, 32 MiB, is as large
   as it). JSON to probes/out/attach.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    CacheFlush,
    interleave,
    median,
    pooled_ratio,
    read_once,
    vm_hwm_mb,
    write_json,
)

import engramdb  # noqa: E402
from engramdb.build.attach import materialize  # noqa: E402
from engramdb.io.mapping import MADV_DONTNEED  # noqa: E402
from engramdb.testing.pages import evict  # noqa: E402

BATCH = 16_384
ALIGN = 8  # data start alignment of the probe's safetensors files (--align)


def v41_header(n: int) -> bytes:
    doc = {
        "layers.1.engram.embed.weight": {
            "dtype": "F8_E4M3",
            "shape": [n, 256],
            "data_offsets": [0, n * 256],
        },
        "layers.1.engram.embed.scale": {
            "dtype": "F8_E8M0",
            "shape": [n, 8],
            "data_offsets": [n * 256, n * 264],
        },
    }
    text = json.dumps(doc).encode()
    # the header is padded to 8 bytes as the safetensors writer does (rows then start at an
    # 8-byte, not a cache-line, boundary); --align 64 pads the data start to a cache line
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def sparse_part(root: Path, gb: float) -> dict[str, Any]:
    n = int(gb * 1e9) // 264
    src = root / "sparse.safetensors"
    head = v41_header(n)
    with open(src, "wb") as f:
        f.write(head)
    os.truncate(src, len(head) + n * 264)
    blocks0 = os.stat(src).st_blocks
    db = root / "sparse_db"
    t0 = time.perf_counter()
    engramdb.attach(db, "t", [src], tensor="*embed.weight", scale_tensor="*embed.scale")
    attach_s = time.perf_counter() - t0
    opens = []
    for _ in range(5):
        t0 = time.perf_counter()
        with engramdb.open(db) as d:
            st = d["t"]
            opens.append(time.perf_counter() - t0)
            assert st.n_rows == n and st.row_bytes == 264
    files = sorted(os.listdir(db))
    out = {
        "file_gb": os.stat(src).st_size / 1e9,
        "attach_ms": attach_s * 1e3,
        "open_ms_median": median(opens) * 1e3,
        "open_ms_all": [o * 1e3 for o in opens],
        "source_blocks_unchanged": os.stat(src).st_blocks == blocks0,
        "db_files": files,
        "manifest_bytes": os.stat(db / "manifest.json").st_size,
    }
    print(
        f"sparse {out['file_gb']:.1f} GB: attach {out['attach_ms']:.1f} ms, open+table "
        f"{out['open_ms_median']:.1f} ms (median of 5), source blocks unchanged: "
        f"{out['source_blocks_unchanged']}, db holds {files} ({out['manifest_bytes']} B manifest)"
    )
    return out


def real_file(root: Path, gib: float) -> tuple[Path, int]:
    n = int(gib * 2**30) // 264
    src = root / "model-00001-of-00001.safetensors"
    rng = np.random.default_rng(7)
    with open(src, "wb") as f:
        f.write(v41_header(n))
        step = (64 << 20) // 256
        for lo in range(0, n, step):
            f.write(rng.integers(0, 256, (min(step, n - lo), 256), np.uint8).tobytes())
        f.write(rng.integers(0, 256, (n, 8), np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return src, n


def table_files(st: Any) -> list[str]:
    if st.attached:
        return [f.path for f in st.info.attached.files]
    return [str(st.db_path / s.path) for s in st.info.shards]


def resident_of(st: Any) -> tuple[str, float]:
    """An attached table's resident-column state and load seconds ("-" for others)."""
    seg = st._segments
    if seg is None:
        return "-", 0.0
    return seg.record.state, seg.record.seconds


def cold_child(db: str, table: str, seed: int) -> None:
    """One cold arm in this fresh process: open, wait for the resident columns (timed),
    drop this process's mapped pages, evict the files, check residency, time one batch of
    `BATCH` random ids read through ``fetch_into`` (default ``auto`` backend)."""
    t0 = time.perf_counter()
    # background_warm off for every arm: a built table's background warm (started by its
    # first cold read) would read the whole table while the batch is timed
    with engramdb.open(db, background_warm=False) as d:
        st = d[table]
        open_s = time.perf_counter() - t0
        seg = st._segments
        t0 = time.perf_counter()
        if seg is not None:
            seg.record.wait()
        load_s = time.perf_counter() - t0
        st._mapping.advise(MADV_DONTNEED)
        for p in table_files(st):
            evict(p)
        res = st.residency()
        ids = np.random.default_rng(seed).integers(0, st.n_rows, BATCH)
        out = np.empty((BATCH, st.row_bytes), np.uint8)
        t0 = time.perf_counter()
        st.fetch_into(ids, out)
        dt = time.perf_counter() - t0
        state, _ = resident_of(st)
        print(
            json.dumps(
                {
                    "rows_per_s": BATCH / dt,
                    "residency": res,
                    "open_ms": open_s * 1e3,
                    "resident_load_ms": load_s * 1e3,
                    "resident": state,
                    "backend": st.backend_name,
                    "chosen": st._auto.last_choice if st._auto is not None else "",
                }
            )
        )


def run_child(db: Path, table: str, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--cold-child", str(db), table, str(seed)]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gib", type=float, default=None)
    ap.add_argument("--sparse-gb", type=float, default=50)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--batches", type=int, default=64, help="warm batches per arm and rep")
    ap.add_argument(
        "--pairs", type=int, default=512, help="warm batches per table of the paired figure"
    )
    ap.add_argument("--dir", default=None)
    ap.add_argument("--align", type=int, default=8, help="data start alignment (8: as written)")
    ap.add_argument("--cold-child", nargs=3, metavar=("DB", "TABLE", "SEED"), default=None)
    a = ap.parse_args()
    global ALIGN
    ALIGN = a.align
    if a.cold_child:
        cold_child(a.cold_child[0], a.cold_child[1], int(a.cold_child[2]))
        return
    gib = a.gib if a.gib is not None else (0.5 if a.quick else 1.0)
    reps = a.reps if a.reps is not None else (5 if a.quick else 9)
    root = Path(tempfile.mkdtemp(prefix="attach-probe-", dir=a.dir))
    doc: dict[str, Any] = {"gib": gib, "reps": reps, "batch": BATCH, "align": ALIGN}
    try:
        doc["sparse"] = sparse_part(root, a.sparse_gb)
        src, n = real_file(root, gib)
        db, built = root / "db", root / "built"
        engramdb.attach(db, "w", [src], tensor="*embed.weight")
        engramdb.attach(db, "ws", [src], tensor="*embed.weight", scale_tensor="*embed.scale")
        engramdb.attach(built, "w_tmp", [src], tensor="*embed.weight")
        engramdb.attach(built, "ws_tmp", [src], tensor="*embed.weight", scale_tensor="*embed.scale")
        for name in ("w", "ws"):
            materialize(built, f"{name}_tmp")
        cold_opens = []
        for _ in range(3):  # identity check with the header and sampled blocks on the device
            evict(src)
            t0 = time.perf_counter()
            with engramdb.open(db) as d:
                d["ws"]
                cold_opens.append(time.perf_counter() - t0)
        doc["cold_open_ms"] = [x * 1e3 for x in cold_opens]
        print(
            f"open of the attached db with its {gib} GiB source evicted: "
            f"{median(cold_opens) * 1e3:.1f} ms (median of 3; 2 tables, ~5 reads per file)"
        )
        rng = np.random.default_rng(1)
        ids = [rng.integers(0, n, BATCH) for _ in range(max(2, a.batches))]
        with engramdb.open(db) as da, engramdb.open(built) as dbb:
            t = {"w": da["w"], "ws": da["ws"], "w_built": dbb["w_tmp"], "ws_built": dbb["ws_tmp"]}
            # Populated first, as `engramdb warm` leaves a table (one sequential pass per file:
            # 2 MiB page-cache folios; cold random reads before it would leave 4 KiB ones in
            # every region they touched, and the comparison would time the TLB)
            for st in t.values():
                st.populate()  # attached ws: also loads its RAM record (scale + spill)
            read_once({p for st in t.values() for p in table_files(st)})
            for k in ("w", "ws"):  # correctness before timing
                want = t[f"{k}_built"].fetch(ids[0])
                assert np.array_equal(t[k].fetch(ids[0]), want), k
            state, load_s = resident_of(t["ws"])
            assert state == "ready", state  # the path under test ran
            rec = t["ws"]._segments.record
            spill = rec.spill[1] if rec.spill else 0
            assert rec.spill_state == ("ready" if spill else "off"), rec.spill_state
            doc["ws_resident"] = {
                "state": state,
                "load_ms": load_s * 1e3,
                "bytes": rec.nbytes,
                "spill_bytes_per_row": spill,
            }
            wide = max(t["ws"]._segments.columns, key=lambda c: c.width)
            line_off = int(wide.offset[0]) % 64  # where the weight rows start past a line
            doc["weight_line_offset"] = line_off
            print(
                f"ws: the weight starts {line_off} B past a cache line; RAM record of "
                f"{8 + spill} B per row (8 B scale + {spill} B of each weight row on a line of "
                f"its own; {rec.nbytes / 2**20:.1f} MiB), loaded in {load_s * 1e3:.1f} ms"
            )
            for k in ("w", "ws"):
                want = t[f"{k}_built"].fetch(ids[1])
                assert np.array_equal(t[k].fetch(ids[1]), want), k
            ref = t["w_built"].array()
            outs = {k: np.empty((BATCH, st.row_bytes), np.uint8) for k, st in t.items()}

            def warm(k: str) -> Any:
                st, out = t[k], outs[k]

                def arm() -> float:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for b in ids:
                        st.fetch_into(b, out)
                    cpu.setdefault(k, []).append(BATCH * len(ids) / (time.thread_time() - c0))
                    return BATCH * len(ids) / (time.perf_counter() - t0)

                return arm

            def take_ref() -> float:
                out = outs["w_built"]
                t0, c0 = time.perf_counter(), time.thread_time()
                for b in ids:
                    np.take(ref, b, axis=0, out=out, mode="clip")
                cpu.setdefault("np.take(built)", []).append(
                    BATCH * len(ids) / (time.thread_time() - c0)
                )
                return BATCH * len(ids) / (time.perf_counter() - t0)

            # rows per CPU-second of the calling thread besides wall-clock rows/s: on a shared
            # machine it leaves out the time this thread was not running (ENGRAMDB_GATHER_THREADS=1
            # keeps every gather on the calling thread, so it counts all the work)
            cpu: dict[str, list[float]] = {}
            print(f"warm, {gib} GiB, batches of {BATCH} random ids, fetch_into (rows/s):")
            arms = {"np.take(built)": take_ref, **{k: warm(k) for k in t}}
            flush = CacheFlush()  # every arm starts with the rows in memory, not in the LLC
            for f in arms.values():  # one untimed round: output buffers, split decisions
                flush()
                f()
            cpu.clear()
            w = interleave(arms, reps, before=flush)
            flush()
            w["np.take(built) last"] = [take_ref()]
            # Paired: each attached table and its built copy alternate batch by batch (AB,
            # BA, ...) on the same ids, so the machine's drift falls on both alike (over one
            # run of this probe the shared VM's warm rates climbed 1.5x, rep after rep)
            pids = [rng.integers(0, n, BATCH) for _ in range(max(2, a.pairs))]
            paired: dict[str, tuple[float, float, float]] = {}
            for k in ("w", "ws"):
                times = []
                for i, b in enumerate(pids):
                    sides = (k, f"{k}_built") if i % 2 == 0 else (f"{k}_built", k)
                    took = {}
                    for side in sides:
                        t0 = time.perf_counter()
                        t[side].fetch_into(b, outs[side])
                        took[side] = time.perf_counter() - t0
                    times.append((took[f"{k}_built"], took[k]))
                paired[k] = pooled_ratio(times)
            tables = {k: (st.db_path, st.name) for k, st in t.items()}
        print(
            "cold (fresh process per arm; own pages dropped, files evicted with "
            "POSIX_FADV_DONTNEED, residency checked < 1 %), one batch per rep (rows/s):"
        )
        c: dict[str, list[float]] = {k: [] for k in tables}
        extra: dict[str, list[dict[str, Any]]] = {k: [] for k in tables}
        for r in range(reps):
            order = list(tables) if r % 2 == 0 else list(tables)[::-1]
            row = []
            for k in order:
                res = run_child(*tables[k], seed=100 + r)
                assert res["residency"] < 0.01, f"{k} still {res['residency']:.1%} resident"
                if k == "ws":
                    assert res["resident"] == "ready", res
                c[k].append(res["rows_per_s"])
                extra[k].append(res)
                row.append(f"{k}={res['rows_per_s'] / 1e6:.3f}M ({res['chosen']})")
            print(f"  rep {r}: " + "  ".join(row))
        loads = [e["resident_load_ms"] for e in extra["ws"]]
        print(
            f"  ws in each fresh process: RAM record loaded in {median(loads):.1f} ms "
            f"(median; before eviction, not in the timed batch)"
        )
        doc["warm"] = w
        doc["warm_cpu"] = cpu
        print("warm, rows per CPU-second of the calling thread (medians):")
        for k, v in cpu.items():
            print(f"  {k}: {median(v) / 1e6:.3f} M")
        for k in ("w", "ws"):
            per = [x / y for x, y in zip(cpu[k], cpu[f"{k}_built"])]
            doc.setdefault("per_rep_ratios", {})[f"warm cpu {k}"] = per
            print(
                f"  warm cpu {k} attached/built per rep: {' '.join(f'{x:.2f}' for x in per)}; "
                f"of medians {median(cpu[k]) / median(cpu[f'{k}_built']):.2f}x"
            )
        doc["cold"] = c
        doc["cold_children"] = extra
        med = {f"warm {k}": median(v) for k, v in w.items()}
        med |= {f"cold {k}": median(v) for k, v in c.items()}
        print("medians:")
        for k, v in med.items():
            print(f"  {k}: {v / 1e6:.3f} M rows/s")
        ratios = {
            f"{mode} {k} attached/built": med[f"{mode} {k}"] / med[f"{mode} {k}_built"]
            for mode in ("warm", "cold")
            for k in ("w", "ws")
        }
        ratios["warm w_built / np.take"] = med["warm w_built"] / med["warm np.take(built)"]
        for mode, runs in (("warm", w), ("cold", c)):
            for k in ("w", "ws"):
                per = [x / y for x, y in zip(runs[k], runs[f"{k}_built"])]
                doc.setdefault("per_rep_ratios", {})[f"{mode} {k}"] = per
                print(f"  {mode} {k} attached/built per rep: " + " ".join(f"{x:.2f}" for x in per))
        doc["ratios"] = ratios
        doc["warm_paired"] = paired
        doc["vm_hwm_mb"] = vm_hwm_mb()
        print("ratios (of medians):")
        for k, v in ratios.items():
            print(f"  {k}: {v:.2f}x")
        print(
            f"warm attached/built, paired ({a.pairs} batches a table, alternating with the "
            "built copy; pooled, 95 % bootstrap interval):"
        )
        for k, (lo, mid, hi) in paired.items():
            print(f"  {k}: {mid:.3f}x ({lo:.3f}-{hi:.3f})")
        s = doc["sparse"]
        print(
            f"acceptance: attach {s['attach_ms']:.0f} ms (< 1000), open {s['open_ms_median']:.1f} ms "
            f"(< 100), no data written: {s['source_blocks_unchanged']}"
        )
        print(f"json: {write_json('attach', doc)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
