"""``engramdb serve``: one call to `engramdb.serve.Server.serve_forever`."""

from __future__ import annotations

import sys
from typing import Any

import click

from engramdb.cli._common import backend_option, library_errors, shown_option
from engramdb.errors import InvalidArgument
from engramdb.serve.auth import load_token, token_file_is_private
from engramdb.serve.context import Limits
from engramdb.serve.lane import DEFAULT_SPIN_US
from engramdb.serve.protocol import DEFAULT_PORT
from engramdb.serve.server import Server
from engramdb.units import parse_size

_D = Limits()


def _limit(flag: str, help: str) -> Any:  # noqa: A002
    """An option for the `Limits` field named like ``flag``: its default and type."""
    default = getattr(_D, flag[2:].replace("-", "_"))
    return shown_option(flag, default, help, type(default))


@click.command("serve")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default=None, help="TCP address to bind. Default 127.0.0.1 (loopback).")
@click.option(
    "--port",
    type=int,
    default=None,
    help=f"TCP port. Default {DEFAULT_PORT}; 0 picks a free port.",
)
@click.option(
    "--unix",
    "unix_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Listen on this Unix socket. Alone it replaces TCP; with --host/--port it adds to it.",
)
@shown_option("--unix-mode", "600", "Octal permissions of the Unix socket file.")
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Require `Authorization: Bearer <token>` with the token in this file.",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Allow a non-loopback bind without a token (trusted networks only).",
)
@click.option(
    "--ram-budget",
    default=None,
    help="RAM tier size per table, e.g. 8G.",
)
@backend_option("Reader backend (auto picks by table size and residency).")
@click.option(
    "--populate",
    is_flag=True,
    help="Fault every table into memory before accepting (warm start; seconds per GB).",
)
@_limit("--max-rows", "Ids per request.")
@shown_option("--max-body", "16M", "Request body bytes.")
@shown_option("--max-response", "256M", "Response body bytes.")
@_limit("--max-connections", "Open connections; more are refused with a 503.")
@_limit("--idle-timeout", "Seconds before an idle keep-alive connection is closed.")
@_limit(
    "--header-timeout",
    "Seconds a request head / wire frame header may take once begun, and a new "
    "connection to complete its first request or HELLO (bytes do not extend it).",
)
@_limit(
    "--max-connections-per-peer",
    "Open connections of one TCP peer address; more are refused with a 503.",
)
@shown_option("--grace", 10.0, "Seconds in-flight requests get to finish after SIGTERM.", float)
@shown_option(
    "--wire/--no-wire",
    default=True,
    help="Also speak the binary wire protocol (row reads without HTTP) on every listener.",
)
@shown_option(
    "--spin-us",
    type=float,
    default=DEFAULT_SPIN_US,
    help="Microseconds the wire-protocol thread keeps polling after each burst of work "
    "(0: sleep at once; trades idle CPU for latency).",
)
@library_errors
def serve(
    db: str,
    host: str | None,
    port: int | None,
    unix_path: str | None,
    unix_mode: str,
    token_file: str | None,
    insecure: bool,
    ram_budget: str | None,
    backend: str,
    populate: bool,
    max_rows: int,
    max_body: str,
    max_response: str,
    max_connections: int,
    idle_timeout: float,
    header_timeout: float,
    max_connections_per_peer: int,
    grace: float,
    wire: bool,
    spin_us: float,
) -> None:
    """Serve every table of DB over HTTP (binary, JSON and Arrow fetches) and the binary
    wire protocol (docs/serve.md).

    Opens DB read-only. Stops on SIGTERM / Ctrl-C after in-flight requests finish.

    \b
    Example: engramdb serve db/ --port 7070 --token-file token.txt
    """
    token = None
    if token_file is not None:
        token = load_token(token_file)
        if not token_file_is_private(token_file):
            click.echo(f"warning: token file {token_file} is readable by group or others", err=True)
    tcp = unix_path is None or host is not None or port is not None
    try:
        mode = int(unix_mode, 8)
    except ValueError:
        raise InvalidArgument(
            f"--unix-mode must be octal like 600 or 660, got {unix_mode!r}"
        ) from None
    limits = Limits(
        max_rows=max_rows,
        max_body_bytes=parse_size(max_body),
        max_response_bytes=parse_size(max_response),
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        header_timeout=header_timeout,
        max_connections_per_peer=max_connections_per_peer,
    )
    server = Server(
        db,
        host=host or "127.0.0.1",
        port=(DEFAULT_PORT if port is None else port) if tcp else None,
        unix=unix_path,
        unix_mode=mode,
        token=token,
        insecure=insecure,
        limits=limits,
        backend=backend,
        wire=wire,
        spin_us=spin_us,
        ram_budget=None if ram_budget is None else parse_size(ram_budget),
        grace=grace,
        populate=populate,
    )

    def ready(s: Server) -> None:
        auth = "token required" if token is not None else "no token"
        click.echo(
            f"serving {db} ({len(s.db.tables)} table(s)) on {', '.join(s.urls)} ({auth}); "
            "SIGTERM or Ctrl-C stops"
        )
        sys.stdout.flush()

    server.serve_forever(on_ready=ready)
    total = sum(server.metrics.requests.values())
    click.echo(f"stopped after {total:,} request(s)")


serve_cmd = serve  # the name the other command modules use
