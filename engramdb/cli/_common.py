"""Shared CLI plumbing: library errors become clean ``click`` errors at the edge, one lazy
progress bar, the shared options (backend, quiet, files, shown defaults), and the text of summaries and problems."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import click

from engramdb.cli._progress import Progress, json_ready
from engramdb.errors import EngramDBError
from engramdb.io.select import BACKENDS

F = TypeVar("F", bound=Callable[..., Any])


def library_errors(fn: F) -> F:
    """Turn an `EngramDBError` into a one-line ``Error: ...`` and exit status 1; an
    operating-system error (a full disk, a permission) into ``Error: <its message>`` naming
    the cause and the file, never a traceback. (Ctrl-C is click's ``Aborted!``, exit 1.)"""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EngramDBError as e:
            raise click.ClickException(f"{type(e).__name__}: {cli_words(str(e))}") from e
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            text = (e.strerror or str(e)) if e.errno is not None else str(e)
            raise click.ClickException(f"{text}{where}") from e

    return wrapper  # type: ignore[return-value]


#: Python keyword -> the CLI flag that sets it (the library's messages name keywords).
_FLAGS = {
    "table": "--table",
    "name": "--view",
    "hasher": "--preset",
    "preset": "--preset",
    "layer": "--layer",
    "keys": "--keys",
    "counts": "--counts",
    "rows": "--rows",
    "from_index": "--from-index",
    "disk_budget": "--disk-budget",
    "slot_bytes": "--slot-bytes",
    "force": "--force",
    "row_bytes": "--row-bytes",
    "bin_dtype": "--bin-dtype",
    "doc_separator": "--doc-sep",
    "hot_rows": "--hot-rows",
    "chunk_tokens": "--chunk-tokens",
    "token_map": "--token-map",
    "compressed": "--compressed",
    "heads": "--heads",
    "ram_budget": "--ram-budget",
    "shard_bytes": "--shard-size",
    "key_hash": "a custom key hash (Python API only)",
}
_KW = "|".join(sorted(_FLAGS, key=len, reverse=True))
# bare words are rewritten only for snake_case keywords ("hot_rows must"), never "table needs"
_KW_SNAKE = "|".join(k for k in sorted(_FLAGS, key=len, reverse=True) if "_" in k)
_REWRITES: list[tuple[re.Pattern[str], Any]] = [
    (
        re.compile(r"[;,]? ?(?:pass|or) strict=False(?: for the reference engine's behaviour)?"),
        " (the CLI checks every id; the Python API's strict=False maps such ids to row 0 "
        "as the reference engine does)",
    ),
    (re.compile(r"give compressed_vocab_size or a token map"), "give --token-map"),
    (re.compile(r"use force=True / --force"), "use --force"),
    (re.compile(r"(?<![-\w])bin_dtype\b"), "--bin-dtype"),
    (re.compile(rf"(?<![-\w])({_KW})=True\b"), lambda m: _FLAGS[m.group(1)]),
    (re.compile(rf"(?<![-\w])({_KW})=(?=[\s,;:.)]|$)"), lambda m: _FLAGS[m.group(1)]),
    (re.compile(rf"(?<![-\w])({_KW})=(?=\S)"), lambda m: _FLAGS[m.group(1)] + " "),
    (
        re.compile(rf"(?<![-\w])({_KW_SNAKE})\b(?= (?:must|needs|applies))"),
        lambda m: _FLAGS[m.group(1)],
    ),
]


def cli_words(message: str) -> str:
    """A library message in the words of the CLI: ``pass table=`` -> ``pass --table``,
    ``needs hasher=`` -> ``needs --preset``, ``bin_dtype`` -> ``--bin-dtype``,
    ``expected row_bytes=0`` -> ``expected --row-bytes 0``."""
    for pattern, repl in _REWRITES:
        message = pattern.sub(repl, message)
    return message


def int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def shown_option(
    decls: str | tuple[str, ...],
    default: Any,
    help: str | None = None,  # noqa: A002
    type: Any = None,  # noqa: A002
) -> Callable[[F], F]:
    """An option (``decls``: its flag, or flag and names) whose ``--help`` shows its
    default."""
    names = (decls,) if isinstance(decls, str) else decls
    return click.option(*names, type=type, default=default, show_default=True, help=help)


def backend_option(help: str | None = None) -> Callable[[F], F]:  # noqa: A002
    """``--backend`` with the choices of `engramdb.io.select.BACKENDS` (default ``auto``)."""
    return shown_option("--backend", "auto", help, click.Choice(BACKENDS))


def file_option(flag: str, dest: str, help: str) -> Callable[[F], F]:  # noqa: A002
    """An option naming an existing file (a `pathlib.Path`), stored in ``dest``."""
    return click.option(
        flag, dest, type=click.Path(exists=True, dir_okay=False, path_type=Path), help=help
    )


def progress_bar(
    quiet: bool,
    label: str,
    total: int | None = None,
    *,
    unit: str = "B",
    row_bytes: int | None = None,
) -> Progress:
    """The CLI's one progress display (`engramdb.cli._progress.Progress`, on stderr, drawn
    only on a terminal; ``quiet`` hides it): pass ``bar.update`` (increments) or ``bar``
    itself (``progress(done, total)``) as a library ``progress`` callback."""
    return Progress(label, total=total, unit=unit, row_bytes=row_bytes, quiet=quiet)


def LazyBar(quiet: bool, label: str, unit: str = "B") -> Progress:  # noqa: N802 (the old name)
    """A `progress_bar` whose total comes with the first ``progress(done, total)``."""
    return Progress(label, unit=unit, quiet=quiet)


#: ``--quiet`` / ``-q``: hide the progress bar.
quiet_option = click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="No progress line (none is drawn when stderr is not a terminal).",
)

