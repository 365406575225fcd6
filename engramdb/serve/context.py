"""What every part of a running server shares: `Limits`, the `ServingContext` (database,
limits, metrics, auth, worker pool, open tables and views), and the reply slots (`Reply`,
`Job`) both protocols use.

The HTTP routes (`engramdb.serve.routes`), the HTTP connections (`engramdb.serve.http`) and
the wire lane (`engramdb.serve.lane`) get a context passed in; none of them knows the
`Server` that built it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any

from engramdb._version import __version__
from engramdb.database import Database
from engramdb.errors import EngramDBError, InvalidArgument
from engramdb.serve.auth import TokenCheck
from engramdb.serve.metrics import Metrics
from engramdb.serve.protocol import RequestTooLarge
from engramdb.store import Store

#: Per-connection response buffers up to this size are kept for the next request; larger
#: ones are freed after sending so 16 idle connections do not pin 16 big buffers.
SCRATCH_MAX = 4 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Per-request and per-server bounds. Every field must be positive.

    ``inline_max_bytes``: responses up to this size are gathered on the event loop; larger
    ones on a worker thread (a thread hand-off costs ~20-50 us, a 1 MiB gather ~60 us).

    Connection hygiene (docs/serve.md, "Hostile clients"): ``header_timeout`` is the most
    seconds a request head (HTTP) or a frame (wire) may take to arrive once its first byte
    came, and the most a new connection may take to complete its first request (HTTP) or
    HELLO (wire); bytes arriving do not extend it. A connection that has not done so is
    *unproven*: at most ``max_connections - reserved_connections`` of them (the reserve is at
    most half) are kept (the
    oldest is closed for a newcomer), so proven clients always find a slot.
    ``max_connections_per_peer`` bounds the connections of one TCP peer address (Unix
    socket peers are local and not counted).
    """

    max_rows: int = 1 << 20
    max_body_bytes: int = 16 << 20
    max_response_bytes: int = 256 << 20
    max_header_bytes: int = 16 << 10
    max_connections: int = 1024
    idle_timeout: float = 300.0
    inline_max_bytes: int = 1 << 20
    header_timeout: float = 10.0
    max_connections_per_peer: int = 128
    reserved_connections: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidArgument(f"limit {name} must be a positive number, got {value!r}")

    @property
    def max_unproven(self) -> int:
        """Connections that have not yet completed a first request / HELLO, at most (the
        reserve is capped at half of ``max_connections``)."""
        return self.max_connections - min(self.reserved_connections, self.max_connections // 2)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_rows(self, n_ids: int, *, hint: str = "") -> None:
        """Refuse a request for more than ``max_rows`` ids (`RequestTooLarge`; ``hint`` ends
        the message)."""
        if n_ids > self.max_rows:
            raise RequestTooLarge(
                f"request asks for {n_ids:,} rows, the server allows {self.max_rows:,} "
                f"per request{hint}"
            )

    def check_response(self, n_ids: int, row_bytes: int) -> int:
        """The response size of ``n_ids`` rows of ``row_bytes``; `RequestTooLarge` above
        ``max_response_bytes``."""
        nbytes = n_ids * row_bytes
        if nbytes > self.max_response_bytes:
            raise RequestTooLarge(
                f"response would be {nbytes:,} bytes ({n_ids:,} rows x {row_bytes} B), the "
                f"limit is {self.max_response_bytes:,} (max_response_bytes)"
            )
        return nbytes


def send_now(sock: socket.socket, parts: list[Any]) -> int | None:
    """Send what a non-blocking socket takes now (one ``send``, or one ``sendmsg`` for
    several parts): the bytes sent, 0 when its buffer is full, None when the peer is gone
    (the caller closes the connection)."""
    try:
        return sock.send(parts[0]) if len(parts) == 1 else sock.sendmsg(parts)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:
        return None


def error_label(exc: BaseException) -> str:
    """The metrics label of a refusal: the error class, or ``InternalError`` for a bug."""
    return type(exc).__name__ if isinstance(exc, EngramDBError) else "InternalError"


@dataclass(slots=True, eq=False)
class Reply:
    """A response ready to send (HTTP or wire): its byte parts and what the metrics need."""

    status: int
    parts: list[Any]
    endpoint: str
    table: str = ""
    rows: int = 0
    nbytes: int = 0
    error: str | None = None
    close: bool = False

    def observe(self, metrics: Metrics, seconds: float, bytes_in: int) -> None:
        """Count this reply once it is queued for sending."""
        metrics.observe(
            self.endpoint,
            self.table,
            self.status,
            rows=self.rows,
            bytes_in=bytes_in,
            bytes_out=self.nbytes,
            seconds=seconds,
            error=self.error,
        )


@dataclass(slots=True, eq=False)
class Job:
    """Work for the worker pool on behalf of one connection (a large gather): ``fn`` runs
    off the connection's thread and returns the `Reply` to send; the connection reads no
    further request until that reply is out. ``owner`` is the connection; ``future`` is set
    once submitted."""

    fn: Callable[[], Reply]
    endpoint: str
    table: str
    _: KW_ONLY
    t0: float = 0.0
    bytes_in: int = 0
    owner: Any = None
    future: Future[Reply] | None = field(default=None, init=False)


def _no_gauges() -> tuple[int, int]:
    return 0, 0


class ServingContext:
    """The database and the shared state of one server, for the routes and both lanes.

    ``db`` is open (read-only); ``executor`` runs large gathers; ``gauges()`` returns
    ``(open connections, requests in flight)`` for ``/metrics``. `store` opens tables once
    (thread-safe: the wire lane opens them from its own thread) and `view` opens Store-P
    views once. ``draining`` is set when the server stops accepting; ``http_in_flight``
    counts HTTP jobs on the worker pool (changed on the event-loop thread only).
    """

    def __init__(
        self,
        db: Database,
        limits: Limits,
        *,
        auth: TokenCheck,
        executor: ThreadPoolExecutor,
        metrics: Metrics | None = None,
        gauges: Callable[[], tuple[int, int]] = _no_gauges,
    ):
        self.db = db
        self.limits = limits
        self.auth = auth
        self.executor = executor
        self.metrics = metrics if metrics is not None else Metrics()
        self.gauges = gauges
        self.version = __version__
        self.draining = False
        self.http_in_flight = 0
        self._stores_lock = threading.Lock()
        self._stores: dict[str, Store] = {}
        self._views: dict[tuple[str, str], Any] = {}
        self._peers: dict[str, int] = {}
        self._peers_lock = threading.Lock()

    # -- per-peer connection accounting (TCP) -----------------------------------------------
    def admit_peer(self, peer: str | None) -> bool:
        """Count one more connection of ``peer`` (a TCP address; None for a Unix socket, never
        limited). False (nothing counted) if the peer is at ``max_connections_per_peer``."""
        if peer is None:
            return True
        with self._peers_lock:
            n = self._peers.get(peer, 0)
            if n >= self.limits.max_connections_per_peer:
                return False
            self._peers[peer] = n + 1
        return True

    def release_peer(self, peer: str | None) -> None:
        """A connection of ``peer`` closed (any thread)."""
        if peer is None:
            return
        with self._peers_lock:
            n = self._peers.get(peer, 0) - 1
            if n > 0:
                self._peers[peer] = n
            else:
                self._peers.pop(peer, None)

    def peer_connections(self, peer: str) -> int:
        return self._peers.get(peer, 0)

    @property
    def table_names(self) -> list[str]:
        """The database's tables, in manifest order (the wire protocol's table indices)."""
        return list(self.db.tables)

    def store(self, name: str) -> Store:
        """The open table ``name`` (opened on first use; `TableNotFound` names the others)."""
        store = self._stores.get(name)
        if store is None:
            with self._stores_lock:
                store = self._stores.get(name)
                if store is None:
                    store = self.db[name]
                    self._stores[name] = store
        return store

    def stores(self) -> list[Store]:
        """The tables opened so far."""
        return list(self._stores.values())

    def view(self, store: Store, name: str, opener: Callable[[str], Any]) -> Any:
        """The view ``name`` of ``store``, opened with ``opener(name)`` on first use: opening
        reads its header pages and maps it, so once per server, not per request."""
        key = (store.name, name)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = opener(name)
        return view

    def views(self) -> list[Any]:
        """The views opened so far."""
        return list(self._views.values())

    def close_views(self) -> None:
        """Close every opened view (at shutdown, after the workers finished)."""
        for view in self._views.values():
            close = getattr(view, "close", None)
            if callable(close):
                close()
