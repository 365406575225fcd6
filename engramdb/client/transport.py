"""The client's transport: where the server is (`Endpoint`), one keep-alive HTTP connection
(`HttpConnection`) and one wire-protocol connection (`WireConnection`).

Both connections use blocking sockets with kernel timeouts (a Python-level timeout would add
a ``poll()`` before every ``recv``, a measurable part of a 30 us round trip), send a request
with one `send_all` (``sendmsg`` of head and body, no join), and receive response rows
straight into the caller's buffer with ``recv_into``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from typing import Any
from urllib.parse import urlsplit

from engramdb.errors import InvalidArgument
from engramdb.serve.frames import RESPONSE, RESPONSE_MAGIC, SPIN_BACKOFF_MAX
from engramdb.serve.protocol import (
    DEFAULT_PORT,
    ProtocolError,
    ResponseHead,
    ServiceUnavailable,
    parse_response_head,
)

#: Largest response header block the client accepts.
MAX_HEAD_BYTES = 64 * 1024


class NoResponse(Exception):
    """The connection ended before any byte of the response arrived (a stale keep-alive
    connection the server had closed): safe to retry once on a new connection."""


class Endpoint:
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


def send_all(sock: socket.socket, head: bytes, body: Any) -> None:
    """Send ``head`` then ``body`` (any buffer, or None) with ``sendmsg`` (no join), resuming
    after partial sends. A peer that closed raises `NoResponse` (nothing was answered)."""
    try:
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
    except (BrokenPipeError, ConnectionResetError) as e:
        raise NoResponse() from e


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


class HttpConnection:
    """One keep-alive HTTP connection and its receive buffer."""

    __slots__ = ("sock", "buf", "view", "reused")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(MAX_HEAD_BYTES)
        self.view = memoryview(self.buf)
        self.reused = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def roundtrip(
        self, head: bytes, body: Any, sink: memoryview | None
    ) -> tuple[ResponseHead, bytes | None]:
        """Send one request; read its response. A 200 response of exactly ``len(sink)``
        bytes goes straight into ``sink`` (returns None as body); anything else is
        returned as bytes."""
        send_all(self.sock, head, body)
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
                    raise NoResponse() from e
                raise
            if n == 0:
                if got == 0:
                    raise NoResponse()
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


class WireConnection:
    """One wire-protocol connection (`engramdb.serve.frames`), past its HELLO.

    Waiting for a reply first polls the socket without sleeping for up to ``spin`` seconds
    (a small read comes back in ~20-40 us), then blocks: a client in a tight loop never
    pays the scheduler's wake-up on top of the server's work. Polling adapts: after ``k``
    replies in a row that did not come within the window (large reads, a busy server, more
    clients than cores) the next ``2**(k-1)`` calls (at most `SPIN_BACKOFF_MAX`) block at
    once, so spinning stops taking CPU from the server when it does not pay off."""

    __slots__ = ("sock", "head", "hview", "spin", "reused", "skip", "misses")

    SPIN_BACKOFF_MAX = SPIN_BACKOFF_MAX

    def __init__(self, sock: socket.socket, spin: float):
        self.sock = sock
        self.head = bytearray(RESPONSE.size)
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
                    raise NoResponse()
                if n > 0:
                    got = n
        while got < size:
            n = sock.recv_into(view[got:])
            if n == 0:
                if got == 0 and spin:
                    raise NoResponse()
                raise ServiceUnavailable("the server closed the connection mid-response")
            got += n

    def call(self, head: bytes, body: Any, sink: memoryview | None) -> tuple[int, bytes | None]:
        """Send one frame (``head`` + ``body``); read the reply. A 200 reply of exactly
        ``len(sink)`` bytes goes straight into ``sink``; anything else is returned."""
        send_all(self.sock, head, body)
        try:
            self._recv(self.hview, True)
        except ConnectionResetError as e:
            raise NoResponse() from e
        magic, status, _flags, _res, length = RESPONSE.unpack_from(self.head)
        if magic != RESPONSE_MAGIC:
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
