"""``engramdb serve``: every table of a database over HTTP/1.1 (TCP and Unix socket).

`Server` runs the service (``start()`` on a background thread, ``serve_forever()`` on this
one); `engramdb.connect` (in ``engramdb.client``) is the client whose tables behave like a
local `Store`. The wire contract is in `engramdb.serve.protocol` and docs/serve.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engramdb.serve.auth import load_token
from engramdb.serve.protocol import (
    AuthenticationFailed,
    MalformedRequest,
    MethodNotAllowed,
    NotAcceptable,
    ProtocolError,
    RemoteError,
    RequestTooLarge,
    ServiceError,
    ServiceUnavailable,
    UnknownEndpoint,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from engramdb.serve.context import Limits
    from engramdb.serve.server import Server, open_database, serve

_SERVER_NAMES = ("Limits", "Server", "open_database", "serve")


def __getattr__(name: str) -> object:
    # The server (asyncio, thread pools) loads on first use, so `engramdb.connect` and the
    # error classes cost a client process no server imports.
    if name in _SERVER_NAMES:
        from engramdb.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'engramdb.serve' has no attribute {name!r}")


__all__ = [
    "AuthenticationFailed",
    "Limits",
    "MalformedRequest",
    "MethodNotAllowed",
    "NotAcceptable",
    "ProtocolError",
    "RemoteError",
    "RequestTooLarge",
    "Server",
    "ServiceError",
    "ServiceUnavailable",
    "UnknownEndpoint",
    "UnsupportedMediaType",
    "load_token",
    "open_database",
    "serve",
]
