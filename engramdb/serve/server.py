"""``engramdb serve``: every table of one database over HTTP/1.1, on TCP and a Unix socket.

Architecture (docs/serve.md has the measurements behind each choice):

* **One asyncio event loop** (standard library) drives non-blocking sockets directly with
  ``add_reader`` / ``add_writer``, not asyncio transports: a transport copies every large
  response it cannot send at once (3.11) and joins ``writelines`` parts, and measured 6x
  slower than direct ``sendmsg`` for a 4,096-row response. Here a response is one buffer
  (head + rows) sent with one ``send``; a partial send keeps a memoryview of the rest.
* **Small fetches run inline** on the loop (a 16-row gather is about 1 us, less than a thread
  hand-off); responses above ``Limits.inline_max_bytes`` are gathered on a worker thread so
  one large request does not stall the small ones of other clients.
* **Buffers are reused**: each connection keeps one response buffer; the rows are gathered
  straight into it behind the header bytes, so the binary path makes no copy of the rows
  after the gather and runs no JSON.
* The database is opened read-only (``engramdb.open``: ``O_RDONLY`` descriptors, read-only
  mappings) and the server never writes into its directory; a server killed at any moment
  leaves nothing to repair.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import logging
import math
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import numpy as np

import engramdb
from engramdb.database import Database
from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    MissingDependency,
    ShapeMismatch,
)
from engramdb.serve import protocol as P
from engramdb.serve.auth import TokenCheck, check_bind, resolve_bind
from engramdb.serve.metrics import Metrics
from engramdb.serve.wire import DEFAULT_SPIN_US, REQUEST_MAGIC, WireLane
from engramdb.store import Store
from engramdb.validate import as_rowids

log = logging.getLogger("engramdb.serve")

#: Bytes read from a socket per ``recv_into``.
RECV_CHUNK = 64 * 1024
#: Per-connection response buffers up to this size are kept for the next request; larger
#: ones are freed after sending so 16 idle connections do not pin 16 big buffers.
SCRATCH_MAX = 4 * 1024 * 1024
#: Kernel send buffer asked for on accepted sockets: a 4,096-row response (655 KB at
#: 160 B rows) then leaves in one or two ``send`` calls (measured: -20 % latency on UDS).
SNDBUF_BYTES = 1 << 20
#: After the last response on a connection the server half-closes and keeps reading this
#: long, so a peer still sending does not get a reset that destroys the response.
LINGER_SECONDS = 1.0
LISTEN_BACKLOG = 512

_BINARY_OK = (
    b"HTTP/1.1 200 OK\r\nServer: engramdb/%s\r\nContent-Type: application/octet-stream\r\n"
    % engramdb.__version__.encode()
)

#: Parsed request heads by their exact bytes. A client in a decode loop sends the same head
#: (path, headers, Content-Length) again and again: a dict hit costs ~0.2 us, parsing ~3 us.
#: Heads are never mutated after parsing, so sharing them is safe; the cache is bounded.
_HEAD_CACHE: dict[bytes, P.RequestHead] = {}
_HEAD_CACHE_SIZE = 512
_HEAD_CACHE_KEY_MAX = 1024

_VIEW_METHODS = {"records": "read_records", "lookup": "lookup", "lookup_tokens": "lookup_tokens"}


@dataclass(frozen=True)
class Limits:
    """Per-request and per-server bounds. Every field must be positive.

    ``inline_max_bytes``: responses up to this size are gathered on the event loop; larger
    ones on a worker thread (a thread hand-off costs ~20-50 us, a 1 MiB gather ~60 us).
    """

    max_rows: int = 1 << 20
    max_body_bytes: int = 16 << 20
    max_response_bytes: int = 256 << 20
    max_header_bytes: int = 16 << 10
    max_connections: int = 1024
    idle_timeout: float = 300.0
    inline_max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidArgument(f"limit {name} must be a positive number, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_database(
    path: str | os.PathLike[str],
    *,
    backend: str = "auto",
    ram_budget: int | str | None = None,
    populate: bool = False,
) -> Database:
    """Open ``path`` read-only for serving. ``populate`` faults every table into the page
    tables first (reads it from the device if cold: seconds per GB), so the first requests
    do not pay page faults.

    ``ram_budget`` is passed to `engramdb.open` only if this build's ``open`` accepts it; a
    build without a RAM tier refuses it with `InvalidArgument` instead of ignoring it.
    ``backend`` is checked against the reader layer's list when that layer exports one.
    """
    kwargs: dict[str, Any] = {"backend": backend, "populate": populate}
    params = inspect.signature(engramdb.open).parameters
    if ram_budget is not None:
        if "ram_budget" not in params:
            raise InvalidArgument(
                "--ram-budget is not supported by this EngramDB build yet (engramdb.open has "
                "no ram_budget: the RAM tier is not installed); serve without it"
            )
        kwargs["ram_budget"] = ram_budget
    known = getattr(getattr(engramdb, "io", None), "BACKENDS", None)
    if known is not None and backend not in known:
        raise InvalidArgument(f"unknown backend {backend!r}; choose one of {', '.join(known)}")
    return engramdb.open(path, **kwargs)


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise MissingDependency(
            "Arrow responses need pyarrow on the server: pip install 'engramdb[arrow]'"
        ) from None
    return pyarrow


class _Reply:
    """A response ready to send: its byte parts and what the metrics need."""

    __slots__ = ("status", "parts", "endpoint", "table", "rows", "nbytes", "error", "close")

    def __init__(
        self,
        status: int,
        parts: list[Any],
        endpoint: str,
        table: str = "",
        rows: int = 0,
        nbytes: int = 0,
        error: str | None = None,
        close: bool = False,
    ):
        self.status = status
        self.parts = parts
        self.endpoint = endpoint
        self.table = table
        self.rows = rows
        self.nbytes = nbytes
        self.error = error
        self.close = close


class _Deferred:
    """A reply to compute on a worker thread (a large gather)."""

    __slots__ = ("fn", "endpoint", "table")

    def __init__(self, fn: Callable[[], _Reply], endpoint: str, table: str):
        self.fn = fn
        self.endpoint = endpoint
        self.table = table


class _Request:
    """What a handler sees: the parsed head, the body, and how to frame its answer."""

    __slots__ = ("head", "body", "conn", "keep_alive")

    def __init__(self, head: P.RequestHead, body: bytes, conn: _Connection, keep_alive: bool):
        self.head = head
        self.body = body
        self.conn = conn
        self.keep_alive = keep_alive

    def conn_header(self) -> bytes:
        if not self.keep_alive:
            return b"Connection: close\r\n"
        if self.head.version == "HTTP/1.0":
            return b"Connection: keep-alive\r\n"
        return b""


class Server:
    """Serve every table of a database. Use `start` (background thread, for tests and
    embedding) or `serve_forever` (this thread, handles SIGTERM / SIGINT).

    ``db`` is a path (opened read-only here and closed on stop) or an open `Database` (left
    open). ``port=None`` disables TCP; ``unix`` adds a Unix-domain socket listener (mode
    ``unix_mode``, owner-only by default). A TCP bind that reaches beyond loopback needs
    ``token`` or ``insecure=True`` (`InvalidArgument` otherwise). ``grace``: seconds that
    in-flight requests get to finish after a stop request. ``populate``: see `open_database`.
    ``wire``: also speak the binary wire protocol (`engramdb.serve.wire`) on every listener;
    ``spin_us``: how long its thread keeps polling without sleeping after each burst of work
    (0 = never spin).
    """

    def __init__(
        self,
        db: str | os.PathLike[str] | Database,
        *,
        host: str = "127.0.0.1",
        port: int | None = P.DEFAULT_PORT,
        unix: str | os.PathLike[str] | None = None,
        token: bytes | str | None = None,
        insecure: bool = False,
        limits: Limits | None = None,
        backend: str = "auto",
        ram_budget: int | str | None = None,
        unix_mode: int = 0o600,
        grace: float = 10.0,
        populate: bool = False,
        wire: bool = True,
        spin_us: float = DEFAULT_SPIN_US,
    ):
        if port is None and unix is None:
            raise InvalidArgument("nothing to listen on: give a TCP port, a Unix socket, or both")
        if port is not None and not (0 <= int(port) <= 65535):
            raise InvalidArgument(f"port must be in [0, 65535], got {port}")
        if not (0 <= float(spin_us) < 1e6):
            raise InvalidArgument(f"spin_us must be in [0, 1e6) microseconds, got {spin_us!r}")
        if isinstance(token, str):
            token = token.encode()
        self.host = host
        self.port = None if port is None else int(port)
        self.unix = None if unix is None else str(unix)
        self.unix_mode = unix_mode
        self.insecure = insecure
        self.limits = limits or Limits()
        self.grace = float(grace)
        self._auth = TokenCheck(token)
        self._token = token
        if isinstance(db, Database):
            self.db, self._owns_db = db, False
        else:
            self.db = open_database(db, backend=backend, ram_budget=ram_budget, populate=populate)
            self._owns_db = True
        self.metrics = Metrics()
        self.wire = bool(wire)
        self.spin_us = float(spin_us)
        self._lane: WireLane | None = None
        self._stores_lock = threading.Lock()
        self._stores: dict[str, Store] = {}
        self._info_json: dict[str, bytes] = {}
        self._views: dict[tuple[str, str], Any] = {}
        self._listeners: list[tuple[str, socket.socket]] = []
        self._conns: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engramdb-serve")
        self._in_flight = 0
        self._stop_requested: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self.draining = False
        self._date = b""
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._bound = False
        self.urls: list[str] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self) -> list[str]:
        """Create the listening sockets (resolves port 0 to a real port). Raises
        `InvalidArgument` for a refused bind: non-loopback without a token, address in use,
        a path that is not a stale socket. Returns the URLs clients connect to."""
        if self._bound:
            return self.urls
        try:
            if self.port is not None:
                self._bind_tcp()
            if self.unix is not None:
                self._bind_unix(self.unix)
        except BaseException:
            for _, s in self._listeners:
                s.close()
            self._listeners.clear()
            self.urls.clear()
            raise
        self._bound = True
        return self.urls

    def _bind_tcp(self) -> None:
        assert self.port is not None
        addrs = resolve_bind(self.host, self.port)
        check_bind(
            self.host,
            [str(sa[0]) for _, sa in addrs],
            token=self._token,
            insecure=self.insecure,
        )
        port = self.port
        for family, sockaddr in addrs:
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((sockaddr[0], port, *sockaddr[2:]))
                s.listen(LISTEN_BACKLOG)
            except OSError as e:
                s.close()
                raise InvalidArgument(
                    f"cannot listen on {sockaddr[0]}:{port}: {e.strerror}"
                ) from None
            port = s.getsockname()[1]  # port 0: every address shares the first one's port
            self._listeners.append(("tcp", s))
            host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else str(sockaddr[0])
            self.urls.append(f"http://{host}:{port}")
        self.port = port

    def _bind_unix(self, path: str) -> None:
        _clear_stale_socket(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(path)
            # before listen(): until then a connect is refused, so no client slips in while
            # the socket still has the umask's permissions
            os.chmod(path, self.unix_mode)
            s.listen(LISTEN_BACKLOG)
        except OSError as e:
            s.close()
            raise InvalidArgument(f"cannot listen on Unix socket {path!r}: {e.strerror}") from None
        self._listeners.append(("unix", s))
        self.urls.append("unix://" + os.path.abspath(path))

    def _bind_or_close(self) -> None:
        try:
            self.bind()
        except BaseException:
            if self._owns_db:
                self.db.close()
            raise

    def start(self) -> Server:
        """Bind, then serve on a background thread; returns once the server accepts."""
        self._bind_or_close()
        self._thread = threading.Thread(
            target=self._run, kwargs={"signals": False}, name="engramdb-serve", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        return self

    def serve_forever(self, *, on_ready: Callable[[Server], None] | None = None) -> None:
        """Bind and serve on this thread until SIGTERM / SIGINT (or `stop` from another
        thread); in-flight requests finish (up to ``grace`` seconds) before it returns."""
        self._bind_or_close()
        self._run(signals=threading.current_thread() is threading.main_thread(), on_ready=on_ready)

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (``grace`` seconds at most), close.
        Thread-safe; returns when the server thread ended (if `start` made one)."""
        if grace is not None:
            self.grace = float(grace)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop finished meanwhile
                loop.call_soon_threadsafe(self.request_stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def request_stop(self) -> None:
        """Begin a graceful stop (call on the loop thread; signal handlers do)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, *, signals: bool, on_ready: Callable[[Server], None] | None = None) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(signals, on_ready))
        finally:
            loop.close()
            self._ready.set()

    async def _main(self, signals: bool, on_ready: Callable[[Server], None] | None) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop_requested = asyncio.Event()
        self._drained = asyncio.Event()
        if self.wire:
            self._lane = WireLane(self, spin_us=self.spin_us)
            self._lane.start()
        for kind, s in self._listeners:
            s.setblocking(False)
            loop.add_reader(s.fileno(), self._on_accept, s, kind)
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        self._tick()
        self._ready.set()
        if on_ready is not None:
            on_ready(self)
        try:
            await self._stop_requested.wait()
            await self._drain()
        finally:
            if signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            # worker threads may still gather from the mappings: wait for them before the
            # database (and its mappings) close
            self._executor.shutdown(wait=True)
            for view in self._views.values():
                close = getattr(view, "close", None)
                if callable(close):
                    close()
            if self._owns_db:
                self.db.close()

    async def _drain(self) -> None:
        assert self._loop is not None and self._drained is not None
        self.draining = True
        for _, s in self._listeners:
            self._loop.remove_reader(s.fileno())
            s.close()
        if self.unix is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix)
        for conn in list(self._conns):
            conn.drain()
        lane_done = None
        if self._lane is not None:
            # the lane finishes its own in-flight reads on its thread, in parallel
            lane_done = self._loop.run_in_executor(None, self._lane.stop, self.grace)
        if self._conns:
            try:
                await asyncio.wait_for(self._drained.wait(), timeout=self.grace)
            except asyncio.TimeoutError:
                log.warning("grace period over: closing %d connection(s)", len(self._conns))
        for conn in list(self._conns):
            conn.close()
        if lane_done is not None:
            await lane_done

    @property
    def n_connections(self) -> int:
        """Open client connections (HTTP and wire protocol)."""
        lane = self._lane
        return len(self._conns) + (lane.n_connections if lane is not None else 0)

    def _tick(self) -> None:
        """Once a second: refresh the Date header; close connections idle too long."""
        assert self._loop is not None
        self._date = formatdate(usegmt=True).encode()
        now = time.monotonic()
        idle = self.limits.idle_timeout
        for conn in list(self._conns):
            if not conn.busy and now - conn.last_active > idle:
                conn.close()
        if not self._loop.is_closed():
            self._loop.call_later(1.0, self._tick)

    def _on_accept(self, lsock: socket.socket, kind: str) -> None:
        for _ in range(64):  # accept a burst, then let the loop serve them
            try:
                sock, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving existing clients
                log.warning("accept failed: %s", e)
                return
            sock.setblocking(False)
            if kind == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if SNDBUF_BYTES:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
            self.metrics.connections_total += 1
            if self.n_connections >= self.limits.max_connections:
                err = P.ServiceUnavailable(
                    f"the server has {self.n_connections} connections, its limit "
                    f"(max_connections={self.limits.max_connections}); retry later"
                )
                status, body = P.error_payload(err)
                with contextlib.suppress(OSError):
                    sock.send(
                        self._head(status, P.CT_JSON, len(body), b"Connection: close\r\n") + body
                    )
                sock.close()
                self.metrics.count_error("accept", type(err).__name__)
                continue
            self._conns.add(_Connection(self, sock))

    def _forget(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        if self.draining and not self._conns and self._drained is not None:
            self._drained.set()

    # -- framing ---------------------------------------------------------------------------------
    def _head(self, status: int, ctype: str, length: int, extra: bytes = b"") -> bytes:
        return (
            b"HTTP/1.1 %d %s\r\nServer: engramdb/%s\r\nDate: %s\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\n%s\r\n"
            % (
                status,
                P.REASONS.get(status, "Unknown").encode(),
                engramdb.__version__.encode(),
                self._date,
                ctype.encode(),
                length,
                extra,
            )
        )

    def _json_reply(
        self, req: _Request, body: bytes, endpoint: str, table: str = "", status: int = 200
    ) -> _Reply:
        head = self._head(status, P.CT_JSON, len(body), req.conn_header())
        return _Reply(status, [head + body], endpoint, table, nbytes=len(body))

    def error_reply(
        self, exc: BaseException, endpoint: str, table: str, *, keep_alive: bool
    ) -> _Reply:
        """The JSON error response for ``exc`` (keeps the connection open when the request
        was framed correctly, so the next request on it is served as usual)."""
        status, body = P.error_payload(exc)
        extra = b"" if keep_alive else b"Connection: close\r\n"
        if status == 401:
            extra += b'WWW-Authenticate: Bearer realm="engramdb"\r\n'
        elif isinstance(exc, P.MethodNotAllowed) and exc.allowed:
            extra += b"Allow: %s\r\n" % exc.allowed.encode()
        head = self._head(status, P.CT_JSON, len(body), extra)
        etype = type(exc).__name__ if isinstance(exc, EngramDBError) else "InternalError"
        return _Reply(
            status,
            [head + body],
            endpoint,
            table,
            nbytes=len(body),
            error=etype,
            close=not keep_alive,
        )

    # -- routing ---------------------------------------------------------------------------------
    def route(self, req: _Request) -> _Reply | _Deferred:
        """Dispatch one request. Raises `EngramDBError` subclasses for every refusal."""
        head = req.head
        path = head.path
        if len(path) > 1 and path.endswith("/"):
            path = path[:-1]
        if path in ("/v1/health", "/healthz"):
            _method(head, "GET")
            return self._health(req)
        if not self._auth.allows(head.headers.get("authorization")):
            if "authorization" not in head.headers:
                raise P.AuthenticationFailed("this server needs `Authorization: Bearer <token>`")
            raise P.AuthenticationFailed("the bearer token is not the server's token")
        if path.startswith("/v1/tables/"):
            name, _, action = path[len("/v1/tables/") :].partition("/")
            if "%" in name:
                name = unquote(name)
            store = self._store(name)
            if action == "fetch":
                _method(head, "POST")
                return self._rows(req, store, lookup=False)
            if action == "lookup":
                _method(head, "POST")
                return self._rows(req, store, lookup=True)
            if action == "":
                _method(head, "GET")
                return self._json_reply(req, self._table_json(store), "table", store.name)
            if action.startswith("views/"):
                return self._view(req, store, action[len("views/") :])
        elif path == "/v1/tables":
            _method(head, "GET")
            doc = {
                "tables": [json.loads(self._table_json(self._store(n))) for n in self.db.tables],
                "generation": self.db.manifest.generation,
                "limits": self.limits.to_dict(),
                "version": engramdb.__version__,
            }
            return self._json_reply(req, P.json_dumps(doc), "tables")
        elif path in ("/metrics", "/v1/metrics"):
            _method(head, "GET")
            lane = self._lane
            text = self.metrics.render(
                connections_open=self.n_connections,
                in_flight=self._in_flight + (lane.in_flight if lane is not None else 0),
                store_stats=[s.stats() for s in self._stores.values()],
                view_stats=[v.stats() for v in self._views.values() if hasattr(v, "stats")],
            ).encode()
            hd = self._head(200, P.CT_PROMETHEUS, len(text), req.conn_header())
            return _Reply(200, [hd + text], "metrics", nbytes=len(text))
        raise P.UnknownEndpoint(
            f"no endpoint {head.method} {head.path[:200]!r}; see GET /v1/tables, POST "
            "/v1/tables/{name}/fetch, POST /v1/tables/{name}/lookup, GET /v1/health, GET /metrics"
        )

    def _health(self, req: _Request) -> _Reply:
        doc = {
            "status": "draining" if self.draining else "ok",
            "tables": len(self.db.tables),
            "generation": self.db.manifest.generation,
            "version": engramdb.__version__,
            "auth": self._auth.required,
        }
        return self._json_reply(
            req, P.json_dumps(doc), "health", status=503 if self.draining else 200
        )

    def _store(self, name: str) -> Store:
        store = self._stores.get(name)
        if store is None:
            with self._stores_lock:  # the wire lane opens tables from its own thread
                store = self._stores.get(name)
                if store is None:
                    store = self.db[name]  # TableNotFound names the table, lists the others
                    self._stores[name] = store
        return store

    def _table_json(self, store: Store) -> bytes:
        doc = self._info_json.get(store.name)
        if doc is None:
            info = {
                "name": store.name,
                "n_rows": int(store.n_rows),
                "row_bytes": int(store.row_bytes),
                "n_heads": int(store.n_heads),
                "heads": [int(h) for h in store.heads],
                "head_offsets": [int(o) for o in np.asarray(store.head_offsets)],
                "dtype": store.dtype,
                "dim": store.dim,
                "nbytes": int(store.nbytes),
                "views": callable(getattr(store, "view", None)),
            }
            doc = self._info_json[store.name] = P.json_dumps(info)
        return doc

    # -- rows ------------------------------------------------------------------------------------
    def _ids(self, req: _Request, *, key: str) -> np.ndarray:
        """The request's ids as int64 (binary: raw little-endian, shape from the header;
        JSON: a nested list, or an object with ``key``). Enforces the row limit."""
        head = req.head
        mtype = head.media_type
        body = req.body
        if mtype == P.CT_BINARY:
            if len(body) % 8:
                raise InvalidArgument(
                    f"binary ids must be little-endian int64: a body of {len(body)} bytes is "
                    "not a multiple of 8"
                )
            ids = np.frombuffer(body, dtype="<i8")
            shape_text = head.headers.get(P.H_SHAPE)
            if shape_text is not None:
                shape = P.parse_shape(shape_text)
                if math.prod(shape) != ids.size or not shape:
                    raise ShapeMismatch(
                        f"X-Engramdb-Shape {shape_text!r} holds {math.prod(shape)} ids, the body "
                        f"holds {ids.size}"
                    )
                ids = ids.reshape(shape)
        elif mtype == P.CT_JSON:
            try:
                doc = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise InvalidArgument(f"request body is not valid JSON: {e}") from None
            if isinstance(doc, dict):
                if key not in doc:
                    raise InvalidArgument(
                        f"JSON body needs a {key!r} field (a list of integers), got fields "
                        f"{sorted(doc)[:10]}"
                    )
                doc = doc[key]
            if not isinstance(doc, list):
                raise InvalidDtype(f"{key!r} must be a list of integers, got {type(doc).__name__}")
            try:
                arr = np.asarray(doc)
            except (ValueError, OverflowError) as e:
                raise ShapeMismatch(f"{key!r} is not a rectangular list of integers: {e}") from None
            if arr.dtype == object:
                raise InvalidDtype(f"{key!r} must hold integers that fit in int64")
            ids = np.ascontiguousarray(as_rowids(arr))
        else:
            raise P.UnsupportedMediaType(
                f"Content-Type {head.headers.get('content-type', '(none)')!r} is not readable "
                f"here; send {P.CT_BINARY} (raw little-endian int64) or {P.CT_JSON}"
            )
        if ids.size > self.limits.max_rows:
            raise P.RequestTooLarge(
                f"request asks for {ids.size:,} rows, the server allows {self.limits.max_rows:,} "
                "per request (split the batch; engramdb.connect does this by itself)"
            )
        return ids

    def _rows(self, req: _Request, store: Store, *, lookup: bool) -> _Reply | _Deferred:
        endpoint = "lookup" if lookup else "fetch"
        ids = self._ids(req, key="row_ids" if lookup else "ids")
        rb = store.row_bytes
        nbytes = ids.size * rb
        if nbytes > self.limits.max_response_bytes:
            raise P.RequestTooLarge(
                f"response would be {nbytes:,} bytes ({ids.size:,} rows x {rb} B), the limit "
                f"is {self.limits.max_response_bytes:,}"
            )
        head = req.head
        accept = head.headers.get("accept")
        if accept == P.CT_BINARY or (accept is None and head.media_type == P.CT_BINARY):
            fmt = P.CT_BINARY  # the fast path: skip the Accept parser
        else:
            fmt = _negotiate(head, P.CT_JSON if head.media_type == P.CT_JSON else P.CT_BINARY)
        shape = ids.shape + (rb,)
        if fmt != P.CT_BINARY:
            # JSON and Arrow are the convenience paths: allocate, encode, done
            if fmt == P.CT_ARROW:
                _pyarrow()  # refuse before gathering
            out = np.empty(shape, np.uint8)
            if lookup:
                store.lookup_into(ids, out)
            else:
                store.fetch_into(ids, out)
            return self._encoded(req, store, ids, out, fmt, endpoint, lookup)
        shape_text = b"%d,%d" % shape if len(shape) == 2 else P.format_shape(shape).encode()
        hd = b"%sDate: %s\r\nX-Engramdb-Shape: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            _BINARY_OK,
            self._date,
            shape_text,
            nbytes,
            req.conn_header(),
        )
        total = len(hd) + nbytes
        buf = req.conn.response_buffer(total)
        mv = buf.data
        mv[: len(hd)] = hd
        # rows are gathered straight into the response buffer, behind the header bytes
        out = buf[len(hd) : total].reshape(shape)
        gather = store.lookup_into if lookup else store.fetch_into
        if nbytes <= self.limits.inline_max_bytes:
            gather(ids, out)
            return _Reply(200, [mv[:total]], endpoint, store.name, rows=ids.size, nbytes=nbytes)
        n_rows = ids.size

        def run() -> _Reply:
            gather(ids, out)
            return _Reply(200, [mv[:total]], endpoint, store.name, rows=n_rows, nbytes=nbytes)

        return _Deferred(run, endpoint, store.name)

    def _encoded(
        self,
        req: _Request,
        store: Store,
        ids: np.ndarray,
        out: np.ndarray,
        fmt: str,
        endpoint: str,
        lookup: bool,
    ) -> _Reply:
        shape = list(out.shape)
        if fmt == P.CT_JSON:
            body = b"".join(
                (
                    b'{"table":',
                    P.json_dumps(store.name),
                    b',"shape":',
                    P.json_dumps(shape),
                    b',"row_bytes":%d,"encoding":"base64","data":"' % out.shape[-1],
                    base64.b64encode(out.data),
                    b'"}',
                )
            )
            hd = self._head(200, P.CT_JSON, len(body), req.conn_header())
            return _Reply(200, [hd + body], endpoint, store.name, rows=ids.size, nbytes=len(body))
        pa = _pyarrow()
        flat = out.reshape(-1, store.row_bytes)
        rows = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(store.row_bytes), len(flat), [None, pa.py_buffer(flat)]
        )
        arrays = [rows]
        names = ["row"]
        if not lookup:
            arrays.insert(0, pa.array(ids.reshape(-1), type=pa.int64()))
            names.insert(0, "id")
        meta = {"engramdb.table": store.name, "engramdb.shape": P.format_shape(out.shape)}
        batch = pa.RecordBatch.from_arrays(arrays, names=names)
        batch = batch.replace_schema_metadata(meta)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        data = sink.getvalue()
        hd = self._head(
            200,
            P.CT_ARROW,
            data.size,
            b"X-Engramdb-Shape: %s\r\n" % P.format_shape(out.shape).encode() + req.conn_header(),
        )
        return _Reply(
            200, [hd, memoryview(data)], endpoint, store.name, rows=ids.size, nbytes=data.size
        )

    # -- views (Store-P) -------------------------------------------------------------------------
    def _view(self, req: _Request, store: Store, rest: str) -> _Reply:
        """``GET views/{v}``, ``POST views/{v}/records|lookup|lookup_tokens``. Active only when
        this build's `Store` has ``view(name)``; otherwise a 404 that says so."""
        view_fn = getattr(store, "view", None)
        if not callable(view_fn):
            raise P.UnknownEndpoint(
                "views are not available: this EngramDB build has no Store.view (Store-P), so "
                f"table {store.name!r} has no view endpoints"
            )
        vname, _, action = rest.partition("/")
        if "%" in vname:
            vname = unquote(vname)
        key = (store.name, vname)
        view = self._views.get(key)
        if view is None:
            # opening a view reads its header pages and maps it: once per server, not per
            # request (TableNotFound / StaleView propagate as typed errors)
            view = self._views[key] = view_fn(vname)
        if action == "":
            _method(req.head, "GET")
            doc: dict[str, Any] = {"table": store.name, "name": vname}
            for attr in ("n_records", "record_bytes", "slot_bytes", "key_width", "stale"):
                v = getattr(view, attr, None)
                if isinstance(v, (int, float, str, bool)):
                    doc[attr] = v
            return self._json_reply(req, P.json_dumps(doc), "view", store.name)
        method = _VIEW_METHODS.get(action)
        if method is None:
            raise P.UnknownEndpoint(
                f"no view action {action!r}; use one of {', '.join(sorted(_VIEW_METHODS))}"
            )
        _method(req.head, "POST")
        ids = self._ids(req, key="ids")
        result = getattr(view, method)(ids)
        records = np.ascontiguousarray(np.asarray(result))
        if records.dtype != np.uint8:
            records = records.view(np.uint8) if records.flags.c_contiguous else records
        fmt = _negotiate(req.head, P.CT_JSON if req.head.media_type == P.CT_JSON else P.CT_BINARY)
        if fmt == P.CT_ARROW:
            raise P.NotAcceptable("view records are served as binary or JSON, not Arrow")
        if fmt == P.CT_JSON:
            return self._encoded(req, store, ids, records, fmt, "view", True)
        hd = (
            b"HTTP/1.1 200 OK\r\nServer: engramdb/%s\r\nDate: %s\r\n"
            b"Content-Type: application/octet-stream\r\nX-Engramdb-Shape: %s\r\n"
            b"Content-Length: %d\r\n%s\r\n"
            % (
                engramdb.__version__.encode(),
                self._date,
                P.format_shape(records.shape).encode(),
                records.nbytes,
                req.conn_header(),
            )
        )
        return _Reply(
            200,
            [hd, records.data.cast("B")],
            "view",
            store.name,
            rows=ids.size,
            nbytes=records.nbytes,
        )


