"""Shared CLI plumbing: library errors become clean ``click`` errors at the edge, one lazy
progress bar, the shared options (backend, quiet, files, shown defaults), and the text of summaries and problems."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import click

from engramdb.errors import EngramDBError
from engramdb.io.select import BACKENDS
from engramdb.table_api import Closing

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
            raise click.ClickException(f"{type(e).__name__}: {e}") from e
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            text = (e.strerror or str(e)) if e.errno is not None else str(e)
            raise click.ClickException(f"{text}{where}") from e

    return wrapper  # type: ignore[return-value]


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


def progress_bar(quiet: bool, label: str, total: int) -> Any:
    """The CLI's progress bar (on stderr; ``quiet`` hides it) for a known ``total``: a
    context manager whose ``update(n)`` is a library ``progress`` callback. `LazyBar` opens
    the same bar where the total is known only at the first report."""
    return click.progressbar(length=total, label=label, hidden=quiet, file=sys.stderr)


#: ``--quiet`` / ``-q``: hide the progress bar.
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")

#: ``--force``: replace a table that exists (the table writers: build, attach).
force_option = click.option("--force", is_flag=True, help="Replace the table if it exists.")


class LazyBar(Closing):
    """A click progress bar (on stderr) opened at the first report, once the total is known.

    Pass it as a library ``progress(done, total)`` callback; `close` it (or use it as a
    context manager) when the call returns. ``quiet`` hides it."""

    def __init__(self, quiet: bool, label: str) -> None:
        self.quiet, self.label = quiet, label
        self.bar: Any = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress_bar(self.quiet, self.label, total)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


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
