"""The EngramDB wire protocol: length-prefixed binary frames for row reads, beside HTTP.

HTTP costs a small read more than the read itself: a request line and headers to build and
parse on both sides, and an event loop built for general callbacks. The wire protocol
carries only what a read needs, in fixed little-endian headers::

    request   "EDBW" op:u8 ndim:u8 flags:u16 table:u32 reserved:u32 length:u64 | payload
    response  "EDBR" status:u16 flags:u16 reserved:u32 length:u64           | payload

* ``HELLO`` (op 1) must be the first frame of a connection. Payload: the bearer token (empty
  when the server has none). Reply: JSON ``{"tables": [names], "generation", "version",
  "limits"}``; a table is named by its index in that list afterwards. A wrong token gets a
  401 frame and the connection is closed.
* ``FETCH`` (op 2) / ``LOOKUP`` (op 3): payload = ``ndim`` int64 dimensions, then the ids as
  little-endian int64 (global ids for FETCH, ``[B, L, H]`` per-head local ids for LOOKUP).
  Reply: ``status`` 200 and the rows (``prod(dims) * row_bytes`` bytes, C order).
* Any refusal is a frame with an HTTP status code and the same JSON error body the HTTP
  endpoints send, so the client raises the same typed exception. A well-framed request that
  is refused keeps the connection open; a frame that cannot be parsed closes it.

The server tells the protocols apart by the first four bytes of a connection, on every
listener, so one socket serves both. `WireLane` runs all wire connections on one thread with
its own epoll loop; after each burst of work it keeps polling without sleeping for
``spin_us`` microseconds, so a client in a tight request loop never waits for the scheduler
to wake the server (an idle 2-core VM takes 20-40 us to do that, more than the whole read).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

import engramdb
from engramdb.errors import EngramDBError, InvalidArgument, ShapeMismatch
from engramdb.serve import protocol as P

if TYPE_CHECKING:
    from engramdb.serve.server import Server
    from engramdb.store import Store

log = logging.getLogger("engramdb.serve")

REQUEST_MAGIC = b"EDBW"
RESPONSE_MAGIC = b"EDBR"
REQUEST = struct.Struct("<4sBBHIIQ")
RESPONSE = struct.Struct("<4sHHIQ")
OP_HELLO = 1
OP_FETCH = 2
OP_LOOKUP = 3
OPS = {OP_HELLO: "hello", OP_FETCH: "fetch", OP_LOOKUP: "lookup"}
#: Largest HELLO payload (a token).
MAX_HELLO_BYTES = 4096
#: Default busy-poll window of the server after each burst of work.
DEFAULT_SPIN_US = 200.0
#: After ``k`` spin windows in a row without work, the next ``2**(k-1) - 1`` bursts (at
#: most this many) end without one.
SPIN_BACKOFF_MAX = 64

_RECV_MIN = 64 * 1024
_SCRATCH_MAX = 4 * 1024 * 1024
_OK_FLAGS = 0


def pack_request(op: int, table: int, dims: tuple[int, ...], nbytes: int) -> bytes:
    """Request header plus the dimension block for a payload of ``nbytes`` id bytes."""
    head = REQUEST.pack(REQUEST_MAGIC, op, len(dims), 0, table, 0, 8 * len(dims) + nbytes)
    if not dims:
        return head
    return head + struct.pack(f"<{len(dims)}q", *dims)


def error_frame(exc: BaseException) -> tuple[int, bytes]:
    """(status, frame bytes) of the JSON error ``exc`` maps to."""
    status, body = P.error_payload(exc)
    return status, RESPONSE.pack(RESPONSE_MAGIC, status, 0, 0, len(body)) + body


class _Job:
    """A large gather running on the server's worker pool for one wire connection."""

    __slots__ = ("conn", "future", "t0", "table", "endpoint", "rows", "nbytes", "bytes_in")

    def __init__(
        self,
        conn: _WireConnection,
        future: Future[None],
        t0: float,
        endpoint: str,
        table: str,
        rows: int,
        nbytes: int,
        bytes_in: int,
    ):
        self.conn = conn
        self.future = future
        self.t0 = t0
        self.endpoint = endpoint
        self.table = table
        self.rows = rows
        self.nbytes = nbytes
        self.bytes_in = bytes_in


