"""`engramdb serve` against the same fetch done in-process, over a Unix socket and loopback TCP.

    python probes/serve.py [--rows 8388608] [--reps 5] [--soak 60] [--quick]

Builds one 160 B-row table (default 8 Mi rows = 1.34 GB, so batches do not sit in CPU
caches; deleted at the end), warms it (read once, then `--populate` in the server and
`populate=True` in this process), starts `engramdb serve` as its own process, and measures:

* correctness first: remote rows == in-process rows over UDS and TCP, and the server's
  ``engramdb_rows_total`` counter grows by exactly the rows this probe asked for (the remote
  path really ran);
* latency p50 / p99 of a 16-row and a 4,096-row `fetch_into`: in-process, UDS (the client's
  default there: the binary wire protocol), UDS over HTTP, TCP (HTTP, the default there) and
  TCP with the wire protocol, arms interleaved per repetition (in-process first and last:
  the noise floor), plus a minimal uvicorn ASGI server serving the same table when uvicorn
  is installed (the stack choice);
* throughput: 1 client process, then 16 client processes for ``--soak`` seconds (decode-like
  16-row fetches, every 8th a 4,096-row one), 0 errors required, server RSS sampled;
* ratios last. JSON goes to probes/out/serve.json.

Only loopback and a Unix socket under a temp directory are used.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import vm_hwm_mb, write_json  # noqa: E402

import engramdb  # noqa: E402
from engramdb.client import connect  # noqa: E402

ROW_BYTES = 160
SERVE = "from engramdb.cli.serve_cmd import serve; serve()"


# --- setup -----------------------------------------------------------------------------------
def build_table(root: Path, rows: int) -> Path:
    src = root / "rows.npy"
    mm = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(rows, ROW_BYTES))
    rng = np.random.default_rng(11)
    step = 1 << 20
    for i in range(0, rows, step):
        k = min(step, rows - i)
        mm[i : i + k] = rng.integers(0, 256, size=(k, ROW_BYTES), dtype=np.uint8)
    mm.flush()
    del mm
    db = root / "db"
    engramdb.build(db, "t", ROW_BYTES, [src])
    src.unlink()
    for p in db.rglob("*.edb"):  # page-cache warm: read every byte once
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    return db


def spawn_server(db: Path, sock: Path) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(db), "--unix", str(sock), "--port", "0", "--populate"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving"):
        proc.kill()
        raise SystemExit(
            f"server did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        )
    urls = re.findall(r"(unix://\S+?|http://\S+?)(?:,|\s)", line)
    return proc, urls


ASGI_SERVER = r"""
import json, sys, numpy as np, uvicorn, engramdb
db = engramdb.open(sys.argv[1], populate=True)
t = db["t"]
doc = json.dumps({"tables": [{"name": "t", "n_rows": t.n_rows, "row_bytes": t.row_bytes,
    "heads": [int(h) for h in t.heads], "head_offsets": [int(o) for o in t.head_offsets],
    "dtype": t.dtype, "dim": t.dim}], "limits": {"max_rows": 1 << 20,
    "max_body_bytes": 16 << 20, "max_response_bytes": 256 << 20}}).encode()

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["method"] == "GET":
        out = doc
        ctype = b"application/json"
    else:
        ids = np.frombuffer(body, "<i8")
        rows = np.empty((ids.size, t.row_bytes), np.uint8)
        t.fetch_into(ids, rows)
        out = rows.tobytes()
        ctype = b"application/octet-stream"
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", ctype), (b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})

print("serving", flush=True)
uvicorn.run(app, uds=sys.argv[2], log_level="error", access_log=False)
"""


def spawn_asgi(db: Path, sock: Path) -> subprocess.Popen[str] | None:
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-c", ASGI_SERVER, str(db), str(sock)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    for _ in range(200):
        if sock.exists():
            return proc
        time.sleep(0.05)
    proc.kill()
    return None


def rows_total(client: Any) -> int:
    m = re.search(r'engramdb_rows_total\{endpoint="fetch",table="t"\} (\d+)', client.metrics())
    return int(m.group(1)) if m else 0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --- latency -----------------------------------------------------------------------------------
def latencies(store: Any, n_rows: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """``steps`` timed ``fetch_into`` calls of ``batch`` random ids (new ids every step), in
    microseconds, after 200 untimed ones."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n_rows, (steps + 200, batch))
    out = np.empty((batch, ROW_BYTES), np.uint8)
    for i in range(200):
        store.fetch_into(ids[i], out)
    lat = np.empty(steps)
    clock = time.perf_counter
    for i in range(steps):
        row = ids[200 + i]
        t0 = clock()
        store.fetch_into(row, out)
        lat[i] = clock() - t0
    return lat * 1e6


