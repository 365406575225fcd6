from __future__ import annotations

import sys

import click

from engramdb.cli._common import library_errors
from engramdb.database import Database
from engramdb.warm import residency, warm_tables


@click.command("warm")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--table", "-t", "tables", multiple=True, help="Only these tables (repeatable).")
@click.option("--threads", default=4, show_default=True, help="Background populate threads.")
@click.option("--check", is_flag=True, help="Only report page-cache residency; read nothing.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@library_errors
def warm_cmd(db: str, tables: tuple[str, ...], threads: int, check: bool, quiet: bool) -> None:
    """Load tables of DB into the page cache at device speed (MADV_POPULATE_READ from
    background threads), or with --check report how much of each is resident."""
    with Database(db) as d:
        names = list(tables) or d.tables
        if check:
            for name, frac in residency(d, names).items():
                click.echo(f"{name}: {frac:.1%} resident ({d[name].nbytes / 1e9:.2f} GB)")
            return
        total = sum(d[n].nbytes for n in names)
        with click.progressbar(length=total, label="warming", hidden=quiet, file=sys.stderr) as bar:
            summaries = warm_tables(d, names, threads=threads, progress=bar.update)
    for s in summaries:
        click.echo(s.line())
