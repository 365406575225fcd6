from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from engramdb.build import drop_table
from engramdb.cli._common import (
    echo_problems,
    json_option,
    library_errors,
    progress_bar,
    quiet_option,
)
from engramdb.cli._progress import json_ready, wait_for_writer
from engramdb.database import Database
from engramdb.disk.publish import gc, leftovers
from engramdb.errors import EngramDBError
from engramdb.read.index import read_index_meta
from engramdb.units import format_bytes, format_rate, per_second
from engramdb.verify import total_bytes, verify


@click.command("info")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the manifest, sizes, index and residency as JSON.",
)
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
    """Describe the tables of database DB: rows, heads, built or attached, Store-P views,
    the `engramdb index` output, page-cache residency and leftovers of killed writers
    (reads the manifest, the index.json files and mincore; no row data).

    \b
    Example: engramdb info db/ --json
    """
    if memory:
        _memory(db, as_json, page_cache_budget)
        return
    with Database(db, background_warm=False) as d:
        doc = d.info()
        raw = doc.get("kind") == "raw-shards"
        left = [] if raw else leftovers(d.path, d.manifest)
        for name, t in doc["tables"].items():
            if raw:
                continue
            t["index"] = _index_summary(d.path, name)
            try:
                t["resident"] = d[name].residency()
            except EngramDBError:  # a source file gone: say so, do not fail the listing
                t["resident"] = None
    doc["leftovers"] = [{"path": p, "bytes": n} for p, n in left]
    if as_json:
        click.echo(json.dumps(json_ready(doc), indent=1))
        return
    if raw:
        click.echo(f"directory of raw-shard tables {doc['path']}: {', '.join(doc['tables'])}")
        return
    click.echo(
        f"database {doc['path']} (generation {doc['generation']}, {len(doc['tables'])} table(s))"
    )
    for name, t in doc["tables"].items():
        _echo_table(name, t)
    if left:
        total = sum(n for _, n in left)
        click.echo(
            f"  leftovers of killed or finished writers: {len(left)}, {format_bytes(total)} "
            "(`engramdb gc` removes them)"
        )
        for path, n in left:
            click.echo(f"    {path} ({format_bytes(n)})")
    else:
        click.echo("  leftovers: none")


def _index_summary(db: Path, table: str) -> dict[str, Any] | None:
    try:
        meta = read_index_meta(db, table)
    except EngramDBError as e:
        return {"error": str(e)}
    if meta is None:
        return None
    corpus = meta.get("corpus") or {}
    return {
        "preset": meta.get("preset"),
        "layer": meta.get("layer"),
        "tokens": corpus.get("tokens"),
        "distinct_keys": meta.get("distinct_keys"),
        "distinct_rows": meta.get("distinct_rows"),
        "hot_rows": (meta.get("hot") or {}).get("rows"),
    }


def _echo_table(name: str, t: dict[str, Any]) -> None:
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
    res = t.get("resident")
    click.echo(
        "    page cache: "
        + ("unknown" if res is None else f"{res:.1%} resident")
        + " (`engramdb warm` loads it)"
    )
    ix = t.get("index")
    if ix is None:
        click.echo("    index: none (`engramdb index DB CORPUS --preset P`)")
    elif "error" in ix:
        click.echo(f"    index: unreadable ({ix['error']})")
    else:
        click.echo(
            f"    index: preset {ix['preset']} layer {ix['layer']}, {ix['tokens']:,} tokens, "
            f"{ix['distinct_keys']:,} keys, {ix['distinct_rows']:,} rows touched, "
            f"hot set {ix['hot_rows']:,} rows"
        )
    views = (t.get("extra") or {}).get("views") or t.get("views") or {}
    if not views:
        click.echo("    views: none")
    for vname, v in sorted(views.items()):
        size = sum(
            int(f.get("bytes", 0)) for f in (v.get("data"), v.get("index"), v.get("rows")) if f
        )
        click.echo(
            f"    view {vname}: {int(v.get('slots', 0)):,} records x {v.get('record_bytes')} B "
            f"({v.get('source')}), {format_bytes(size)}"
        )


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
@json_option
@library_errors
def gc_cmd(db: str, as_json: bool) -> None:
    """Remove what killed or finished writers left in DB (staging directories, replaced
    generations, temp files), under the writer lock; nothing the manifest names is touched.

    \b
    Example: engramdb gc db/
    """
    wait_for_writer(db, as_json)
    removed = gc(db)
    total = sum(n for _, n in removed)
    if as_json:
        doc = {"removed": [{"path": p, "bytes": n} for p, n in removed], "bytes": total}
        click.echo(json.dumps(json_ready(doc), indent=1))
        return
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
@json_option
@library_errors
def verify_cmd(db: str, tables: tuple[str, ...], full: bool, quiet: bool, as_json: bool) -> None:
    """Recompute every shard checksum of DB and check its Store-P views (checksums, and
    slots against Store-I rows). Exit status 1 names each bad table, shard and byte range.

    \b
    Example: engramdb verify db/ --table ple --full
    """
    from engramdb.verify import verify_views, views_bytes

    names = list(tables) or None
    total = total_bytes(db, names) + views_bytes(db, names)
    t0 = time.perf_counter()
    with progress_bar(quiet, "verifying", total) as bar:
        problems = verify(db, tables=names, progress=bar.update)
        view_problems = verify_views(
            db,
            tables=names,
            full=full,
            progress=bar.update,
            notes=lambda m: click.echo(f"note: {m}", err=True),
        )
    seconds = time.perf_counter() - t0
    found = [*problems, *view_problems]
    if as_json:
        doc = {
            "ok": not found,
            "bytes": total,
            "seconds": seconds,
            "problems": [dataclasses.asdict(p) | {"line": p.line()} for p in found],
        }
        click.echo(json.dumps(json_ready(doc), indent=1))
        if found:
            sys.exit(1)
        return
    if echo_problems(found):
        sys.exit(1)
    click.echo(
        "ok: every shard matches its manifest checksum; views match Store-I "
        f"({format_bytes(total)} in {seconds:.2f} s, {format_rate(per_second(total, seconds))})"
    )


@click.command("drop")
@click.argument("db", type=click.Path(exists=True, file_okay=False))
@click.option("--table", "-t", required=True, help="Table to remove.")
@json_option
@library_errors
def drop_cmd(db: str, table: str, as_json: bool) -> None:
    """Remove TABLE from DB (atomic manifest update, then its files).

    \b
    Example: engramdb drop db/ --table old
    """
    wait_for_writer(db, as_json)
    drop_table(db, table)
    if as_json:
        click.echo(json.dumps({"dropped": table}))
        return
    click.echo(f"dropped table {table!r}")
