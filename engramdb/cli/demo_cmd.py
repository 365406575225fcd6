from __future__ import annotations

import click

from engramdb.cli._common import library_errors
from engramdb.demo import run_demo


@click.command("demo")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--seconds", default=2.0, show_default=True, help="Time spent per measurement.")
@library_errors
def demo_cmd(directory: str | None, seconds: float) -> None:
    """Build a ~150 MB PLE-like demo database in DIRECTORY (default: under the system temp
    dir), run batched lookups, and print the measured rows/s and the next commands."""
    run_demo(directory, click.echo, seconds=seconds)
