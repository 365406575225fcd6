"""Cold and warm random row reads per backend, against fio on the same file, same run.

    python probes/cold_reads.py [--gib 2] [--dir /tmp] [--reps 5] [--batches 2]

fio is the device limit (random 4 KiB reads, io_uring, QD32, O_DIRECT, one job); install it
with ``apt-get install -y fio`` (the fio arm is skipped, and said so, when it is missing).

What it does:
  1. writes a ``--gib`` GiB file under a fresh temp dir (deleted at the end) whose 8-byte word
     ``i`` is ``i * 0x9E3779B97F4A7C15``, so any row's bytes can be recomputed to check them;
  2. treats it as a compact table of 160 B, 2560 B and 4096 B rows and reads batches of
     16,384 uniformly random row ids the way a Store would (validate -> plan: dedupe, sort ->
     backend.read into a reused scratch -> assemble into the output);
  3. cold: before *every* timed batch drops its own mapping's pages (MADV_DONTNEED), evicts
     the file (posix_fadvise DONTNEED) and checks residency with mincore (must be < 1 %);
     arms preadv, io_uring, io_uring + O_DIRECT, auto, one mmap batch (MADV_RANDOM), and fio,
     interleaved (ABAB..), ``--reps`` times; device bytes per row from /proc/self/io
     (read_bytes: this process only) and /sys/block/<dev>/stat (the whole device);
  4. warm: file in the page cache, mapping populated; arms foundation take_rows (the Store's
     current gather), mmap backend, auto, io_uring, preadv;
  5. shows the io_uring fallback (ENGRAMDB_DISABLE_IO_URING=1 -> auto uses preadv);
  6. prints every repetition, the medians, then the ratios; JSON to probes/out/cold_reads.json.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import proc_read_bytes, vm_hwm_mb, write_json  # noqa: E402

from engramdb.io import (  # noqa: E402
    AutoBackend,
    Backend,
    IoUringBackend,
    MmapBackend,
    PreadvBackend,
    make_backend,
)
from engramdb.io.gather import take_rows  # noqa: E402
from engramdb.io.uring import DISABLE_ENV  # noqa: E402
from engramdb.read.plan import Geometry, assemble, locate, plan_reads  # noqa: E402
from engramdb.testing.pages import (  # noqa: E402
    advise_random,
    drop_mapped_pages,
    evict,
    file_residency,
    mapped_residency,
    populate,
)
from engramdb.validate import as_rowids, check_bounds  # noqa: E402

K = np.uint64(0x9E3779B97F4A7C15)
BATCH = 16_384
ROW_SIZES = (160, 2560, 4096)


# --- the file --------------------------------------------------------------------------------
def write_file(path: Path, nbytes: int) -> float:
    t0 = time.perf_counter()
    chunk = 64 << 20
    with open(path, "wb") as f:
        for start in range(0, nbytes, chunk):
            words = np.arange(start // 8, (start + chunk) // 8, dtype=np.uint64)
            words *= K
            f.write(words.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def expected_rows(offsets: np.ndarray, row_bytes: int) -> np.ndarray:
    """The file's bytes at ``offsets`` (rows of ``row_bytes``), recomputed from the pattern."""
    pos = offsets[:, None].astype(np.uint64) + np.arange(row_bytes, dtype=np.uint64)[None, :]
    words = (pos >> np.uint64(3)) * K
    return ((words >> ((pos & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint8)


# --- accounting ------------------------------------------------------------------------------
def block_device(path: Path) -> str | None:
    """The /sys/block name of the disk holding ``path`` (partition -> its disk)."""
    st = os.stat(path)
    link = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not link.exists():
        return None
    real = link.resolve()
    if (real / "partition").exists():
        real = real.parent
    return real.name if (Path("/sys/block") / real.name).exists() else None


def device_read_bytes(dev: str | None) -> int:
    if dev is None:
        return 0
    fields = Path(f"/sys/block/{dev}/stat").read_text().split()
    return int(fields[2]) * 512  # sectors read


# --- readers (the Store's two paths) ---------------------------------------------------------
class Table:
    """One file seen as a compact table of ``row_bytes`` rows; reads like a Store would."""

    def __init__(self, fd: int, view: np.ndarray, row_bytes: int) -> None:
        self.fd = fd
        self.row_bytes = row_bytes
        self.n_rows = view.shape[0] // row_bytes
        self.geometry = Geometry(self.n_rows, row_bytes, rows_per_shard=self.n_rows)
        self.table2d = view[: self.n_rows * row_bytes].reshape(self.n_rows, row_bytes)
        self.fds = np.array([fd], dtype=np.int32)
        self.scratch = np.empty(BATCH * row_bytes, dtype=np.uint8)
        self.scratch.fill(0)  # prefault once: fresh allocations are expensive here
        self.unique_rows = 0  # rows the last planned batch actually read (after dedupe)

    def checked(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` as int64, bounds-checked (what a Store does before reading)."""
        flat = as_rowids(ids)
        check_bounds(flat.reshape(-1), self.n_rows, shape=flat.shape)
        return flat

    def via_plan(self, backend: Backend, ids: np.ndarray, out: np.ndarray) -> None:
        plan = plan_reads(ids, self.geometry)
        self.unique_rows = plan.n_unique
        backend.read(self.fds[plan.shard], plan.offset, plan.length, self.scratch, plan.dest_offset)
        assemble(plan, self.scratch, out)

    def via_mapping(self, ids: np.ndarray, out: np.ndarray) -> None:
        flat = self.checked(ids)
        take_rows(self.table2d, flat, out.reshape(-1, self.row_bytes))

    def via_mmap_backend(self, backend: Backend, ids: np.ndarray, out: np.ndarray) -> None:
        flat = self.checked(ids)
        rb = self.row_bytes
        backend.read(self.fd, flat * rb, rb, out, np.arange(flat.shape[0], dtype=np.int64) * rb)

    def via_auto(self, auto: Backend, ids: np.ndarray, out: np.ndarray) -> None:
        """The wiring proposed for Store: choose on a located sample, then plan or gather."""
        flat = self.checked(ids)
        sample = flat[:: max(1, flat.shape[0] // 16)]
        shard, off = locate(sample, self.geometry)
        chosen = auto.choose(self.fds[shard], off, self.row_bytes, batch_rows=flat.shape[0])
        t0 = time.perf_counter()
        if chosen.wants_plan:
            self.via_plan(chosen, flat, out)
        else:
            take_rows(self.table2d, flat, out.reshape(-1, self.row_bytes))
            if isinstance(chosen, MmapBackend):
                chosen._count(flat.shape[0], flat.shape[0] * self.row_bytes, 0)
        auto.feedback(chosen, flat.shape[0], time.perf_counter() - t0)


# --- fio -------------------------------------------------------------------------------------
def run_fio(path: Path, seconds: float, size: int) -> dict[str, float] | None:
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio",
        "--name=qd32",
        f"--filename={path}",
        "--rw=randread",
        "--bs=4k",
        "--ioengine=io_uring",
        "--iodepth=32",
        "--direct=1",
        "--numjobs=1",
        f"--size={size}",
        f"--runtime={seconds}",
        "--time_based",
        "--output-format=json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(res.stdout)["jobs"][0]["read"]
    return {"iops": float(job["iops"]), "clat_mean_us": float(job["clat_ns"]["mean"]) / 1e3}


# --- main ------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="file size in GiB (>= 2 for cold)")
    ap.add_argument("--dir", default=None, help="where to put the temp dir (default: $TMPDIR)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=2, help="timed cold batches per arm and rep")
    ap.add_argument("--warm-batches", type=int, default=10)
    ap.add_argument("--fio-seconds", type=float, default=3.0)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="engramdb-cold-", dir=args.dir))
    path = tmp / "table.bin"
    nbytes = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    doc: dict[str, Any] = {
        "probe": "cold_reads",
        "batch_rows": BATCH,
        "file_bytes": nbytes,
        "cpus": os.cpu_count(),
        "reps": args.reps,
    }
    log: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.append(msg)

    try:
        say(f"writing {nbytes / 2**30:.2f} GiB to {path} ...")
        say(f"  {write_file(path, nbytes):.1f} s")
        dev = block_device(path)
        doc["device"] = dev
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        # Cold reads are random: no read-ahead on the descriptor the syscall backends use.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        view = np.memmap(path, dtype=np.uint8, mode="r")
        advise_random(view)  # what the Store's mapping does too

        uring_ok, uring_why = IoUringBackend.availability()
        doc["io_uring_available"] = [uring_ok, uring_why]
        say(f"io_uring available: {uring_ok} {uring_why}")
        backends: dict[str, Backend] = {"preadv": PreadvBackend()}
        if uring_ok:
            backends["io_uring"] = IoUringBackend()
            backends["io_uring_direct"] = IoUringBackend(direct=True)
        mmap_b = MmapBackend({fd: view})
        auto = AutoBackend(
            MmapBackend({fd: view}), make_backend("io_uring") if uring_ok else PreadvBackend()
        )
        backends["mmap"] = mmap_b
        tables = {rb: Table(fd, view, rb) for rb in ROW_SIZES}
        outs = {rb: np.zeros(BATCH * rb, dtype=np.uint8) for rb in ROW_SIZES}
        rng = np.random.default_rng(2026)

        def batch_ids(rb: int) -> np.ndarray:
            return rng.integers(0, tables[rb].n_rows, BATCH, dtype=np.int64)

        def runner(arm: str, rb: int) -> Callable[[np.ndarray, np.ndarray], None]:
            t = tables[rb]
            if arm == "auto":
                return lambda ids, out: t.via_auto(auto, ids, out)
            if arm == "foundation":
                return t.via_mapping
            if arm == "mmap":
                return lambda ids, out: t.via_mmap_backend(mmap_b, ids, out)
            b = backends[arm]
            return lambda ids, out: t.via_plan(b, ids, out)

        def make_cold() -> float:
            drop_mapped_pages(view)  # a live mapping pins its pages against FADV_DONTNEED
            return evict(fd)

        # ---- correctness first (also proves every path ran: counters below) ---------------
        def warm_up() -> float:
            """Sequential read (device speed), then fill the mapping's page tables. Populating
            a MADV_RANDOM mapping of a cold file directly reads it page by page (~70 MB/s)."""
            t0 = time.perf_counter()
            buf = bytearray(8 << 20)
            pos = 0
            while pos < nbytes:
                got = os.preadv(fd, [buf], pos)
                if got <= 0:
                    break
                pos += got
            populate(view)
            return time.perf_counter() - t0

        say("\ncorrectness (every arm, every row size, against the recomputed pattern)")
        warm_up()
        for rb in ROW_SIZES:
            ids = batch_ids(rb)
            want = expected_rows(ids[:2048] * rb, rb)
            for arm in ["foundation", "mmap", "auto", *[a for a in backends if a != "mmap"]]:
                out = outs[rb]
                out.fill(0)
                runner(arm, rb)(ids, out)
                got = out.reshape(BATCH, rb)[:2048]
                if not np.array_equal(got, want):
                    raise SystemExit(f"WRONG BYTES: {arm} {rb} B")
        say("  ok: every arm returns the file's bytes")
        auto.choices.clear()

        # ---- cold ---------------------------------------------------------------------------
        cold_arms = ["preadv"] + (["io_uring", "io_uring_direct"] if uring_ok else []) + ["auto"]
        has_fio = shutil.which("fio") is not None
        if not has_fio:
            say(
                "  fio not installed: `apt-get update && apt-get install -y fio` for the device arm"
            )
        cold: dict[str, Any] = {}
        say(
            f"\ncold: {args.batches} batches x {BATCH} rows per arm and rep; before each batch "
            "the file is evicted and checked (mincore); fio QD32 runs in every rep"
        )
        max_resident = 0.0
        for rb in ROW_SIZES:
            keys = ["rows_s", "proc_bytes_row", "dev_bytes_row", "proc_bytes_read", "others_mb_s"]
            res: dict[str, dict[str, list[float]]] = {a: {k: [] for k in keys} for a in cold_arms}
            res["fio_qd32"] = {"rows_s": []}
            arms = [*cold_arms, "fio_qd32"] if has_fio else cold_arms
            for rep in range(args.reps):
                order = arms if rep % 2 == 0 else arms[::-1]
                line = []
                for arm in order:
                    if arm == "fio_qd32":
                        f = run_fio(path, args.fio_seconds, nbytes)
                        assert f is not None
                        res[arm]["rows_s"].append(f["iops"])
                        line.append(f"fio_qd32={f['iops'] / 1e3:.1f}k")
                        continue
                    fn = runner(arm, rb)
                    t_total = 0.0
                    pbytes = dbytes = uniq = 0
                    for _ in range(args.batches):
                        ids = batch_ids(rb)
                        resident = make_cold()
                        max_resident = max(max_resident, resident)
                        if resident > 0.01:
                            raise SystemExit(f"eviction failed: {resident:.1%} still resident")
                        p0, d0 = proc_read_bytes(), device_read_bytes(dev)
                        t0 = time.perf_counter()
                        fn(ids, outs[rb])
                        t_total += time.perf_counter() - t0
                        pbytes += proc_read_bytes() - p0
                        dbytes += device_read_bytes(dev) - d0
                        uniq += tables[rb].unique_rows
                    rows = args.batches * BATCH
                    res[arm]["rows_s"].append(rows / t_total)
                    res[arm]["proc_bytes_row"].append(pbytes / rows)
                    res[arm]["dev_bytes_row"].append(dbytes / rows)
                    res[arm]["proc_bytes_read"].append(pbytes / max(1, uniq))  # per row read
                    # other tenants' reads on the same disk while this arm ran (noise marker)
                    res[arm]["others_mb_s"].append(max(0, dbytes - pbytes) / t_total / 1e6)
                    line.append(f"{arm}={rows / t_total / 1e3:.1f}k ({pbytes / rows:.0f} B/row)")
                say(f"  {rb:5d} B rep {rep}: " + "  ".join(line))
            # one mmap batch: what reading cold data through a mapping costs (MADV_RANDOM)
            ids = batch_ids(rb)
            make_cold()
            p0 = proc_read_bytes()
            t0 = time.perf_counter()
            tables[rb].via_mapping(ids, outs[rb])
            dt = time.perf_counter() - t0
            res["mmap_one_batch"] = {
                "rows_s": [BATCH / dt],
                "proc_bytes_row": [(proc_read_bytes() - p0) / BATCH],
            }
            say(
                f"  {rb:5d} B mmap (one batch, MADV_RANDOM): {BATCH / dt / 1e3:.1f}k rows/s, "
                f"{(proc_read_bytes() - p0) / BATCH:.0f} B/row"
            )
            cold[str(rb)] = {
                a: {
                    k: {"median": float(np.median(v)) if v else None, "reps": [float(x) for x in v]}
                    for k, v in d.items()
                }
                for a, d in res.items()
            }
        doc["cold"] = cold
        doc["cold_max_resident_fraction"] = max_resident
        doc["auto_choices_cold"] = dict(auto.choices)
        say(f"  auto chose (cold): {auto.choices}")

        # ---- warm ---------------------------------------------------------------------------
        say("\nwarm: file in the page cache, mapping populated")
        auto.choices.clear()
        t0 = time.perf_counter()
        populate(view)
        say(
            f"  MADV_POPULATE_READ on the cold MADV_RANDOM mapping: "
            f"{time.perf_counter() - t0:.2f} s (page by page, no read-ahead)"
        )
        drop_mapped_pages(view)
        evict(fd)
        say(
            f"  sequential read, then MADV_POPULATE_READ: {warm_up():.2f} s; file residency "
            f"{file_residency(fd):.3f}, mapping {mapped_residency(view):.3f}"
        )
        warm_arms = ["foundation", "mmap", "auto", "preadv"] + (["io_uring"] if uring_ok else [])
        warm: dict[str, Any] = {}
        for rb in ROW_SIZES:
            res_w: dict[str, list[float]] = {a: [] for a in warm_arms}
            id_sets = [batch_ids(rb) for _ in range(args.warm_batches)]
            for arm in warm_arms:  # untimed pass
                runner(arm, rb)(id_sets[0], outs[rb])
            for rep in range(max(7, args.reps)):
                order = warm_arms if rep % 2 == 0 else warm_arms[::-1]
                line = []
                for arm in order:
                    fn = runner(arm, rb)
                    n = args.warm_batches if arm in ("foundation", "mmap", "auto") else 2
                    # fresh ids per arm: no arm finds rows left in the CPU caches by another
                    id_sets = [batch_ids(rb) for _ in range(n)]
                    t0 = time.perf_counter()
                    for ids in id_sets:
                        fn(ids, outs[rb])
                    r = n * BATCH / (time.perf_counter() - t0)
                    res_w[arm].append(r)
                    line.append(f"{arm}={r / 1e6:.2f}M")
                say(f"  {rb:5d} B rep {rep}: " + "  ".join(line))
            warm[str(rb)] = {
                a: {"median": float(np.median(v)), "reps": [float(x) for x in v]}
                for a, v in res_w.items()
            }
        doc["warm"] = warm
        doc["auto_choices_warm"] = dict(auto.choices)
        say(f"  auto chose (warm): {auto.choices}")

        # ---- io_uring forced off: auto falls back to preadv ---------------------------------
        os.environ[DISABLE_ENV] = "1"
        try:
            ok, why = IoUringBackend.availability()
            fb = make_backend("auto", regions={fd: view})
            assert isinstance(fb, AutoBackend)
            make_cold()
            ids = batch_ids(160)
            tables[160].via_auto(fb, ids, outs[160])
            good = np.array_equal(
                outs[160].reshape(BATCH, 160)[:256], expected_rows(ids[:256] * 160, 160)
            )
            doc["fallback"] = {
                "available": ok,
                "why": why,
                "auto_cold_backend": fb.cold.name,
                "choices": dict(fb.choices),
                "bytes_ok": good,
            }
            say(
                f"\nfallback with {DISABLE_ENV}=1: available={ok} ({why}); auto's cold backend "
                f"= {fb.cold.name}; chose {fb.choices}; bytes ok: {good}"
            )
            fb.close()
        finally:
            del os.environ[DISABLE_ENV]

        doc["stats"] = {name: b.stats.as_dict() for name, b in backends.items()}
        doc["stats"]["auto.cold"] = auto.cold.stats.as_dict()
        doc["vm_hwm_mb"] = vm_hwm_mb()

        # ---- ratios (last) ------------------------------------------------------------------
        say("\nmedians, cold (k rows/s | process B/row | device B/row)")
        for rb in ROW_SIZES:
            c = cold[str(rb)]
            say(
                f"  {rb:5d} B: "
                + "  ".join(
                    f"{a}={c[a]['rows_s']['median'] / 1e3:.1f}k|{c[a]['proc_bytes_read']['median']:.0f}"
                    f"|{c[a]['dev_bytes_row']['median']:.0f}"
                    for a in cold_arms
                )
            )
        say("medians, warm (M rows/s)")
        for rb in ROW_SIZES:
            w = warm[str(rb)]
            say(f"  {rb:5d} B: " + "  ".join(f"{a}={w[a]['median'] / 1e6:.2f}M" for a in warm_arms))

        ratios: dict[str, Any] = {}
        say(
            "\nratios (medians of per-repetition ratios: each arm against fio / the best arm "
            "of the same repetition)"
        )

        def paired(a: list[float], b: list[float]) -> float:
            return float(np.median([x / y for x, y in zip(a, b, strict=True)]))

        for rb in ROW_SIZES:
            c = cold[str(rb)]
            rates = {a: c[a]["rows_s"]["reps"] for a in cold_arms}
            fio = c["fio_qd32"]["rows_s"]["reps"] if has_fio else []
            best_per_rep = [max(rates[a][i] for a in cold_arms) for i in range(args.reps)]
            best = max(cold_arms, key=lambda a: c[a]["rows_s"]["median"])
            pages = {a: c[a]["proc_bytes_read"]["median"] / 4096 for a in cold_arms}
            lean = [a for a in cold_arms if pages[a] <= 1.0 + 1e-9]
            best_lean = max(lean, key=lambda a: c[a]["rows_s"]["median"]) if lean else None
            r: dict[str, Any] = {
                "best_cold": best,
                "best_cold_rows_s": c[best]["rows_s"]["median"],
                "device_pages_per_row": pages,
                "best_cold_within_one_page": best_lean,
                "auto_vs_best_cold": paired(rates["auto"], best_per_rep),
                "others_mb_s_median": float(
                    np.median([x for a in cold_arms for x in c[a]["others_mb_s"]["reps"]])
                ),
            }
            if fio:
                r["fio_qd32_iops"] = c["fio_qd32"]["rows_s"]["median"]
                r["vs_fio_qd32"] = {a: paired(rates[a], fio) for a in cold_arms}
                r["best_vs_fio_qd32"] = r["vs_fio_qd32"][best]
                if best_lean:
                    r["best_within_one_page_vs_fio_qd32"] = r["vs_fio_qd32"][best_lean]
            if "io_uring_direct" in c:
                r["direct_device_bytes_vs_payload"] = (
                    c["io_uring_direct"]["proc_bytes_read"]["median"] / rb
                )
            w = warm[str(rb)]
            best_w = max(warm_arms, key=lambda a: w[a]["median"])
            best_w_reps = [
                max(w[a]["reps"][i] for a in warm_arms) for i in range(len(w["auto"]["reps"]))
            ]
            r["best_warm"] = best_w
            r["auto_vs_best_warm"] = paired(w["auto"]["reps"], best_w_reps)
            r["mmap_backend_vs_foundation_warm"] = paired(
                w["mmap"]["reps"], w["foundation"]["reps"]
            )
            ratios[str(rb)] = r
            fio_x = ""
            if fio:
                fio_x = (
                    f" (fio QD32 {r['fio_qd32_iops'] / 1e3:.1f}k IOPS; per arm vs fio: "
                    + ", ".join(f"{a} {v:.2f}x" for a, v in r["vs_fio_qd32"].items())
                    + ")"
                )
            say(
                f"  {rb:5d} B cold: best {best} {c[best]['rows_s']['median'] / 1e3:.1f}k rows/s, "
                f"{pages[best]:.2f} device pages per row read{fio_x}"
            )
            if best_lean and fio:
                say(
                    f"           best at <= 1 device page/row: {best_lean} = "
                    f"{r['best_within_one_page_vs_fio_qd32']:.2f}x fio QD32 "
                    f"({pages[best_lean]:.2f} pages/row)"
                )
            if "direct_device_bytes_vs_payload" in r:
                say(
                    f"           O_DIRECT device bytes / payload = "
                    f"{r['direct_device_bytes_vs_payload']:.2f}x"
                )
            say(
                f"           auto / best = {r['auto_vs_best_cold']:.2f}; other tenants read "
                f"{r['others_mb_s_median']:.1f} MB/s from the disk meanwhile (median)"
            )
            say(
                f"  {rb:5d} B warm: best {best_w} {w[best_w]['median'] / 1e6:.2f}M rows/s; "
                f"auto / best = {r['auto_vs_best_warm']:.2f}; mmap backend (generic read) / "
                f"foundation take_rows = {r['mmap_backend_vs_foundation_warm']:.2f}"
            )
        say(
            f"  peak RSS {doc['vm_hwm_mb']:.0f} MB; max residency seen before a cold batch "
            f"{max_resident:.4f}"
        )
        doc["ratios"] = ratios
        doc["log"] = log
        out = write_json("cold_reads", doc)
        print(f"\nJSON: {out}")
        for b in backends.values():
            b.close()
        auto.close()
        os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
