"""The server side of the wire protocol (`engramdb.serve.frames`): `WireLane` runs every
wire connection of a server on one thread with its own epoll loop.

After each burst of work the lane keeps polling without sleeping for ``spin_us``
microseconds, so a client in a tight request loop never waits for the scheduler to wake the
server (an idle 2-core VM takes 20-40 us to do that, more than the whole read). The lane
gets everything it needs from a `ServingContext` (tables, limits, auth, metrics, the worker
pool); it never sees the `Server`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from engramdb.errors import EngramDBError, InvalidArgument
from engramdb.serve import protocol as P
from engramdb.serve.context import SCRATCH_MAX, Job, Reply, ServingContext, error_label, send_now
from engramdb.serve.frames import (
    MAX_HELLO_BYTES,
    OK_FLAGS,
    OP_HELLO,
    OP_LOOKUP,
    OPS,
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    SPIN_BACKOFF_MAX,
    error_frame,
    pack_response,
    parse_ids,
)
from engramdb.store import Store

log = logging.getLogger("engramdb.serve")

#: Default busy-poll window of the server after each burst of work.
DEFAULT_SPIN_US = 200.0

_RECV_MIN = 64 * 1024
#: Receive buffer of a connection before HELLO: one request header and the largest HELLO
#: payload. Nothing larger is allocated for a peer that has not authenticated.
PREAUTH_BUF = REQUEST.size + MAX_HELLO_BYTES


class _WireConnection:
    """One wire connection: a receive buffer, a reusable response buffer, the unsent rest of
    the last response. One request is answered at a time (reading pauses while a reply is
    gathered off-thread or cannot be sent at once). Before HELLO the buffer is `PREAUTH_BUF`
    bytes and another frame is refused from its header; after, it grows with the bytes that
    arrived (doubling, up to the frame length), never to a length a header only claims."""

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
        "peer",
        "born",
        "frame_since",
    )

    def __init__(
        self,
        lane: WireLane,
        sock: socket.socket,
        initial: bytes,
        peer: str | None = None,
        born: float | None = None,
    ):
        self.lane = lane
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.buf = bytearray(max(PREAUTH_BUF, len(initial)))
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
        self.born = self.last_active if born is None else born
        self.frame_since = 0.0  # when the pending (incomplete) frame header began

    def expired(self, now: float, header_timeout: float) -> bool:
        """HELLO not done ``header_timeout`` after accept, or a frame header pending longer."""
        if self.busy:
            return False
        if not self.hello:
            return now - self.born > header_timeout
        return bool(self.frame_since) and now - self.frame_since > header_timeout

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
        limits = self.lane.ctx.limits
        while not self.busy and not self.closed:
            have = self.have
            if have < REQUEST.size:
                if have and not self.frame_since:
                    self.frame_since = time.monotonic()
                return
            self.frame_since = 0.0
            magic, op, ndim, _flags, table, _res, length = REQUEST.unpack_from(self.buf, 0)
            if magic != REQUEST_MAGIC or op not in OPS:
                what = f"magic {bytes(magic)!r}" if magic != REQUEST_MAGIC else f"op {op}"
                self.fatal(P.MalformedRequest(f"not a wire-protocol frame ({what})"))
                return
            if op != OP_HELLO and not self.hello:  # refused from the header alone
                self.fatal(P.AuthenticationFailed("the first frame of a connection must be HELLO"))
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
                if have == len(self.buf):  # full: grow with what arrived (doubling)
                    self._regrow(min(end, max(2 * len(self.buf), _RECV_MIN)))
                return
            t0 = time.perf_counter()
            payload = self.view[REQUEST.size : end]
            if op == OP_HELLO:
                self.on_hello(payload)
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
                self._regrow(_RECV_MIN)  # self.have == rest here

    def _regrow(self, size: int) -> None:
        grown = bytearray(size)
        grown[: self.have] = self.view[: self.have]
        self.buf, self.view = grown, memoryview(grown)

    def on_hello(self, payload: memoryview) -> None:
        ctx = self.lane.ctx
        token = bytes(payload)
        if not ctx.auth.allows_token(token):
            what = "a token" if not token else "the server's token"
            self.fatal(P.AuthenticationFailed(f"this server needs {what} in HELLO"), "hello")
            return
        self.hello = True
        self.lane.proven(self)
        if len(self.buf) < _RECV_MIN:  # authenticated: the working buffer size
            self._regrow(_RECV_MIN)
        doc = {
            "tables": list(self.lane.names),
            "generation": ctx.db.manifest.generation,
            "version": ctx.version,
            "limits": ctx.limits.to_dict(),
        }
        body = P.json_dumps(doc)
        ctx.metrics.observe(
            "hello", "", 200, rows=0, bytes_in=len(token), bytes_out=len(body), seconds=0.0
        )
        self.send(memoryview(pack_response(200, len(body)) + body))

    def on_rows(self, op: int, ndim: int, table: int, payload: memoryview, t0: float) -> None:
        lane = self.lane
        limits = lane.ctx.limits
        endpoint = "lookup" if op == OP_LOOKUP else "fetch"
        name = ""
        try:
            if table >= len(lane.names):
                raise P.UnknownEndpoint(
                    f"table index {table} is not served here ({len(lane.names)} tables)"
                )
            name = lane.names[table]
            store = lane.store(table)
            ids = parse_ids(payload, ndim)
            limits.check_rows(ids.size)
            rb = store.row_bytes
            nbytes = limits.check_response(ids.size, rb)
            total = RESPONSE.size + nbytes
            buf = self.response_buffer(total)
            out = buf[RESPONSE.size : total].reshape(ids.shape + (rb,))
            gather = store.lookup_into if op == OP_LOOKUP else store.fetch_into
            if nbytes > limits.inline_max_bytes:
                self.busy = True
                self.watch(0)
                lane.submit(self._deferred(gather, ids.copy(), out, endpoint, name, t0, payload))
                return
            gather(ids, out)
        except Exception as e:
            self.reply_error(e, endpoint, name, t0, len(payload))
            return
        mv = buf.data
        RESPONSE.pack_into(mv, 0, RESPONSE_MAGIC, 200, OK_FLAGS, 0, nbytes)
        lane.ctx.metrics.observe(
            endpoint,
            name,
            200,
            rows=ids.size,
            bytes_in=len(payload),
            bytes_out=nbytes,
            seconds=time.perf_counter() - t0,
        )
        self.send(mv[:total])

    def _deferred(
        self,
        gather: Callable[[np.ndarray, np.ndarray], object],
        ids: np.ndarray,
        out: np.ndarray,
        endpoint: str,
        name: str,
        t0: float,
        payload: memoryview,
    ) -> Job:
        """A worker-pool job for a large read (``ids`` is a copy: the receive buffer is
        reused for the next frame). The rows land behind the header slot of the
        connection's response buffer, kept while the connection is busy with the job."""
        buf = self.scratch
        assert buf is not None
        nbytes = out.nbytes
        total = RESPONSE.size + nbytes

        def run() -> Reply:
            gather(ids, out)
            mv = buf.data
            RESPONSE.pack_into(mv, 0, RESPONSE_MAGIC, 200, OK_FLAGS, 0, nbytes)
            return Reply(200, [mv[:total]], endpoint, name, rows=ids.size, nbytes=nbytes)

        return Job(run, endpoint, name, t0=t0, bytes_in=len(payload), owner=self)

    def finished(self, job: Job) -> None:
        """A worker-pool job is done: send its rows (or its error)."""
        self.busy = False
        if self.closed:
            return
        assert job.future is not None
        exc = job.future.exception()
        if exc is not None:
            self.reply_error(exc, job.endpoint, job.table, job.t0, job.bytes_in)
        else:
            reply = job.future.result()
            reply.observe(self.lane.ctx.metrics, time.perf_counter() - job.t0, job.bytes_in)
            self.send(reply.parts[0])
        if not self.busy and not self.closed:
            self.watch(select.EPOLLIN)
            self.process()

    def reply_error(
        self, exc: BaseException, endpoint: str, table: str, t0: float, bytes_in: int
    ) -> None:
        if not isinstance(exc, EngramDBError):
            log.error("error serving a wire %s", endpoint, exc_info=exc)
        status, frame = error_frame(exc)
        reply = Reply(
            status, [], endpoint, table, nbytes=len(frame) - RESPONSE.size, error=error_label(exc)
        )
        reply.observe(self.lane.ctx.metrics, time.perf_counter() - t0, bytes_in)
        self.send(memoryview(frame))

    def fatal(self, exc: EngramDBError, endpoint: str = "malformed") -> None:
        """The connection cannot go on: send the error, then close."""
        self.close_after = True
        self.reply_error(exc, endpoint, "", time.perf_counter(), 0)
        if self.pending is None:
            self.close()

    # -- writing ------------------------------------------------------------------------------
    def response_buffer(self, nbytes: int) -> np.ndarray:
        """The connection's response buffer, grown to ``nbytes`` (one response at a time:
        a buffer above `SCRATCH_MAX` is dropped once its response is sent)."""
        buf = self.scratch
        if buf is None or buf.size < nbytes:
            buf = self.scratch = np.empty(max(nbytes, 16 * 1024), np.uint8)
        return buf

    def send(self, data: memoryview) -> None:
        sent = send_now(self.sock, [data])
        if sent is None:
            self.close()
            return
        if sent < len(data):
            self.pending = data[sent:]
            self.busy = True
            self.watch(select.EPOLLOUT)
            return
        if self.scratch is not None and self.scratch.size > SCRATCH_MAX:
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
        self.lane.ctx.release_peer(self.peer)
        self.lane.forget(self)