def _method(head: P.RequestHead, allowed: str) -> None:
    if head.method != allowed:
        raise P.MethodNotAllowed(f"{head.path[:200]} takes {allowed}, not {head.method}", allowed)


def _negotiate(head: P.RequestHead, default: str) -> str:
    """The response encoding: the first type in ``Accept`` this server writes (q-values are
    not ranked), ``default`` for ``*/*`` or no ``Accept``."""
    accept = head.headers.get("accept")
    if not accept:
        return default
    for part in accept.split(","):
        kind = part.split(";", 1)[0].strip().lower()
        if kind in (P.CT_BINARY, P.CT_JSON, P.CT_ARROW):
            return kind
        if kind in ("*/*", "application/*"):
            return default
    raise P.NotAcceptable(
        f"cannot answer with {accept[:200]!r}; this endpoint writes {P.CT_BINARY}, {P.CT_JSON} "
        f"or {P.CT_ARROW}"
    )


def _clear_stale_socket(path: str) -> None:
    """Remove ``path`` if it is a socket nobody listens on (its server was killed); refuse to
    touch anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgument(f"{path!r} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as e:
        raise InvalidArgument(f"cannot check existing socket {path!r}: {e.strerror}") from None
    finally:
        probe.close()
    raise InvalidArgument(f"another server is already listening on {path!r}")


class _Connection:
    """One client connection: reads requests, answers them in order, one at a time.

    States: reading (``busy`` False) -> a reply is gathered off-loop or only partly sent
    (``busy`` True; reading paused, which pushes back on a client that pipelines) -> reading.
    """

    __slots__ = (
        "server",
        "sock",
        "fd",
        "loop",
        "rbuf",
        "recv_buf",
        "recv_view",
        "head",
        "body_at",
        "discard",
        "busy",
        "pending",
        "close_after",
        "closed",
        "reading",
        "writing",
        "lingering",
        "last_active",
        "scratch",
        "continued",
        "fresh",
    )

    def __init__(self, server: Server, sock: socket.socket):
        assert server._loop is not None
        self.server = server
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = server._loop
        self.rbuf = bytearray()
        self.recv_buf = bytearray(RECV_CHUNK)
        self.recv_view = memoryview(self.recv_buf)
        self.head: P.RequestHead | None = None
        self.body_at = 0
        self.discard = 0
        self.busy = False
        self.pending: list[memoryview] | None = None
        self.close_after = False
        self.closed = False
        self.reading = False
        self.writing = False
        self.lingering = False
        self.last_active = time.monotonic()
        self.scratch: np.ndarray | None = None
        self.continued = False
        self.fresh = True  # the first bytes may still pick the wire protocol
        self._read_on()

    # -- event registration ----------------------------------------------------------------------
    def _read_on(self) -> None:
        if not self.reading and not self.closed:
            self.loop.add_reader(self.fd, self.on_readable)
            self.reading = True

    def _read_off(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.fd)
            self.reading = False

    # -- reading ---------------------------------------------------------------------------------
    def on_readable(self) -> None:
        try:
            n = self.sock.recv_into(self.recv_buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if self.lingering:
            if n == 0:
                self.close()
            return
        if n == 0:  # the peer closed its side: finish what is in flight, then close
            self._read_off()
            if self.busy:
                self.close_after = True
            else:
                self.close()
            return
        self.last_active = time.monotonic()
        start = 0
        if self.discard:  # skipping the body of a refused request
            start = min(self.discard, n)
            self.discard -= start
            if start == n:
                return
        self.rbuf += self.recv_view[start:n]
        if self.fresh:
            head = bytes(self.rbuf[: len(REQUEST_MAGIC)])
            if REQUEST_MAGIC.startswith(head) and len(head) < len(REQUEST_MAGIC):
                return  # too few bytes to tell the protocols apart yet
            self.fresh = False
            if head == REQUEST_MAGIC:
                if self.server._lane is not None:
                    self._hand_to_lane()
                else:
                    self._fatal(
                        P.MalformedRequest(
                            "this server does not speak the wire protocol (started without "
                            "it); connect with wire=False"
                        )
                    )
                return
        self.process()

    def _hand_to_lane(self) -> None:
        """This connection speaks the wire protocol: give its socket (and the bytes read so
        far) to the wire lane and forget it here."""
        lane = self.server._lane
        assert lane is not None
        self._read_off()
        self.closed = True
        initial, self.rbuf = bytes(self.rbuf), bytearray()
        self.server._forget(self)
        lane.adopt(self.sock, initial)

    def process(self) -> None:
        """Answer every complete request in the buffer, in order, until one goes off-loop
        or cannot be sent at once."""
        limits = self.server.limits
        while not self.busy and not self.closed and not self.lingering:
            rbuf = self.rbuf
            head = self.head
            if head is None:
                if not rbuf:
                    if self.close_after:
                        self.close()
                    return
                end = rbuf.find(b"\r\n\r\n", 0, limits.max_header_bytes + 4)
                if end < 0:
                    if len(rbuf) > limits.max_header_bytes:
                        self._fatal(
                            P.RequestTooLarge(
                                f"request header block exceeds {limits.max_header_bytes} bytes"
                            )
                        )
                    return
                raw = bytes(rbuf[:end])
                head = _HEAD_CACHE.get(raw)
                if head is None:
                    try:
                        head = P.parse_request_head(raw, max_header_bytes=limits.max_header_bytes)
                    except EngramDBError as e:
                        self._fatal(e)
                        return
                    if len(raw) <= _HEAD_CACHE_KEY_MAX:
                        if len(_HEAD_CACHE) >= _HEAD_CACHE_SIZE:
                            _HEAD_CACHE.clear()
                        _HEAD_CACHE[raw] = head
                self.body_at = end + 4
                length = head.content_length
                if length > limits.max_body_bytes:
                    del rbuf[: self.body_at]
                    skip = min(length, len(rbuf))
                    del rbuf[:skip]
                    self.discard = length - skip
                    err = P.RequestTooLarge(
                        f"request body is {length:,} bytes, the limit is "
                        f"{limits.max_body_bytes:,} (max_body_bytes)"
                    )
                    self._send_reply(
                        self.server.error_reply(
                            err, _endpoint_of(head.path), "", keep_alive=self._keep(head)
                        ),
                        time.perf_counter(),
                    )
                    continue
                self.head = head
                self.continued = False
            length = head.content_length
            if len(rbuf) < self.body_at + length:
                if not self.continued and head.headers.get("expect", "").lower() == "100-continue":
                    self.continued = True
                    self._send_parts([memoryview(b"HTTP/1.1 100 Continue\r\n\r\n")])
                return
            self.head = None
            body = bytes(rbuf[self.body_at : self.body_at + length])
            del rbuf[: self.body_at + length]
            self._dispatch(head, body)

    def _keep(self, head: P.RequestHead) -> bool:
        return head.keep_alive and not self.close_after and not self.server.draining

    def _dispatch(self, head: P.RequestHead, body: bytes) -> None:
        t0 = time.perf_counter()
        server = self.server
        keep = self._keep(head)
        req = _Request(head, body, self, keep)
        try:
            result = server.route(req)
        except Exception as e:  # every refusal becomes a JSON error; the loop keeps serving
            if not isinstance(e, EngramDBError):
                log.exception("error serving %s %s", head.method, head.path[:200])
            result = server.error_reply(
                e, _endpoint_of(head.path), _table_of(server, head.path), keep_alive=keep
            )
        if not keep:
            self.close_after = True
        if isinstance(result, _Deferred):
            self._defer(result, t0, keep, len(body))
        else:
            self._send_reply(result, t0, len(body))

    def _defer(self, job: _Deferred, t0: float, keep: bool, bytes_in: int) -> None:
        server = self.server
        self.busy = True
        self._read_off()
        server._in_flight += 1
        fut: Future[_Reply] = server._executor.submit(job.fn)

        def done(f: Future[_Reply]) -> None:
            server._in_flight -= 1
            try:
                reply = f.result()
            except Exception as e:
                if not isinstance(e, EngramDBError):
                    log.exception("error in an off-loop gather")
                reply = server.error_reply(e, job.endpoint, job.table, keep_alive=keep)
            self.busy = False
            if self.closed:
                return
            self._send_reply(reply, t0, bytes_in)
            if not self.busy and not self.closed:
                self._read_on()
                self.process()

        fut.add_done_callback(lambda f: self.loop.call_soon_threadsafe(done, f))

    # -- writing ---------------------------------------------------------------------------------
    def response_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` for the next response: the connection's own
        (reused; safe because a connection sends one response at a time) or, above
        `SCRATCH_MAX`, a fresh one that is dropped after sending."""
        if nbytes > SCRATCH_MAX:
            return np.empty(nbytes, np.uint8)
        buf = self.scratch
        if buf is None or buf.size < nbytes:
            buf = self.scratch = np.empty(max(nbytes, 16 * 1024), np.uint8)
        return buf

    def _send_reply(self, reply: _Reply, t0: float, bytes_in: int = 0) -> None:
        if reply.close:
            self.close_after = True
        # send first, count after: the client can start on the response meanwhile
        self._send_parts(reply.parts)
        self.server.metrics.observe(
            reply.endpoint,
            reply.table,
            reply.status,
            rows=reply.rows,
            bytes_in=bytes_in,
            bytes_out=reply.nbytes,
            seconds=time.perf_counter() - t0,
            error=reply.error,
        )
        if not self.busy and self.close_after and not self.closed:
            self._linger()

    def _send_parts(self, parts: list[Any]) -> None:
        try:
            if len(parts) == 1:
                sent = self.sock.send(parts[0])
            else:
                sent = self.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        rest: list[memoryview] = []
        for p in parts:
            size = len(p)
            if sent >= size:
                sent -= size
                continue
            rest.append(memoryview(p)[sent:])
            sent = 0
        if rest:
            # the socket buffer is full: keep views of the unsent bytes (no copy) and pause
            # reading until they are out
            self.pending = rest
            self.busy = True
            self._read_off()
            if not self.writing:
                self.loop.add_writer(self.fd, self.on_writable)
                self.writing = True

    def on_writable(self) -> None:
        parts = self.pending
        self.pending = None
        self.busy = False
        self.loop.remove_writer(self.fd)
        self.writing = False
        if parts:
            self._send_parts(parts)
        if self.busy or self.closed:
            return
        if self.close_after:
            self._linger()
            return
        if self.scratch is not None and self.scratch.size > SCRATCH_MAX:
            self.scratch = None
        self._read_on()
        self.process()

    # -- closing ---------------------------------------------------------------------------------
    def _fatal(self, exc: EngramDBError) -> None:
        """The request cannot be framed: answer with the error and close the connection."""
        self.close_after = True
        self.rbuf.clear()
        self.head = None
        self._send_reply(
            self.server.error_reply(exc, "malformed", "", keep_alive=False), time.perf_counter()
        )

    def drain(self) -> None:
        """The server is stopping: close now if idle, else after the current response."""
        if not self.busy and self.head is None and not self.rbuf:
            self.close()
        else:
            self.close_after = True

    def _linger(self) -> None:
        """Half-close after the last response and drop what the peer still sends, so our
        close cannot reset the connection before the peer read that response."""
        if self.lingering or self.closed:
            return
        self.lingering = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()
            return
        self._read_on()
        self.loop.call_later(LINGER_SECONDS, self.close)

    def close(self) -> None:
        if self.closed:
            return
        self._read_off()
        if self.writing:
            self.loop.remove_writer(self.fd)
            self.writing = False
        self.closed = True
        self.pending = None
        self.scratch = None
        with contextlib.suppress(OSError):
            self.sock.close()
        self.server._forget(self)


