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
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np

from engramdb.errors import InvalidArgument, ShapeMismatch, StoreClosed, TableNotFound
from engramdb.serve import wire as W
from engramdb.serve.auth import check_token
from engramdb.serve.protocol import (
    CT_ARROW,
    CT_BINARY,
    DEFAULT_PORT,
    H_SHAPE,
    ProtocolError,
    ResponseHead,
    ServiceError,
    ServiceUnavailable,
    format_shape,
    parse_response_head,
    raise_for_error,
)
from engramdb.validate import (
    as_rowids,
    check_bounds,
    check_head_bounds,
    check_lookup_ids,
    check_output,
)

__all__ = ["Client", "RemoteStore", "RemoteView", "connect"]

#: Largest response header block the client accepts.
MAX_HEAD_BYTES = 64 * 1024
_LITTLE = sys.byteorder == "little"


class _Endpoint:
    """Where the server is: ``unix`` path, or TCP ``host`` / ``port`` (+ a path prefix)."""

    def __init__(self, url: str):
        self.url = url
        self.unix: str | None = None
        self.host = "localhost"
        self.port = DEFAULT_PORT
        self.prefix = ""
        if url.startswith("unix://"):
            path = url[len("unix://") :]
            if not path.startswith("/"):
                raise InvalidArgument(
                    f"unix URL {url!r} needs an absolute path: unix:///path/to/socket"
                )
            self.unix = path
            self.host_header = b"localhost"
            return
        if url.startswith("https://"):
            raise InvalidArgument(
                f"{url!r}: the client speaks plain HTTP; reach a remote server through a TLS "
                "tunnel or proxy and connect to its local end, or use a Unix socket"
            )
        if not url.startswith("http://"):
            raise InvalidArgument(f"unsupported URL {url!r}: use http://HOST:PORT or unix:///PATH")
        parts = urlsplit(url)
        if not parts.hostname:
            raise InvalidArgument(f"URL {url!r} names no host")
        try:
            port = parts.port
        except ValueError:
            raise InvalidArgument(f"URL {url!r} has a bad port") from None
        self.host = parts.hostname
        self.port = port if port is not None else DEFAULT_PORT
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"{host}:{self.port}".encode()

    def connect(self, timeout: float) -> socket.socket:
        try:
            if self.unix is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(self.unix)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((self.host, self.port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise ServiceUnavailable(f"cannot connect to {self.url}: {e.strerror or e}") from None
        # Blocking mode with kernel timeouts: a Python-level timeout would add a poll()
        # before every recv, which is a measurable part of a 30 us round trip.
        sock.settimeout(None)
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        return sock


_OK = b"HTTP/1.1 200 OK\r\n"
_CL = b"\r\nContent-Length: "


def _fast_head(buf: bytearray, end: int) -> ResponseHead | None:
    """The head of a plain ``200 OK`` from this server without the general parser (which
    costs ~2 us): status and Content-Length only. None sends the caller to the parser."""
    if not buf.startswith(_OK):
        return None
    i = buf.find(_CL, 0, end)
    if i < 0 or buf.find(b"\r\nConnection:", 0, end) >= 0:
        return None
    j = buf.find(b"\r\n", i + len(_CL), end + 2)
    value = bytes(buf[i + len(_CL) : j])
    if not value.isdigit():
        return None
    return ResponseHead(200, {"content-length": value.decode()})


class _NoResponse(Exception):
    """The connection ended before any byte of the response arrived (a stale keep-alive
    connection the server had closed): safe to retry once on a new connection."""


class _Connection:
    """One keep-alive connection and its receive buffer."""

    __slots__ = ("sock", "buf", "view", "reused")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(MAX_HEAD_BYTES)
        self.view = memoryview(self.buf)
        self.reused = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _send(self, head: bytes, body: Any) -> None:
        sock = self.sock
        if body is None or len(body) == 0:
            sock.sendall(head)
            return
        parts: list[Any] = [head, body]
        while parts:
            sent = sock.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = memoryview(parts[0])[sent:]

    def roundtrip(
        self, head: bytes, body: Any, sink: memoryview | None
    ) -> tuple[ResponseHead, bytes | None]:
        """Send one request; read its response. A 200 response of exactly ``len(sink)``
        bytes goes straight into ``sink`` (returns None as body); anything else is
        returned as bytes."""
        try:
            self._send(head, body)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _NoResponse() from e
        sock = self.sock
        buf = self.buf
        view = self.view
        got = 0
        end = -1
        while end < 0:
            if got == len(buf):
                raise ProtocolError(f"response header block exceeds {MAX_HEAD_BYTES} bytes")
            try:
                n = sock.recv_into(view[got:])
            except ConnectionResetError as e:
                if got == 0:
                    raise _NoResponse() from e
                raise
            if n == 0:
                if got == 0:
                    raise _NoResponse()
                raise ServiceUnavailable("the server closed the connection mid-response")
            got += n
            end = buf.find(b"\r\n\r\n", 0, got)
        rh = _fast_head(buf, end) or parse_response_head(bytes(buf[:end]))
        start = end + 4
        length = rh.content_length
        have = got - start
        if have > length:
            raise ProtocolError("the server sent more bytes than its Content-Length")
        if sink is not None and rh.status == 200:
            if length != len(sink):
                raise ProtocolError(f"response has {length} bytes, the request expects {len(sink)}")
            sink[:have] = view[start:got]
            dest = sink
            out = None
        else:
            data = bytearray(length)
            data[:have] = view[start:got]
            dest = memoryview(data)
            out = data
        while have < length:
            n = sock.recv_into(dest[have:])
            if n == 0:
                raise ServiceUnavailable("the server closed the connection mid-response")
            have += n
        return rh, (bytes(out) if out is not None else None)


class _WireConnection:
    """One wire-protocol connection (`engramdb.serve.wire`), past its HELLO.

    Waiting for a reply first polls the socket without sleeping for up to ``spin`` seconds
    (a small read comes back in ~20-40 us), then blocks: a client in a tight loop never
    pays the scheduler's wake-up on top of the server's work. Polling adapts: after ``k``
    replies in a row that did not come within the window (large reads, a busy server, more
    clients than cores) the next ``2**(k-1)`` calls (at most `SPIN_BACKOFF_MAX`) block at
    once, so spinning stops taking CPU from the server when it does not pay off."""

    __slots__ = ("sock", "head", "hview", "spin", "reused", "skip", "misses")

    SPIN_BACKOFF_MAX = 64

    def __init__(self, sock: socket.socket, spin: float):
        self.sock = sock
        self.head = bytearray(W.RESPONSE.size)
        self.hview = memoryview(self.head)
        self.spin = spin
        self.reused = False
        self.skip = 0
        self.misses = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _recv(self, view: memoryview, spin: bool) -> None:
        """Fill ``view`` from the socket."""
        sock = self.sock
        got = 0
        size = len(view)
        if spin and self.spin:
            if self.skip:
                self.skip -= 1
            else:
                deadline = time.perf_counter() + self.spin
                while True:
                    try:
                        n = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                        self.misses = 0
                        break
                    except BlockingIOError:
                        if time.perf_counter() >= deadline:
                            self.misses += 1
                            self.skip = min(self.SPIN_BACKOFF_MAX, 1 << (self.misses - 1))
                            n = -1
                            break
                if n == 0:
                    raise _NoResponse()
                if n > 0:
                    got = n
        while got < size:
            n = sock.recv_into(view[got:])
            if n == 0:
                if got == 0 and spin:
                    raise _NoResponse()
                raise ServiceUnavailable("the server closed the connection mid-response")
            got += n

    def call(self, head: bytes, body: Any, sink: memoryview | None) -> tuple[int, bytes | None]:
        """Send one frame (``head`` + ``body``); read the reply. A 200 reply of exactly
        ``len(sink)`` bytes goes straight into ``sink``; anything else is returned."""
        sock = self.sock
        try:
            if body is None or len(body) == 0:
                sock.sendall(head)
            else:
                parts: list[Any] = [head, body]
                while parts:
                    sent = sock.sendmsg(parts)
                    while parts and sent >= len(parts[0]):
                        sent -= len(parts[0])
                        parts.pop(0)
                    if parts and sent:
                        parts[0] = memoryview(parts[0])[sent:]
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _NoResponse() from e
        try:
            self._recv(self.hview, True)
        except ConnectionResetError as e:
            raise _NoResponse() from e
        magic, status, _flags, _res, length = W.RESPONSE.unpack_from(self.head)
        if magic != W.RESPONSE_MAGIC:
            if magic.startswith(b"HTTP"):
                raise ProtocolError(
                    "the server answered the wire protocol with HTTP: it runs without the "
                    "wire protocol; connect with wire=False"
                )
            raise ProtocolError(f"not a wire-protocol reply (magic {bytes(magic)!r})")
        if status == 200 and sink is not None:
            if length != len(sink):
                raise ProtocolError(f"reply has {length} bytes, the request expects {len(sink)}")
            self._recv(sink, False)
            return status, None
        data = bytearray(length)
        if length:
            self._recv(memoryview(data), False)
        return status, bytes(data)


class Client:
    """A connection to ``engramdb serve``: the remote twin of `engramdb.Database`.

    ``tables`` (names), ``client[name]`` (a `RemoteStore`), ``in`` / ``len`` / iteration,
    ``info()``, ``health()``, ``metrics()``. Thread-safe: each thread's request borrows a
    connection from a pool of up to ``pool_size`` idle keep-alive connections.
    """

    def __init__(
        self,
        url: str,
        token: str | bytes | None = None,
        *,
        timeout: float = 30.0,
        pool_size: int = 4,
        wire: bool | None = None,
        spin_us: float = 100.0,
    ):
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}")
        if not (0 <= spin_us < 1e6):
            raise InvalidArgument(f"spin_us must be in [0, 1e6), got {spin_us!r}")
        self.url = url
        self._endpoint = _Endpoint(url)
        self.timeout = float(timeout)
        self.pool_size = int(pool_size)
        if isinstance(token, str):
            token = token.encode()
        self._auth = b""
        self._token = b""
        if token is not None:
            self._token = check_token(token)
            self._auth = b"Authorization: Bearer %s\r\n" % self._token
        #: rows travel over the wire protocol (Unix sockets by default), the rest over HTTP
        self.wire = self._endpoint.unix is not None if wire is None else bool(wire)
        self._spin = float(spin_us) / 1e6
        self._wire_pool: list[_WireConnection] = []
        self._wire_tables: dict[str, int] = {}
        self._pool: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._stores: dict[str, RemoteStore] = {}
        self._doc: dict[str, Any] = {}
        try:
            self.refresh()
        except BaseException:
            self.close()  # a refused connect must not leak its pooled socket
            raise

    # -- plumbing ---------------------------------------------------------------------------------
    def _prefix(self, method: str, path: str) -> bytes:
        """Request line and fixed headers up to (not including) ``Content-Length``."""
        target = (self._endpoint.prefix + path).encode()
        return b"%s %s HTTP/1.1\r\nHost: %s\r\n%s" % (
            method.encode(),
            target,
            self._endpoint.host_header,
            self._auth,
        )

    def _exchange(
        self, pool: list[Any], open_conn: Callable[[], Any], send: Callable[[Any], Any]
    ) -> tuple[Any, Any]:
        """``send(conn)`` on a connection from ``pool`` (or a new one from ``open_conn``);
        returns ``(conn, result)`` and leaves giving the connection back to the caller.
        Retries once on a fresh connection when a pooled one turns out to be closed
        (requests are reads, so a repeat is harmless); transport failures become
        `ServiceUnavailable`."""
        for attempt in (0, 1):
            if self._closed:
                raise StoreClosed(f"client for {self.url} is closed")
            with self._lock:
                conn = pool.pop() if pool else None
            if conn is None:
                conn = open_conn()
            try:
                return conn, send(conn)
            except _NoResponse:
                conn.close()
                if conn.reused and attempt == 0:
                    continue
                raise ServiceUnavailable(
                    f"{self.url} closed the connection without answering"
                ) from None
            except (BlockingIOError, TimeoutError):
                conn.close()
                raise ServiceUnavailable(
                    f"no response from {self.url} within {self.timeout:g} s"
                ) from None
            except OSError as e:
                conn.close()
                if isinstance(e, ServiceError):
                    raise
                raise ServiceUnavailable(f"{self.url}: {e.strerror or e}") from None
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _give_back(self, pool: list[Any], conn: Any) -> None:
        with self._lock:
            if not self._closed and len(pool) < self.pool_size:
                conn.reused = True
                pool.append(conn)
                return
        conn.close()

    def request(
        self, head: bytes, body: Any = None, sink: memoryview | None = None
    ) -> tuple[ResponseHead, bytes | None]:
        """One HTTP round trip; raises the typed error of a non-200 response."""
        conn, (rh, data) = self._exchange(
            self._pool,
            lambda: _Connection(self._endpoint.connect(self.timeout)),
            lambda c: c.roundtrip(head, body, sink),
        )
        if rh.keep_alive:
            self._give_back(self._pool, conn)
        else:
            conn.close()
        if rh.status != 200:
            raise_for_error(rh.status, data or b"", where=self.url)
        return rh, data

    # -- the wire protocol ------------------------------------------------------------------------
    def _wire_open(self) -> _WireConnection:
        conn = _WireConnection(self._endpoint.connect(self.timeout), self._spin)
        try:
            token = self._token
            status, data = conn.call(
                W.pack_request(W.OP_HELLO, 0, (), len(token)), token or None, None
            )
            if status != 200:
                raise_for_error(status, data or b"", where=self.url)
            doc = W.parse_hello(data or b"")
        except _NoResponse:
            conn.close()
            raise ServiceUnavailable(f"{self.url} closed the connection at HELLO") from None
        except BaseException:
            conn.close()
            raise
        self._wire_tables = {str(n): i for i, n in enumerate(doc["tables"])}
        return conn

    def wire_call(
        self, op: int, table: str, dims: tuple[int, ...], ids: Any, sink: memoryview
    ) -> None:
        """One FETCH / LOOKUP frame for ``table`` with int64 ``ids`` of shape ``dims``; the
        rows land in ``sink``. Raises the typed error of a refusal."""
        body = ids.data.cast("B")

        def send(conn: _WireConnection) -> tuple[int, bytes | None]:
            index = self._wire_tables.get(table)
            if index is None:
                raise TableNotFound(f"no table {table!r} at {self.url} (tables: {self.tables})")
            return conn.call(W.pack_request(op, index, dims, len(body)), body, sink)

        conn, (status, data) = self._exchange(self._wire_pool, self._wire_open, send)
        self._give_back(self._wire_pool, conn)
        if status != 200:
            raise_for_error(status, data or b"", where=self.url)

    def _get_json(self, path: str) -> Any:
        _, data = self.request(self._prefix("GET", path) + b"\r\n")
        return json.loads(data or b"null")

    # -- the Database-like surface ------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the table list and limits from the server (done once at connect)."""
        self._doc = self._get_json("/v1/tables")
        self._stores.clear()

    @property
    def tables(self) -> list[str]:
        return sorted(t["name"] for t in self._doc["tables"])

    @property
    def limits(self) -> dict[str, Any]:
        return dict(self._doc["limits"])

    def __contains__(self, name: object) -> bool:
        return name in self.tables

    def __iter__(self) -> Any:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self._doc["tables"])

    def __getitem__(self, name: str) -> RemoteStore:
        if self._closed:
            raise StoreClosed(f"client for {self.url} is closed")
        store = self._stores.get(name)
        if store is None:
            for t in self._doc["tables"]:
                if t["name"] == name:
                    store = self._stores[name] = RemoteStore(self, t)
                    break
            else:
                raise TableNotFound(f"no table {name!r} at {self.url} (tables: {self.tables})")
        return store

    def info(self) -> dict[str, Any]:
        """The server's table list, limits and generation (as read at connect/refresh)."""
        doc: dict[str, Any] = json.loads(json.dumps(self._doc))
        return doc

    def health(self) -> dict[str, Any]:
        """``GET /v1/health`` (one round trip)."""
        result: dict[str, Any] = self._get_json("/v1/health")
        return result

    def metrics(self) -> str:
        """The server's Prometheus metrics text (one round trip)."""
        _, data = self.request(self._prefix("GET", "/metrics") + b"\r\n")
        return (data or b"").decode()

    def close(self) -> None:
        """Close every pooled connection. Later calls raise `StoreClosed`."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, []
            wire_pool, self._wire_pool = self._wire_pool, []
        for conn in pool:
            conn.close()
        for wconn in wire_pool:
            wconn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Client {self.url!r} tables={self.tables}>"


class RemoteStore:
    """A table on a server, with the read API of a local `Store`.

    ``fetch`` / ``fetch_into`` / ``lookup_into`` take the same arguments, validate them the
    same way and raise the same typed errors. Cost: one round trip per call (about 30 us on
    a Unix socket for a small batch), plus one per ``max_rows`` ids for huge batches.
    """

    def __init__(self, client: Client, info: dict[str, Any]):
        self._client = client
        self.info = info
        self.name: str = info["name"]
        self.row_bytes: int = int(info["row_bytes"])
        self.n_rows: int = int(info["n_rows"])
        self.heads = np.asarray(info["heads"], dtype=np.int64)
        self.head_offsets = np.asarray(info["head_offsets"], dtype=np.int64)
        self.dtype: str = info["dtype"]
        self.dim: int | None = info["dim"]
        lim = client.limits
        # rows per request: within every server limit (rows, ids body, response bytes)
        self.chunk_rows = max(
            1,
            min(
                int(lim["max_rows"]),
                int(lim["max_body_bytes"]) // 8,
                int(lim["max_response_bytes"]) // self.row_bytes,
            ),
        )
        name = quote(self.name, safe="").encode()
        self._quoted = name.decode()
        self._fetch_head = client._prefix("POST", f"/v1/tables/{name.decode()}/fetch") + (
            b"Content-Type: application/octet-stream\r\nAccept: application/octet-stream\r\n"
        )
        self._lookup_head = client._prefix("POST", f"/v1/tables/{name.decode()}/lookup") + (
            b"Content-Type: application/octet-stream\r\nAccept: application/octet-stream\r\n"
        )
        self._counters = {"fetch_calls": 0, "rows_fetched": 0, "requests": 0}

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def closed(self) -> bool:
        return self._client.closed

    def __repr__(self) -> str:
        return (
            f"<RemoteStore {self.name!r} at {self._client.url}: {self.n_rows:,} rows x "
            f"{self.row_bytes} B, {self.n_heads} heads>"
        )

    # -- reads --------------------------------------------------------------------------------------
    def _post_ids(
        self, lookup: bool, ids: np.ndarray, dest: memoryview, shape: tuple[int, ...] | None
    ) -> None:
        """One request for flat int64 ``ids``; ``shape`` travels when not None (so a
        server-side error names the same position a local Store would)."""
        if self._client.wire:
            op = W.OP_LOOKUP if lookup else W.OP_FETCH
            dims = (ids.size,) if shape is None else shape
            self._client.wire_call(op, self.name, dims, ids, dest)
            self._counters["requests"] += 1
            return
        body = ids.data.cast("B")
        head = self._lookup_head if lookup else self._fetch_head
        extra = b"" if shape is None else _shape_header(shape)
        req = head + extra + b"Content-Length: %d\r\n\r\n" % len(body)
        self._client.request(req, body, dest)
        self._counters["requests"] += 1

    def _fetch_flat(self, flat: np.ndarray, dest: memoryview, shape: tuple[int, ...]) -> None:
        """Rows of validated-or-not global int64 ``flat`` ids into the byte view ``dest``."""
        n = flat.size
        if n <= self.chunk_rows:
            # the shape travels only when it is not 1-D, so a server-side error names the
            # same position a local Store would
            self._post_ids(False, flat, dest, None if len(shape) == 1 else shape)
            return
        # several requests: validate the whole batch first, so an error leaves dest as it was
        check_bounds(flat, self.n_rows, shape=shape)
        rb = self.row_bytes
        step = self.chunk_rows
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            self._post_ids(False, flat[lo:hi], dest[lo * rb : hi * rb], None)

    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids`` (any integer array or list), shape
        ``rowids.shape + (row_bytes,)``, uint8. Allocates the result; see `fetch_into`."""
        ids = as_rowids(rowids)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        return self.fetch_into(ids, out)

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """Write the rows of global ``rowids`` into ``out`` (writable C-contiguous uint8 of
        shape ``rowids.shape + (row_bytes,)``). The rows arrive straight into ``out``."""
        if self._client.closed:
            raise StoreClosed(f"table {self.name!r}: client for {self._client.url} is closed")
        ids = as_rowids(rowids)
        check_output(out, ids.shape + (self.row_bytes,))
        flat = _wire_ids(ids)
        if flat.size:
            self._fetch_flat(flat, out.data.cast("B"), ids.shape)
            self._counters["fetch_calls"] += 1
            self._counters["rows_fetched"] += flat.size
        return out

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> None:
        """Mooncake-style lookup: ``row_ids`` int64 C-contiguous ``[B, L, H]`` of per-head
        *local* ids, ``out`` writable C-contiguous uint8 ``[B, L, H, row_bytes]``. No
        implicit conversions; an empty batch is a no-op (no round trip)."""
        if self._client.closed:
            raise StoreClosed(f"table {self.name!r}: client for {self._client.url} is closed")
        check_lookup_ids(row_ids, self.n_heads)
        check_output(out, row_ids.shape + (self.row_bytes,))
        if row_ids.size == 0:
            return
        dest = out.data.cast("B")
        if row_ids.size <= self.chunk_rows:
            self._post_ids(True, _wire_ids(row_ids), dest, row_ids.shape)
        else:
            check_head_bounds(row_ids, self.heads)
            g = (row_ids.reshape(-1, self.n_heads) + self.head_offsets).reshape(-1)
            self._fetch_flat(_wire_ids(g), dest, row_ids.shape)
        self._counters["fetch_calls"] += 1
        self._counters["rows_fetched"] += row_ids.size

    def to_global(self, local_ids: np.ndarray) -> np.ndarray:
        """Global ids for per-head local ids ``[..., H]`` (validated; no round trip)."""
        local = np.ascontiguousarray(as_rowids(local_ids))
        if local.ndim == 0 or local.shape[-1] != self.n_heads:
            raise ShapeMismatch(
                f"local ids need a last axis of {self.n_heads} heads, got {local.shape}"
            )
        check_head_bounds(local, self.heads)
        return local + self.head_offsets

    def fetch_arrow(self, rowids: Any) -> Any:
        """The rows as a ``pyarrow.Table`` with columns ``id`` (int64) and ``row``
        (``fixed_size_binary[row_bytes]``); needs pyarrow here and on the server."""
        try:
            import pyarrow.ipc
        except ImportError:
            from engramdb.errors import MissingDependency

            raise MissingDependency(
                "fetch_arrow needs pyarrow: pip install 'engramdb[arrow]'"
            ) from None
        ids = as_rowids(rowids)
        flat = _wire_ids(ids)
        body = flat.data.cast("B")
        head = self._fetch_head.replace(
            b"Accept: " + CT_BINARY.encode(), b"Accept: " + CT_ARROW.encode()
        )
        _, data = self._client.request(head + b"Content-Length: %d\r\n\r\n" % len(body), body)
        return pyarrow.ipc.open_stream(data).read_all()

    def view(self, name: str) -> RemoteView:
        """The server's Store-P view ``name`` of this table (one round trip; the server
        answers 404 `UnknownEndpoint` while its build has no views)."""
        _, data = self._client.request(
            self._client._prefix("GET", f"/v1/tables/{self._quoted}/views/{quote(name, safe='')}")
            + b"\r\n"
        )
        return RemoteView(self, name, json.loads(data or b"{}"))

    def stats(self) -> dict[str, Any]:
        """Client-side counters (calls, rows, requests); server counters are in `metrics`."""
        return {"table": self.name, "backend": "remote", "url": self._client.url, **self._counters}

    def close(self) -> None:
        """A remote table holds no resources of its own; close the `Client` instead."""

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteView:
    """A Store-P view on a server: ``read_records`` / ``lookup`` / ``lookup_tokens`` with the
    arguments of a local ``View`` (``out`` optional), answered by the server's view."""

    def __init__(self, table: RemoteStore, name: str, info: dict[str, Any]):
        self.table = table
        self.name = name
        self.info = info
        self.n_records = info.get("n_records")
        self.record_bytes = info.get("record_bytes")
        base = f"/v1/tables/{table._quoted}/views/{quote(name, safe='')}/"
        self._heads = {
            action: table._client._prefix("POST", base + action)
            + b"Content-Type: application/octet-stream\r\nAccept: application/octet-stream\r\n"
            for action in ("records", "lookup", "lookup_tokens")
        }

    def _call(self, action: str, ids: Any, out: np.ndarray | None) -> np.ndarray:
        arr = as_rowids(ids)
        rb = int(self.record_bytes or 0)
        lead = arr.shape[:-1] if action == "lookup" else arr.shape
        if out is not None:  # checked before any I/O, as a local view does
            check_output(out, lead + (rb,))
        flat = _wire_ids(arr)
        body = flat.data.cast("B")
        head = self._heads[action] + _shape_header(arr.shape if arr.ndim else (1,))
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        if out is None:
            out = np.empty(lead + (rb,), np.uint8)
        self.table._client.request(head, body, out.data.cast("B"))
        return out

    def read_records(self, ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records ``ids`` as uint8 ``ids.shape + (record_bytes,)`` (one round trip)."""
        return self._call("records", ids, out)

    def lookup(self, keys: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records of n-gram ``keys`` (int ``[..., key_width]``); misses are served by the
        server from Store-I, as a local view does."""
        return self._call("lookup", keys, out)

    def lookup_tokens(self, token_ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Records of every position of ``token_ids`` (default keygen options)."""
        return self._call("lookup_tokens", token_ids, out)


def _shape_header(shape: tuple[int, ...]) -> bytes:
    return b"%s: %s\r\n" % (H_SHAPE.encode(), format_shape(shape).encode())


def _wire_ids(ids: np.ndarray) -> np.ndarray:
    """Flat, C-contiguous little-endian int64 (no copy when ``ids`` already is)."""
    flat = ids.reshape(-1)
    if _LITTLE and flat.dtype == np.int64 and flat.flags.c_contiguous:
        return flat
    return np.ascontiguousarray(flat, dtype="<i8")


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
        from engramdb.serve.auth import load_token

        token = load_token(token_file)
    return Client(url, token, timeout=timeout, pool_size=pool_size, wire=wire, spin_us=spin_us)
