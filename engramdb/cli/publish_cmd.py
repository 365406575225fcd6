from __future__ import annotations

import os

import click

from engramdb.cli._common import (
    aliased,
    deprecated_alias,
    echo_result,
    json_option,
    library_errors,
    progress_bar,
    quiet_option,
)
from engramdb.database import Database
from engramdb.integrations import mooncake
from engramdb.units import parse_size


@click.command("publish")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--mooncake", "master", required=True, help="Address of mooncake_master (HOST:PORT).")
@click.option(
    "--metadata",
    required=True,
    help="Metadata server URL (the master's own: http://HOST:8080/metadata).",
)
@click.option(
    "--table",
    "-t",
    "tables",
    multiple=True,
    help="Table to publish (repeatable). Default: every table.",
)
@click.option(
    "--publication",
    "name",
    default=None,
    help="Publication name in the store. Default: the database's directory name.",
)
@deprecated_alias("--name", "--publication", "publication")
@click.option(
    "--object-size",
    default=f"{mooncake.DEFAULT_OBJECT_BYTES >> 20}M",
    show_default=True,
    help="Largest store object; heads are split into objects of whole rows "
    "(an object must fit in one storage segment).",
)
@click.option(
    "--local-hostname",
    default=None,
    help="Address this client is reached at. Default: $MC_TCP_BIND_ADDRESS or the host's address.",
)
@click.option("--protocol", default="tcp", show_default=True, help="Transfer protocol (tcp, rdma).")
@click.option(
    "--view",
    "views",
    multiple=True,
    help="Store-P view to publish with its table (repeatable; it must hold one row per head). "
    "Default: every such view.",
)
@click.option("--no-views", is_flag=True, help="Publish the tables only, no views.")
@quiet_option
@click.option(
    "--connect-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds the master (and an HTTP metadata server) get to accept a connection.",
)
@click.option("--verbose", "-v", is_flag=True, help="Show the native Mooncake client's log.")
@json_option
@library_errors
def publish(
    db: str,
    master: str,
    metadata: str,
    tables: tuple[str, ...],
    name: str | None,
    object_size: str,
    local_hostname: str | None,
    protocol: str,
    views: tuple[str, ...],
    no_views: bool,
    quiet: bool,
    connect_timeout: float,
    verbose: bool,
    as_json: bool,
) -> None:
    """Publish tables of database DB into a Mooncake store so every host can read them.

    Streams each table head by head as store objects, then writes a manifest object
    (engramdb:PUBLICATION:manifest) that `engramdb.integrations.mooncake.open_mooncake` reads to
    discover the layout. Create-only: publishing a PUBLICATION twice is an error. Store-P
    views go along (records plus a row index) so readers can serve lookups in runs
    (open_mooncake(..., view=NAME)).

    \b
    Example: engramdb publish db/ --mooncake 127.0.0.1:50051 \\
      --metadata http://127.0.0.1:8080/metadata --publication prod
    """
    name = aliased(click.get_current_context(), "publication", name)
    if views and no_views:
        raise click.UsageError("--view and --no-views exclude each other")
    if verbose:  # the native log is quiet by default (GLOG_minloglevel=2)
        os.environ["GLOG_minloglevel"] = "0"
    with Database(db) as database:
        chosen = list(tables) or database.tables
        total = sum(
            database.manifest.tables[t].n_rows * database.manifest.tables[t].row_bytes
            for t in chosen
            if t in database
        )
        with progress_bar(quiet, f"publishing {len(chosen)} table(s)", total) as bar:
            summary = mooncake.publish(
                database,
                master=master,
                metadata=metadata,
                name=name,
                tables=chosen,
                object_bytes=parse_size(object_size),
                progress=bar.update,
                views=False if no_views else (list(views) or True),
                local_hostname=local_hostname,
                protocol=protocol,
                connect_timeout=connect_timeout,
            )
    echo_result(as_json, summary)
