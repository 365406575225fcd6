"""``engramdb bench``: the probes a user cares about, at a small size, on their machine.

Every figure is measured against its baseline in the same run: warm gathers against
single-thread ``np.take(table, ids, axis=0, out=out, mode="clip")`` on a populated
mapping of the same rows, cold reads against ``fio`` (4 KiB random reads on the same
shard, when fio is installed), a view against the Store-I gather of the same rows, a
`serve` round trip against the local gather. `run_bench` returns one JSON-ready document;
its keys are `RESULT_KEYS` (documented in docs/cli.md, checked by tests/test_bench.py).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engramdb import keygen
from engramdb._version import __version__
from engramdb.build import build
from engramdb.build.view import build_view
from engramdb.cli.bench import measure_throughput
from engramdb.database import Database
from engramdb.decode import Decoder
from engramdb.io.select import BACKENDS
from engramdb.io.uring import IoUringBackend
from engramdb.stream import stream
from engramdb.testing.pages import evict
from engramdb.view import View

#: Top-level keys of the document `run_bench` returns (and ``--json`` writes).
RESULT_KEYS = (
    "engramdb_version",
    "created",
    "machine",
    "config",
    "warm",
    "cold",
    "convergence",
    "decode",
    "stream",
    "view",
    "serve",
    "ratios",
    "seconds",
)

ROW_BYTES = 256  # a PLE-like row: 256 fp8 values
TABLE = "ple"


def bench_hasher(base: int) -> keygen.Hasher:
    """A Qwen-style layout (3-grams, 2 orders x 8 heads = 16 rows per token) whose table
    holds about ``16 * base`` rows."""
    return keygen.hasher(
        "qwen4exp",
        {
            "vocab_size": 32000,
            "ngram_size": 3,
            "heads_per_ngram": 8,
            "ngram_vocab_size_base": base,
            "make_ngram_vocab_size_divisible_by": 4,
            "eos_token_id": 1,
            "ple_layer_ids": [1],
        },
        name="bench",
    )


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "base": 16000,
            "batches": [64, 1024, 16384],
            "seconds": 0.12,
            "cold_rows": 16384,
            "converge_s": 1.0,
            "decode_steps": 1500,
            "stream_tokens": 65536,
            "view_records": 32768,
            "serve_batches": [256, 4096],
        }
    return {
        "base": 64000,
        "batches": [16, 64, 256, 1024, 4096, 16384, 65536],
        "seconds": 0.5,
        "cold_rows": 65536,
        "converge_s": 4.0,
        "decode_steps": 10000,
        "stream_tokens": 1 << 20,
        "view_records": 262144,
        "serve_batches": [64, 1024, 16384],
    }


def _rate(fn: Callable[[], int], seconds: float) -> float:
    """Items per second of repeated ``fn()`` calls (each returns its item count), after one
    untimed call."""
    fn()
    done, t0 = 0, time.perf_counter()
    while True:
        done += fn()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return done / dt


def _fio(path: Path, seconds: float) -> dict[str, Any] | None:
    """4 KiB O_DIRECT random reads of ``path`` by fio (None when fio is not installed or
    fails): read IOPS and GB/s."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    cmd = [
        exe, "--name=bench", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
        "--iodepth=32", "--ioengine=psync" if os.name != "posix" else "--ioengine=libaio",
        f"--runtime={max(1, round(seconds))}", "--time_based", "--readonly",
        "--output-format=json",
    ]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        job = json.loads(out)["jobs"][0]["read"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
        return None
    return {"iops": float(job["iops"]), "gb_per_s": float(job["bw_bytes"]) / 1e9}


def run_bench(
    directory: str | os.PathLike[str] | None = None,
    *,
    quick: bool = True,
    echo: Callable[[str], None] = print,
    serve: bool = True,
) -> dict[str, Any]:
    """Run every probe (see the module doc) in a fresh temp directory (or ``directory``),
    print one line per figure through ``echo``, remove the files, return the document."""
    cfg = _settings(quick)
    started = time.perf_counter()
    own = directory is None
    root = Path(tempfile.mkdtemp(prefix="engramdb-bench-") if own else directory)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    try:
        return _run(root, cfg, quick, echo, serve, started)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def _run(
    root: Path,
    cfg: dict[str, Any],
    quick: bool,
    echo: Callable[[str], None],
    serve: bool,
    started: float,
) -> dict[str, Any]:
    h = bench_hasher(cfg["base"])
    heads = [int(r) for r in h.head_rows()]
    pad = h.table_rows() - sum(heads)
    heads += [pad] if pad else []
    n = sum(heads)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8)
    src = root / "rows.npy"
    np.save(src, rows)
    del rows
    db = root / "db"
    built = build(db, TABLE, ROW_BYTES, [str(src)], heads=heads, dtype="fp8_e4m3")
    echo(built.line())
    doc: dict[str, Any] = {
        "engramdb_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
        },
        "config": {
            "quick": quick,
            "rows": n,
            "row_bytes": ROW_BYTES,
            "table_bytes": n * ROW_BYTES,
            "heads": len(heads),
            "seconds_per_figure": cfg["seconds"],
        },
    }
    ratios: list[dict[str, Any]] = []

    def ratio(name: str, ours: float, base: float, baseline: str, unit: str) -> None:
        r = ours / base if base > 0 else float("nan")
        ratios.append(
            {"name": name, "engramdb": ours, "baseline": base, "baseline_name": baseline,
             "unit": unit, "ratio": r}
        )  # fmt: skip
        echo(f"{name}: {ours:,.0f} vs {base:,.0f} {unit} ({baseline}): {r:.2f}x")

    mm = np.load(src, mmap_mode="r")
    np.take(mm, np.arange(0, n, 16), axis=0)  # touch every page: a populated mapping
    int(np.asarray(mm[:, 0], dtype=np.int64).sum())
    doc["warm"] = _warm(db, mm, n, cfg, ratio)
    with Database(db, backend="auto", background_warm=False) as d:
        store = d[TABLE]
        shards = [db / s.path for s in d.manifest.tables[TABLE].shards]
        doc["cold"] = _cold(store, shards, n, cfg, ratio, echo)
        doc["convergence"] = _convergence(store, shards, n, cfg)
        echo(convergence_line(doc["convergence"]))
        store.populate()
        doc["decode"] = _decode(store, h, mm, n, cfg, ratio)
        doc["stream"] = _stream(store, h, cfg, doc["warm"], ratio)
    doc["view"] = _view(db, h, n, cfg, ratio)
    doc["serve"] = _serve(db, n, cfg, ratio) if serve else None
    doc["ratios"] = ratios
    doc["seconds"] = time.perf_counter() - started
    return doc