# --- client processes --------------------------------------------------------------------------
def client_worker(args: tuple[str, int, float, float, int]) -> dict[str, Any]:
    """One client process: fetch until ``stop_at``; 16-row fetches, every ``big_every``-th a
    4,096-row one (0: only 4,096-row fetches). Returns counts, errors and latencies (us)."""
    url, seed, start_at, stop_at, big_every = args
    rng = np.random.default_rng(seed)
    small = np.empty((16, ROW_BYTES), np.uint8)
    big = np.empty((4096, ROW_BYTES), np.uint8)
    lat16: list[float] = []
    lat4k: list[float] = []
    errors: list[str] = []
    rows = 0
    try:
        client = connect(url, timeout=30)
    except Exception as e:
        return {"errors": [repr(e)], "rows": 0, "lat16": [], "lat4k": [], "requests": 0}
    t = client["t"]
    n = t.n_rows
    while time.time() < start_at:
        time.sleep(0.001)
    i = 0
    clock = time.perf_counter
    while True:
        now = time.time()
        if now >= stop_at:
            break
        is_big = big_every == 0 or i % big_every == big_every - 1
        ids = rng.integers(0, n, 4096 if is_big else 16)
        out = big if is_big else small
        try:
            t0 = clock()
            t.fetch_into(ids, out)
            dt = clock() - t0
        except Exception as e:  # counted, never hidden
            errors.append(repr(e))
            if len(errors) > 100:
                break
            continue
        (lat4k if is_big else lat16).append(dt * 1e6)
        rows += ids.size
        i += 1
    client.close()
    return {"errors": errors, "rows": rows, "lat16": lat16, "lat4k": lat4k, "requests": i}


