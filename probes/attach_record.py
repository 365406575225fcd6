"""Attached V4.1 rows through the RAM record, by where the weight tensor starts: warm rows/s of
an attached weight + scale table with and without the spill (``engramdb.read.resident``),
against the same rows built, in one process.

    python probes/attach_record.py [--aligns 8,16,24,32,40,48] [--gib 0.5] [--reps 9] [--dir /tmp]

For each alignment ``a`` (bytes past a cache line where the weight tensor's data starts), a
safetensors file holds one V4.1 layer (``embed.weight`` F8_E4M3 ``[N, 256]`` then
``embed.scale`` F8_E8M0 ``[N, 8]``, random bytes, ``--gib`` GiB in all). It is attached
(weight + scale: 264 B rows) and built (``build --from-attached``); every file is evicted
and then populated by ``populate`` (one sequential pass: 2 MiB page-cache folios, as
``engramdb warm`` leaves them), then read once by the CPU (`common.read_once`). Arms, each
16 batches of 16,384 random ids through ``fetch_into`` on this thread
(``ENGRAMDB_GATHER_THREADS=1``), the CPU caches flushed before every arm, interleaved ABBA:

* ``np.take(built)``: single-thread ``np.take(out=)`` on the built mapping (the baseline);
* ``built``: the built table's ``fetch_into``;
* ``attached``: the attached table, its record holding the scale only
  (``ENGRAMDB_ATTACH_SPILL=0``);
* ``attached+spill``: the attached table as opened by default (the record also holds each
  weight row's bytes on a cache line of their own, where ``a`` <= 24).

Prints rows/s per repetition, medians, and attached/built ratios per alignment. JSON to
probes/out/attach_record.json. Files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["ENGRAMDB_GATHER_THREADS"] = "1"  # before engramdb reads it: gathers on this thread

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CacheFlush, interleave, median, read_once, write_json  # noqa: E402

import engramdb  # noqa: E402
from engramdb.build.attach import materialize  # noqa: E402
from engramdb.read import resident  # noqa: E402
from engramdb.testing.pages import evict  # noqa: E402

W, S = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"
BATCH, BATCHES = 16_384, 16


def write_layer(path: Path, rows: int, align: int) -> None:
    """A V4.1 layer whose weight data starts ``align`` bytes past a cache line (random
    bytes, written in 64 MiB pieces)."""
    doc = {
        W: {"dtype": "F8_E4M3", "shape": [rows, 256], "data_offsets": [0, rows * 256]},
        S: {"dtype": "F8_E8M0", "shape": [rows, 8], "data_offsets": [rows * 256, rows * 264]},
    }
    text = json.dumps(doc).encode()
    text += b" " * ((align - 8 - len(text)) % 64)  # the data start, 8 + len(text), at align
    rng = np.random.default_rng(align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        left = rows * 264
        while left:
            n = min(left, 64 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n


def one_alignment(root: Path, align: int, gib: float, reps: int) -> dict[str, Any]:
    rows = int(gib * 2**30) // 264
    src = root / f"a{align}.safetensors"
    write_layer(src, rows, align)
    db, built = root / f"db{align}", root / f"built{align}"
    engramdb.attach(db, "t", [str(src)], tensor=W, scale_tensor=S)
    engramdb.attach(built, "t", [str(src)], tensor=W, scale_tensor=S)
    materialize(built, "t")
    os.environ[resident.SPILL_ENV] = "0"
    plain = engramdb.open(db)
    plain_t = plain["t"]  # its record is laid out as the table opens
    del os.environ[resident.SPILL_ENV]
    with engramdb.open(db) as da, engramdb.open(built) as dbb, plain:
        t = {"built": dbb["t"], "attached": plain_t, "attached+spill": da["t"]}
        for p in [src] + [built / s.path for s in t["built"].info.shards]:
            evict(str(p))
        for st in t.values():
            st.populate()
        # without this pass attached rows came out 1.02-1.08x built, 0.88-0.91x with it
        read_once([src] + [built / s.path for s in t["built"].info.shards])
        rec = t["attached+spill"]._segments.record
        spill = rec.spill[1] if rec.spill else 0
        assert rec.spill_state == ("ready" if spill else "off"), rec.spill_state
        assert t["attached"]._segments.record.spill_state == "off"
        rng = np.random.default_rng(1)
        ids = [rng.integers(0, rows, BATCH) for _ in range(BATCHES)]
        want = t["built"].fetch(ids[0])
        for k in ("attached", "attached+spill"):  # correctness before timing
            assert np.array_equal(t[k].fetch(ids[0]), want), k
        ref = t["built"].array()
        out = np.empty((BATCH, 264), np.uint8)

        def arm(st: Any) -> Any:
            def run() -> float:
                t0 = time.perf_counter()
                for b in ids:
                    st.fetch_into(b, out)
                return BATCH * BATCHES / (time.perf_counter() - t0)

            return run

        def take_ref() -> float:
            t0 = time.perf_counter()
            for b in ids:
                np.take(ref, b, axis=0, out=out, mode="clip")
            return BATCH * BATCHES / (time.perf_counter() - t0)

        arms = {"np.take(built)": take_ref, **{k: arm(st) for k, st in t.items()}}
        flush = CacheFlush()
        for f in arms.values():  # one untimed round: first touches, split decisions
            flush()
            f()
        print(f"a = {align}: {rows} rows, record {8 + spill} B per row (spill {spill} B)")
        res = interleave(arms, reps, before=flush)
    med = {k: median(v) for k, v in res.items()}
    doc = {"align": align, "rows": rows, "spill": spill, "rows_per_s": res, "medians": med}
    doc["ratios"] = {
        "attached/built": med["attached"] / med["built"],
        "attached+spill/built": med["attached+spill"] / med["built"],
        "built/np.take": med["built"] / med["np.take(built)"],
    }
    for p in (src, db, built):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--aligns", default="8,16,24,32,40,48")
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="engramdb-attach-record-", dir=a.dir))
    docs = []
    try:
        for align in (int(x) for x in a.aligns.split(",")):
            docs.append(one_alignment(root, align, a.gib, a.reps))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("medians (rows/s) and ratios, per alignment of the weight tensor:")
    print("  a   spill  np.take(built)  built     attached  +spill    att/built  +spill/built")
    for d in docs:
        m, r = d["medians"], d["ratios"]
        print(
            f"  {d['align']:<3d} {d['spill']:>3d} B  {m['np.take(built)'] / 1e6:8.2f} M    "
            f"{m['built'] / 1e6:6.2f} M  {m['attached'] / 1e6:6.2f} M  "
            f"{m['attached+spill'] / 1e6:6.2f} M  {r['attached/built']:6.2f}x    "
            f"{r['attached+spill/built']:6.2f}x"
        )
    print(f"json: {write_json('attach_record', {'gib': a.gib, 'reps': a.reps, 'runs': docs})}")


if __name__ == "__main__":
    main()