#: ``--json``: print the result as one JSON document on stdout instead of the summary line.
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (no summary line)."
)

#: ``--force``: replace a table that exists (the table writers: build, attach).
force_option = click.option("--force", is_flag=True, help="Replace the table if it exists.")


def as_record(obj: Any) -> Any:
    """A result (a summary dataclass, a dict, a list of them) as JSON-ready data; a summary
    also carries its ``line``."""
    if isinstance(obj, (list, tuple)):
        return [as_record(o) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        doc = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        for extra in ("gb_per_s", "tokens_per_s"):
            if hasattr(type(obj), extra):
                doc[extra] = getattr(obj, extra)
        if hasattr(obj, "line"):
            doc["line"] = obj.line()
        return json_ready(doc)
    return json_ready(obj)


def echo_result(as_json: bool, results: Any) -> None:
    """Print a command's result: with ``--json`` one JSON document, else each summary's
    line (``results``: one summary or a list)."""
    if as_json:
        click.echo(json.dumps(as_record(results), indent=1))
        return
    for r in results if isinstance(results, (list, tuple)) else [results]:
        click.echo(r.line() if hasattr(r, "line") else str(r))


def deprecated_alias(old: str, new: str, dest: str) -> Callable[[F], F]:
    """A hidden option ``old`` that still works as ``new`` (stored in ``dest``), with a
    deprecation note on stderr."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and value != ():
            click.echo(f"note: {old} is deprecated; use {new}", err=True)
            ctx.meta[f"alias:{dest}"] = value
        return value

    return click.option(
        old, f"_alias_{dest}", default=None, hidden=True, expose_value=False, callback=callback
    )


def aliased(ctx: click.Context, dest: str, value: Any) -> Any:
    """``value`` of an option, or what its `deprecated_alias` gave when it was not set."""
    if value is None or value == ():
        return ctx.meta.get(f"alias:{dest}", value)
    return value


class _HasLine(Protocol):
    def line(self) -> str: ...


def echo_summaries(summaries: Iterable[_HasLine]) -> None:
    """Print each summary's one-line text (``.line()``) on stdout."""
    for s in summaries:
        click.echo(s.line())


def echo_problems(problems: Iterable[_HasLine]) -> bool:
    """Print ``MISMATCH <problem>`` on stderr for each problem; True if there were any."""
    found = False
    for p in problems:
        click.echo(f"MISMATCH {p.line()}", err=True)
        found = True
    return found
