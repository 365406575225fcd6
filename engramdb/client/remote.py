"""The remote handles: `Client` (the remote twin of `engramdb.Database`), `RemoteStore` (a
table, a `RowTable` like a local `Store`) and `RemoteView` (a Store-P view on the server).

Requests use the binary wire format (raw int64 ids out, raw rows in, no JSON), a pool of
keep-alive connections (`engramdb.client.transport`), and write response rows straight into
the caller's ``out``. A bad id raises the same typed error (and message) a local `Store`
raises and leaves ``out`` untouched: the server refuses a batch that fits one request;
bigger batches are validated here first (the `RowTable` base) and then split into several
requests.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import numpy as np

from engramdb.client.transport import Endpoint, HttpConnection, NoResponse, WireConnection
from engramdb.errors import InvalidArgument, StoreClosed, TableNotFound
from engramdb.serve import frames as F
from engramdb.serve.auth import check_token
from engramdb.serve.protocol import (
    CT_ARROW,
    CT_BINARY,
    H_SHAPE,
    ResponseHead,
    ServiceError,
    ServiceUnavailable,
    format_shape,
    raise_for_error,
)
from engramdb.table_api import Closing, RowTable, TableSchema
from engramdb.validate import as_rowids, check_lookup_ids, check_output

_LITTLE = sys.byteorder == "little"
_BINARY_HEADERS = b"Content-Type: application/octet-stream\r\nAccept: application/octet-stream\r\n"


class Client(Closing):
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
        self._endpoint = Endpoint(url)
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
        self._wire_pool: list[WireConnection] = []
        self._wire_tables: dict[str, int] = {}
        self._pool: list[HttpConnection] = []
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
    def request_prefix(self, method: str, path: str) -> bytes:
        """The HTTP request line and fixed headers (``Host``, ``Authorization``) of a
        request for ``path``, up to (not including) ``Content-Length``."""
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
            except NoResponse:
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
            lambda: HttpConnection(self._endpoint.connect(self.timeout)),
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
    def _wire_open(self) -> WireConnection:
        conn = WireConnection(self._endpoint.connect(self.timeout), self._spin)
        try:
            token = self._token
            status, data = conn.call(
                F.pack_request(F.OP_HELLO, 0, (), len(token)), token or None, None
            )
            if status != 200:
                raise_for_error(status, data or b"", where=self.url)
            doc = F.parse_hello(data or b"")
        except NoResponse:
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

        def send(conn: WireConnection) -> tuple[int, bytes | None]:
            index = self._wire_tables.get(table)
            if index is None:
                raise TableNotFound(f"no table {table!r} at {self.url} (tables: {self.tables})")
            return conn.call(F.pack_request(op, index, dims, len(body)), body, sink)

        conn, (status, data) = self._exchange(self._wire_pool, self._wire_open, send)
        self._give_back(self._wire_pool, conn)
        if status != 200:
            raise_for_error(status, data or b"", where=self.url)

    def _get_json(self, path: str) -> Any:
        _, data = self.request(self.request_prefix("GET", path) + b"\r\n")
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
        _, data = self.request(self.request_prefix("GET", "/metrics") + b"\r\n")
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

    def __repr__(self) -> str:
        return f"<Client {self.url!r} tables={self.tables}>"


class RemoteStore(RowTable):
    """A table on a server, with the read API of a local `Store` (a `RowTable`).

    ``fetch`` / ``fetch_into`` / ``lookup_into`` / ``to_global`` take the same arguments,
    validate them the same way and raise the same typed errors with the same messages. Cost:
    one round trip per call (about 30 us on a Unix socket for a small batch), plus one per
    ``chunk_rows`` ids for huge batches.
    """

    def __init__(self, client: Client, info: dict[str, Any]):
        RowTable.__init__(self, TableSchema.of(info))
        self._client = client
        self.info = info
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
        self._path = f"/v1/tables/{quote(self.name, safe='')}"
        self._fetch_head = client.request_prefix("POST", self._path + "/fetch") + _BINARY_HEADERS
        self._lookup_head = client.request_prefix("POST", self._path + "/lookup") + _BINARY_HEADERS
        self._counters = {"fetch_calls": 0, "rows_fetched": 0, "requests": 0}

    @property
    def client(self) -> Client:
        """The `Client` this table is read through."""
        return self._client

    @property
    def path(self) -> str:
        """This table's HTTP path on the server (``/v1/tables/{quoted name}``)."""
        return self._path

    @property
    def closed(self) -> bool:
        return self._client.closed

    def _closed_message(self) -> str:
        return f"table {self.name!r}: client for {self._client.url} is closed"

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_rows:,} rows x {self.row_bytes} B"
        return f"<RemoteStore {self.name!r} at {self._client.url}: {state}, {self.n_heads} heads>"

    # -- reads --------------------------------------------------------------------------------------
    def _post_ids(
        self, lookup: bool, ids: np.ndarray, dest: memoryview, shape: tuple[int, ...] | None
    ) -> None:
        """One request for flat int64 ``ids``; ``shape`` travels when not None."""
        if self._client.wire:
            op = F.OP_LOOKUP if lookup else F.OP_FETCH
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

    def gather(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        """Rows of validated global ids ``flat`` into ``out2d``: one request, or one per
        ``chunk_rows`` ids (the batch was validated as a whole, so no chunk is refused after
        another was written)."""
        flat = _wire_ids(flat)
        dest = out2d.data.cast("B")
        n = flat.size
        step = self.chunk_rows
        if n <= step:
            self._post_ids(False, flat, dest, None)
        else:
            rb = self.row_bytes
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                self._post_ids(False, flat[lo:hi], dest[lo * rb : hi * rb], None)
        self._count(n)

    def _count(self, n: int) -> None:
        self._counters["fetch_calls"] += 1
        self._counters["rows_fetched"] += n

    # A batch that fits one request is validated by the server (it must check its input
    # anyway) and refused with the typed error and message a local Store raises, before any
    # row is written; checking it here as well costs 2-3 us of a ~25 us round trip. Bigger
    # batches take the RowTable path: validated here first, then split by `gather`, so a bad
    # id in the last chunk leaves ``out`` untouched.
    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids`` (any integer array or list), shape
        ``rowids.shape + (row_bytes,)``, uint8. Allocates the result; see `fetch_into`."""
        self.check_open()
        ids = as_rowids(rowids)
        return self.fetch_into(ids, np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8))

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """Write the rows of global ``rowids`` into ``out`` (writable C-contiguous uint8 of
        shape ``rowids.shape + (row_bytes,)``) and return it. The rows arrive straight into
        ``out``."""
        self.check_open()
        ids = as_rowids(rowids)
        if ids.size > self.chunk_rows:
            return super().fetch_into(ids, out)
        check_output(out, ids.shape + (self.row_bytes,))
        if ids.size:
            # the shape travels when it has two or more axes, so a refusal names the position
            # a local Store would (a scalar id travels as one id: an empty shape header would
            # be refused)
            shape = None if ids.ndim <= 1 else ids.shape
            self._post_ids(False, _wire_ids(ids), out.data.cast("B"), shape)
            self._count(ids.size)
        return out

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Mooncake-style lookup: ``row_ids`` int64 C-contiguous ``[B, L, H]`` of per-head
        *local* ids, ``out`` writable C-contiguous uint8 ``[B, L, H, row_bytes]``; returns
        ``out``. No implicit conversions; an empty batch is a no-op (no round trip)."""
        self.check_open()
        check_lookup_ids(row_ids, self.n_heads)
        check_output(out, row_ids.shape + (self.row_bytes,))
        if row_ids.size > self.chunk_rows:
            return super().lookup_into(row_ids, out)
        if row_ids.size:
            self._post_ids(True, _wire_ids(row_ids), out.data.cast("B"), row_ids.shape)
            self._count(row_ids.size)
        return out

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
            self._client.request_prefix("GET", f"{self._path}/views/{quote(name, safe='')}")
            + b"\r\n"
        )
        return RemoteView(self, name, json.loads(data or b"{}"))

    def stats(self) -> dict[str, Any]:
        """Client-side counters (calls, rows, requests); server counters are in `metrics`."""
        return {"table": self.name, "backend": "remote", "url": self._client.url, **self._counters}

    def close(self) -> None:
        """A remote table holds no resources of its own; close the `Client` instead."""


class RemoteView:
    """A Store-P view on a server: ``read_records`` / ``lookup`` / ``lookup_tokens`` with the
    arguments of a local ``View`` (``out`` optional), answered by the server's view."""

    def __init__(self, table: RemoteStore, name: str, info: dict[str, Any]):
        self.table = table
        self.name = name
        self.info = info
        self.n_records = info.get("n_records")
        self.record_bytes = info.get("record_bytes")
        base = f"{table.path}/views/{quote(name, safe='')}/"
        self._heads = {
            action: table.client.request_prefix("POST", base + action) + _BINARY_HEADERS
            for action in ("records", "lookup", "lookup_tokens")
        }

    def __repr__(self) -> str:
        return (
            f"RemoteView(table={self.table.name!r}, name={self.name!r}, "
            f"n_records={self.n_records}, record_bytes={self.record_bytes})"
        )

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
        self.table.client.request(head, body, out.data.cast("B"))
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
