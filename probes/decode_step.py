"""What a `Decoder` step's cold path costs the engine's thread: the compiled step (keygen's
one-position step, the ring entries written and the rows copied out by one call each)
against the same decoder with those parts served by numpy, in one process.

    python probes/decode_step.py [--gb 1] [--batches 1,8] [--steps 1200] [--block 20] [--warm]
        [--built [--shard-mb 256]] [--module]

Two attached tables of 320 B rows (random bytes, ``--gb`` in all, evicted first, opened
with ``background_warm=False`` so they stay cold: every step's rows come from the device
through the step reader) and an engram-peft hasher of two layers, 16 heads each. Each step
pushes B new tokens, runs a single-thread torch compute (a few matrix products, so the
decoder's code and data leave the CPU caches as in a model step), fills layer 1, computes
again, fills layer 3, computes again. Blocks of ``--block`` steps alternate between the two
modes (compiled, numpy), so drift of the machine cancels. Rows are checked against the files
in both modes. Printed per B: the median push / fill / total microseconds a step of each
mode and their ratio. JSON to probes/out/decode_step.json; the tables are deleted at exit.

``--built``: the tables built by `engramdb.build` from the same bytes, in shards of
``--shard-mb`` (a step's rows then come from several files: each entry's descriptor is
written by the compiled call too, or by numpy with the entries staged again each step).

``--files-only`` (with ``--built``): the two modes differ only there (everything else
compiled in both).

``--module``: the two layers read through `engramdb.torch.DiskMultiHeadEmbedding` instead,
each step's ids prefetched right after hashing (`prefetch`), then each layer's forward. The
two modes are then the step reader's short submission of a repeated step shape
(`StepReader.submit_fast`) against its long `submit`; the compiled writers are on in both.

``--warm``: the tables resident instead (populated and ``mlock``ed: this VM's DAMON page-out
would drop idle page cache under the loop), opened by default, ``prefetch="auto"`` (so no
prefetch: the fills gather from the mapping). The two modes are then the warm step's fast
paths as built (the one-layer fill's compiled gather into the layer's slice, the prefetch
rule's quiet window) against the general path (`_fill_direct`'s ``np.take``, every push's
rule judged in full).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_note, write_json  # noqa: E402

ROW = 320
LAYERS = (1, 3)


def hasher_config(gb: float) -> dict[str, Any]:
    per_order = max(64, int(gb * 1e9 / ROW / 2 / len(LAYERS)))
    return {
        "engram_vocab_size_per_ngram": [per_order, per_order],
        "ngram_sizes": [2, 3],
        "n_head_per_ngram": 8,
        "target_layers": list(LAYERS),
        "compressed_vocab_size": 8192,
        "pad_id": 0,
        "enable_tokenizer_compression": False,
    }


def build(root: Path, h: Any, args: argparse.Namespace) -> dict[int, Path]:
    """Each layer's raw row file, attached in place (``--built``: built from it, in shards of
    ``--shard-mb``)."""
    import engramdb

    files = {}
    for lay in LAYERS:
        path = files[lay] = root / f"l{lay}.bin"
        n = int(h.table_rows(lay)) * ROW
        rng = np.random.default_rng(lay)
        with open(path, "wb") as f:
            for i in range(0, n, 64 << 20):
                f.write(rng.integers(0, 256, min(64 << 20, n - i), dtype=np.uint8).data)
        heads = h.primes(lay).tolist()
        if args.built:
            rows = np.memmap(path, np.uint8, "r").reshape(-1, ROW)
            engramdb.build(
                root / "db", f"l{lay}", ROW, [rows], heads=heads, shard_bytes=args.shard_mb << 20
            )
        else:
            engramdb.attach(root / "db", f"l{lay}", [str(path)], row_bytes=ROW, heads=heads)
    return files


def table_files(root: Path, files: dict[int, Path], db: Any) -> list[Path]:
    """The files the steps read: the raw files, or a built table's shards."""
    return list(files.values()) + [
        root / "db" / sh.path for lay in LAYERS for sh in db[f"l{lay}"].info.shards
    ]