_ENDPOINTS = {"fetch", "lookup"}


def _endpoint_of(path: str) -> str:
    """A metrics label from a path, from a fixed set (arbitrary paths must not grow it)."""
    if path.startswith("/v1/tables/"):
        rest = path[len("/v1/tables/") :].split("/")
        if len(rest) == 1 or rest[1] == "":
            return "table"
        if rest[1] in _ENDPOINTS:
            return rest[1]
        if rest[1] == "views":
            return "view"
        return "other"
    return {
        "/v1/tables": "tables",
        "/v1/health": "health",
        "/healthz": "health",
        "/metrics": "metrics",
        "/v1/metrics": "metrics",
    }.get(path, "other")


def _table_of(server: Server, path: str) -> str:
    """The table label of a path: only names of real tables (no unbounded label growth)."""
    if path.startswith("/v1/tables/"):
        name = unquote(path[len("/v1/tables/") :].split("/", 1)[0])
        if name in server.db:
            return name
    return ""


def serve(
    db: str | os.PathLike[str],
    *,
    on_ready: Callable[[Server], None] | None = None,
    **kwargs: Any,
) -> None:
    """Serve ``db`` on this thread until SIGTERM / SIGINT. Keywords as for `Server`."""
    Server(db, **kwargs).serve_forever(on_ready=on_ready)
