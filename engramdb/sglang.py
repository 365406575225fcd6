"""The published EngramDB API's SGLang module path: ``from engramdb.sglang import ...``.

* `install_sglang_ple` — patch an SGLang model class so its per-layer embedding is a disk
  table (`engramdb.integrations.installers.install_sglang_ple`); returns an `Undo`.
* `install_sglang_io_uring_reader(module=None, attr="IoUringReader")` — replace the
  low-level page reader class an SGLang storage module reads pages with (the published
  API's hook: the ``IoUringReader`` attribute of the ``sglang_storage`` module) by
  `SGLangPageReader`, our `IoUringPageReader` with the published ``read_pages(fds,
  offsets) -> list[bytes]``. Returns an `Undo` that restores the previous class, or
  ``False`` (the published result) when the storage module is not importable. SGLang itself
  ships no such module or hook (it was not installable here to check further), so pass
  ``module=`` / ``attr=`` to patch the reader attribute of your own storage backend.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from engramdb.errors import InvalidArgument
from engramdb.integrations.installers import Undo, install_sglang_ple
from engramdb.io.pages import IoUringPageReader

__all__ = ["SGLangPageReader", "Undo", "install_sglang_io_uring_reader", "install_sglang_ple"]

_DEFAULT_MODULE = "sglang_storage"
_MISSING = object()


class SGLangPageReader(IoUringPageReader):
    """`IoUringPageReader` with the published page-reader contract: ``read_pages(fds,
    offsets)`` returns one ``bytes`` per page; `read_pages_array` (and ``out=``) is the
    allocation-free path returning ``[n, page_size]`` uint8."""

    def read_pages(  # type: ignore[override]
        self, fds: ArrayLike, offsets: ArrayLike, *, out: np.ndarray | None = None
    ) -> Any:
        pages = super().read_pages(fds, offsets, out=out)
        return pages if out is not None else [p.tobytes() for p in pages]

    def read_pages_array(
        self, fds: ArrayLike, offsets: ArrayLike, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        return super().read_pages(fds, offsets, out=out)


def install_sglang_io_uring_reader(
    module: ModuleType | str | None = None,
    attr: str = "IoUringReader",
    reader: type = SGLangPageReader,
) -> Undo | bool:
    """Set ``module.<attr>`` to ``reader`` (default `SGLangPageReader`) and return an `Undo`.

    ``module``: a module object or an importable name (default ``"sglang_storage"``); when
    the name cannot be imported the published API's ``False`` is returned. Raises
    `InvalidArgument` when ``reader`` is not a class."""
    if not isinstance(reader, type):
        raise InvalidArgument(f"reader must be a class, got {type(reader).__name__}")
    if module is None or isinstance(module, str):
        try:
            target = importlib.import_module(module or _DEFAULT_MODULE)
        except ImportError:
            return False
    else:
        target = module
    previous = getattr(target, attr, _MISSING)
    setattr(target, attr, reader)

    def restore() -> None:
        if previous is _MISSING:
            delattr(target, attr)
        else:
            setattr(target, attr, previous)

    return Undo(restore, f"{target.__name__}.{attr}")