def evict(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def set_mode(dec: Any, compiled: bool, saved: dict[str, Any]) -> None:
    """Turn the decoder's compiled step parts on (as built) or off (numpy). Warm: the step's
    fast paths (the one-layer fill's compiled gather, the prefetch rule's quiet window) on,
    or off (the fills through `_fill_direct`'s ``np.take``, every push judged in full)."""
    if saved.get("warm"):
        saved.setdefault("grid", dec._grid)
        dec._grid = saved["grid"] if compiled else None
        saved["fast"] = compiled
        return
    reader = dec._reader
    if saved.get("files_only"):  # only the several-files entry writer off (numpy's instead)
        if reader is not None:
            saved.setdefault("files", reader._files_fn)
            reader._files_fn = saved["files"] if compiled else None
        return
    if reader is not None:
        saved.setdefault("reader", (reader._spans_fn, reader._files_fn, reader._copy_fn))
        off = (None, None, None)
        reader._spans_fn, reader._files_fn, reader._copy_fn = saved["reader"] if compiled else off
    for i, st in enumerate(dec._streams):
        saved.setdefault(f"stream{i}", st._native)
        st._native = saved[f"stream{i}"] if compiled else None


def model_compute(b: int) -> Any:
    """``compute(k)``: k single-thread matrix products at batch ``b``, a model step's stand-in
    (the decoder's code and data leave the CPU caches as in a model step)."""
    import torch

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(4 * 448, 448, generator=g) for _ in range(8)]
    x = torch.randn(b, 448, generator=g)

    def compute(k: int) -> None:
        y = x
        for j in range(k):
            y = (weights[j % 8] @ y.T).T[:, :448]

    return compute