def run_clients(
    url: str, n: int, seconds: float, big_every: int, server_pid: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    start_at = time.time() + 3.0  # time for the client processes to start and connect
    stop_at = start_at + seconds
    rss: list[tuple[float, float]] = []
    with ctx.Pool(n) as pool:
        res = pool.map_async(
            client_worker, [(url, 1000 + k, start_at, stop_at, big_every) for k in range(n)]
        )
        while not res.ready():
            rss.append((time.time() - start_at, rss_mb(server_pid)))
            res.wait(0.5)
        results = res.get()
    wall = seconds
    lat16 = np.concatenate([np.asarray(r["lat16"]) for r in results] + [np.empty(0)])
    lat4k = np.concatenate([np.asarray(r["lat4k"]) for r in results] + [np.empty(0)])
    errors = [e for r in results for e in r["errors"]]
    rows = sum(r["rows"] for r in results)
    during = [m for s, m in rss if 0 <= s <= seconds]
    return {
        "clients": n,
        "seconds": seconds,
        "requests": sum(r["requests"] for r in results),
        "requests_per_s": sum(r["requests"] for r in results) / wall,
        "rows_per_s": rows / wall,
        "errors": len(errors),
        "first_errors": errors[:5],
        "p50_16_us": float(np.percentile(lat16, 50)) if lat16.size else None,
        "p99_16_us": float(np.percentile(lat16, 99)) if lat16.size else None,
        "p50_4096_us": float(np.percentile(lat4k, 50)) if lat4k.size else None,
        "p99_4096_us": float(np.percentile(lat4k, 99)) if lat4k.size else None,
        "server_rss_mb": during,
    }


def rss_verdict(samples: list[float]) -> dict[str, Any]:
    """Stable = after the first quarter (warm-up: buffers, page tables), RSS grows by less
    than 5 % or 8 MB, whichever is larger."""
    if len(samples) < 4:
        return {"stable": None}
    settled = samples[len(samples) // 4]
    growth = samples[-1] - settled
    return {
        "start_mb": samples[0],
        "settled_mb": settled,
        "end_mb": samples[-1],
        "max_mb": max(samples),
        "growth_mb": growth,
        "stable": growth <= max(8.0, 0.05 * settled),
    }


def pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=8 << 20, help="table rows (160 B each)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved latency repetitions")
    ap.add_argument("--steps", type=int, default=2000, help="16-row steps per arm per rep")
    ap.add_argument("--soak", type=float, default=60.0, help="seconds of the 16-client soak")
    ap.add_argument("--single", type=float, default=10.0, help="seconds of the 1-client run")
    ap.add_argument("--quick", action="store_true", help="small table, short runs (~1 min)")
    ap.add_argument("--tmp", default=None, help="directory for the temporary database")
    a = ap.parse_args()
    if a.quick:
        a.rows, a.reps, a.steps, a.soak, a.single = 1 << 20, 5, 1000, 10.0, 3.0
    root = Path(tempfile.mkdtemp(prefix="engramdb-serve-probe-", dir=a.tmp))
    doc: dict[str, Any] = {
        "probe": "serve",
        "rows": a.rows,
        "row_bytes": ROW_BYTES,
        "table_bytes": a.rows * ROW_BYTES,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "quick": a.quick,
    }
    server = asgi = None
    try:
        t0 = time.perf_counter()
        db_path = build_table(root, a.rows)
        print(
            f"table: {a.rows:,} rows x {ROW_BYTES} B = {a.rows * ROW_BYTES / 1e9:.2f} GB "
            f"(built and read once in {time.perf_counter() - t0:.1f} s)"
        )
        server, urls = spawn_server(db_path, root / "s.sock")
        uds = next(u for u in urls if u.startswith("unix://"))
        tcp = next(u for u in urls if u.startswith("http://"))
        print(f"server pid {server.pid}: {uds}  {tcp}")
        local_db = engramdb.open(db_path, populate=True)
        local = local_db["t"]
        clients = {
            "uds": connect(uds),
            "uds_http": connect(uds, wire=False),
            "tcp": connect(tcp),
            "tcp_wire": connect(tcp, wire=True),
        }
        uds_client = clients["uds"]
        if not uds_client.wire or clients["tcp"].wire:
            raise SystemExit("client defaults changed: UDS must use the wire protocol")
        arms: dict[str, Any] = {"inproc": local, **{k: c["t"] for k, c in clients.items()}}
        asgi = spawn_asgi(db_path, root / "asgi.sock")
        if asgi is not None:
            asgi_client = connect(f"unix://{root / 'asgi.sock'}")
            arms["uvicorn_uds"] = asgi_client["t"]
        print(
            f"arms: {', '.join(arms)}" + ("" if asgi else "  (uvicorn not installed: no ASGI arm)")
        )

        # correctness, and proof that the remote path served the rows
        rng = np.random.default_rng(5)
        before = rows_total(uds_client)
        asked = 0
        for _ in range(20):
            ids = rng.integers(0, a.rows, int(rng.integers(1, 5000)))
            ref = local.fetch(ids)
            for name in clients:
                if not np.array_equal(arms[name].fetch(ids), ref):
                    raise SystemExit(f"MISMATCH on {name}")
                asked += ids.size
        if "uvicorn_uds" in arms and not np.array_equal(arms["uvicorn_uds"].fetch(ids), ref):
            raise SystemExit("MISMATCH on uvicorn arm")
        served = rows_total(uds_client) - before
        hellos = re.search(
            r'engramdb_requests_total\{endpoint="hello",table="",code="200"\} (\d+)',
            uds_client.metrics(),
        )
        n_hello = int(hellos.group(1)) if hellos else 0
        print(
            f"correctness: remote == in-process for 20 random batches on {len(clients)} "
            f"remote arms; server counted {served:,} rows for {asked:,} asked, "
            f"{n_hello} wire-protocol connection(s)"
        )
        if served != asked:
            raise SystemExit("the server's row counter disagrees: the remote path did not run")
        if n_hello < 2:
            raise SystemExit("the wire-protocol arms did not open wire connections")
        doc["proof"] = {
            "rows_asked": asked,
            "server_rows_counted": served,
            "wire_connections": n_hello,
        }

        # latency, interleaved: baseline (in-process) first and last
        order = list(arms)
        samples: dict[str, dict[int, list[np.ndarray]]] = {n: {16: [], 4096: []} for n in order}
        base_first_last: list[float] = []
        for batch, steps in ((16, a.steps), (4096, max(200, a.steps // 10))):
            print(f"latency, {batch}-row fetch_into, {steps} steps per arm per rep (us):")
            for r in range(a.reps):
                seq = order if r % 2 == 0 else order[::-1]
                line = []
                for name in seq:
                    lat = latencies(arms[name], a.rows, batch, steps, seed=r * 100 + batch)
                    samples[name][batch].append(lat)
                    line.append(f"{name}={np.median(lat):.1f}")
                print(f"  rep {r}: p50 " + "  ".join(line))
            last = latencies(local, a.rows, batch, steps, seed=999)
            base_first_last.append(float(np.median(samples["inproc"][batch][0])))
            base_first_last.append(float(np.median(last)))
        lat_doc: dict[str, Any] = {}
        for name in order:
            for batch in (16, 4096):
                allv = np.concatenate(samples[name][batch])
                reps_p50 = [float(np.median(x)) for x in samples[name][batch]]
                lat_doc[f"{name}_{batch}"] = {
                    "p50_us": pct(allv, 50),
                    "p99_us": pct(allv, 99),
                    "rep_p50_us": reps_p50,
                    "rows_per_s_at_p50": batch / pct(allv, 50) * 1e6,
                }
        doc["latency"] = lat_doc
        doc["baseline_first_last_p50_us"] = base_first_last
        for c in clients.values():
            c.close()

        # throughput: one client process, 4,096-row fetches only
        print(f"throughput: 1 client process, 4,096-row fetches, {a.single:g} s ...")
        one = run_clients(uds, 1, a.single, 0, server.pid)
        print(
            f"  {one['rows_per_s'] / 1e6:.2f} M rows/s, {one['requests_per_s']:.0f} req/s, "
            f"p50 {one['p50_4096_us']:.0f} us, errors {one['errors']}"
        )
        doc["one_client"] = one
        # soak: 16 client processes, decode-like
        print(f"soak: 16 client processes, 16-row fetches (every 8th 4,096 rows), {a.soak:g} s ...")
        soak = run_clients(uds, 16, a.soak, 8, server.pid)
        soak["rss"] = rss_verdict(soak["server_rss_mb"])
        print(
            f"  {soak['requests_per_s']:.0f} req/s, {soak['rows_per_s'] / 1e6:.2f} M rows/s, "
            f"16-row p50 {soak['p50_16_us']:.0f} us p99 {soak['p99_16_us']:.0f} us, "
            f"4,096-row p99 {soak['p99_4096_us']:.0f} us, errors {soak['errors']}"
        )
        print(
            f"  server RSS MB: start {soak['rss'].get('start_mb', 0):.1f}, settled "
            f"{soak['rss'].get('settled_mb', 0):.1f}, end {soak['rss'].get('end_mb', 0):.1f}, "
            f"stable={soak['rss']['stable']}"
        )
        doc["soak"] = soak
        doc["server_vm_hwm_mb"] = vm_hwm_mb(str(server.pid))
        doc["probe_vm_hwm_mb"] = vm_hwm_mb()
        local_db.close()

        # ratios last
        L = lat_doc
        ratios = {
            "uds16_over_inproc16": L["uds_16"]["p50_us"] / L["inproc_16"]["p50_us"],
            "tcp16_over_uds16": L["tcp_16"]["p50_us"] / L["uds_16"]["p50_us"],
            "uds_http16_over_uds16": L["uds_http_16"]["p50_us"] / L["uds_16"]["p50_us"],
            "tcp16_over_tcp_wire16": L["tcp_16"]["p50_us"] / L["tcp_wire_16"]["p50_us"],
            "uds4096_over_inproc4096": L["uds_4096"]["p50_us"] / L["inproc_4096"]["p50_us"],
        }
        if "uvicorn_uds_16" in L:
            ratios["uvicorn16_over_engramdb16_uds"] = (
                L["uvicorn_uds_16"]["p50_us"] / L["uds_16"]["p50_us"]
            )
            ratios["uvicorn4096_over_engramdb4096_uds"] = (
                L["uvicorn_uds_4096"]["p50_us"] / L["uds_4096"]["p50_us"]
            )
        doc["ratios"] = ratios
        accept = {
            "uds16_p50_le_60us": L["uds_16"]["p50_us"] <= 60.0,
            "one_client_4096_ge_1M_rows_per_s": one["rows_per_s"] >= 1e6,
            "soak_zero_errors": soak["errors"] == 0 and one["errors"] == 0,
            "soak_rss_stable": soak["rss"]["stable"],
        }
        doc["acceptance"] = accept
        print("summary (p50 / p99 us):")
        for name in order:
            print(
                f"  {name:12s} 16 rows {L[f'{name}_16']['p50_us']:8.1f} / {L[f'{name}_16']['p99_us']:8.1f}"
                f"   4,096 rows {L[f'{name}_4096']['p50_us']:8.1f} / {L[f'{name}_4096']['p99_us']:8.1f}"
            )
        print(
            f"  in-process baseline p50 first/last: {', '.join(f'{x:.1f}' for x in base_first_last)}"
        )
        print(
            f"  server peak RSS {doc['server_vm_hwm_mb']:.0f} MB (table {a.rows * ROW_BYTES / 1e6:.0f} MB mapped)"
        )
        print("ratios: " + "  ".join(f"{k}={v:.2f}x" for k, v in ratios.items()))
        print("acceptance: " + "  ".join(f"{k}={v}" for k, v in accept.items()))
        print(f"wrote {write_json('serve', doc)}")
    finally:
        for proc in (server, asgi):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
