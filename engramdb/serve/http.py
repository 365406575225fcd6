"""One HTTP/1.1 client connection on the server's asyncio loop: parsing, buffers, sends.

Non-blocking sockets are driven directly with ``add_reader`` / ``add_writer``, not asyncio
transports: a transport copies every large response it cannot send at once (3.11) and joins
``writelines`` parts, and measured 6x slower than direct ``sendmsg`` for a 4,096-row
response. A response is one buffer (head + rows) sent with one ``send``; a partial send
keeps a memoryview of the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from engramdb.errors import EngramDBError
from engramdb.serve import protocol as P
from engramdb.serve.context import SCRATCH_MAX, Job, Reply, ServingContext, send_now
from engramdb.serve.frames import REQUEST_MAGIC
from engramdb.serve.routes import Request, Routes, endpoint_of

log = logging.getLogger("engramdb.serve")

#: Bytes read from a socket per ``recv_into``.
RECV_CHUNK = 64 * 1024
#: After the last response on a connection the server half-closes and keeps reading this
#: long, so a peer still sending does not get a reset that destroys the response.
LINGER_SECONDS = 1.0

#: Parsed request heads by their exact bytes. A client in a decode loop sends the same head
#: (path, headers, Content-Length) again and again: a dict hit costs ~0.2 us, parsing ~3 us.
#: Heads are never mutated after parsing, so sharing them is safe; the cache is bounded.
_HEAD_CACHE: dict[bytes, P.RequestHead] = {}
_HEAD_CACHE_SIZE = 512
_HEAD_CACHE_KEY_MAX = 1024


class HttpConnection:
    """One client connection: reads requests, answers them in order, one at a time.

    States: reading (``busy`` False) -> a reply is gathered off-loop or only partly sent
    (``busy`` True; reading paused, which pushes back on a client that pipelines) -> reading.

    ``adopt(sock, initial, peer, born)`` takes over a connection whose first bytes are the
    wire magic (None: this server does not speak the wire protocol); ``forget(conn)`` is
    called once the connection is closed or handed over; ``prove(conn)`` once its first
    request head arrived complete and authenticated (the connection is then *proven*).

    Memory before that point is bounded: the socket is read into ``recv_buf`` (one buffer
    shared by every connection of the loop; its bytes are copied out at once), the pending
    head is at most ``max_header_bytes``, and the body of a request whose head fails
    authentication is read and dropped, never buffered.
    """

    __slots__ = (
        "ctx",
        "routes",
        "adopt",
        "forget",
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
        "peer",
        "born",
        "proven",
        "head_since",
        "prove",
    )

    def __init__(
        self,
        sock: socket.socket,
        *,
        loop: asyncio.AbstractEventLoop,
        ctx: ServingContext,
        routes: Routes,
        adopt: Callable[[socket.socket, bytes, str | None, float], None] | None,
        forget: Callable[[HttpConnection], None],
        prove: Callable[[HttpConnection], None] | None = None,
        recv_buf: bytearray | None = None,
        peer: str | None = None,
    ):
        self.ctx = ctx
        self.routes = routes
        self.adopt = adopt
        self.forget = forget
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = loop
        self.rbuf = bytearray()
        self.recv_buf = recv_buf if recv_buf is not None else bytearray(RECV_CHUNK)
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
        self.peer = peer
        self.born = self.last_active
        self.proven = False
        self.head_since = 0.0  # when the pending (incomplete) request head began
        self.prove = prove
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
                if self.adopt is not None:
                    self._hand_over(self.adopt)
                else:
                    self._fatal(
                        P.MalformedRequest(
                            "this server does not speak the wire protocol (started without "
                            "it); connect with wire=False"
                        )
                    )
                return
        self.process()

    def _hand_over(self, adopt: Callable[[socket.socket, bytes, str | None, float], None]) -> None:
        """This connection speaks the wire protocol: give its socket (and the bytes read so
        far, its peer and its age) to the wire lane and forget it here."""
        self._read_off()
        self.closed = True
        initial, self.rbuf = bytes(self.rbuf), bytearray()
        self.forget(self)
        adopt(self.sock, initial, self.peer, self.born)

    def expired(self, now: float, header_timeout: float) -> bool:
        """True if a deadline passed: an incomplete request head older than
        ``header_timeout`` (bytes arriving do not extend it), or a connection that has not
        completed a first authenticated request head within ``header_timeout``."""
        if self.busy or self.lingering:
            return False
        if self.head_since and now - self.head_since > header_timeout:
            return True
        return not self.proven and now - self.born > header_timeout

    def process(self) -> None:
        """Answer every complete request in the buffer, in order, until one goes off-loop
        or cannot be sent at once. A failure while framing (a bug: every refusal is typed)
        answers 500 and closes this connection instead of leaving the peer waiting."""
        try:
            self._process()
        except Exception as e:
            log.exception("error framing a request; closing the connection")
            if not self.closed:
                self.close_after = True
                self.rbuf.clear()
                self.head = None
                self.busy = False
                self._send_reply(
                    self.routes.error_reply(e, "malformed", "", keep_alive=False),
                    time.perf_counter(),
                )

    def _process(self) -> None:
        limits = self.ctx.limits
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
                    if not self.head_since:
                        self.head_since = time.monotonic()
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
                self.head_since = 0.0
                self.body_at = end + 4
                length = head.content_length
                err: EngramDBError | None = None
                proves = False
                try:
                    proves = self.routes.authorize(head)  # before a single body byte is kept
                except EngramDBError as e:
                    err = e
                if proves and not self.proven:
                    self.proven = True
                    if self.prove is not None:
                        self.prove(self)
                if err is None and length > limits.max_body_bytes:
                    err = P.RequestTooLarge(
                        f"request body is {length:,} bytes, the limit is "
                        f"{limits.max_body_bytes:,} (max_body_bytes)"
                    )
                if err is not None:
                    del rbuf[: self.body_at]
                    skip = min(length, len(rbuf))
                    del rbuf[:skip]
                    self.discard = length - skip
                    self._send_reply(
                        self.routes.error_reply(
                            err, endpoint_of(head.path), "", keep_alive=self._keep(head)
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
        return head.keep_alive and not self.close_after and not self.ctx.draining

    def _dispatch(self, head: P.RequestHead, body: bytes) -> None:
        t0 = time.perf_counter()
        routes = self.routes
        keep = self._keep(head)
        req = Request(head, body, self.response_buffer, keep)
        try:
            result = routes.route(req)
        except Exception as e:  # every refusal becomes a JSON error; the loop keeps serving
            if not isinstance(e, EngramDBError):
                log.exception("error serving %s %s", head.method, head.path[:200])
            result = routes.error_reply(
                e, endpoint_of(head.path), routes.table_of(head.path), keep_alive=keep
            )
        if not keep:
            self.close_after = True
        if isinstance(result, Job):
            result.t0 = t0
            result.bytes_in = len(body)
            self._defer(result, keep)
        else:
            self._send_reply(result, t0, len(body))

    def _defer(self, job: Job, keep: bool) -> None:
        ctx = self.ctx
        self.busy = True
        self._read_off()
        ctx.http_in_flight += 1
        job.owner = self
        fut: Future[Reply] = ctx.executor.submit(job.fn)
        job.future = fut

        def done(f: Future[Reply]) -> None:
            ctx.http_in_flight -= 1
            try:
                reply = f.result()
            except Exception as e:
                if not isinstance(e, EngramDBError):
                    log.exception("error in an off-loop gather")
                reply = self.routes.error_reply(e, job.endpoint, job.table, keep_alive=keep)
            self.busy = False
            if self.closed:
                return
            self._send_reply(reply, job.t0, job.bytes_in)
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

    def _send_reply(self, reply: Reply, t0: float, bytes_in: int = 0) -> None:
        if reply.close:
            self.close_after = True
        # counted before it is sent: a client that has its response sees it in the metrics
        reply.observe(self.ctx.metrics, time.perf_counter() - t0, bytes_in)
        self._send_parts(reply.parts)
        if not self.busy and self.close_after and not self.closed:
            self._linger()

    def _send_parts(self, parts: list[Any]) -> None:
        sent = send_now(self.sock, parts)
        if sent is None:
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
            self.routes.error_reply(exc, "malformed", "", keep_alive=False), time.perf_counter()
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
        self.ctx.release_peer(self.peer)
        self.forget(self)
