"""`install_engramstore`: make ``from mooncake.store import EngramStore`` return EngramDB's.

Engines import the class from the Mooncake package (SGLang's ``engram_mooncake.py``:
``from mooncake.store import EngramStore, EngramStoreConfig, MooncakeDistributedStore``).
After ``install_engramstore()`` those names are `engramdb.integrations.engramstore`'s
`EngramStore` and `EngramStoreConfig`; ``MooncakeDistributedStore`` stays Mooncake's own,
so a store-mode engine passes a real client, which the EngramDB class accepts. The returned
`Undo` puts Mooncake's classes back.
"""

from __future__ import annotations

from typing import Any

from engramdb.integrations.mooncake._store import import_store

_NAMES = ("EngramStore", "EngramStoreConfig")
_MISSING = object()


def install_engramstore() -> Any:
    """Patch ``mooncake.store.EngramStore`` / ``EngramStoreConfig`` with EngramDB's; returns
    an `Undo` (callable, context manager, idempotent). `MissingDependency` when the Mooncake
    wheel is not installed. Modules that already bound the old names keep them: install
    before the engine imports ``mooncake.store``'s names (SGLang imports them lazily, at
    ``connect_store``)."""
    # Imported here: the EngramStore module imports this package.
    from engramdb.integrations.engramstore import EngramStore, EngramStoreConfig
    from engramdb.integrations.installers import Undo

    module = import_store()
    saved = {name: getattr(module, name, _MISSING) for name in _NAMES}
    setattr(module, "EngramStore", EngramStore)  # noqa: B010 - a compiled module: no stubs
    setattr(module, "EngramStoreConfig", EngramStoreConfig)  # noqa: B010

    def restore() -> None:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)

    return Undo(restore, "mooncake.store.EngramStore")


__all__ = ["install_engramstore"]
