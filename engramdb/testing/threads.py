"""Run a test body on several threads at once and re-raise the first failure in the caller."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def run_threads(work: Callable[..., None], args: Iterable[tuple[Any, ...]]) -> None:
    """Start one thread per ``args`` tuple running ``work(*args)``, wait for all of them, then
    raise the first exception any of them raised (an assertion, a wrong error type)."""
    errors: list[BaseException] = []

    def run(*a: Any) -> None:
        try:
            work(*a)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
