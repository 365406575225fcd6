"""``engramdb demo``: the whole chain on a tiny Qwen-PLE table, each step against its baseline.

The table is ``qwen3.8-flash-next`` at ``scale="tiny"``: the preset's real algorithm
(multipliers, orders 2..3 x 8 heads, EOS rule, padding to 128 rows) with 1,000x smaller heads,
filled with deterministic random rows (``build --synthetic``). Steps: build -> index a
synthetic corpus -> view build -> warm -> warm gathers -> decode steps -> a serve round trip
over a Unix socket -> corpus streaming. Every step prints one line: the measured figure and
the baseline it is measured against in the same run (gathers: single-thread
``np.take(table, ids, axis=0, out=out, mode="clip")`` on a populated mapping of the same
file). Core dependencies only (numpy, click, zstandard, xxhash).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.build.index import build_index
from engramdb.build.table import build, synthetic_bytes
from engramdb.build.view import build_view
from engramdb.client import connect
from engramdb.database import open as open_db
from engramdb.decode import Decoder
from engramdb.keygen.presets import preset
from engramdb.read.index import load_index
from engramdb.serve.server import Server
from engramdb.units import format_bytes
from engramdb.warm import warm_tables

PRESET = "qwen3.8-flash-next"
SCALE = "tiny"
SEED = 1
#: the synthetic corpus: sequences x tokens, Zipf-distributed ids (so n-grams repeat)
CORPUS_SHAPE = (4, 16_384)
VIEW_BUDGET = "24M"
GATHER_BATCH = 16_384
STEPS = 2_000


def _rate(fn: Callable[[], object], seconds: float, per_call: int) -> float:
    """Items per second of ``fn`` (``per_call`` items per call) over about ``seconds``."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += per_call
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt


def _p50_us(fn: Callable[[], object], calls: int) -> float:
    """Median wall time of one ``fn()`` in microseconds over ``calls`` calls."""
    fn()
    times = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return float(np.median(times)) * 1e6


