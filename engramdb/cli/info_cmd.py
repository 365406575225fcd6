from __future__ import annotations

import json
import sys

import click

from engramdb.build import drop_table
from engramdb.cli._common import echo_problems, library_errors, progress_bar, quiet_option
from engramdb.database import Database
from engramdb.disk.publish import gc, leftovers
from engramdb.units import format_bytes
from engramdb.verify import total_bytes, verify


@click.command("info")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and sizes as JSON.")
@click.option(
    "--memory",
    is_flag=True,
    help="Where each table's bytes live: page-cache residency (mincore), the page-cache "
    "budget and whether the table fits it (reads no data).",
)
@click.option(
    "--page-cache-budget",
    default=None,
    help="Budget to judge 'fits' by (default: "
    "MemAvailable minus a safety margin, or ENGRAMDB_PAGE_CACHE_BUDGET).",
)
@library_errors
def info_cmd(db: str, as_json: bool, memory: bool, page_cache_budget: str | None) -> None:
    """Describe the tables of database DB (reads only the manifest and shard sizes)."""
    if memory:
        _memory(db, as_json, page_cache_budget)
        return
    with Database(db) as d:
        doc = d.info()
        left = leftovers(d.path, d.manifest)
    doc["leftovers"] = [{"path": p, "bytes": n} for p, n in left]
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    click.echo(
        f"database {doc['path']} (generation {doc['generation']}, {len(doc['tables'])} table(s))"
    )
    for name, t in doc["tables"].items():
        heads = [h["rows"] for h in t["heads"]]
        att = t.get("attached")
        where = (
            f"attached to {len(att['files'])} source file(s), {len(att['columns'])} column(s)"
            if att
            else f"built, {len(t['shards'])} shard(s), {t['layout']['rows_per_badge']:,} rows/badge"
        )
        click.echo(
            f"  {name}: {t['n_rows']:,} rows x {t['row_bytes']} B = {format_bytes(t['bytes'])}, "
            f"{len(heads)} head(s), dtype {t['dtype']}, {where}"
        )
        if len(heads) <= 32:
            click.echo(f"    heads: {heads}")
        for f in (att or {}).get("files", [])[:16]:
            click.echo(f"    source: {f['path']} ({format_bytes(f['size'])})")

    if left:
        total = sum(n for _, n in left)
        click.echo(
            f"  leftovers of killed or finished writers: {len(left)}, {format_bytes(total)} "
            "(`engramdb gc` removes them)"
        )
        for path, n in left:
            click.echo(f"    {path} ({format_bytes(n)})")



def _memory(db: str, as_json: bool, budget: str | None) -> None:
    with Database(db, page_cache_budget=budget, background_warm=False) as d:
        docs = {name: d[name].memory() for name in d.tables}
    if as_json:
        click.echo(json.dumps(docs, indent=1))
        return
    for name, m in docs.items():
        n = max(1, m["table_bytes"])
        click.echo(
            f"{name}: {format_bytes(m['table_bytes'])}, page cache "
            f"{format_bytes(m['page_cache_resident_bytes'])} resident "
            f"({m['page_cache_resident_bytes'] / n:.1%}), budget "
            f"{format_bytes(m['page_cache_budget'])} ({'fits' if m['fits'] else 'does not fit'})"
        )
    click.echo(
        "  (RssFile / RssAnon and the RAM tier belong to the process that reads: "
        "Store.memory() there)"
    )


@click.command("gc")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@library_errors
def gc_cmd(db: str) -> None:
    """Remove what killed or finished writers left in DB (staging directories, replaced
    generations, temp files), under the writer lock; nothing the manifest names is touched."""
    removed = gc(db)
    total = sum(n for _, n in removed)
    for path, n in removed:
        click.echo(f"removed {path} ({format_bytes(n)})")
    click.echo(f"gc: removed {len(removed)} leftover(s), {format_bytes(total)}")


@click.command("verify")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--table", "-t", "tables", multiple=True, help="Only these tables (repeatable).")
@click.option(
    "--full", is_flag=True, help="Compare every view slot with Store-I (default: a sample)."
)
@quiet_option
@library_errors
def verify_cmd(db: str, tables: tuple[str, ...], full: bool, quiet: bool) -> None:
    """Recompute every shard checksum of DB and check its Store-P views (checksums, and
    slots against Store-I rows). Exit status 1 names each bad table, shard and byte range."""
    from engramdb.verify import verify_views, views_bytes

    names = list(tables) or None
    total = total_bytes(db, names) + views_bytes(db, names)
    with progress_bar(quiet, "verifying", total) as bar:
        problems = verify(db, tables=names, progress=bar.update)
        view_problems = verify_views(
            db,
            tables=names,
            full=full,
            progress=bar.update,
            notes=lambda m: click.echo(f"note: {m}", err=True),
        )
    if echo_problems([*problems, *view_problems]):
        sys.exit(1)
    click.echo("ok: every shard matches its manifest checksum; views match Store-I")


@click.command("drop")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--table", "-t", required=True, help="Table to remove.")
@library_errors
def drop_cmd(db: str, table: str) -> None:
    """Remove TABLE from DB (atomic manifest update, then its files)."""
    drop_table(db, table)
    click.echo(f"dropped table {table!r}")
