from __future__ import annotations

import click

from engramdb.cli._common import library_errors
from engramdb.demo import run_demo


@click.command("demo")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--seconds", default=1.0, show_default=True, help="Time spent per measurement.")
@click.option("--clean", is_flag=True, help="Remove DIRECTORY at the end (default: kept).")
@library_errors
def demo_cmd(directory: str | None, seconds: float, clean: bool) -> None:
    """Walk the whole chain on a tiny Qwen-PLE table (the qwen3.8-flash-next algorithm at
    --scale tiny, 49 MiB of synthetic rows) in DIRECTORY (default: <tmp>/engramdb-demo):
    build, index a synthetic corpus, view build, warm, warm gathers, Decoder steps, a serve
    round trip over a Unix socket, corpus streaming. Each step prints its measured figure
    and its baseline from the same run (gathers: np.take(out=) on a populated mapping).

    \b
    Example: engramdb demo --clean
    """
    run_demo(directory, click.echo, seconds=seconds, clean=clean)