def run_batch(
    args: argparse.Namespace, root: Path, h: Any, files: dict[int, Path], b: int
) -> dict[str, Any]:
    import torch

    import engramdb
    from engramdb.decode import Decoder

    torch.set_num_threads(1)
    raw = {lay: np.memmap(files[lay], np.uint8, "r").reshape(-1, ROW) for lay in LAYERS}
    if args.warm:  # resident, populated and locked (no page-out under the loop), default open
        db = engramdb.open(root / "db")
        for st in db.tables:
            db[st].populate()
            db[st].tiers.lock(None)
    else:
        db = engramdb.open(root / "db", background_warm=False)
        evict(table_files(root, files, db))
    stores = {lay: db[f"l{lay}"] for lay in LAYERS}
    if args.module:
        return run_module(args, db, h, raw, b)
    dec = Decoder(stores, h, batch=b, prefetch="auto" if args.warm else True, compressed=True)
    out = np.empty(dec.out_shape, np.uint8)
    compute = model_compute(b)

    tokens = np.random.default_rng(b).integers(0, 8192, (args.steps, b))
    dec.push(tokens[0])  # binds the streams, makes the reader
    dec.fill(out)
    saved: dict[str, Any] = {"warm": args.warm, "files_only": args.files_only}
    times: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    checked = {True: 0, False: 0}
    pc = time.perf_counter
    for s in range(1, args.steps):
        compiled = (s // args.block) % 2 == 0
        set_mode(dec, compiled, saved)
        slow = args.warm and not compiled  # warm, fast paths off
        if slow:
            dec.rule.quiet_until[:] = [-float("inf")] * len(LAYERS)
        t0 = pc()
        rows = dec.push(tokens[s])
        t1 = pc()
        compute(12)
        if slow:
            dec._quick_dst[:] = [None] * len(LAYERS)  # off for this fill
        t2 = pc()
        dec.fill(out, layer=LAYERS[0])
        t3 = pc()
        compute(8)
        if slow:
            dec._quick_dst[:] = [None] * len(LAYERS)
        t4 = pc()
        dec.fill(out, layer=LAYERS[1])
        t5 = pc()
        if slow:
            dec.rule.quiet_until[:] = [-float("inf")] * len(LAYERS)
        compute(8)
        if s % 7 == 0:  # rows equal the files, in both modes
            for i, lay in enumerate(LAYERS):
                want = raw[lay][rows[i].reshape(-1)].reshape(out[:, i].shape)
                assert np.array_equal(out[:, i], want), (b, s, compiled)
            checked[compiled] += 1
        if s >= 2 * args.block:  # past the first cold pages and plans
            times[compiled].append((t1 - t0, t3 - t2, t5 - t4))
    reader = dec._reader
    doc: dict[str, Any] = {
        "batch": b,
        "warm": args.warm,
        "prefetched": dec.prefetched,
        "direct_fills": dec.direct_fills,
        "step_rows": sum(st.counters()["step_rows"] for st in stores.values()),
        "compiled_built": bool(
            saved.get("reader", (None,))[0] is not None or saved.get("files") is not None
        ),
        "native_steps": sum(st.native_steps for st in dec._streams),
        "checked_steps": checked,
        "reader": type(reader).__name__,
    }
    db.close()
    return medians(
        doc, times, ("compiled", "numpy"), ("push_us", "fill_first_us", "fill_second_us")
    )


def medians(
    doc: dict[str, Any],
    times: dict[bool, list[tuple[float, float, float]]],
    modes: tuple[str, str],
    parts: tuple[str, str, str],
) -> dict[str, Any]:
    """``doc`` with each mode's median microseconds a step (``parts`` of it and their total)
    and the ratio of the first mode's total to the second's."""
    for on, mode in zip((True, False), modes):
        med = np.median(np.array(times[on]), axis=0) * 1e6
        doc[mode] = {name: float(x) for name, x in zip(parts, med)}
        doc[mode].update(total_us=float(med.sum()), steps=len(times[on]))
    doc["total_ratio"] = doc[modes[0]]["total_us"] / doc[modes[1]]["total_us"]
    return doc


def _declined(*_args: object) -> bool:
    return False


def short_submissions(reader: Any, on: bool) -> None:
    """A step reader's `submit_fast` as built (``on``), or declining every step (the long
    `submit` then reads each)."""
    if reader is not None:
        if on:
            reader.__dict__.pop("submit_fast", None)
        else:
            reader.submit_fast = _declined


def run_module(
    args: argparse.Namespace, db: Any, h: Any, raw: dict[int, np.ndarray], b: int
) -> dict[str, Any]:
    """``--module``: the layers through `DiskMultiHeadEmbedding`, cold, each step's ids
    prefetched after hashing; blocks alternate the prefetch's short path and general path."""
    import torch

    from engramdb.torch import DiskMultiHeadEmbedding

    mods = {lay: DiskMultiHeadEmbedding(db[f"l{lay}"]) for lay in LAYERS}
    for m in mods.values():
        m.resident_recheck_s = 3600.0  # the table stays cold: every step prefetched
    streams = {lay: h.stream(layer=lay, compressed=True, local=True) for lay in LAYERS}
    offsets = {lay: db[f"l{lay}"].head_offsets for lay in LAYERS}
    compute = model_compute(b)

    tokens = np.random.default_rng(b).integers(0, 8192, (args.steps, b, 1))
    times: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    checked = {True: 0, False: 0}
    pc = time.perf_counter
    with torch.no_grad():
        for s in range(args.steps):
            short = (s // args.block) % 2 == 0
            for m in mods.values():
                short_submissions(m._reader, short)
            ids = {lay: torch.from_numpy(st.push(tokens[s])) for lay, st in streams.items()}
            t0 = pc()
            for lay in LAYERS:
                mods[lay].prefetch(ids[lay])
            t1 = pc()
            compute(12)
            t2 = pc()
            first = mods[LAYERS[0]](ids[LAYERS[0]])
            t3 = pc()
            compute(8)
            t4 = pc()
            second = mods[LAYERS[1]](ids[LAYERS[1]])
            t5 = pc()
            compute(8)
            if s % 7 == 0:  # rows equal the files, in both modes
                for lay, got in ((LAYERS[0], first), (LAYERS[1], second)):
                    want = raw[lay][(ids[lay].numpy() + offsets[lay]).reshape(-1)]
                    assert np.array_equal(got.numpy().view(np.uint8).reshape(want.shape), want)
                checked[short] += 1
            if s >= 2 * args.block:
                times[short].append((t1 - t0, t3 - t2, t5 - t4))
    doc: dict[str, Any] = {
        "batch": b,
        "module": True,
        "prefetches": sum(m.prefetches for m in mods.values()),
        "from_prefetch": sum(m.served_from_prefetch for m in mods.values()),
        "checked_steps": checked,
    }
    db.close()
    parts = ("prefetch_us", "forward_first_us", "forward_second_us")
    return medians(doc, times, ("short", "general"), parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="both tables together")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--block", type=int, default=20, help="steps per block of one mode")
    ap.add_argument("--dir", default=None, help="where the tables go (a temp dir by default)")
    ap.add_argument("--built", action="store_true", help="tables built in shards, not attached")
    ap.add_argument("--shard-mb", type=int, default=256, help="--built: the shard size")
    ap.add_argument(
        "--files-only",
        action="store_true",
        help="--built: the modes differ only in the entry writer for several files "
        "(spans_files, or numpy with the entries staged again)",
    )
    ap.add_argument(
        "--module",
        action="store_true",
        help="the layers through DiskMultiHeadEmbedding with prefetch: its short path "
        "against its general path",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="resident tables, default open and prefetch rule: the step's warm fast paths "
        "(compiled one-layer fill, the rule's quiet window) against the general path",
    )
    args = ap.parse_args()

    from engramdb import keygen

    h = keygen.hasher("engram-peft", hasher_config(args.gb))
    root = Path(tempfile.mkdtemp(prefix="decode_step_", dir=args.dir))
    try:
        files = build(root, h, args)
        gb = sum(p.stat().st_size for p in files.values()) / 1e9
        state = "warm (populated, locked)" if args.warm else "cold (evicted, no background warm)"
        kind = f"built, {args.shard_mb} MB shards" if args.built else "attached"
        print(f"tables: 2 layers, {gb:.2f} GB, {kind}, {state}; {cpu_note()}")
        names = ("fast paths", "general path") if args.warm else ("compiled", "numpy")
        if args.files_only:
            names = ("compiled entries (spans_files)", "numpy entries, staged each step")
        results = []
        for b in (int(x) for x in args.batches.split(",")):
            r = run_batch(args, root, h, files, b)
            results.append(r)
            if args.module:
                c, n = r["short"], r["general"]
                print(
                    f"B={b}: module, short path prefetch {c['prefetch_us']:.0f} + forwards "
                    f"{c['forward_first_us']:.0f} / {c['forward_second_us']:.0f} = "
                    f"{c['total_us']:.0f} us a step; general path {n['prefetch_us']:.0f} + "
                    f"{n['forward_first_us']:.0f} / {n['forward_second_us']:.0f} = "
                    f"{n['total_us']:.0f} us; ratio {r['total_ratio']:.2f}x ({c['steps']} / "
                    f"{n['steps']} steps, rows checked in {r['checked_steps'][True]} / "
                    f"{r['checked_steps'][False]}; {r['from_prefetch']} of {r['prefetches']} "
                    "prefetches served)"
                )
                continue
            c, n = r["compiled"], r["numpy"]
            print(
                f"B={b}: {names[0]} push {c['push_us']:.0f} + fills {c['fill_first_us']:.0f} / "
                f"{c['fill_second_us']:.0f} = {c['total_us']:.0f} us a step; {names[1]} "
                f"{n['push_us']:.0f} + {n['fill_first_us']:.0f} / {n['fill_second_us']:.0f} = "
                f"{n['total_us']:.0f} us; ratio {r['total_ratio']:.2f}x "
                f"({c['steps']} / {n['steps']} steps, rows checked in "
                f"{r['checked_steps'][True]} / {r['checked_steps'][False]}; "
                f"{r['prefetched']} layer steps prefetched, {r['direct_fills']} direct fills)"
            )
        path = write_json("decode_step", {"args": vars(args), "table_gb": gb, "results": results})
        print(f"wrote {path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
