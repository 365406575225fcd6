"""Probe: keygen throughput and one-token decode latency, against plain numpy in the same run.

    python probes/keygen.py [--tokens 1000000] [--reps 5] [--steps 10000] [--index-tokens 10000000]
                            [--batch 8] [--batch-steps 1500] [--evict-mib 8]

For every preset it builds a 1 M-token corpus (Qwen: EOS every ~1000 tokens), checks that the
engine's row ids equal a plain, unoptimised numpy implementation of the same rules (and the
shared reference vectors when the file is found), then times both, interleaved (A B C ... A,
the baseline first and last), and prints every repetition, the medians and the ratio.

Decode: p50 / p99 microseconds of ``stream.push(token)`` (one token in, its row ids out, state
updated) over ``--steps`` steps after a warm-up, against a plain-numpy step that rehashes the
last N tokens. The stream's ``fast_steps`` counter and the kernel's position counter prove
which path served each arm.

Batched decode: p50 of ``stream.push(tokens[B, 1])`` through keygen's compiled loop and
through the numpy kernel (``engramdb.keygen._core``), interleaved, alone and with memory
rewritten between steps; the kernel's native-position counter proves which path served.

Index: ``build_index`` of a ``--index-tokens`` Zipf corpus in a child process (its own
VmHWM). Writes ``probes/out/keygen.json`` beside the human summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engramdb import keygen
from engramdb.keygen import native

OUT = Path(__file__).resolve().parent / "out"


def vm_hwm_mib() -> float:
    """Peak resident set size of this process (VmHWM), MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --- the competitor: plain numpy, written straight from the rules ---------------------------
def plain_row_ids(h: keygen.Hasher, layer: int, ids: np.ndarray) -> np.ndarray:
    """Row ids of one sequence of hashed ids the obvious way: shifted copies, a segment-start
    array for Qwen, then ``mix[:, None] % P + OFF`` per order (full-size temporaries)."""
    n = ids.shape[0]
    order = h.max_ngram
    fill = h.fill_id
    mult = h.multipliers(layer).tolist()
    primes, offsets = h.primes(layer), h.offsets(layer)
    heads = h.heads_per_ngram
    pos = np.arange(n)
    shifted = []
    for k in range(order):
        col = np.full(n, fill, dtype=np.int64)
        col[k:] = ids[: n - k]
        shifted.append(col)
    if h.kind == "qwen4exp":
        last_eos = np.maximum.accumulate(np.where(ids == fill, pos, -1))
        seg_start = np.concatenate([[0], last_eos[:-1] + 1])
        for k in range(1, order):
            shifted[k] = np.where(pos - seg_start >= k, shifted[k], fill)
    mix = shifted[0] * mult[0]
    parts = []
    for k in range(1, order):
        mix = mix ^ (shifted[k] * mult[k])
        cols = slice((k - 1) * heads, k * heads)
        parts.append(mix[:, None] % primes[cols] + offsets[cols])
    return np.concatenate(parts, axis=1)


def plain_step(h: keygen.Hasher, layer: int, window: list[int], token: int) -> np.ndarray:
    """Plain decode step: rehash the last N tokens with the batched plain code."""
    window.append(token)
    del window[0]
    return plain_row_ids(h, layer, np.array(window, dtype=np.int64))[-1]


