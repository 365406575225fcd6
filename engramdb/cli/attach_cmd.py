"""``engramdb attach``: publish a table read in place from safetensors or raw row files."""

from __future__ import annotations

import json
import os

import click

from engramdb.build.attach import attach, preset_tables
from engramdb.cli._common import (
    as_record,
    force_option,
    int_list,
    json_option,
    library_errors,
    progress_bar,
    quiet_option,
)
from engramdb.cli._progress import wait_for_writer
from engramdb.units import format_bytes


@click.command("attach")
@click.argument("db", type=click.Path(file_okay=False))
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--table", "-t", default=None, help="Table name (not with --preset).")
@click.option(
    "--tensor",
    "tensors",
    multiple=True,
    help="Glob of row tensors (repeatable); "
    "matches are concatenated along rows in numeric-aware name order.",
)
@click.option(
    "--scale-tensor",
    default=None,
    help="Glob of a second column appended to each "
    "row (same row count), or a scalar scale recorded as metadata.",
)
@click.option(
    "--preset",
    default=None,
    help="Keygen preset: tables, tensor names and heads "
    "(config.json beside FILES overrides its fields).",
)
@click.option(
    "--row-bytes",
    "-r",
    type=click.IntRange(min=1),
    default=None,
    help="Row bytes of raw row files.",
)
@click.option(
    "--rows-per-shard",
    type=int,
    default=None,
    help="Rows of each raw shard file but the last (checked).",
)
@click.option("--heads", default=None, help="Rows per head, comma-separated.")
@click.option("--dtype", default=None, help="Dtype hint (default from the tensors).")
@click.option("--checksum", is_flag=True, help="Also hash every 64 MiB block of every file.")
@force_option
@quiet_option
@json_option
@library_errors
def attach_cmd(
    db: str,
    files: tuple[str, ...],
    table: str | None,
    tensors: tuple[str, ...],
    scale_tensor: str | None,
    preset: str | None,
    row_bytes: int | None,
    rows_per_shard: int | None,
    heads: str | None,
    dtype: str | None,
    checksum: bool,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Attach table(s) of DB to FILES in place: writes only the manifest, copies no row.

    FILES are .safetensors files, raw row files, or directories of shard_NNN.bin files.

    \b
    Example: engramdb attach db/ model.safetensors --table ple --tensor '*per_layer*'
    """
    if preset is not None:
        if table or tensors or scale_tensor or heads:
            raise click.BadParameter("--preset fills --table/--tensor/--scale-tensor/--heads")
        jobs = preset_tables(preset, list(files))
    else:
        if table is None:
            raise click.BadParameter("--table is required without --preset")
        jobs = [
            {
                "table": table,
                "tensor": list(tensors) or None,
                "scale_tensor": scale_tensor,
                "heads": int_list(heads),
            }
        ]
    total = sum(os.stat(f).st_size for f in files) if checksum else 0
    wait_for_writer(db, quiet)
    done = []
    with progress_bar(quiet or not checksum, "hashing", total) as bar:
        for job in jobs:
            s = attach(
                db,
                job["table"],
                list(files),
                tensor=job["tensor"],
                scale_tensor=job["scale_tensor"],
                heads=job["heads"],
                row_bytes=row_bytes,
                rows_per_shard=rows_per_shard,
                dtype=dtype,
                checksum=checksum,
                force=force,
                progress=bar.update,
            )
            done.append(s)
            if as_json:
                continue
            click.echo(
                f"attached {s.table}: {s.rows:,} rows x {s.row_bytes} B = "
                f"{format_bytes(s.rows * s.row_bytes)} in place from {s.files} file(s) "
                f"in {s.seconds * 1e3:.1f} ms"
            )
    if as_json:
        click.echo(json.dumps(as_record(done if len(done) != 1 else done[0]), indent=1))
