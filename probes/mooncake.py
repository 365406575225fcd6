"""EngramDB tables through a real Mooncake store vs the local EngramDB store, same run.

    python probes/mooncake.py [--rows-per-head 500000] [--reps 5] [--steps 10000]

Starts ``mooncake_master`` and one storage host (``mooncake_client``) in a private network
namespace (loopback only, TCP transport), then measures at 264 B rows:

* populate: `EngramStore.populate` into the store (one ``batch_put_from``) and
  ``publish`` of the same EngramDB database, payload GB/s;
* ``lookup_into`` rows/s for ``[64, 256, 8]`` (8 heads, >= 1 GB, page-cache warm) and p50 /
  p99 latency for ``[1, 1, 24]`` (a 24-head layer), for three arms:
  ``local`` — `EngramStore` on the local EngramDB database (the baseline, first and last),
  ``ranged`` — `EngramStore` on the store client (one ``get_into_ranges`` per batch),
  ``host_copy`` — `open_mooncake(..., host_copy=/dev/shm/...)` (table pulled once per host),
  ``wheel`` — the Mooncake wheel's own ``mooncake.store.EngramStore`` (the peer: per-layer,
  float32 rows, ``lookup`` allocates its result) on the same store, same bytes;
  ``near`` (big batch only) — `EngramStore` on a second client that mounts its own segment
  and holds the layer's replica there (``ReplicateConfig.preferred_segment``), with
  ``MC_STORE_MEMCPY=1``: the most local a ranged read through the store can be;
* checks bytes against the local store before timing, and prints the store counters that
  prove each path served the reads.

The ranged arm is slow on TCP (the client spends tens of microseconds per range), so its
large batch runs ``--ranged-reps`` times with a smaller timing budget.
The ids here are uniformly random, the case no layout can help; a corpus stream read
through a published Store-P view is measured by probes/mooncake_view.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
# This file shares its name with the Mooncake package: keep its directory off sys.path so
# that `import mooncake` finds the wheel, and load the probe helpers by file path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
sys.path.insert(0, str(ROOT.parent / "tests"))
_spec = importlib.util.spec_from_file_location("probe_common", ROOT / "common.py")
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
interleave, median, vm_hwm_mb, write_json = (
    common.interleave,
    common.median,
    common.vm_hwm_mb,
    common.write_json,
)
from mooncake_harness import Cluster, enter_private_netns  # noqa: E402

from engramdb import EngramStore, EngramStoreConfig  # noqa: E402
from engramdb.integrations import mooncake as mc  # noqa: E402

ROW = 264
BIG = (64, 256, 8)
DECODE = (1, 1, 24)


def rss_mb(pid: int) -> float:
    return vm_hwm_mb(str(pid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows-per-head", type=int, default=500_000)
    ap.add_argument("--decode-rows-per-head", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranged-reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--ranged-steps", type=int, default=2_000)
    ap.add_argument("--segment", default="6GB", help="storage host memory")
    args = ap.parse_args()

    restore = enter_private_netns()
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    # Read when a client is created; only the `near` client holds replicas in its own
    # segment, so this changes no other arm.
    os.environ["MC_STORE_MEMCPY"] = "1"
    work = Path(tempfile.mkdtemp(prefix="edb-mc-"))
    shm = Path(tempfile.mkdtemp(prefix="edb-mc-", dir="/dev/shm"))
    cluster = Cluster(segment=args.segment, lease_ms=10_000)
    report: dict[str, object] = {"probe": "mooncake", "row_bytes": ROW, "transport": "tcp"}
    client = near_client = None
    try:
        cluster.start()
        client = cluster.connect()
        rng = np.random.default_rng(0)
        big_sizes = [args.rows_per_head + 7 * h for h in range(BIG[2])]
        dec_sizes = [args.decode_rows_per_head + 3 * h for h in range(DECODE[2])]
        big = [rng.integers(0, 256, (n, ROW), dtype=np.uint8) for n in big_sizes]
        dec = [rng.integers(0, 256, (n, ROW), dtype=np.uint8) for n in dec_sizes]
        layers = {1: EngramStoreConfig(big_sizes, ROW), 2: EngramStoreConfig(dec_sizes, ROW)}
        nbytes = sum(t.nbytes for t in big)
        print(
            f"tables: [64,256,8] layer {nbytes / 1e9:.2f} GB, [1,1,24] layer "
            f"{sum(t.nbytes for t in dec) / 1e9:.2f} GB; {os.cpu_count()} cpus"
        )

        # ---- populate ---------------------------------------------------------------------
        local = EngramStore(layers, store=work / "db")
        t0 = time.perf_counter()
        local.populate(1, big)
        local_gbs = nbytes / 1e9 / (time.perf_counter() - t0)
        local.populate(2, dec)
        ranged = EngramStore(layers, store=client)
        t0 = time.perf_counter()
        ranged.populate(1, big)
        store_gbs = nbytes / 1e9 / (time.perf_counter() - t0)
        ranged.populate(2, dec)
        import mooncake.store as mstore

        def peer(layer_id: int, tabs: list[np.ndarray]) -> object:
            pcfg = mstore.EngramStoreConfig()
            pcfg.embedding_dim = ROW // 4
            pcfg.table_vocab_sizes = [t.shape[0] for t in tabs]
            es = mstore.EngramStore(layer_id, pcfg, client)
            es.populate([t.view(np.float32) for t in tabs])
            return es

        wheel_big, wheel_dec = peer(3, big), peer(4, dec)

        # `near`: the layer's only replica lives in the reading client's own segment.
        near_client = mc.connect(
            cluster.master_addr,
            cluster.metadata_url,
            local_hostname="127.0.0.1",
            segment_bytes=nbytes + (256 << 20),
        )
        near_host = near_client.get_hostname()
        near = EngramStore({5: EngramStoreConfig(big_sizes, ROW)}, store=near_client)
        near_cfg = mstore.ReplicateConfig()
        near_cfg.with_hard_pin = True
        near_cfg.preferred_segment = near_host
        near.populate(5, big, near_cfg)
        near_replicas = sorted(
            {
                d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for h in range(BIG[2])
                for d in near_client.get_replica_desc(f"engram:l5:h{h}")
            }
        )
        assert near_replicas == [near_host], (near_replicas, near_host)
        t0 = time.perf_counter()
        summary = mc.publish(work / "db", client=client, name="probe", tables=["engram_l1"])
        publish_gbs = summary.gb_per_s
        mc.publish(work / "db", client=client, name="probe2", tables=["engram_l2"])
        t0 = time.perf_counter()
        db = mc.open_mooncake(client=client, name="probe", host_copy=shm)
        pull_gbs = nbytes / 1e9 / (time.perf_counter() - t0)
        db2 = mc.open_mooncake(client=client, name="probe2", host_copy=shm)
        hc_big, hc_dec = db["engram_l1"], db2["engram_l2"]
        populate = {
            "engramdb_build_gbs": local_gbs,
            "store_populate_gbs": store_gbs,
            "publish_gbs": publish_gbs,
            "host_copy_pull_gbs": pull_gbs,
        }
        for k, v in populate.items():
            print(f"populate {k}: {v:.2f} GB/s")
        report["populate"] = populate
        del big, dec

        # ---- correctness first ------------------------------------------------------------
        def ids_for(shape: tuple[int, int, int], sizes: list[int], n: int) -> list[np.ndarray]:
            return [
                np.ascontiguousarray(
                    np.stack([rng.integers(0, s, shape[:2]) for s in sizes], -1), dtype=np.int64
                )
                for _ in range(n)
            ]

        big_ids = ids_for(BIG, big_sizes, 4)
        dec_ids = ids_for(DECODE, dec_sizes, 256)
        arms = ("local", "ranged", "host_copy", "wheel")
        out_big = {a: np.empty(BIG + (ROW,), np.uint8) for a in (*arms, "near")}
        out_dec = {a: np.empty(DECODE + (ROW,), np.uint8) for a in arms}

        wheel_failures = [0]

        def wheel(lay: int, ids: np.ndarray, out: np.ndarray) -> None:
            # The wheel's lookup fails now and then here with a bare "EngramStore lookup
            # failed" (seen after a 1 GB host-copy pull); count it and retry, as a caller would.
            for attempt in range(3):
                try:
                    got = (wheel_big if lay == 1 else wheel_dec).lookup(ids)  # type: ignore[attr-defined]
                    break
                except RuntimeError:
                    wheel_failures[0] += 1
                    if attempt == 2:
                        raise
            out[:] = np.ascontiguousarray(got).view(np.uint8).reshape(out.shape)

        for buf in (out_big["ranged"], out_dec["ranged"]):
            assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        nb = out_big["near"]
        assert near_client.register_buffer(nb.ctypes.data, nb.nbytes) == 0
        lookups = {
            "local": lambda lay, ids, out: local.lookup_into(lay, ids, out),
            "ranged": lambda lay, ids, out: ranged.lookup_into(lay, ids, out),
            "host_copy": lambda lay, ids, out: (hc_big if lay == 1 else hc_dec).lookup_into(
                ids, out
            ),
            "wheel": wheel,
            "near": lambda lay, ids, out: near.lookup_into(5, ids, out),
        }
        for lay, ids, outs in ((1, big_ids[0], out_big), (2, dec_ids[0], out_dec)):
            for name, out in outs.items():
                lookups[name](lay, ids, out)
            assert np.array_equal(outs["ranged"], outs["local"])
            assert np.array_equal(outs["host_copy"], outs["local"])
            assert np.array_equal(outs["wheel"], outs["local"])
            if "near" in outs:
                assert np.array_equal(outs["near"], outs["local"])
        print(
            "correctness: ranged store == near replica == host copy == wheel EngramStore == "
            "local, both layers"
        )

        # ---- [64, 256, 8] rows/s ----------------------------------------------------------
        rows = int(np.prod(BIG))
        k = [0]

        def big_arm(name: str):  # type: ignore[no-untyped-def]
            def run() -> float:
                k[0] += 1
                ids = big_ids[k[0] % len(big_ids)]
                t = time.perf_counter()
                lookups[name](1, ids, out_big[name])
                return rows / (time.perf_counter() - t)

            return run

        def best_of(fn, n: int):  # type: ignore[no-untyped-def]
            return lambda: statistics.median(fn() for _ in range(n))

        print(f"lookup_into {list(BIG)} x {ROW} B, rows/s per rep (median of 8 calls):")
        res = interleave(
            {"local": best_of(big_arm("local"), 8), "host_copy": best_of(big_arm("host_copy"), 8)},
            args.reps,
        )
        res["local_last"] = [best_of(big_arm("local"), 8)()]
        print(
            f"  baseline drift: local first {res['local'][0] / 1e6:.2f}M, last "
            f"{res['local_last'][0] / 1e6:.2f}M"
        )
        print(
            f"  ranged ({args.ranged_reps} single calls, each one get_into_ranges of {rows} ranges):"
        )
        calls0 = ranged.mooncake_layers.counters.calls
        res["ranged"] = []
        for r in range(args.ranged_reps):
            res["ranged"].append(big_arm("ranged")())
            print(f"    rep {r}: ranged={res['ranged'][-1] / 1e6:.4f}M")
        assert ranged.mooncake_layers.counters.calls - calls0 == args.ranged_reps
        print(f"  wheel EngramStore.lookup ({args.ranged_reps} single calls):")
        res["wheel"] = []
        for r in range(args.ranged_reps):
            res["wheel"].append(big_arm("wheel")())
            print(f"    rep {r}: wheel={res['wheel'][-1] / 1e6:.4f}M")
        print(
            f"  near (replica in the reader's own segment {near_host}, MC_STORE_MEMCPY=1; "
            f"{args.ranged_reps} single calls):"
        )
        res["near"] = []
        near_calls0 = near.mooncake_layers.counters.calls  # type: ignore[union-attr]
        for r in range(args.ranged_reps):
            res["near"].append(big_arm("near")())
            print(f"    rep {r}: near={res['near'][-1] / 1e6:.4f}M")
        assert near.mooncake_layers.counters.calls - near_calls0 == args.ranged_reps  # type: ignore[union-attr]
        report["lookup_64x256x8_rows_per_s"] = res

        # ---- [1, 1, 24] latency -----------------------------------------------------------
        def lat_arm(name: str, steps: int) -> list[float]:
            out = out_dec[name]
            fn = lookups[name]
            for i in range(200):
                fn(2, dec_ids[i % 256], out)
            ts = []
            for i in range(steps):
                t = time.perf_counter_ns()
                fn(2, dec_ids[i % 256], out)
                ts.append(time.perf_counter_ns() - t)
            return ts

        lat: dict[str, dict[str, list[float]]] = {}
        print(f"lookup_into {list(DECODE)} latency, us (p50 / p99):")
        for r in range(args.reps):
            order = ["local", "host_copy", "ranged", "wheel"]
            for name in order if r % 2 == 0 else order[::-1]:
                steps = args.ranged_steps if name in ("ranged", "wheel") else args.steps
                ts = np.asarray(lat_arm(name, steps)) / 1000
                d = lat.setdefault(name, {"p50": [], "p99": []})
                d["p50"].append(float(np.percentile(ts, 50)))
                d["p99"].append(float(np.percentile(ts, 99)))
            print(
                f"  rep {r}: "
                + "  ".join(f"{n}={lat[n]['p50'][-1]:.1f}/{lat[n]['p99'][-1]:.1f}" for n in order)
            )
        report["lookup_1x1x24_latency_us"] = lat

        # ---- proof, memory, ratios ---------------------------------------------------------
        proof = {
            "ranged_store_counters": ranged.mooncake_layers.counters.as_dict(),
            "near_store_counters": near.mooncake_layers.counters.as_dict(),  # type: ignore[union-attr]
            "near_replica_endpoints": near_replicas,
            "near_client": near_host,
            "host_copy_mode": [hc_big.mode, hc_dec.mode],
            "host_copy_get_into_ranges_calls": hc_big.counters.calls + hc_dec.counters.calls,
            "local_store_fetch_calls": local.layer_store(1).stats()["fetch_calls"],
            "host_copy_files": sorted(p.name for p in shm.glob("*.rows")),
            "wheel_lookup_failures_retried": wheel_failures[0],
        }
        report["proof"] = proof
        report["peak_rss_mb"] = {
            "probe": vm_hwm_mb(),
            "storage_host": rss_mb(cluster.storage.pid) if cluster.storage else None,
        }
        print(f"proof: {proof}")
        print(f"peak RSS MB: {report['peak_rss_mb']}")
        m = {n: median(v) for n, v in res.items()}
        p50 = {n: median(v["p50"]) for n, v in lat.items()}
        ratios = {
            "ranged_vs_local_rows_per_s": m["ranged"] / m["local"],
            "near_vs_local_rows_per_s": m["near"] / m["local"],
            "near_vs_ranged_rows_per_s": m["near"] / m["ranged"],
            "host_copy_vs_local_rows_per_s": m["host_copy"] / m["local"],
            "ranged_vs_wheel_rows_per_s": m["ranged"] / m["wheel"],
            "ranged_vs_local_p50": p50["ranged"] / p50["local"],
            "ranged_vs_wheel_p50": p50["ranged"] / p50["wheel"],
            "host_copy_vs_local_p50": p50["host_copy"] / p50["local"],
        }
        report["ratios"] = ratios
        report["medians"] = {"rows_per_s": m, "p50_us": p50}
        print(f"json: {write_json('mooncake', report)}")
        print(
            f"RATE  [64,256,8] local {m['local'] / 1e6:.2f}M  host_copy "
            f"{m['host_copy'] / 1e6:.2f}M  ranged {m['ranged'] / 1e6:.4f}M  near "
            f"{m['near'] / 1e6:.4f}M  wheel {m['wheel'] / 1e6:.4f}M rows/s"
        )
        print(
            f"P50   [1,1,24]   local {p50['local']:.1f}  host_copy {p50['host_copy']:.1f}  "
            f"ranged {p50['ranged']:.1f}  wheel {p50['wheel']:.1f} us"
        )
        print(
            f"RATIO ranged / wheel EngramStore: rows/s {ratios['ranged_vs_wheel_rows_per_s']:.2f}x, "
            f"p50 {ratios['ranged_vs_wheel_p50']:.2f}x"
        )
        print(
            f"RATIO ranged / local rows/s: {ratios['ranged_vs_local_rows_per_s']:.4f}x; "
            f"host_copy / local: {ratios['host_copy_vs_local_rows_per_s']:.2f}x; "
            f"p50 ranged / local: {ratios['ranged_vs_local_p50']:.1f}x; "
            f"host_copy / local: {ratios['host_copy_vs_local_p50']:.2f}x"
        )
        print(
            f"RATIO near (own-segment replica) / local rows/s: "
            f"{ratios['near_vs_local_rows_per_s']:.4f}x; near / ranged: "
            f"{ratios['near_vs_ranged_rows_per_s']:.2f}x"
        )
        db.close()
        db2.close()
    finally:
        if near_client is not None:
            near_client.close()
        if client is not None:
            client.close()
        cluster.stop()
        restore()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