def _warm(
    db: Path, mm: np.ndarray, n: int, cfg: dict[str, Any], ratio: Any
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    out_rows: list[dict[str, Any]] = []
    backends = [b for b in BACKENDS if b != "io_uring" or IoUringBackend.availability()[0]]
    base_rate: dict[int, float] = {}
    for batch in cfg["batches"]:
        ids = rng.integers(0, n, batch, dtype=np.int64)
        out = np.empty((batch, ROW_BYTES), np.uint8)

        def take(ids: np.ndarray = ids, out: np.ndarray = out) -> int:
            np.take(mm, ids, axis=0, out=out, mode="clip")
            return ids.shape[0]

        base_rate[batch] = _rate(take, cfg["seconds"])
        out_rows.append({"backend": "np.take", "batch": batch, "rows_per_s": base_rate[batch]})
    for backend in backends:
        with Database(db, backend=backend, background_warm=False) as d:
            store = d[TABLE]
            store.populate()
            for batch in cfg["batches"]:
                ids = rng.integers(0, n, batch, dtype=np.int64)
                out = np.empty((batch, ROW_BYTES), np.uint8)

                def gather(ids: np.ndarray = ids, out: np.ndarray = out, s: Any = store) -> int:
                    s.fetch_into(ids, out)
                    return ids.shape[0]

                r = _rate(gather, cfg["seconds"])
                out_rows.append({"backend": backend, "batch": batch, "rows_per_s": r,
                                 "vs_np_take": r / base_rate[batch]})  # fmt: skip
    big = cfg["batches"][-1]
    auto = next(r for r in out_rows if r["backend"] == "auto" and r["batch"] == big)
    ratio(f"warm gather, batch {big:,}", auto["rows_per_s"], base_rate[big],
          "np.take(out=) on a populated mapping", "rows/s")  # fmt: skip
    return out_rows


def _cold(
    store: Any,
    shards: list[Path],
    n: int,
    cfg: dict[str, Any],
    ratio: Any,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    for shard in shards:
        evict(shard)  # POSIX_FADV_DONTNEED of these files only, never drop_caches
    resident_before = store.residency()
    count = min(n, cfg["cold_rows"])
    ids = rng.permutation(n)[:count].astype(np.int64)
    out = np.empty((4096, ROW_BYTES), np.uint8)
    t0 = time.perf_counter()
    for lo in range(0, count, 4096):
        b = ids[lo : lo + 4096]
        store.fetch_into(b, out[: b.shape[0]])
    dt = time.perf_counter() - t0
    doc: dict[str, Any] = {
        "rows": count,
        "seconds": dt,
        "rows_per_s": count / dt,
        "resident_before": resident_before,
        "fio": _fio(shards[0], 2.0 if cfg["seconds"] < 0.5 else 5.0),
    }
    echo(
        f"cold random rows (evicted, resident {resident_before:.0%} before): "
        f"{doc['rows_per_s']:,.0f} rows/s"
        + ("" if doc["fio"] is not None else " (fio not installed: no device baseline)")
    )
    if doc["fio"] is not None:
        ratio("cold random rows vs fio 4 KiB random reads", doc["rows_per_s"],
              doc["fio"]["iops"], "fio randread 4k iodepth 32", "rows/s vs IOPS")  # fmt: skip
    return doc


def _convergence(
    store: Any, shards: list[Path], n: int, cfg: dict[str, Any]
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(3)
    for shard in shards:
        evict(shard)  # POSIX_FADV_DONTNEED of these files only, never drop_caches
    out = np.empty((4096, ROW_BYTES), np.uint8)
    series: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < cfg["converge_s"]:
        ids = rng.integers(0, n, 4096, dtype=np.int64)
        t = time.perf_counter()
        store.fetch_into(ids, out)
        dt = time.perf_counter() - t
        series.append({"t_s": t - t0 + dt, "rows_per_s": 4096 / dt})
    for i, point in enumerate(series):  # residency only now: mincore is not free
        point["step"] = i
    series[-1]["resident"] = store.residency()
    return series


def convergence_line(series: list[dict[str, Any]]) -> str:
    """When the first-read rate reached half of its last rate."""
    last = series[-1]["rows_per_s"]
    t_half = next((p["t_s"] for p in series if p["rows_per_s"] >= last / 2), series[-1]["t_s"])
    return (
        f"first reads after eviction: {series[0]['rows_per_s']:,.0f} rows/s at first, half of "
        f"the final {last:,.0f} rows/s after {t_half:.2f} s ({len(series)} batches)"
    )


def _decode(
    store: Any, h: keygen.Hasher, mm: np.ndarray, n: int, cfg: dict[str, Any], ratio: Any
) -> dict[str, Any]:
    rng = np.random.default_rng(4)
    steps = cfg["decode_steps"]
    tokens = rng.integers(2, 32000, steps).tolist()
    dec = Decoder(store, preset=h, prefetch=False)
    out = np.empty((h.n_heads, ROW_BYTES), np.uint8)
    for t in tokens[:100]:
        dec.step(t, out)
    dec = Decoder(store, preset=h, prefetch=False)
    clock = time.perf_counter_ns
    lat = np.empty(steps, np.int64)
    for i, t in enumerate(tokens):  # one decode step per call is the thing measured
        c = clock()
        dec.step(t, out)
        lat[i] = clock() - c
    base = np.empty(steps, np.int64)
    ids = rng.integers(0, n, (steps, h.n_heads), dtype=np.int64)
    for i in range(steps):  # baseline: np.take of the same number of rows per step
        c = clock()
        np.take(mm, ids[i], axis=0, out=out, mode="clip")
        base[i] = clock() - c
    us, bus = lat / 1e3, base / 1e3
    doc = {
        "steps": steps,
        "rows_per_step": h.n_heads,
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "np_take_p50_us": float(np.percentile(bus, 50)),
        "np_take_p99_us": float(np.percentile(bus, 99)),
        "latencies_us": [float(x) for x in np.sort(us)[:: max(1, steps // 500)]],
        "np_take_latencies_us": [float(x) for x in np.sort(bus)[:: max(1, steps // 500)]],
    }
    ratio("decode step p50 (hash + gather) vs np.take p50 of its rows", doc["np_take_p50_us"],
          doc["p50_us"], "np.take of 16 rows (no hashing)", "us (baseline / ours)")  # fmt: skip
    return doc


def _stream(
    store: Any, h: keygen.Hasher, cfg: dict[str, Any], warm: list[dict[str, Any]], ratio: Any
) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    corpus = rng.integers(2, 32000, cfg["stream_tokens"]).astype(np.int64)
    t0 = time.perf_counter()
    tokens = 0
    s = stream(store, corpus, preset=h)
    try:
        for ids, _e in s:
            tokens += len(ids)
    finally:
        s.close()
    dt = time.perf_counter() - t0
    rows_per_s = tokens * h.n_heads / dt
    doc = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "rows_per_s": rows_per_s}
    best = max(r["rows_per_s"] for r in warm if r["backend"] == "np.take")
    ratio("corpus stream (hash + gather), rows", rows_per_s, best,
          "np.take(out=) best batch, no hashing", "rows/s")  # fmt: skip
    return doc


def _view(db: Path, h: keygen.Hasher, n: int, cfg: dict[str, Any], ratio: Any) -> dict[str, Any]:
    rng = np.random.default_rng(6)
    k = cfg["view_records"]
    rows = rng.integers(0, n, (k, h.n_heads), dtype=np.int64)
    build_view(db, table=TABLE, name="bench", rows=rows, force=True)
    with View(db, table=TABLE, name="bench", backend="mmap") as v:
        res = measure_throughput(v, order="access", batch=1024, seconds=cfg["seconds"])
    with Database(db, background_warm=False) as d:
        store = d[TABLE]
        store.populate()
        out = np.empty((1024 * h.n_heads, ROW_BYTES), np.uint8)
        pos = [0]

        def gather() -> int:
            lo = pos[0]
            pos[0] = (lo + 1024) % max(1, k - 1024)
            store.fetch_into(rows[lo : lo + 1024].reshape(-1), out)
            return 1024

        base = _rate(gather, cfg["seconds"])
    doc = {"records": k, "rows_per_record": h.n_heads, "records_per_s": res.records_per_s,
           "gather_records_per_s": base}  # fmt: skip
    ratio("Store-P view records vs Store-I gather of the same rows", res.records_per_s, base,
          "Store.fetch_into of each record's 16 rows", "records/s")  # fmt: skip
    return doc


def _serve(db: Path, n: int, cfg: dict[str, Any], ratio: Any) -> dict[str, Any]:
    from engramdb.client import connect
    from engramdb.serve.server import Server

    rng = np.random.default_rng(7)
    srv = Server(str(db), host="127.0.0.1", port=0).start()
    points: list[dict[str, Any]] = []
    try:
        with connect(srv.urls[0]) as client, Database(db, background_warm=False) as d:
            remote, local = client[TABLE], d[TABLE]
            local.populate()
            for batch in cfg["serve_batches"]:
                ids = rng.integers(0, n, batch, dtype=np.int64)
                out = np.empty((batch, ROW_BYTES), np.uint8)

                def over(ids: np.ndarray = ids, out: np.ndarray = out) -> int:
                    remote.fetch_into(ids, out)
                    return ids.shape[0]

                def here(ids: np.ndarray = ids, out: np.ndarray = out) -> int:
                    local.fetch_into(ids, out)
                    return ids.shape[0]

                points.append({"batch": batch, "rows_per_s": _rate(over, cfg["seconds"]),
                               "local_rows_per_s": _rate(here, cfg["seconds"])})  # fmt: skip
    finally:
        srv.stop()
    big = points[-1]
    ratio(f"serve round trip, batch {big['batch']:,}", big["rows_per_s"],
          big["local_rows_per_s"], "local Store gather", "rows/s")  # fmt: skip
    return {"url": "loopback", "points": points}