class _WireConnection:
    """One wire connection: a receive buffer, a reusable response buffer, the unsent rest of
    the last response. One request is answered at a time (reading pauses while a reply is
    gathered off-thread or cannot be sent at once)."""

    __slots__ = (
        "lane",
        "sock",
        "fd",
        "buf",
        "view",
        "have",
        "hello",
        "scratch",
        "pending",
        "busy",
        "close_after",
        "closed",
        "mask",
        "last_active",
    )

    def __init__(self, lane: WireLane, sock: socket.socket, initial: bytes):
        self.lane = lane
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = bytearray(max(_RECV_MIN, len(initial)))
        self.view = memoryview(self.buf)
        self.buf[: len(initial)] = initial
        self.have = len(initial)
        self.hello = False
        self.scratch: np.ndarray | None = None
        self.pending: memoryview | None = None
        self.busy = False
        self.close_after = False
        self.closed = False
        self.mask = 0
        self.last_active = time.monotonic()

    # -- events -------------------------------------------------------------------------------
    def watch(self, mask: int) -> None:
        if mask != self.mask and not self.closed:
            self.lane.ep.modify(self.fd, mask)
            self.mask = mask

    def on_readable(self) -> None:
        if self.have == len(self.buf):
            # full of pipelined frames while a reply is pending: only look for a hang-up
            try:
                if not self.sock.recv(1, socket.MSG_PEEK):
                    self.close()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self.close()
            return
        try:
            n = self.sock.recv_into(self.view[self.have :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if n == 0:
            self.close()
            return
        self.have += n
        self.last_active = time.monotonic()
        self.process()

    def on_writable(self) -> None:
        rest = self.pending
        self.pending = None
        if rest is not None:
            self.send(rest)
        if self.pending is None and not self.closed:
            if self.close_after:
                self.close()
                return
            self.busy = False
            self.watch(select.EPOLLIN)
            self.process()

    # -- frames -------------------------------------------------------------------------------
    def process(self) -> None:
        """Answer every complete frame in the buffer, in order."""
        server = self.lane.server
        limits = server.limits
        while not self.busy and not self.closed:
            have = self.have
            if have < REQUEST.size:
                return
            magic, op, ndim, _flags, table, _res, length = REQUEST.unpack_from(self.buf, 0)
            if magic != REQUEST_MAGIC or op not in OPS:
                what = f"magic {bytes(magic)!r}" if magic != REQUEST_MAGIC else f"op {op}"
                self.fatal(P.MalformedRequest(f"not a wire-protocol frame ({what})"))
                return
            limit = MAX_HELLO_BYTES if op == OP_HELLO else limits.max_body_bytes + 8 * P.MAX_NDIM
            if length > limit:
                self.fatal(
                    P.RequestTooLarge(
                        f"frame payload is {length:,} bytes, the limit is {limit:,} "
                        "(max_body_bytes)"
                    )
                )
                return
            end = REQUEST.size + length
            if have < end:
                if end > len(self.buf):  # grow for a large request (bounded by the limit)
                    grown = bytearray(end)
                    grown[:have] = self.view[:have]
                    self.buf = grown
                    self.view = memoryview(grown)
                return
            t0 = time.perf_counter()
            payload = self.view[REQUEST.size : end]
            if op == OP_HELLO:
                self.on_hello(payload)
            elif not self.hello:
                self.fatal(P.AuthenticationFailed("the first frame of a connection must be HELLO"))
                return
            else:
                self.on_rows(op, ndim, table, payload, t0)
            if self.close_after:  # fatal(): nothing after this frame is read
                self.have = 0
                return
            # drop the frame (usually the whole buffer: nothing to move)
            rest = self.have - end
            if rest:
                self.view[:rest] = self.view[end : self.have]
            self.have = rest
            if len(self.buf) > _RECV_MIN and rest <= _RECV_MIN:
                small = bytearray(_RECV_MIN)
                small[:rest] = self.view[:rest]
                self.buf = small
                self.view = memoryview(small)

    def on_hello(self, payload: memoryview) -> None:
        server = self.lane.server
        token = bytes(payload)
        if not server._auth.allows_token(token):
            what = "a token" if not token else "the server's token"
            self.fatal(P.AuthenticationFailed(f"this server needs {what} in HELLO"), "hello")
            return
        self.hello = True
        doc = {
            "tables": list(self.lane.names),
            "generation": server.db.manifest.generation,
            "version": engramdb.__version__,
            "limits": server.limits.to_dict(),
        }
        body = P.json_dumps(doc)
        self.send(memoryview(RESPONSE.pack(RESPONSE_MAGIC, 200, 0, 0, len(body)) + body))
        server.metrics.observe(
            "hello", "", 200, rows=0, bytes_in=len(token), bytes_out=len(body), seconds=0.0
        )

    def on_rows(self, op: int, ndim: int, table: int, payload: memoryview, t0: float) -> None:
        lane = self.lane
        server = lane.server
        endpoint = "lookup" if op == OP_LOOKUP else "fetch"
        name = ""
        try:
            if table >= len(lane.names):
                raise P.UnknownEndpoint(
                    f"table index {table} is not served here ({len(lane.names)} tables)"
                )
            name = lane.names[table]
            store = lane.store(table)
            ids = _ids(payload, ndim)
            if ids.size > server.limits.max_rows:
                raise P.RequestTooLarge(
                    f"request asks for {ids.size:,} rows, the server allows "
                    f"{server.limits.max_rows:,} per request"
                )
            rb = store.row_bytes
            nbytes = ids.size * rb
            if nbytes > server.limits.max_response_bytes:
                raise P.RequestTooLarge(
                    f"response would be {nbytes:,} bytes ({ids.size:,} rows x {rb} B), the "
                    f"limit is {server.limits.max_response_bytes:,}"
                )
            total = RESPONSE.size + nbytes
            buf = self.response_buffer(total)
            out = buf[RESPONSE.size : total].reshape(ids.shape + (rb,))
            gather = store.lookup_into if op == OP_LOOKUP else store.fetch_into
            if nbytes > server.limits.inline_max_bytes:
                ids = ids.copy()  # the receive buffer is reused for the next frame
                self.busy = True
                self.watch(0)
                fut = server._executor.submit(gather, ids, out)
                job = _Job(self, fut, t0, endpoint, name, ids.size, nbytes, len(payload))
                lane.started(job)
                return
            gather(ids, out)
        except Exception as e:
            self.reply_error(e, endpoint, name, t0, len(payload))
            return
        RESPONSE.pack_into(buf, 0, RESPONSE_MAGIC, 200, _OK_FLAGS, 0, nbytes)
        self.send(buf.data[:total])
        server.metrics.observe(
            endpoint,
            name,
            200,
            rows=ids.size,
            bytes_in=len(payload),
            bytes_out=nbytes,
            seconds=time.perf_counter() - t0,
        )

    def finished(self, job: _Job) -> None:
        """A worker-pool gather is done: send its rows (or its error)."""
        self.busy = False
        if self.closed:
            return
        exc = job.future.exception()
        if exc is not None:
            self.reply_error(exc, job.endpoint, job.table, job.t0, job.bytes_in)
        else:
            buf = self.scratch
            assert buf is not None  # kept while the connection was busy with the job
            total = RESPONSE.size + job.nbytes
            RESPONSE.pack_into(buf, 0, RESPONSE_MAGIC, 200, _OK_FLAGS, 0, job.nbytes)
            self.send(buf.data[:total])
            self.lane.server.metrics.observe(
                job.endpoint,
                job.table,
                200,
                rows=job.rows,
                bytes_in=job.bytes_in,
                bytes_out=job.nbytes,
                seconds=time.perf_counter() - job.t0,
            )
        if not self.busy and not self.closed:
            self.watch(select.EPOLLIN)
            self.process()

    def reply_error(
        self, exc: BaseException, endpoint: str, table: str, t0: float, bytes_in: int
    ) -> None:
        if not isinstance(exc, EngramDBError):
            log.error("error serving a wire %s", endpoint, exc_info=exc)
        status, frame = error_frame(exc)
        self.send(memoryview(frame))
        etype = type(exc).__name__ if isinstance(exc, EngramDBError) else "InternalError"
        self.lane.server.metrics.observe(
            endpoint,
            table,
            status,
            rows=0,
            bytes_in=bytes_in,
            bytes_out=len(frame) - RESPONSE.size,
            seconds=time.perf_counter() - t0,
            error=etype,
        )

    def fatal(self, exc: EngramDBError, endpoint: str = "malformed") -> None:
        """The connection cannot go on: send the error, then close."""
        self.close_after = True
        self.reply_error(exc, endpoint, "", time.perf_counter(), 0)
        if self.pending is None:
            self.close()

    # -- writing ------------------------------------------------------------------------------
    def response_buffer(self, nbytes: int) -> np.ndarray:
        """The connection's response buffer, grown to ``nbytes`` (one response at a time:
        a buffer above `_SCRATCH_MAX` is dropped once its response is sent)."""
        buf = self.scratch
        if buf is None or buf.size < nbytes:
            buf = self.scratch = np.empty(max(nbytes, 16 * 1024), np.uint8)
        return buf

    def send(self, data: memoryview) -> None:
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self.pending = data[sent:]
            self.busy = True
            self.watch(select.EPOLLOUT)
            return
        if self.scratch is not None and self.scratch.size > _SCRATCH_MAX:
            self.scratch = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pending = None
        self.scratch = None
        with contextlib.suppress(OSError, ValueError):
            self.lane.ep.unregister(self.fd)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.lane.forget(self)


def _ids(payload: memoryview, ndim: int) -> np.ndarray:
    """The int64 ids of a FETCH / LOOKUP payload (a view of the receive buffer)."""
    if ndim == 0 or ndim > P.MAX_NDIM:
        raise ShapeMismatch(f"ids need 1 to {P.MAX_NDIM} dimensions, got {ndim}")
    size = len(payload)
    if size % 8 or size < 8 * ndim:
        raise P.MalformedRequest(
            f"payload of {size} bytes does not hold {ndim} dimensions and int64 ids"
        )
    words = np.frombuffer(payload, dtype="<i8")
    n = words.size - ndim
    if ndim == 1:
        if int(words[0]) != n:
            raise ShapeMismatch(f"frame says {int(words[0])} ids, its payload holds {n}")
        return words[1:]
    dims = tuple(int(d) for d in words[:ndim])
    if min(dims) < 0 or math.prod(dims) != n:
        raise ShapeMismatch(f"frame shape {dims} holds {math.prod(dims)} ids, the payload {n}")
    return words[ndim:].reshape(dims)


class WireLane:
    """Every wire-protocol connection of a server, on one thread with its own epoll loop.

    The asyncio loop hands a connection over (`adopt`) once its first bytes show the wire
    magic. Small reads are gathered inline; reads above ``Limits.inline_max_bytes`` go to
    the server's worker pool and their connection pauses until the rows are sent.
    """

    def __init__(self, server: Server, *, spin_us: float = DEFAULT_SPIN_US):
        if spin_us < 0 or not math.isfinite(spin_us):
            raise InvalidArgument(f"spin_us must be a finite number >= 0, got {spin_us!r}")
        self.server = server
        self.spin = spin_us / 1e6
        self.names: list[str] = list(server.db.tables)
        self._stores: list[Store | None] = [None] * len(self.names)
        self.ep = select.epoll()
        self.conns: dict[int, _WireConnection] = {}
        self._inbox: collections.deque[tuple[socket.socket, bytes]] = collections.deque()
        self._done: collections.deque[_Job] = collections.deque()
        self._jobs = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.ep.register(self._wake_r, select.EPOLLIN)
        self._stopping = False
        self._grace_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name="engramdb-wire", daemon=True)

    @property
    def n_connections(self) -> int:
        return len(self.conns) + len(self._inbox)

    @property
    def in_flight(self) -> int:
        return self._jobs

    def store(self, index: int) -> Store:
        s = self._stores[index]
        if s is None:
            s = self._stores[index] = self.server._store(self.names[index])
        return s

    def start(self) -> None:
        self._thread.start()

    def adopt(self, sock: socket.socket, initial: bytes) -> None:
        """Take over ``sock`` (non-blocking), whose first bytes ``initial`` were already read.
        Called from the asyncio thread."""
        self._inbox.append((sock, initial))
        self._wake()

    def started(self, job: _Job) -> None:
        self._jobs += 1
        job.future.add_done_callback(lambda _f: self._finish(job))

    def _finish(self, job: _Job) -> None:  # worker thread
        self._done.append(job)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")

    def forget(self, conn: _WireConnection) -> None:
        self.conns.pop(conn.fd, None)

    def stop(self, grace: float) -> None:
        """Finish what is in flight (up to ``grace`` seconds), close every connection, end
        the thread. Called from the asyncio thread; blocks until the lane ended."""
        self._grace_deadline = time.monotonic() + grace
        self._stopping = True
        if self._thread.is_alive():
            self._wake()
            self._thread.join()
        # the pipe outlives the thread: a worker may still call _wake() until here
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug; keep the process serving HTTP
            log.exception("the wire-protocol lane failed")
        finally:
            for conn in list(self.conns.values()):
                conn.close()
            while self._inbox:
                sock, _ = self._inbox.popleft()
                sock.close()
            self.ep.close()

    def _loop(self) -> None:
        poll = self.ep.poll
        clock = time.perf_counter
        spin_until = 0.0  # poll without sleeping until then
        misses = 0  # spin windows in a row that ended without work
        skip = 0  # bursts left that end without a spin window
        last_tick = time.monotonic()
        wake_fd = self._wake_r
        conns = self.conns
        while True:
            if self._stopping and self._drained():
                return
            events = poll(0)
            if not events:
                if spin_until:
                    if clock() < spin_until:
                        continue
                    # the window passed without work: back off (more clients than cores,
                    # or a client that is not in a tight loop), so spinning stops taking
                    # CPU that the clients need
                    spin_until = 0.0
                    misses += 1
                    skip = min(SPIN_BACKOFF_MAX, (1 << (misses - 1)) - 1)
                events = poll(0.5 if not self._stopping else 0.05)
            elif spin_until:
                misses = 0  # work came while spinning: the window pays off
            for fd, ev in events:
                if fd == wake_fd:
                    self._on_wake()
                    continue
                conn = conns.get(fd)
                if conn is None:
                    continue
                try:
                    if ev & select.EPOLLOUT:
                        conn.on_writable()
                    elif ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        conn.on_readable()
                except Exception:  # a bug: lose this connection, not the lane
                    log.exception("wire connection failed; closing it")
                    conn.close()
            now = time.monotonic()
            if now - last_tick >= 1.0:
                last_tick = now
                self._tick(now)
            if not (self.spin and conns):
                spin_until = 0.0
            elif skip:
                skip -= 1
                spin_until = 0.0
            else:
                spin_until = clock() + self.spin

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        while self._done:
            job = self._done.popleft()
            self._jobs -= 1
            job.conn.finished(job)
        while self._inbox:
            sock, initial = self._inbox.popleft()
            if self._stopping:
                sock.close()
                continue
            conn = _WireConnection(self, sock, initial)
            self.conns[conn.fd] = conn
            conn.mask = select.EPOLLIN
            self.ep.register(conn.fd, select.EPOLLIN)
            try:
                conn.process()
            except Exception:  # a bug: lose this connection, not the lane
                log.exception("wire connection failed; closing it")
                conn.close()

    def _drained(self) -> bool:
        """While stopping: close idle connections; True once nothing is in flight (or the
        grace period is over)."""
        for conn in list(self.conns.values()):
            if not conn.busy and conn.have == 0:
                conn.close()
        if not self.conns and not self._jobs:
            return True
        return time.monotonic() >= self._grace_deadline

    def _tick(self, now: float) -> None:
        idle = self.server.limits.idle_timeout
        for conn in list(self.conns.values()):
            if not conn.busy and now - conn.last_active > idle:
                conn.close()


def parse_hello(body: bytes) -> dict[str, Any]:
    """The HELLO reply's document (client side)."""
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise P.ProtocolError(f"HELLO reply is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), list):
        raise P.ProtocolError("HELLO reply has no table list")
    return doc
