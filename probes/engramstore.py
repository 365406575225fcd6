"""EngramStore lookup_into and DiskEmbedding, against numpy / torch in RAM, same run.

    python probes/engramstore.py [--rows-per-head 500000] [--reps 7]

* ``lookup_into`` ``[64, 256, 8]`` at 264 B rows (8 heads, >= 1 GB, page-cache warm) through
  `EngramStore` bound to per-head ``np.memmap`` files and through an EngramDB-backed
  `EngramStore`, vs numpy fancy-indexing of the same bytes (per-head memmaps for the bound
  arm; the table's shard memmap with global ids for the EngramDB arm).
* `DiskEmbedding` forward latency for 16 and 4,096 ids vs ``nn.Embedding`` with the same
  (bf16) weights in RAM: p50 over >= 2,000 calls per arm, interleaved.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleave, median, rate, vm_hwm_mb, write_json  # noqa: E402

import engramdb  # noqa: E402
from engramdb import EngramStore, EngramStoreConfig  # noqa: E402

ROW = 264
B, L, H = 64, 256, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows-per-head", type=int, default=500_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edb-es-"))
    report: dict[str, object] = {"probe": "engramstore"}
    try:
        rng = np.random.default_rng(0)
        sizes = [args.rows_per_head + 7 * h for h in range(H)]
        paths = []
        for h, n in enumerate(sizes):
            p = work / f"head{h}.bin"
            rng.integers(0, 256, size=(n, ROW), dtype=np.uint8).tofile(p)
            paths.append(p)
        db_path = work / "db"
        engramdb.build(db_path, "engram_l1", ROW, paths, shard_bytes=8 << 30)
        cfg = EngramStoreConfig(sizes, ROW)
        maps = [
            np.memmap(p, dtype=np.uint8, mode="r", shape=(n, ROW)) for p, n in zip(paths, sizes)
        ]
        local = EngramStore({1: cfg})
        local.bind_local(1, maps)
        backed = EngramStore({1: cfg}, store=db_path)
        with engramdb.open(db_path, populate=True) as db:
            shard = np.memmap(
                db_path / db["engram_l1"].info.shards[0].path,
                dtype=np.uint8,
                mode="r",
                shape=(sum(sizes), ROW),
            )
            offsets = db["engram_l1"].head_offsets
        for m in maps:  # warm the per-head files
            m[:: 4096 // ROW + 1].sum()
        id_sets = [
            np.ascontiguousarray(
                np.stack([rng.integers(0, n, (B, L)) for n in sizes], -1), dtype=np.int64
            )
            for _ in range(6)
        ]
        out = np.empty((B, L, H, ROW), np.uint8)
        ref = np.empty_like(out)

        def numpy_heads(ids: np.ndarray) -> np.ndarray:
            return np.stack([maps[h][ids[..., h]] for h in range(H)], axis=-2)

        # correctness first, both arms
        for ids in id_sets[:2]:
            ref[:] = numpy_heads(ids)
            local.lookup_into(1, ids, out)
            assert np.array_equal(out, ref)
            backed.lookup_into(1, ids, out)
            assert np.array_equal(out, ref)
            assert np.array_equal(shard[ids + offsets], ref)
        print("correctness: EngramStore (bound, EngramDB) == numpy per-head == shard memmap")
        k = [0]
        rows = B * L * H

        def arm(fn):  # type: ignore[no-untyped-def]
            def run() -> float:
                def once() -> int:
                    k[0] += 1
                    fn(id_sets[k[0] % len(id_sets)])
                    return rows

                return rate(once, args.seconds)

            return run

        arms = {
            "numpy_heads": arm(numpy_heads),
            "bound": arm(lambda ids: local.lookup_into(1, ids, out)),
            "numpy_global": arm(lambda ids: shard[ids + offsets]),
            "engramdb": arm(lambda ids: backed.lookup_into(1, ids, out)),
        }
        for fn in arms.values():
            fn()  # untimed warm-up
        print(f"lookup_into [{B}, {L}, {H}] x {ROW} B, rows/s:")
        res = interleave(arms, args.reps)
        store_calls = backed.layer_store(1).stats()["fetch_calls"]
        assert store_calls > 0
        r_bound = median(res["bound"]) / median(res["numpy_heads"])
        r_db = median(res["engramdb"]) / median(res["numpy_global"])
        report["lookup"] = res
        report["ratios"] = {"bound_vs_numpy": r_bound, "engramdb_vs_numpy": r_db}

        # ---- DiskEmbedding vs nn.Embedding ------------------------------------------------
        import torch

        from engramdb.torch import DiskEmbedding

        n_emb, dim = 1_000_000, 80
        weight = torch.from_numpy(rng.standard_normal((n_emb, dim), dtype=np.float32)).to(
            torch.bfloat16
        )
        engramdb.build(db_path, "emb", dim * 2, [weight.view(torch.uint8).numpy()], dtype="bf16")
        with engramdb.open(db_path, populate=True) as db:
            disk = DiskEmbedding(db["emb"])
            ram = torch.nn.Embedding(n_emb, dim, _weight=weight.clone(), dtype=torch.bfloat16)
            ram.requires_grad_(False)
            lat: dict[str, list[float]] = {}
            for n in (16, 4096):
                ids = [torch.randint(0, n_emb, (n,)) for _ in range(64)]
                assert torch.equal(disk(ids[0]), ram(ids[0]))
                for _name, mod in (("disk", disk), ("ram", ram)):
                    for i in ids:
                        mod(i)
                for rep in range(args.reps):
                    for name, mod in (
                        (("disk", disk), ("ram", ram))
                        if rep % 2 == 0
                        else (("ram", ram), ("disk", disk))
                    ):
                        ts = []
                        calls = 2000 if n == 16 else 300
                        with torch.no_grad():
                            for c in range(calls):
                                t0 = time.perf_counter_ns()
                                mod(ids[c % 64])
                                ts.append(time.perf_counter_ns() - t0)
                        lat.setdefault(f"{name}_{n}", []).append(statistics.median(ts) / 1000)
                print(
                    f"DiskEmbedding forward, {n} ids, p50 us per rep: disk "
                    f"{[round(x, 1) for x in lat[f'disk_{n}']]}  nn.Embedding "
                    f"{[round(x, 1) for x in lat[f'ram_{n}']]}"
                )
        report["embedding_p50_us"] = lat
        emb16 = median(lat["disk_16"]) / median(lat["ram_16"])
        emb4k = median(lat["disk_4096"]) / median(lat["ram_4096"])
        report["ratios"].update(disk_embedding_cost_16=emb16, disk_embedding_cost_4096=emb4k)  # type: ignore[attr-defined]
        report["peak_rss_mb"] = vm_hwm_mb()
        print(f"proof: EngramDB-backed store served {store_calls} gathers")
        print(f"json: {write_json('engramstore', report)}")
        print(
            f"RATIO EngramStore.lookup_into bound memmaps / numpy fancy-index: {r_bound:.2f}x "
            f"({median(res['bound']) / 1e6:.1f} vs {median(res['numpy_heads']) / 1e6:.1f} M rows/s)"
        )
        print(
            f"RATIO EngramStore.lookup_into EngramDB / numpy fancy-index:    {r_db:.2f}x "
            f"({median(res['engramdb']) / 1e6:.1f} vs {median(res['numpy_global']) / 1e6:.1f} M rows/s)"
        )
        print(
            f"COST  DiskEmbedding / nn.Embedding in RAM, 16 ids:   {emb16:.2f}x "
            f"({median(lat['disk_16']):.1f} vs {median(lat['ram_16']):.1f} us)"
        )
        print(
            f"COST  DiskEmbedding / nn.Embedding in RAM, 4096 ids: {emb4k:.2f}x "
            f"({median(lat['disk_4096']):.1f} vs {median(lat['ram_4096']):.1f} us)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