def _drop_cache(path: Path) -> None:
    """Make ``path`` cold for this run (POSIX_FADV_DONTNEED on this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sequential_read(path: Path) -> float:
    """Seconds to read ``path`` front to back in 8 MiB reads (the warm baseline)."""
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def _shard_file(db: Path, table: str) -> Path:
    files = [p for p in (db / table).glob("g-*/*") if p.is_file()]
    if len(files) != 1:
        raise AssertionError(f"demo: expected one shard file, found {files}")
    return files[0]


def run_demo(
    directory: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] = print,
    *,
    seconds: float = 1.0,
    clean: bool = False,
) -> dict[str, float]:
    """Walk the chain in ``directory`` (default ``<tmp>/engramdb-demo``), print one line per
    step, and return the figures. ``clean`` removes the directory at the end."""
    root = Path(directory) if directory else Path(tempfile.gettempdir()) / "engramdb-demo"
    root.mkdir(parents=True, exist_ok=True)
    db_path = root / "db"
    try:
        figures = _chain(root, db_path, echo, seconds)
    except BaseException:
        if clean:
            shutil.rmtree(root, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    if clean:
        shutil.rmtree(root, ignore_errors=True)
        echo(f"removed {root} ({format_bytes(size)})")
    else:
        echo(f"files kept in {root} ({format_bytes(size)}); `engramdb demo --clean` removes them")
        echo("next:")
        echo(f"  engramdb info {db_path}")
        echo(f"  engramdb verify {db_path}")
        echo(f"  engramdb serve {db_path} --unix {root / 'ple.sock'}")
    return figures


def _chain(
    root: Path, db_path: Path, echo: Callable[[str], None], seconds: float
) -> dict[str, float]:
    h = preset(PRESET, scale=SCALE)
    layer = int(h.layers[0])
    n_heads, rb = h.n_heads, 160
    fig: dict[str, float] = {}

    # 1. build ------------------------------------------------------------------------------
    s = build(db_path, "ple", None, [], preset=PRESET, scale=SCALE, synthetic=SEED, force=True)
    plain = root / "plain-write.bin"
    t0 = time.perf_counter()
    with open(plain, "wb") as f:
        f.write(synthetic_bytes(SEED, 0, s.bytes).data)
        f.flush()
        os.fsync(f.fileno())
    plain_gbs = s.bytes / (time.perf_counter() - t0) / 1e9
    plain.unlink()
    fig.update(build_gb_per_s=s.gb_per_s, plain_write_gb_per_s=plain_gbs)
    echo(
        f"[1/8] build --preset {PRESET} --scale {SCALE} --synthetic {SEED}: {s.rows:,} rows x "
        f"{rb} B ({n_heads} heads + pad head) in {s.seconds:.2f} s = {s.gb_per_s:.2f} GB/s "
        f"| generate + write + fsync the same bytes: {plain_gbs:.2f} GB/s"
    )

    # 2. index a synthetic corpus ------------------------------------------------------------
    rng = np.random.default_rng(0)
    vocab = int(h.info["vocab_size"])
    tokens = (rng.zipf(1.3, CORPUS_SHAPE) % vocab).astype(np.int32)
    corpus = root / "corpus.npy"
    np.save(corpus, tokens)
    ix = build_index(corpus, db_path, preset=PRESET, table="ple")
    t0 = time.perf_counter()
    h.row_ids(tokens, layer=layer)
    keygen_tps = tokens.size / (time.perf_counter() - t0)
    fig.update(index_tokens_per_s=ix.tokens_per_s, keygen_tokens_per_s=keygen_tps)
    echo(
        f"[2/8] index {corpus.name} ({tokens.size:,} tokens): {ix.tokens_per_s / 1e6:.2f} M "
        f"tokens/s, {ix.distinct_keys:,} keys, hot set {ix.hot_rows:,} rows "
        f"| keygen alone (row_ids): {keygen_tps / 1e6:.2f} M tokens/s"
    )

    # 3. view build ---------------------------------------------------------------------------
    vs = build_view(
        db_path, table="ple", name="corpus", from_index=True, disk_budget=VIEW_BUDGET, force=True
    )
    tix = load_index(db_path, "ple")
    kept = np.argsort(-tix.key_counts.astype(np.int64), kind="stable")[: vs.records]
    view_rows = h.hash_keys(tix.keys[kept], layer=layer).reshape(-1)
    shard = _shard_file(db_path, "ple")
    plain_view = root / "plain-view.bin"
    t0 = time.perf_counter()
    gathered = np.take(np.memmap(shard, np.uint8, "r", shape=(s.rows, rb)), view_rows, axis=0)
    with open(plain_view, "wb") as f:
        f.write(gathered.data)
        f.flush()
        os.fsync(f.fileno())
    plain_view_gbs = gathered.nbytes / (time.perf_counter() - t0) / 1e9
    plain_view.unlink()
    fig.update(view_build_gb_per_s=vs.gb_per_s, plain_view_gb_per_s=plain_view_gbs)
    echo(
        f"[3/8] view build --from-index --disk-budget {VIEW_BUDGET}: {vs.records:,} of "
        f"{vs.keys_total:,} keys kept, {format_bytes(vs.bytes)} in {vs.seconds:.2f} s = "
        f"{vs.gb_per_s:.2f} GB/s | np.take of the same rows + write + fsync: "
        f"{plain_view_gbs:.2f} GB/s"
    )

    # 4. warm ---------------------------------------------------------------------------------
    _drop_cache(shard)
    seq_gbs = s.bytes / _sequential_read(shard) / 1e9
    _drop_cache(shard)
    with open_db(db_path, background_warm=False) as db:
        (w,) = warm_tables(db, ["ple"])
        fig.update(warm_gb_per_s=w.gb_per_s, sequential_read_gb_per_s=seq_gbs)
        echo(f"[4/8] warm: {w.line()} | cold sequential read of the shard: {seq_gbs:.2f} GB/s")
        _warm_steps(db, h, layer, tokens, root, shard, echo, seconds, fig)
    return fig


def _warm_steps(
    db: Any,
    h: Any,
    layer: int,
    tokens: np.ndarray,
    root: Path,
    shard: Path,
    echo: Callable[[str], None],
    seconds: float,
    fig: dict[str, float],
) -> None:
    ple = db["ple"]
    rb, n_heads = ple.row_bytes, h.n_heads
    table = np.memmap(shard, dtype=np.uint8, mode="r", shape=(ple.n_rows, rb))
    int(np.asarray(table).max())  # populate the baseline's mapping (the pages are cached)
    rng = np.random.default_rng(1)

    # 5. warm gathers -------------------------------------------------------------------------
    ids = rng.integers(0, ple.n_rows, GATHER_BATCH, dtype=np.int64)
    out = np.empty((GATHER_BATCH, rb), np.uint8)
    ref = np.empty_like(out)
    ple.fetch_into(ids, out)
    np.take(table, ids, axis=0, out=ref, mode="clip")
    if not np.array_equal(out, ref):
        raise AssertionError("demo: fetch_into differs from the file's rows")
    r_db = _rate(lambda: ple.fetch_into(ids, out), seconds, GATHER_BATCH)
    r_np = _rate(lambda: np.take(table, ids, axis=0, out=ref, mode="clip"), seconds, GATHER_BATCH)
    fig.update(fetch_rows_per_s=r_db, np_take_rows_per_s=r_np)
    echo(
        f"[5/8] fetch_into {GATHER_BATCH:,} random rows: {r_db / 1e6:.1f} M rows/s "
        f"({r_db * rb / 1e9:.2f} GB/s) | np.take(out=) on a populated mapping: "
        f"{r_np / 1e6:.1f} M rows/s; ratio {r_db / r_np:.2f}x"
    )

    # 6. decode steps -------------------------------------------------------------------------
    seq = tokens[0, :STEPS].tolist()
    step_out = np.empty((n_heads, rb), np.uint8)
    check = Decoder(ple, PRESET, layer=layer)  # the bare name: the table records its scale
    want = np.take(table, h.row_ids(np.array(seq[:3]), layer=layer), axis=0)
    for t in range(3):
        check.push(seq[t])
        check.fill(step_out)
        if not np.array_equal(step_out, want[t]):
            raise AssertionError("demo: Decoder rows differ from keygen + np.take")
    dec = Decoder(ple, PRESET, layer=layer)
    it = iter(range(10**9))

    def dec_step() -> None:
        dec.push(seq[next(it) % len(seq)])
        dec.fill(step_out)

    ks = h.stream(layer=layer)
    base_out = np.empty((n_heads, rb), np.uint8)
    it2 = iter(range(10**9))

    def base_step() -> None:
        rows = ks.push(seq[next(it2) % len(seq)])
        np.take(table, rows, axis=0, out=base_out, mode="clip")

    d_us = _p50_us(dec_step, STEPS)
    b_us = _p50_us(base_step, STEPS)
    fig.update(decode_step_us=d_us, baseline_step_us=b_us)
    echo(
        f"[6/8] Decoder push + fill ({n_heads} rows/token): p50 {d_us:.1f} us/token "
        f"| KeyStream.push + np.take(out=): p50 {b_us:.1f} us; ratio {b_us / d_us:.2f}x"
    )

    # 7. serve round trip ---------------------------------------------------------------------
    sock = root / "ple.sock"
    server = Server(db, port=None, unix=sock).start()
    try:
        with connect(f"unix://{sock}") as client:
            remote = client["ple"]
            small = ids[:16].copy()
            r16 = np.empty((16, rb), np.uint8)
            remote.fetch_into(small, r16)
            if not np.array_equal(r16, ref[:16]):
                raise AssertionError("demo: served rows differ from the local rows")
            srv_us = _p50_us(lambda: remote.fetch_into(small, r16), 300)
            loc_us = _p50_us(lambda: ple.fetch_into(small, r16), 300)
            big, rbig = ids[:4096].copy(), np.empty((4096, rb), np.uint8)
            srv_rps = _rate(lambda: remote.fetch_into(big, rbig), seconds, 4096)
            np_rps = _rate(
                lambda: np.take(table, big, axis=0, out=rbig, mode="clip"), seconds, 4096
            )
    finally:
        server.stop()
    fig.update(serve_16_us=srv_us, local_16_us=loc_us, serve_4096_rows_per_s=srv_rps)
    echo(
        f"[7/8] serve over {sock.name} (wire protocol): 16 rows p50 {srv_us:.0f} us, 4,096 rows "
        f"{srv_rps / 1e6:.2f} M rows/s | in-process: 16 rows p50 {loc_us:.1f} us, np.take "
        f"4,096 rows {np_rps / 1e6:.1f} M rows/s"
    )

    # 8. corpus streaming ---------------------------------------------------------------------
    corpus = root / "corpus.npy"
    t0 = time.perf_counter()
    n_tok = 0
    first: np.ndarray | None = None
    for toks, e_t in db.stream(str(corpus), preset=PRESET, table="ple", layer=layer):
        n_tok += int(toks.size)
        if first is None:  # batches are [T] (one sequence's chunk) or [S, T]
            first = np.array(e_t[:4] if toks.ndim == 1 else e_t[0, :4])
    st_tps = n_tok / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    batch = np.empty((CORPUS_SHAPE[1], n_heads, rb), np.uint8)
    for s in range(tokens.shape[0]):
        rows = h.row_ids(tokens[s], layer=layer)
        np.take(table, rows, axis=0, out=batch, mode="clip")
        if s == 0 and first is not None and not np.array_equal(batch[:4], first):
            raise AssertionError("demo: streamed rows differ from keygen + np.take")
    base_tps = tokens.size / (time.perf_counter() - t0)
    fig.update(stream_tokens_per_s=st_tps, baseline_stream_tokens_per_s=base_tps)
    echo(
        f"[8/8] db.stream corpus.npy: {st_tps / 1e6:.2f} M tokens/s "
        f"({st_tps * n_heads / 1e6:.1f} M rows/s) | row_ids + np.take(out=) per sequence, "
        f"one thread: {base_tps / 1e6:.2f} M tokens/s; ratio {st_tps / base_tps:.2f}x"
    )
