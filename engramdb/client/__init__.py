"""``engramdb.connect``: tables served by ``engramdb serve`` that behave like local ones.

Switching between local and remote is one line::

    db = engramdb.open("DB")                                  # local
    db = engramdb.connect("unix:///run/engramdb.sock")       # same machine, other process
    db = engramdb.connect("http://10.0.0.5:7070", token=tok)  # other host

    ple = db["ple"]
    rows = ple.fetch(ids)          # same signature, same validation, same typed errors
    ple.fetch_into(ids, out)
    ple.lookup_into(local_ids, out4d)

Requests use the binary wire format (raw int64 ids out, raw rows in, no JSON), a pool of
keep-alive connections, and write response rows straight into the caller's ``out`` with
``recv_into`` (no intermediate copy). Batches above the server's per-request limits are
split into several requests after the whole batch was validated, so a bad id still leaves
``out`` untouched. Server errors come back as the same `EngramDBError` subclasses a local
`Store` raises; transport failures raise `ServiceUnavailable` (a `ConnectionError`).

The client imports the wire codec (`engramdb.serve.frames`), the HTTP protocol and auth
helpers, never the server: `engramdb.client.transport` moves bytes, `engramdb.client.remote`
holds the handles.
"""

from __future__ import annotations

import os

from engramdb.client.remote import Client, RemoteStore, RemoteView
from engramdb.client.transport import MAX_HEAD_BYTES  # noqa: F401  (public constant)
from engramdb.errors import InvalidArgument
from engramdb.serve.auth import load_token

__all__ = ["Client", "RemoteStore", "RemoteView", "connect"]


def connect(
    url: str,
    token: str | bytes | None = None,
    *,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
    pool_size: int = 4,
    wire: bool | None = None,
    spin_us: float = 100.0,
) -> Client:
    """Connect to ``engramdb serve`` at ``url`` (``http://HOST:PORT`` or
    ``unix:///path/to.sock``) and read its table list (one round trip).

    ``token`` (or ``token_file``) is sent as ``Authorization: Bearer``. ``timeout`` bounds
    connecting and each wait for data, in seconds. Raises `ServiceUnavailable` if the server
    cannot be reached, `AuthenticationFailed` for a missing or wrong token.

    ``wire``: read rows over the binary wire protocol instead of HTTP (default: on for a
    Unix socket, off for TCP; table listings and views always use HTTP). ``spin_us``: how
    long a wire request polls for its reply before sleeping (0 = sleep at once).
    """
    if token_file is not None:
        if token is not None:
            raise InvalidArgument("give token or token_file, not both")
        token = load_token(token_file)
    return Client(url, token, timeout=timeout, pool_size=pool_size, wire=wire, spin_us=spin_us)
