from __future__ import annotations

import click

from engramdb.build import build
from engramdb.cli._common import (
    echo_result,
    force_option,
    int_list,
    json_option,
    library_errors,
    progress_bar,
    quiet_option,
)
from engramdb.cli._progress import wait_for_writer
from engramdb.sources import resolve_sources
from engramdb.units import parse_size


@click.command("build")
@click.argument("db", type=click.Path(file_okay=False))
@click.argument("sources", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--table", "-t", required=True, help="Table name ([A-Za-z0-9_.-]).")
@click.option("--row-bytes", "-r", type=click.IntRange(min=1), default=None, help="Bytes per row.")
@click.option(
    "--from-attached",
    is_flag=True,
    help="Materialize attached table TABLE of DB as a built (compact) copy; no SOURCES.",
)
@click.option(
    "--into",
    default=None,
    help="With --from-attached: the database to build in (default DB, replacing the entry).",
)
@click.option(
    "--heads",
    default=None,
    help="Rows per head, comma-separated (N0,N1,...): split the concatenated sources. "
    "Default: one head per source.",
)
@click.option(
    "--tensor",
    default=None,
    help="Glob of safetensors tensor names to take across all SOURCES, concatenated "
    "in numeric-aware name order.",
)
@click.option(
    "--dtype",
    default="u8",
    show_default=True,
    help="Dtype hint recorded in the manifest (e.g. fp8_e4m3, fp8_e4m3+ue8m0, bf16).",
)
@click.option("--dim", type=int, default=None, help="Values per row (hint for decoders).")
@click.option(
    "--preset",
    default=None,
    help="Keygen preset whose table this is (e.g. qwen3.8-flash-next): derives --heads, the "
    "pad head included, and the row format (--row-bytes, --dtype, --dim).",
)
@click.option(
    "--scale",
    type=click.Choice(["full", "small", "tiny"]),
    default=None,
    help="With --preset: the preset's algorithm with 100x (small) / 1,000x (tiny) smaller "
    "tables. Its row ids are NOT the checkpoint's (docs/keygen.md).",
)
@click.option(
    "--layer", type=int, default=None, help="With --preset: the layer whose table this is."
)
@click.option(
    "--synthetic",
    type=int,
    default=None,
    metavar="SEED",
    help="Fill the table with deterministic random rows from SEED instead of SOURCES "
    "(for trying and benchmarking without a checkpoint).",
)
@click.option("--shard-size", default="1G", show_default=True, help="Target shard size.")
@force_option
@click.option(
    "--warm",
    is_flag=True,
    help="After publishing, read the table into the page cache (for reading right away).",
)
@quiet_option
@json_option
@library_errors
def build_cmd(
    db: str,
    sources: tuple[str, ...],
    table: str,
    row_bytes: int | None,
    from_attached: bool,
    into: str | None,
    heads: str | None,
    tensor: str | None,
    dtype: str,
    dim: int | None,
    preset: str | None,
    scale: str | None,
    layer: int | None,
    synthetic: int | None,
    shard_size: str,
    force: bool,
    warm: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Build table TABLE of database DB from SOURCES (.npy, raw .bin, .safetensors).

    Streams with bounded memory and publishes atomically: a failed or killed build leaves
    the previous database exactly as it was. The build writes with O_DIRECT, so the new
    table is not in the page cache; --warm reads it in after publishing.

    \b
    Example: engramdb build DB --table ple --preset qwen3.8-flash-next --scale tiny --synthetic 1
    """
    if from_attached:
        from engramdb.build.attach import materialize

        if sources:
            raise click.BadParameter("--from-attached takes no SOURCES")
        wait_for_writer(db, quiet)
        echo_result(as_json, materialize(db, table, into))
        return
    if synthetic is not None and sources:
        raise click.BadParameter("--synthetic takes no SOURCES")
    if (not sources and synthetic is None) or (row_bytes is None and preset is None):
        raise click.BadParameter(
            "SOURCES (or --synthetic SEED) and --row-bytes (or --preset) are required "
            "(or --from-attached)"
        )
    if preset is not None:
        from engramdb.build.table import preset_layout

        layout = preset_layout(preset, scale=scale, layer=layer)
        row_bytes = row_bytes or layout["row_bytes"]
        rows_total = sum(layout["heads"])
    else:
        rows_total = sum(int_list(heads) or [])
    if row_bytes is None:
        raise click.BadParameter(f"preset {preset!r} has no fixed row format: give --row-bytes")
    if synthetic is not None:
        total = rows_total * row_bytes
    else:
        total = sum(s.nbytes for g in resolve_sources(sources, row_bytes, tensor=tensor) for s in g)
    wait_for_writer(db, quiet)  # a wait for another writer is said, and not timed as build
    with progress_bar(quiet, f"building {table}", total, row_bytes=row_bytes) as bar:
        summary = build(
            db,
            table,
            row_bytes,
            list(sources),
            heads=int_list(heads),
            tensor=tensor,
            dtype=dtype,
            dim=dim,
            force=force,
            shard_bytes=parse_size(shard_size),
            progress=bar.update,
            synthetic=synthetic,
            preset=preset,
            scale=scale,
            layer=layer,
        )
    results: list[object] = [summary]
    if warm:
        from engramdb.database import Database
        from engramdb.warm import warm_tables

        with Database(db, background_warm=False) as d:
            results += warm_tables(d, [table])
    echo_result(as_json, results if warm else summary)
