"""Shared CLI plumbing: library errors become clean ``click`` errors at the edge."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from engramdb.errors import EngramDBError

F = TypeVar("F", bound=Callable[..., Any])


def library_errors(fn: F) -> F:
    """Turn an `EngramDBError` into a one-line ``Error: ...`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EngramDBError as e:
            raise click.ClickException(f"{type(e).__name__}: {e}") from e

    return wrapper  # type: ignore[return-value]


def int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
