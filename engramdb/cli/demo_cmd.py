from __future__ import annotations

import json
import re

import click

from engramdb.cli._common import library_errors
from engramdb.demo import run_demo


@click.command("demo")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--seconds", default=1.0, show_default=True, help="Time spent per measurement.")
@click.option("--clean", is_flag=True, help="Remove DIRECTORY at the end (default: kept).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (the steps, each with its figure and baseline) instead.",
)
@library_errors
def demo_cmd(directory: str | None, seconds: float, clean: bool, as_json: bool) -> None:
    """Walk the whole chain on a tiny Qwen-PLE table (the qwen3.8-flash-next algorithm at
    --scale tiny, 49 MiB of synthetic rows) in DIRECTORY (default: <tmp>/engramdb-demo):
    build, index a synthetic corpus, view build, warm, warm gathers, Decoder steps, a serve
    round trip over a Unix socket, corpus streaming. Each step prints its measured figure
    and its baseline from the same run (gathers: np.take(out=) on a populated mapping).

    \b
    Example: engramdb demo --clean
    """
    if not as_json:
        run_demo(directory, click.echo, seconds=seconds, clean=clean)
        return
    lines: list[str] = []
    run_demo(directory, lines.append, seconds=seconds, clean=clean)
    click.echo(json.dumps(demo_document(lines), indent=2))


def demo_document(lines: list[str]) -> dict[str, object]:
    """The demo's printed lines as a document: each ``[k/n] name: figure | baseline`` line is
    a step; the other lines are notes (where the files are, what to run next)."""
    steps: list[dict[str, object]] = []
    notes: list[str] = []
    for line in lines:
        m = _STEP.match(line)
        if m is None:
            notes.append(line)
            continue
        figure, _, baseline = m["rest"].partition(" | ")
        steps.append(
            {"step": int(m["k"]), "of": int(m["n"]), "name": m["name"],
             "figure": figure.strip(), "baseline": baseline.strip() or None}
        )  # fmt: skip
    return {"steps": steps, "notes": notes}


_STEP = re.compile(r"^\[(?P<k>\d+)/(?P<n>\d+)\] (?P<name>[^:]+): (?P<rest>.*)$")