class WireLane:
    """Every wire-protocol connection of a server, on one thread with its own epoll loop.

    The asyncio loop hands a connection over (`adopt`) once its first bytes show the wire
    magic. Small reads are gathered inline; reads above ``Limits.inline_max_bytes`` go to
    the context's worker pool and their connection pauses until the rows are sent.
    """

    def __init__(self, ctx: ServingContext, *, spin_us: float = DEFAULT_SPIN_US):
        if spin_us < 0 or not math.isfinite(spin_us):
            raise InvalidArgument(f"spin_us must be a finite number >= 0, got {spin_us!r}")
        self.ctx = ctx
        self.spin = spin_us / 1e6
        self.names: list[str] = ctx.table_names
        self._stores: list[Store | None] = [None] * len(self.names)
        self.ep = select.epoll()
        self.conns: dict[int, _WireConnection] = {}
        self._inbox: collections.deque[tuple[socket.socket, bytes, str | None, float]] = (
            collections.deque()
        )
        #: connections without HELLO yet, oldest first (lane thread only)
        self._unproven: dict[int, _WireConnection] = {}
        self._evictions: collections.deque[int] = collections.deque()
        self._done: collections.deque[Job] = collections.deque()
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
    def n_unproven(self) -> int:  # any thread; approximate
        return len(self._unproven) + len(self._inbox)

    def proven(self, conn: _WireConnection) -> None:
        self._unproven.pop(conn.fd, None)

    def evict_unproven(self) -> None:  # any thread: close the oldest connection w/o HELLO
        self._evictions.append(1)
        self._wake()

    @property
    def in_flight(self) -> int:
        return self._jobs

    def store(self, index: int) -> Store:
        s = self._stores[index]
        if s is None:
            s = self._stores[index] = self.ctx.store(self.names[index])
        return s

    def start(self) -> None:
        self._thread.start()

    def adopt(
        self, sock: socket.socket, initial: bytes, peer: str | None = None, born: float = 0.0
    ) -> None:
        """Take over ``sock`` (first bytes ``initial`` already read; ``peer``: its counted TCP
        address; ``born``: when accepted). Called from the asyncio thread."""
        self._inbox.append((sock, initial, peer, born or time.monotonic()))
        self._wake()

    def submit(self, job: Job) -> None:
        """Run ``job`` on the worker pool; its connection's `finished` is called on the lane
        thread once it is done."""
        self._jobs += 1
        job.future = self.ctx.executor.submit(job.fn)
        job.future.add_done_callback(lambda _f: self._finish(job))

    def _finish(self, job: Job) -> None:  # worker thread
        self._done.append(job)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")

    def forget(self, conn: _WireConnection) -> None:
        self.conns.pop(conn.fd, None)
        if self._unproven.get(conn.fd) is conn:
            del self._unproven[conn.fd]

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
                sock, _, peer, _ = self._inbox.popleft()
                sock.close()
                self.ctx.release_peer(peer)
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
            job.owner.finished(job)
        while self._evictions:
            self._evictions.popleft()
            if self._unproven:
                next(iter(self._unproven.values())).close()
        while self._inbox:
            sock, initial, peer, born = self._inbox.popleft()
            if self._stopping:
                sock.close()
                self.ctx.release_peer(peer)
                continue
            conn = _WireConnection(self, sock, initial, peer, born)
            self.conns[conn.fd] = conn
            self._unproven[conn.fd] = conn
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
        idle = self.ctx.limits.idle_timeout
        header_timeout = self.ctx.limits.header_timeout
        for conn in list(self.conns.values()):
            if (not conn.busy and now - conn.last_active > idle) or conn.expired(
                now, header_timeout
            ):
                conn.close()
