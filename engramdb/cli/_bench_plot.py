"""The figures of ``engramdb bench --plot``: matplotlib (the ``[plots]`` extra), Agg only."""

from __future__ import annotations

import os
from typing import Any

from engramdb.errors import InvalidArgument


def plot_bench(doc: dict[str, Any], path: str | os.PathLike[str]) -> int:
    """Draw the four panels of a `run_bench` document into ``path`` (PNG): rows/s vs batch
    size per backend, the latency CDF of a decode step, first-read convergence over time,
    cold vs warm. Returns the number of series drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise InvalidArgument("--plot needs matplotlib: pip install 'engramdb[plots]'") from None
    fig, ((a1, a2), (a3, a4)) = plt.subplots(2, 2, figsize=(12, 8.5), dpi=100)
    series = 0
    cfg = doc["config"]
    fig.suptitle(
        f"engramdb bench {doc['engramdb_version']}: {cfg['rows']:,} rows x {cfg['row_bytes']} B, "
        f"{doc['machine']['cpus']} CPUs{' (quick)' if cfg['quick'] else ''}"
    )
    backends = sorted({r["backend"] for r in doc["warm"]}, key=lambda b: (b != "np.take", b))
    for b in backends:
        pts = sorted((r["batch"], r["rows_per_s"]) for r in doc["warm"] if r["backend"] == b)
        style = "k--" if b == "np.take" else "-o"
        a1.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], style, label=b)
        series += 1
    if doc.get("serve"):
        pts = doc["serve"]["points"]
        a1.plot(
            [p["batch"] for p in pts],
            [p["rows_per_s"] / 1e6 for p in pts],
            "-s",
            label="serve (loopback)",
        )
        series += 1
    a1.set(
        xscale="log",
        yscale="log",
        xlabel="batch size (rows)",
        ylabel="M rows/s",
        title="warm gather: rows/s vs batch size",
    )
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)

    dec = doc["decode"]
    for key, label in (
        ("latencies_us", "Decoder.step (hash + gather)"),
        ("np_take_latencies_us", f"np.take of {dec['rows_per_step']} rows"),
    ):
        xs = dec[key]
        a2.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        series += 1
    a2.set(
        xscale="log",
        xlabel="latency (us)",
        ylabel="fraction of steps",
        title=f"decode step latency CDF ({dec['steps']:,} steps)",
    )
    a2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)

    conv = doc["convergence"]
    a3.plot(
        [p["t_s"] for p in conv],
        [p["rows_per_s"] / 1e6 for p in conv],
        "-",
        label="random batches of 4,096 rows",
    )
    warm_auto = [r["rows_per_s"] for r in doc["warm"] if r["backend"] == "auto"]
    if warm_auto:
        a3.axhline(max(warm_auto) / 1e6, color="gray", ls=":", label="warm (populated)")
    series += 1
    a3.set(
        xlabel="seconds since the table was evicted",
        ylabel="M rows/s",
        yscale="log",
        title="first-read convergence",
    )
    a3.legend(fontsize=8)
    a3.grid(alpha=0.3)

    cold = doc["cold"]
    bars = [
        ("cold\n(evicted)", cold["rows_per_s"]),
        ("warm\nauto", max(warm_auto) if warm_auto else 0.0),
    ]
    np_take = [r["rows_per_s"] for r in doc["warm"] if r["backend"] == "np.take"]
    if np_take:
        bars.append(("np.take\npopulated", max(np_take)))
    if cold.get("fio"):
        bars.append(("fio 4 KiB\nrandread IOPS", cold["fio"]["iops"]))
    a4.bar(
        [b[0] for b in bars],
        [b[1] / 1e6 for b in bars],
        color=["#c44", "#48c", "#888", "#4a4"][: len(bars)],
    )
    series += 1
    for i, (_, v) in enumerate(bars):
        a4.text(i, v / 1e6, f"{v / 1e6:.2f}", ha="center", va="bottom", fontsize=8)
    a4.set(ylabel="M rows/s", yscale="log", title="cold vs warm (random rows)")
    a4.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    plt.close(fig)
    return series
