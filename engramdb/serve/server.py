"""``engramdb serve``: every table of one database over HTTP/1.1, on TCP and a Unix socket.

Architecture (docs/serve.md has the measurements behind each choice):

* **One asyncio event loop** (standard library) drives non-blocking HTTP sockets directly
  (`engramdb.serve.http`); the endpoints are `engramdb.serve.routes`. Connections whose
  first bytes are the wire magic move to the wire lane (`engramdb.serve.lane`), one thread
  with its own epoll loop.
* **Small fetches run inline** on the loop (a 16-row gather is about 1 us, less than a thread
  hand-off); responses above ``Limits.inline_max_bytes`` are gathered on a worker thread so
  one large request does not stall the small ones of other clients.
* **Buffers are reused**: each connection keeps one response buffer; the rows are gathered
  straight into it behind the header bytes, so the binary path makes no copy of the rows
  after the gather and runs no JSON.
* The database is opened read-only (``engramdb.open``: ``O_RDONLY`` descriptors, read-only
  mappings) and the server never writes into its directory; a server killed at any moment
  leaves nothing to repair.

This module holds the `Server` itself: listeners, the loop, lifecycle and signals. It builds
the `ServingContext` the routes and both lanes share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engramdb.database import Database
from engramdb.database import open as open_db
from engramdb.errors import InvalidArgument
from engramdb.serve import protocol as P
from engramdb.serve.auth import TokenCheck, check_bind, resolve_bind
from engramdb.serve.context import Limits, ServingContext
from engramdb.serve.http import HttpConnection
from engramdb.serve.lane import DEFAULT_SPIN_US, WireLane
from engramdb.serve.metrics import Metrics
from engramdb.serve.routes import Routes

log = logging.getLogger("engramdb.serve")

#: Kernel send buffer asked for on accepted sockets: a 4,096-row response (655 KB at
#: 160 B rows) then leaves in one or two ``send`` calls (measured: -20 % latency on UDS).
SNDBUF_BYTES = 1 << 20
LISTEN_BACKLOG = 512

__all__ = ["Limits", "Server", "open_database", "serve"]


def open_database(
    path: str | os.PathLike[str],
    *,
    backend: str = "auto",
    ram_budget: int | str | None = None,
    populate: bool = False,
) -> Database:
    """Open ``path`` read-only for serving (`engramdb.open`). ``populate`` faults every table
    into the page tables first (reads it from the device if cold: seconds per GB), so the
    first requests do not pay page faults; ``ram_budget`` gives each table a RAM tier.
    An unknown ``backend`` raises `InvalidArgument`."""
    return open_db(path, backend=backend, ram_budget=ram_budget, populate=populate)


class Server:
    """Serve every table of a database. Use `start` (background thread, for tests and
    embedding) or `serve_forever` (this thread, handles SIGTERM / SIGINT).

    ``db`` is a path (opened read-only here and closed on stop) or an open `Database` (left
    open). ``port=None`` disables TCP; ``unix`` adds a Unix-domain socket listener (mode
    ``unix_mode``, owner-only by default). A TCP bind that reaches beyond loopback needs
    ``token`` or ``insecure=True`` (`InvalidArgument` otherwise). ``grace``: seconds that
    in-flight requests get to finish after a stop request. ``populate``: see `open_database`.
    ``wire``: also speak the binary wire protocol (`engramdb.serve.frames`) on every listener;
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
        auth = TokenCheck(token)
        self._token = token
        if isinstance(db, Database):
            self.db, self._owns_db = db, False
        else:
            self.db = open_database(db, backend=backend, ram_budget=ram_budget, populate=populate)
            self._owns_db = True
        self.metrics = Metrics()
        self.wire = bool(wire)
        self.spin_us = float(spin_us)
        #: what the routes and both lanes share (database, limits, auth, metrics, workers)
        self.context = ServingContext(
            self.db,
            self.limits,
            auth=auth,
            executor=ThreadPoolExecutor(max_workers=2, thread_name_prefix="engramdb-serve"),
            metrics=self.metrics,
            gauges=self._gauges,
        )
        self._routes = Routes(self.context)
        self._lane: WireLane | None = None
        self._listeners: list[tuple[str, socket.socket]] = []
        self._conns: set[HttpConnection] = set()
        #: HTTP connections not yet proven (no authenticated request head yet), oldest first
        self._unproven: dict[HttpConnection, None] = {}
        #: one receive buffer for every HTTP connection of the loop (bytes are copied out of
        #: it at once), so an idle or hostile connection costs no 64 KiB buffer of its own
        self._recv_buf = bytearray(64 * 1024)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
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
            self._lane = WireLane(self.context, spin_us=self.spin_us)
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
            self.context.executor.shutdown(wait=True)
            self.context.close_views()
            if self._owns_db:
                self.db.close()

    async def _drain(self) -> None:
        assert self._loop is not None and self._drained is not None
        self.context.draining = True
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
    def draining(self) -> bool:
        """True once a stop was requested (listeners closed, connections finishing)."""
        return self.context.draining

    @property
    def n_connections(self) -> int:
        """Open client connections (HTTP and wire protocol)."""
        return self.n_http_connections + self.n_wire_connections

    @property
    def n_http_connections(self) -> int:
        """Open HTTP connections (on the event loop)."""
        return len(self._conns)

    @property
    def n_wire_connections(self) -> int:
        """Open wire-protocol connections (on the wire lane; 0 without it)."""
        lane = self._lane
        return lane.n_connections if lane is not None else 0

    def _gauges(self) -> tuple[int, int]:
        """(open connections, requests in flight) for ``/metrics``."""
        lane = self._lane
        in_flight = self.context.http_in_flight + (lane.in_flight if lane is not None else 0)
        return self.n_connections, in_flight

    def _tick(self) -> None:
        """Once a second: refresh the Date header; close connections idle too long."""
        assert self._loop is not None
        self._routes.refresh_date()
        now = time.monotonic()
        idle = self.limits.idle_timeout
        header_timeout = self.limits.header_timeout
        for conn in list(self._conns):
            if (not conn.busy and now - conn.last_active > idle) or conn.expired(
                now, header_timeout
            ):
                conn.close()
        if not self._loop.is_closed():
            self._loop.call_later(1.0, self._tick)

    def _on_accept(self, lsock: socket.socket, kind: str) -> None:
        loop = self._loop
        assert loop is not None
        for _ in range(64):  # accept a burst, then let the loop serve them
            try:
                sock, addr = lsock.accept()
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
            peer = str(addr[0]) if kind == "tcp" and isinstance(addr, tuple) else None
            err = self._admit(peer)
            if err is not None:
                with contextlib.suppress(OSError):
                    sock.send(self._routes.refusal(err))
                sock.close()
                self.metrics.count_error("accept", type(err).__name__)
                continue
            lane = self._lane
            conn = HttpConnection(
                sock,
                loop=loop,
                ctx=self.context,
                routes=self._routes,
                adopt=lane.adopt if lane is not None else None,
                forget=self._forget,
                prove=self._prove,
                recv_buf=self._recv_buf,
                peer=peer,
            )
            self._conns.add(conn)
            self._unproven[conn] = None

    def _admit(self, peer: str | None) -> P.ServiceUnavailable | None:
        """Count a new connection of ``peer`` in, or the error that refuses it.

        Unproven connections (no authenticated request / HELLO yet) may hold at most
        ``max_unproven`` slots: past that, the oldest one is closed for the newcomer, so a
        flood of idle or dribbling connections cannot lock out a client that authenticates;
        the ``reserved_connections`` above that are for proven connections only."""
        limits = self.limits
        if not self.context.admit_peer(peer):
            return P.ServiceUnavailable(
                f"peer {peer} has {self.context.peer_connections(str(peer))} connections, the "
                f"limit (max_connections_per_peer={limits.max_connections_per_peer}); retry later"
            )
        lane = self._lane
        unproven = len(self._unproven) + (lane.n_unproven if lane is not None else 0)
        if unproven >= limits.max_unproven or self.n_connections >= limits.max_connections:
            if unproven and self._evict_unproven():
                return None
            self.context.release_peer(peer)
            return P.ServiceUnavailable(
                f"the server has {self.n_connections} connections, its limit "
                f"(max_connections={limits.max_connections}); retry later"
            )
        return None

    def _evict_unproven(self) -> bool:
        """Close the oldest unproven connection (HTTP here, else ask the wire lane)."""
        if self._unproven:
            oldest = next(iter(self._unproven))  # insertion order: the oldest first
            oldest.close()
            self.metrics.count_error("accept", "EvictedUnproven")
            return True
        lane = self._lane
        if lane is not None and lane.n_unproven:
            lane.evict_unproven()
            self.metrics.count_error("accept", "EvictedUnproven")
            return True
        return False

    def _prove(self, conn: HttpConnection) -> None:
        self._unproven.pop(conn, None)

    def _forget(self, conn: HttpConnection) -> None:
        self._conns.discard(conn)
        self._unproven.pop(conn, None)
        if self.context.draining and not self._conns and self._drained is not None:
            self._drained.set()


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


def serve(
    db: str | os.PathLike[str],
    *,
    on_ready: Callable[[Server], None] | None = None,
    **kwargs: Any,
) -> None:
    """Serve ``db`` on this thread until SIGTERM / SIGINT. Keywords as for `Server`."""
    Server(db, **kwargs).serve_forever(on_ready=on_ready)
