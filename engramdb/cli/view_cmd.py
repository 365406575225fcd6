"""``engramdb view build|bench|lat``: Store-P views, one library call per command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from engramdb.build.view import build_view
from engramdb.cli._common import (
    LazyBar,
    aliased,
    deprecated_alias,
    echo_result,
    file_option,
    json_option,
    library_errors,
    quiet_option,
)
from engramdb.cli._progress import wait_for_writer
from engramdb.cli.bench import measure_latency, measure_throughput
from engramdb.io.select import BACKENDS
from engramdb.keygen import PRESETS
from engramdb.view import View


def _view_options(fn: Any) -> Any:
    fn = deprecated_alias("--name", "--view", "view")(fn)
    fn = click.option("--view", "-n", "name", default=None, help="View name (required).")(fn)
    fn = click.option("--table", "-t", required=True, help="Table the view belongs to.")(fn)
    return click.argument("db", type=click.Path(exists=True, file_okay=False, path_type=Path))(fn)


def _view_name(name: str | None) -> str:
    value = aliased(click.get_current_context(), "view", name)
    if not value:
        raise click.UsageError("Missing option '--view' (the view's name).")
    return str(value)


@click.group("view")
def view_group() -> None:
    """Store-P materialized views: one fixed-size record per n-gram key, in access order.

    \b
    Example: engramdb view build db/ --table ple --view hot --from-index
    """


@view_group.command("build")
@_view_options
@file_option("--keys", "keys_file", "int64 [K, max_ngram] .npy of keys in access order.")
@file_option(
    "--counts", "counts_file", "With --keys: [K] .npy of key counts (ranks keys for --disk-budget)."
)
@click.option(
    "--from-index", is_flag=True, help="Use the keys and counts of `engramdb index` for T."
)
@file_option(
    "--rows", "rows_file", "int64 [K, H] .npy of global row ids: record i = the rows of line i."
)
@click.option(
    "--preset",
    "preset_name",
    type=click.Choice(sorted(PRESETS)),
    help="Keygen preset (default with --from-index: the index's).",
)
@click.option("--layer", type=int, help="Model layer of the table (presets with several).")
@click.option(
    "--disk-budget", help="Cap on view + key index bytes (e.g. 20G): keeps the most frequent keys."
)
@click.option(
    "--slot-bytes",
    type=click.IntRange(min=1),
    help="Slot size (default: the record size); larger pads each slot with zeros.",
)
@click.option("--force", is_flag=True, help="Replace an existing view of that name.")
@quiet_option
@json_option
@library_errors
def build_cmd(
    db: Path,
    table: str,
    name: str | None,
    keys_file: Path | None,
    counts_file: Path | None,
    from_index: bool,
    rows_file: Path | None,
    preset_name: str | None,
    layer: int | None,
    disk_budget: str | None,
    slot_bytes: int | None,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Build view --view V of table T in database DB from keys (--keys / --from-index) or
    explicit row ids (--rows), gathering every record from Store-I, and publish it
    atomically. Ends with a one-line summary.

    \b
    Example: engramdb view build db/ --table ple --view hot --from-index --disk-budget 1G
    """
    name = _view_name(name)
    wait_for_writer(db, quiet)
    with LazyBar(quiet, "gathering", unit="records") as bar:
        summary = build_view(
            db,
            table=table,
            name=name,
            keys=keys_file,
            counts=counts_file,
            from_index=from_index,
            rows=rows_file,
            hasher=preset_name,
            layer=layer,
            disk_budget=disk_budget,
            slot_bytes=slot_bytes,
            force=force,
            progress=bar,
        )
    echo_result(as_json, summary)


@view_group.command("bench")
@_view_options
@click.option(
    "--order",
    type=click.Choice(["access", "random", "both"]),
    default="both",
    show_default=True,
    help="Consecutive slots (corpus replay) or a random permutation.",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=16384,
    show_default=True,
    help="Records per View.read_records call.",
)
@click.option("--cold", is_flag=True, help="Evict the view first and read each record once.")
@click.option(
    "--records",
    type=click.IntRange(min=1),
    help="Records per pass (default: all; cold at most 262,144).",
)
@click.option("--seconds", type=float, default=1.0, show_default=True, help="Warm: time per order.")
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    show_default=True,
    help="Reader of the view's records.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@library_errors
def bench_cmd(
    db: Path,
    table: str,
    name: str | None,
    order: str,
    batch: int,
    cold: bool,
    records: int | None,
    seconds: float,
    backend: str,
    as_json: bool,
) -> None:
    """Throughput of View.read_records: records/s, MB/s and bytes amplification (bytes asked
    of the mapping/backend and bytes read from the device, per byte returned).

    \b
    Example: engramdb view bench db/ --table ple --view hot --order random --seconds 2
    """
    name = _view_name(name)
    orders = ["access", "random"] if order == "both" else [order]
    with View(db, table=table, name=name, backend=backend) as view:
        results = [
            measure_throughput(
                view, order=o, batch=batch, cold=cold, records=records, seconds=seconds
            )
            for o in orders
        ]
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in results], indent=1))
        return
    for r in results:
        click.echo(r.line())
    if len(results) == 2 and results[1].records_per_s > 0:
        ratio = results[0].records_per_s / results[1].records_per_s
        click.echo(f"access / random order: {ratio:.2f}x")


@view_group.command("lat")
@_view_options
@click.option("--warm/--cold", default=True, show_default=True, help="Populated or evicted.")
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Single-record reads to time.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@library_errors
def lat_cmd(db: Path, table: str, name: str | None, warm: bool, steps: int, as_json: bool) -> None:
    """Latency of single View.read_record calls on random records: p50 / p99 in us.

    \b
    Example: engramdb view lat db/ --table ple --view hot --steps 20000
    """
    name = _view_name(name)
    with View(db, table=table, name=name, backend="mmap") as view:
        result = measure_latency(view, steps=steps, cold=not warm)
    click.echo(json.dumps(result.as_dict(), indent=1) if as_json else result.line())


view = view_group
