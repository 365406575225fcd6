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
@click.option(
    "--row-bytes", "-r", type=click.IntRange(min=1), default=None, help="Bytes per row."
)
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
    Example: engramdb build db/ emb.npy --table ple --row-bytes 256
    """
    if from_attached:
        from engramdb.build.attach import materialize

        if sources:
            raise click.BadParameter("--from-attached takes no SOURCES")
        wait_for_writer(db, quiet)
        echo_result(as_json, materialize(db, table, into))
        return
    if not sources or row_bytes is None:
        raise click.BadParameter("SOURCES and --row-bytes are required (or --from-attached)")
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
        )
    results: list[object] = [summary]
    if warm:
        from engramdb.database import Database
        from engramdb.warm import warm_tables

        with Database(db, background_warm=False) as d:
            results += warm_tables(d, [table])
    echo_result(as_json, results if warm else summary)