# --- corpora ------------------------------------------------------------------------------
def corpus_for(h: keygen.Hasher, n: int, rng: np.random.Generator) -> np.ndarray:
    bound = h.id_bound or 1
    ids = rng.integers(0, min(bound, 1 << 20), size=n, dtype=np.int64)
    if h.kind == "qwen4exp":
        ids[rng.integers(0, n, size=max(1, n // 1000))] = h.fill_id  # documents of ~1000 tokens
    return ids


CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    ("qwen3.8-flash-next", "qwen3.8-flash-next", 2, {}),
    ("deepseek-v4.1-flash L1", "deepseek-v4.1-flash", 1, {"compressed": True}),
    ("deepseek-v4.1-flash L14", "deepseek-v4.1-flash", 14, {"compressed": True}),
    ("deepseek-engram-demo L1", "deepseek-engram-demo", 1, {"compressed": True}),
    ("gemma3n-e2b", "gemma3n-e2b", 0, {}),
]


def make(preset: str) -> keygen.Hasher:
    if preset == "deepseek-engram-demo":  # the demo's V_c depends on its tokenizer: stand-in
        return keygen.preset(preset, compressed_vocab_size=99_092, compressed_pad_id=2)
    return keygen.preset(preset)


def check_vectors(echo: Callable[[str], None]) -> int:
    """Replay the shared reference vectors (if the file is around). Returns cases checked."""
    here = Path(__file__).resolve()
    path = next(
        (
            p / "shared" / "vectors" / "keygen.json"
            for p in here.parents
            if (p / "shared" / "vectors" / "keygen.json").is_file()
        ),
        None,
    )
    if path is None:
        echo("  reference vectors: file not found, skipped")
        return 0
    doc = json.loads(path.read_text())
    vecs = {v["name"]: v for v in doc["vectors"]}
    checked = 0
    qwen = keygen.preset("qwen3.8-flash-next")
    for case in vecs["qwen3_8_flash_next_ple"]["cases"]:
        assert qwen.row_ids(case["input_token_ids"]).tolist() == case["global_rowids"]
        checked += 1
    v41 = keygen.preset("deepseek-v4.1-flash")
    for case in vecs["deepseek_v41_flash_geometry"]["cases"]:
        for layer, want in case["rowids"].items():
            got = v41.row_ids(case["compressed_ids"], layer=int(layer), compressed=True)
            assert got.tolist() == want["global"]
            checked += 1
    echo(f"  reference vectors: {checked} cases bit-exact ({path})")
    return checked


# --- arms ---------------------------------------------------------------------------------
def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def numpy_kernel(fn: Callable[[], object]) -> object:
    """``fn()`` with keygen's compiled loop turned off (the numpy kernel serves)."""
    native.use_native(False)
    try:
        return fn()
    finally:
        native.use_native(None)


def batched(args: argparse.Namespace, echo: Callable[[str], None]) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    results: dict[str, Any] = {}
    for label, preset, layer, kw in CASES:
        h = make(preset)
        ids = corpus_for(h, args.tokens, rng)
        ours = h.row_ids(ids, layer=layer, **kw)
        plain = None if h.kind == "gemma3n" else plain_row_ids(h, layer, ids)
        if plain is not None:
            assert np.array_equal(ours, plain), f"{label}: engine differs from plain numpy"
        out = np.empty_like(ours)
        del ours, plain
        arms: dict[str, Callable[[], object]] = {
            "engine": lambda h=h, ids=ids, layer=layer, kw=kw: h.row_ids(ids, layer=layer, **kw),
            "engine_out": lambda h=h, ids=ids, layer=layer, kw=kw, out=out: h.row_ids(
                ids, layer=layer, out=out, **kw
            ),
        }
        if h.kind != "gemma3n":
            arms = {"plain": lambda h=h, ids=ids, layer=layer: plain_row_ids(h, layer, ids), **arms}
            if native.native_enabled():  # the compiled loop's baseline: the numpy kernel
                arms["numpy_kernel"] = lambda h=h, ids=ids, layer=layer, kw=kw: numpy_kernel(
                    lambda: h.row_ids(ids, layer=layer, **kw)
                )
        stats = keygen.kernel_stats
        before = stats["positions"] + stats["native_positions"]
        reps: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        for r in range(args.reps):
            order = names if r % 2 == 0 else names[::-1]
            row = []
            for name in order:
                tok_s = ids.shape[0] / timed(arms[name])
                reps[name].append(tok_s)
                row.append(f"{name} {tok_s / 1e6:7.2f}")
            echo(f"  {label:26s} rep {r}: " + "  ".join(row) + "  M tokens/s")
        first = names[0]
        tail = ids.shape[0] / timed(arms[first])  # baseline again, last: drift / noise floor
        served = stats["positions"] + stats["native_positions"] - before
        med = {name: statistics.median(v) for name, v in reps.items()}
        entry: dict[str, Any] = {
            "preset": preset,
            "layer": layer,
            "tokens": int(ids.shape[0]),
            "n_heads": h.n_heads,
            "reps_tokens_per_s": reps,
            "median_tokens_per_s": med,
            "baseline_first_last": [reps[first][0], tail],
            "kernel_positions_served": served,
        }
        if "plain" in med:
            entry["ratio_engine_vs_plain"] = med["engine"] / med["plain"]
            entry["ratio_engine_out_vs_plain"] = med["engine_out"] / med["plain"]
        if "numpy_kernel" in med:
            entry["ratio_engine_vs_numpy_kernel"] = med["engine"] / med["numpy_kernel"]
        results[label] = entry
        ratio = f"  ratio vs plain {entry.get('ratio_engine_vs_plain', float('nan')):.2f}x"
        if "numpy_kernel" in med:
            ratio += f", vs the numpy kernel {entry['ratio_engine_vs_numpy_kernel']:.2f}x"
        echo(
            f"  {label:26s} median: engine {med['engine'] / 1e6:.2f}  engine(out=) "
            f"{med['engine_out'] / 1e6:.2f} M tokens/s{ratio if 'plain' in med else ''}; "
            f"baseline {first} first/last {reps[first][0] / 1e6:.2f}/{tail / 1e6:.2f}; "
            f"kernel served {served:,} positions"
        )
    return results


def decode(args: argparse.Namespace, echo: Callable[[str], None]) -> dict[str, Any]:
    rng = np.random.default_rng(11)
    results: dict[str, Any] = {}
    for label, preset, layer, kw in CASES[:3]:
        h = make(preset)
        toks = corpus_for(h, args.steps + 1000, rng).tolist()
        full = h.row_ids(toks, layer=layer, **kw)
        lat: dict[str, list[float]] = {"engine": [], "plain": []}
        for rep in range(3):
            for arm in ("engine", "plain") if rep % 2 == 0 else ("plain", "engine"):
                if arm == "engine":
                    s = h.stream(layer=layer, **kw)
                    clock = time.perf_counter_ns
                    ns = []
                    for i, t in enumerate(toks):
                        t0 = clock()
                        row = s.push(t)
                        ns.append(clock() - t0)
                        if i % 997 == 0:
                            assert np.array_equal(row, full[i]), f"{label}: decode step {i} differs"
                    assert s.fast_steps == len(toks) and s.batched_pushes == 0
                else:
                    window = [h.fill_id] * h.max_ngram
                    ns = []
                    for i, t in enumerate(toks[: args.plain_steps + 1000]):
                        t0 = time.perf_counter_ns()
                        row = plain_step(h, layer, window, t)
                        ns.append(time.perf_counter_ns() - t0)
                        if i % 997 == 0 and h.kind != "qwen4exp":
                            assert np.array_equal(row, full[i])
                lat[arm].extend(ns[1000:])  # after warm-up
        p = {
            arm: {
                "p50_us": float(np.percentile(v, 50)) / 1e3,
                "p99_us": float(np.percentile(v, 99)) / 1e3,
                "steps": len(v),
            }
            for arm, v in lat.items()
        }
        p["ratio_plain_over_engine_p50"] = p["plain"]["p50_us"] / p["engine"]["p50_us"]
        results[label] = p
        echo(
            f"  {label:26s} engine p50 {p['engine']['p50_us']:.2f} us  p99 "
            f"{p['engine']['p99_us']:.2f} us ({p['engine']['steps']:,} steps, one-token path)"
            f" | plain p50 {p['plain']['p50_us']:.1f} us -> {p['ratio_plain_over_engine_p50']:.1f}x"
        )
    return results


def batch_decode(args: argparse.Namespace, echo: Callable[[str], None]) -> dict[str, Any]:
    """A decode step of ``--batch`` sequences (``stream.push(tokens[B, 1])``): the compiled
    loop against the numpy kernel, interleaved, alone and with ``--evict-mib`` of memory
    rewritten between steps (the stand-in for a model step that evicts numpy's code and data
    from the caches; only the push is timed)."""

    if not native.native_enabled():
        echo("  skipped: keygen's compiled loop is not built or ENGRAMDB_NATIVE=0")
        return {}
    rng = np.random.default_rng(13)
    b, steps = args.batch, args.batch_steps
    junk = np.zeros(args.evict_mib << 20, np.uint8)
    results: dict[str, Any] = {}
    for label, preset, layer, kw in CASES[:3]:
        h = make(preset)
        toks = np.stack([corpus_for(h, steps, rng) for _ in range(b)])
        full = h.row_ids(toks, layer=layer, **kw)
        lat: dict[str, list[float]] = {}
        for rep in range(4):
            arms = ("native", "numpy") if rep % 2 == 0 else ("numpy", "native")
            for evict in (False, True):
                for arm in arms:
                    native.use_native(arm == "native")
                    before = keygen.kernel_stats["native_positions"]
                    s = h.stream(layer=layer, **kw)
                    ns = []
                    for i in range(steps):
                        if evict:
                            np.add(junk, 1, out=junk)
                        col = toks[:, i : i + 1]
                        t0 = time.perf_counter_ns()
                        row = s.push(col)
                        ns.append(time.perf_counter_ns() - t0)
                        if i % 97 == 0:
                            assert np.array_equal(row, full[:, i : i + 1]), f"{label} step {i}"
                    served = keygen.kernel_stats["native_positions"] - before
                    assert served == (steps * b if arm == "native" else 0), (arm, served)
                    key = f"{arm}{'_evict' if evict else ''}"
                    lat.setdefault(key, []).extend(ns[50:])
        native.use_native(None)
        p = {k: float(np.percentile(v, 50)) / 1e3 for k, v in lat.items()}
        results[label] = p
        echo(
            f"  {label:26s} B={b}: p50 native {p['native']:.1f} us vs numpy {p['numpy']:.1f} us "
            f"({p['numpy'] / p['native']:.1f}x); after {args.evict_mib} MiB rewritten: "
            f"{p['native_evict']:.1f} vs {p['numpy_evict']:.1f} us "
            f"({p['numpy_evict'] / p['native_evict']:.1f}x)"
        )
    return results


def index_child(tokens: int) -> None:
    """Run in a child process: index a Zipf corpus, print the summary as JSON."""
    from engramdb.build.index import build_index
    from engramdb.read.index import load_index

    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        ids = (rng.zipf(1.2, size=tokens) % 248_000).astype(np.uint32)
        ids[rng.integers(0, tokens, size=tokens // 800)] = 248_044
        np.save(Path(tmp) / "corpus.npy", ids)
        del ids
        db = Path(tmp) / "db"
        db.mkdir()
        manifest = {
            "format_version": 1,
            "tables": {"ple": {"n_rows": 320_001_536, "row_bytes": 160}},
        }
        (db / "manifest.json").write_text(json.dumps(manifest))
        hwm0 = vm_hwm_mib()
        summary = build_index(
            Path(tmp) / "corpus.npy", db, preset="qwen3.8-flash-next", table="ple"
        )
        ix = load_index(db, "ple")
        assert int(ix.key_counts.sum()) == tokens
        sizes = {p.name: p.stat().st_size for p in (db / "ple" / "index").iterdir()}
        print(
            json.dumps(
                {
                    "tokens": summary.tokens,
                    "seconds": summary.seconds,
                    "tokens_per_s": summary.tokens_per_s,
                    "distinct_keys": summary.distinct_keys,
                    "distinct_rows": summary.distinct_rows,
                    "hot_rows": summary.hot_rows,
                    "vm_hwm_mib_before": hwm0,
                    "vm_hwm_mib": vm_hwm_mib(),
                    "file_bytes": sizes,
                    "line": summary.line(),
                }
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--plain-steps", type=int, default=3_000)
    ap.add_argument("--index-tokens", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=8, help="sequences per batched decode step")
    ap.add_argument("--batch-steps", type=int, default=1500)
    ap.add_argument("--evict-mib", type=int, default=8)
    ap.add_argument("--index-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.index_child:
        index_child(args.index_child)
        return
    lines: list[str] = []

    def echo(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    echo(f"keygen probe: numpy {np.__version__}, {os.cpu_count()} cpus, one thread")
    echo("correctness")
    n_vectors = check_vectors(echo)
    echo(f"batched keygen, {args.tokens:,}-token corpus per preset (plain = unoptimised numpy)")
    batch = batched(args, echo)
    echo(f"decode: one token pushed per step, {args.steps:,} steps after 1,000 warm-up")
    dec = decode(args, echo)
    echo(f"decode: one token for each of {args.batch} sequences per step, compiled loop vs numpy")
    bdec = batch_decode(args, echo)
    idx: dict[str, Any] = {}
    if args.index_tokens:
        echo(f"index: {args.index_tokens:,}-token Zipf corpus, qwen3.8-flash-next (child process)")
        proc = subprocess.run(
            [sys.executable, __file__, "--index-child", str(args.index_tokens)],
            capture_output=True,
            text=True,
            check=True,
        )
        idx = json.loads(proc.stdout.strip().splitlines()[-1])
        echo(f"  {idx['line']}")
        echo(f"  peak RSS (VmHWM) {idx['vm_hwm_mib']:.0f} MiB; files {idx['file_bytes']}")
    hwm = vm_hwm_mib()
    echo(f"peak RSS of this process (VmHWM): {hwm:.0f} MiB")
    for label in ("qwen3.8-flash-next", "deepseek-v4.1-flash L1", "deepseek-v4.1-flash L14"):
        b = batch[label]
        echo(
            f"RESULT {label}: {b['median_tokens_per_s']['engine'] / 1e6:.2f} M tokens/s "
            f"(target >= 5), {b['ratio_engine_vs_plain']:.2f}x plain numpy"
        )
    for label, d in dec.items():
        echo(
            f"RESULT decode {label}: p50 {d['engine']['p50_us']:.2f} us (target <= 5), "
            f"p99 {d['engine']['p99_us']:.2f} us, {d['ratio_plain_over_engine_p50']:.1f}x faster than plain"
        )
    OUT.mkdir(exist_ok=True)
    doc = {
        "probe": "keygen",
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "vectors_checked": n_vectors,
        "batched": batch,
        "decode": dec,
        "batch_decode": bdec,
        "index": idx,
        "vm_hwm_mib": hwm,
        "summary": lines,
    }
    path = OUT / "keygen.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
