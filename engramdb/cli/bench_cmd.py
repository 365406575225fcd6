"""``engramdb bench``: the probes a user cares about, at a small size, on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import click

from engramdb.cli._common import library_errors


@click.command("bench")
@click.option(
    "--quick", is_flag=True, help="Smallest settings (a 63 MiB table, well under a minute)."
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the figures as JSON to this file ('-': stdout, no table).",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw the figures into this PNG (needs matplotlib: the [plots] extra).",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Work directory (default: a temp dir, removed at the end).",
)
@click.option("--no-serve", is_flag=True, help="Skip the serve round trip.")
@library_errors
def bench_cmd(
    quick: bool,
    json_path: Path | None,
    plot_path: Path | None,
    directory: Path | None,
    no_serve: bool,
) -> None:
    """Measure this machine: warm gathers per backend and batch size against np.take(out=)
    on a populated mapping, cold reads (against fio when it is installed), first-read
    convergence, decode steps, corpus streaming, a Store-P view and a serve round trip;
    print the ratios, optionally write JSON (--json) and a PNG (--plot).

    \b
    Example: engramdb bench --quick --json bench.json --plot bench.png
    """
    from engramdb.cli._bench_suite import run_bench

    to_stdout = json_path is not None and str(json_path) == "-"
    echo = (lambda _m: None) if to_stdout else click.echo
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException(
                "--plot needs matplotlib: pip install 'engramdb[plots]'"
            ) from None
    doc = run_bench(directory, quick=quick, echo=echo, serve=not no_serve)
    if not to_stdout:
        click.echo(f"{'ratio':>8}  figure")
        for r in doc["ratios"]:
            click.echo(f"{r['ratio']:>7.2f}x  {r['name']} (baseline: {r['baseline_name']})")
    text = json.dumps(doc, indent=1, allow_nan=False, default=_nan_safe)
    if to_stdout:
        click.echo(text)
    elif json_path is not None:
        json_path.write_text(text + "\n")
        click.echo(f"wrote {json_path}")
    if plot_path is not None:
        from engramdb.cli._bench_plot import plot_bench

        n = plot_bench(doc, plot_path)
        if not to_stdout:
            click.echo(f"wrote {plot_path} ({n} series in 4 panels)")
    if not to_stdout:
        click.echo(f"bench took {doc['seconds']:.1f} s")


def _nan_safe(value: object) -> object:
    return str(value)
