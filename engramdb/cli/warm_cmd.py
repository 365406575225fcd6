from __future__ import annotations

import json

import click

from engramdb.cli._common import (
    as_record,
    echo_result,
    echo_summaries,
    json_option,
    library_errors,
    progress_bar,
    quiet_option,
)
from engramdb.database import Database
from engramdb.errors import InvalidArgument
from engramdb.units import format_bytes, parse_size
from engramdb.warm import hold, residency, warm_hot, warm_tables, warm_view


@click.command("warm")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--table", "-t", "tables", multiple=True, help="Only these tables (repeatable).")
@click.option("--view", "view", default=None, help="Warm this Store-P view of --table instead.")
@click.option("--threads", default=4, show_default=True, help="Background populate threads.")
@click.option(
    "--hot",
    is_flag=True,
    help="Pin the hot set from `engramdb index` in the RAM tier instead (needs --ram-budget).",
)
@click.option("--ram-budget", default=None, help="RAM tier size per table, e.g. 8G (with --hot).")
@click.option("--check", is_flag=True, help="Only report page-cache residency; read nothing.")
@click.option(
    "--lock",
    is_flag=True,
    help="Then mlock the tables (within --lock-budget) and hold them until interrupted.",
)
@click.option("--lock-budget", default=None, help="Most bytes to mlock, e.g. 8G (with --lock).")
@click.option(
    "--watch",
    is_flag=True,
    help="Then stay and re-warm (at a bounded rate) whenever residency drops.",
)
@click.option(
    "--seconds",
    type=float,
    default=None,
    help="Hold for this long (--lock/--watch; default: until interrupted).",
)
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Hash each warmed table's 64 MiB blocks against the manifest (ChecksumMismatch).",
)
@quiet_option
@json_option
@library_errors
def warm_cmd(
    db: str,
    tables: tuple[str, ...],
    view: str | None,
    threads: int,
    hot: bool,
    ram_budget: str | None,
    check: bool,
    lock: bool,
    lock_budget: str | None,
    watch: bool,
    seconds: float | None,
    verify: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Load tables of DB into the page cache at device speed (MADV_POPULATE_READ from
    background threads), or a Store-P view with --table T --view V, or with --hot
    --ram-budget B pin each table's hot set in a RAM tier of B bytes, or with --check report
    how much of each is resident. --lock / --watch then keep the tables resident while the
    command runs (mlock within --lock-budget; re-warm after residency loss).

    \b
    Example: engramdb warm db/ --table ple --check
    """
    if lock_budget is not None and not lock:
        raise InvalidArgument("--lock-budget applies to --lock")
    if (lock or watch) and (hot or check or view is not None):
        raise InvalidArgument(
            "--lock/--watch hold tables in the page cache: drop --hot/--check/--view"
        )
    if hot and ram_budget is None:
        raise InvalidArgument("--hot needs --ram-budget (the size of the RAM tier)")
    if ram_budget is not None and not hot:
        raise InvalidArgument("--ram-budget applies to --hot (the page cache has no budget)")
    if hot and check:
        raise InvalidArgument("--check reports page-cache residency; drop --hot")
    if view is not None and (hot or len(tables) != 1):
        raise InvalidArgument("--view needs exactly one --table (and no --hot)")
    with Database(db, ram_budget=ram_budget) as d:
        names = list(tables) or d.tables
        if view is not None:
            v = d[names[0]].view(view)
            if check:
                _echo_residency(as_json, {f"{names[0]}/{view}": (v.residency(), v.nbytes)})
            else:
                echo_result(as_json, warm_view(d, names[0], view, threads=threads))
            return
        if check:
            fracs = residency(d, names)
            _echo_residency(as_json, {n: (fracs[n], d[n].nbytes) for n in names})
            return
        if hot:
            echo_result(as_json, warm_hot(d, names))
            return
        total = sum(d[n].nbytes for n in names)
        one = d[names[0]].row_bytes if len(names) == 1 else None
        with progress_bar(quiet, "warming", total, row_bytes=one) as bar:
            summaries = warm_tables(d, names, threads=threads, progress=bar.update, verify=verify)
        if as_json and not (lock or watch):
            echo_result(True, summaries)
            return
        echo_summaries(summaries)
        if lock or watch:
            budget = parse_size(lock_budget) if lock_budget is not None else None
            click.echo("holding (Ctrl-C to stop)" if seconds is None else f"holding {seconds} s")
            try:
                held = hold(d, names, lock=lock, lock_budget=budget, watch=watch, seconds=seconds)
            except KeyboardInterrupt:
                return
            echo_summaries(held)


def _echo_residency(as_json: bool, rows: dict[str, tuple[float, int]]) -> None:
    """``--check``: each table's (or view's) resident fraction and size."""
    if as_json:
        click.echo(
            json.dumps(
                as_record({k: {"resident": f, "bytes": n} for k, (f, n) in rows.items()}),
                indent=1,
            )
        )
        return
    for name, (frac, n) in rows.items():
        click.echo(f"{name}: {frac:.1%} resident ({format_bytes(n)})")
