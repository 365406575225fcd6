"""The HTTP endpoints: one parsed request in, one `Reply` (or a `Job` for the worker pool)
out, over a `ServingContext`. No sockets here; `engramdb.serve.http` frames and sends.

Small binary fetches are the hot path: rows are gathered straight into the connection's
response buffer behind the header bytes (no copy after the gather, no JSON), and responses
above ``Limits.inline_max_bytes`` become a `Job` gathered on a worker thread.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import numpy as np

from engramdb.errors import InvalidArgument, InvalidDtype, MissingDependency, ShapeMismatch
from engramdb.serve import protocol as P
from engramdb.serve.context import Job, Reply, ServingContext, error_label
from engramdb.store import Store
from engramdb.validate import as_rowids

_VIEW_METHODS = {"records": "read_records", "lookup": "lookup", "lookup_tokens": "lookup_tokens"}
_ENDPOINTS = {"fetch", "lookup"}
_SPLIT_HINT = " (split the batch; engramdb.connect does this by itself)"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise MissingDependency(
            "Arrow responses need pyarrow on the server: pip install 'engramdb[arrow]'"
        ) from None
    return pyarrow


class Request:
    """What a handler sees: the parsed head, the body, how to frame its answer, and
    ``buffer(nbytes)``: the connection's reusable response buffer (`HttpConnection`)."""

    __slots__ = ("head", "body", "buffer", "keep_alive")

    def __init__(
        self,
        head: P.RequestHead,
        body: bytes,
        buffer: Callable[[int], np.ndarray],
        keep_alive: bool,
    ):
        self.head = head
        self.body = body
        self.buffer = buffer
        self.keep_alive = keep_alive

    def conn_header(self) -> bytes:
        if not self.keep_alive:
            return b"Connection: close\r\n"
        if self.head.version == "HTTP/1.0":
            return b"Connection: keep-alive\r\n"
        return b""


class Routes:
    """Every HTTP endpoint of one server. ``date`` is the ``Date`` header value, refreshed
    by `refresh_date` (the server calls it once a second)."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.version = ctx.version.encode()
        self.date = b""
        self._binary_ok = (
            b"HTTP/1.1 200 OK\r\nServer: engramdb/%s\r\n"
            b"Content-Type: application/octet-stream\r\n" % self.version
        )
        self._info_json: dict[str, bytes] = {}
        self.refresh_date()

    def refresh_date(self) -> None:
        self.date = formatdate(usegmt=True).encode()

    # -- framing ---------------------------------------------------------------------------------
    def head(self, status: int, ctype: str, length: int, extra: bytes = b"") -> bytes:
        """A response head (status line, standard headers, ``extra``, blank line)."""
        return (
            b"HTTP/1.1 %d %s\r\nServer: engramdb/%s\r\nDate: %s\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\n%s\r\n"
            % (
                status,
                P.REASONS.get(status, "Unknown").encode(),
                self.version,
                self.date,
                ctype.encode(),
                length,
                extra,
            )
        )

    def _json_reply(
        self, req: Request, body: bytes, endpoint: str, table: str = "", status: int = 200
    ) -> Reply:
        head = self.head(status, P.CT_JSON, len(body), req.conn_header())
        return Reply(status, [head + body], endpoint, table, nbytes=len(body))

    def error_reply(
        self, exc: BaseException, endpoint: str, table: str, *, keep_alive: bool
    ) -> Reply:
        """The JSON error response for ``exc`` (keeps the connection open when the request
        was framed correctly, so the next request on it is served as usual)."""
        status, body = P.error_payload(exc)
        extra = b"" if keep_alive else b"Connection: close\r\n"
        if status == 401:
            extra += b'WWW-Authenticate: Bearer realm="engramdb"\r\n'
        elif isinstance(exc, P.MethodNotAllowed) and exc.allowed:
            extra += b"Allow: %s\r\n" % exc.allowed.encode()
        head = self.head(status, P.CT_JSON, len(body), extra)
        return Reply(
            status,
            [head + body],
            endpoint,
            table,
            nbytes=len(body),
            error=error_label(exc),
            close=not keep_alive,
        )

    def refusal(self, exc: BaseException) -> bytes:
        """The whole response (head and body) that refuses a connection with ``exc``."""
        status, body = P.error_payload(exc)
        return self.head(status, P.CT_JSON, len(body), b"Connection: close\r\n") + body

    # -- routing ---------------------------------------------------------------------------------
    def authorize(self, head: P.RequestHead) -> bool:
        """Raise `AuthenticationFailed` unless ``head`` may be served: it carries the server's
        token, the server needs none, or it is the health endpoint. Checked by the connection
        as soon as the head arrived, before any of the body is kept. True if the head proves
        its connection (authenticated, or no token needed); a health check on a server with
        a token does not."""
        auth = self.ctx.auth
        if not auth.required:
            return True
        path = head.path
        if path in ("/v1/health", "/healthz", "/v1/health/", "/healthz/"):
            return False
        if not auth.allows(head.headers.get("authorization")):
            if "authorization" not in head.headers:
                raise P.AuthenticationFailed("this server needs `Authorization: Bearer <token>`")
            raise P.AuthenticationFailed("the bearer token is not the server's token")
        return True

    def route(self, req: Request) -> Reply | Job:
        """Dispatch one request. Raises `EngramDBError` subclasses for every refusal."""
        ctx = self.ctx
        head = req.head
        path = head.path
        if len(path) > 1 and path.endswith("/"):
            path = path[:-1]
        if path in ("/v1/health", "/healthz"):
            _method(head, "GET")
            return self._health(req)
        self.authorize(head)
        if path.startswith("/v1/tables/"):
            name, _, action = path[len("/v1/tables/") :].partition("/")
            if "%" in name:
                name = unquote(name)
            store = ctx.store(name)
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
                "tables": [json.loads(self._table_json(ctx.store(n))) for n in ctx.db.tables],
                "generation": ctx.db.manifest.generation,
                "limits": ctx.limits.to_dict(),
                "version": ctx.version,
            }
            return self._json_reply(req, P.json_dumps(doc), "tables")
        elif path in ("/metrics", "/v1/metrics"):
            _method(head, "GET")
            connections, in_flight = ctx.gauges()
            text = ctx.metrics.render(
                connections_open=connections,
                in_flight=in_flight,
                store_stats=[s.stats() for s in ctx.stores()],
                view_stats=[v.stats() for v in ctx.views() if hasattr(v, "stats")],
            ).encode()
            hd = self.head(200, P.CT_PROMETHEUS, len(text), req.conn_header())
            return Reply(200, [hd + text], "metrics", nbytes=len(text))
        raise P.UnknownEndpoint(
            f"no endpoint {head.method} {head.path[:200]!r}; see GET /v1/tables, POST "
            "/v1/tables/{name}/fetch, POST /v1/tables/{name}/lookup, GET /v1/health, GET /metrics"
        )

    def _health(self, req: Request) -> Reply:
        ctx = self.ctx
        doc = {
            "status": "draining" if ctx.draining else "ok",
            "tables": len(ctx.db.tables),
            "generation": ctx.db.manifest.generation,
            "version": ctx.version,
            "auth": ctx.auth.required,
        }
        return self._json_reply(
            req, P.json_dumps(doc), "health", status=503 if ctx.draining else 200
        )

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
    def _ids(self, req: Request, *, key: str) -> np.ndarray:
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
            ids = _json_ids(body, key)
        else:
            raise P.UnsupportedMediaType(
                f"Content-Type {head.headers.get('content-type', '(none)')!r} is not readable "
                f"here; send {P.CT_BINARY} (raw little-endian int64) or {P.CT_JSON}"
            )
        self.ctx.limits.check_rows(ids.size, hint=_SPLIT_HINT)
        return ids

    def _rows(self, req: Request, store: Store, *, lookup: bool) -> Reply | Job:
        limits = self.ctx.limits
        endpoint = "lookup" if lookup else "fetch"
        ids = self._ids(req, key="row_ids" if lookup else "ids")
        rb = store.row_bytes
        nbytes = limits.check_response(ids.size, rb)
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
            else:
                limits.check_response(_b64_len(nbytes), 1)  # base64 is 4/3 of the rows
            gather_to = store.lookup_into if lookup else store.fetch_into

            def encoded() -> Reply:
                out = np.empty(shape, np.uint8)
                gather_to(ids, out)
                return self._encoded(req, store, ids, out, fmt, endpoint, lookup)

            if nbytes <= limits.inline_max_bytes:
                return encoded()
            return Job(encoded, endpoint, store.name)
        shape_text = b"%d,%d" % shape if len(shape) == 2 else P.format_shape(shape).encode()
        hd = b"%sDate: %s\r\nX-Engramdb-Shape: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            self._binary_ok,
            self.date,
            shape_text,
            nbytes,
            req.conn_header(),
        )
        total = len(hd) + nbytes
        buf = req.buffer(total)
        mv = buf.data
        mv[: len(hd)] = hd
        # rows are gathered straight into the response buffer, behind the header bytes
        out = buf[len(hd) : total].reshape(shape)
        gather = store.lookup_into if lookup else store.fetch_into
        if nbytes <= limits.inline_max_bytes:
            gather(ids, out)
            return Reply(200, [mv[:total]], endpoint, store.name, rows=ids.size, nbytes=nbytes)
        n_rows = ids.size

        def run() -> Reply:
            gather(ids, out)
            return Reply(200, [mv[:total]], endpoint, store.name, rows=n_rows, nbytes=nbytes)

        return Job(run, endpoint, store.name)

    def _encoded(
        self,
        req: Request,
        store: Store,
        ids: np.ndarray,
        out: np.ndarray,
        fmt: str,
        endpoint: str,
        lookup: bool,
    ) -> Reply:
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
            hd = self.head(200, P.CT_JSON, len(body), req.conn_header())
            return Reply(200, [hd + body], endpoint, store.name, rows=ids.size, nbytes=len(body))
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
        hd = self.head(
            200,
            P.CT_ARROW,
            data.size,
            b"X-Engramdb-Shape: %s\r\n" % P.format_shape(out.shape).encode() + req.conn_header(),
        )
        return Reply(
            200, [hd, memoryview(data)], endpoint, store.name, rows=ids.size, nbytes=data.size
        )

    # -- views (Store-P) -------------------------------------------------------------------------
    def _view(self, req: Request, store: Store, rest: str) -> Reply | Job:
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
        # TableNotFound / StaleView of the opener propagate as typed errors
        view = self.ctx.view(store, vname, view_fn)
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
        fmt = _negotiate(req.head, P.CT_JSON if req.head.media_type == P.CT_JSON else P.CT_BINARY)
        if fmt == P.CT_ARROW:
            raise P.NotAcceptable("view records are served as binary or JSON, not Arrow")
        # the response limit holds before anything is gathered: one record per id (per key
        # of key_width ids for lookup), record_bytes each
        limits = self.ctx.limits
        record_bytes = getattr(view, "record_bytes", None)
        if isinstance(record_bytes, int) and record_bytes > 0:
            key_width = getattr(view, "key_width", 1) if method == "lookup" else 1
            n_out = ids.size // key_width if isinstance(key_width, int) and key_width > 0 else 0
            expect = limits.check_response(n_out or ids.size, record_bytes)
            if fmt == P.CT_JSON:
                limits.check_response(_b64_len(expect), 1)
        else:
            expect = limits.inline_max_bytes + 1  # unknown size: off the loop
        call = getattr(view, method)
        if expect <= limits.inline_max_bytes:
            return self._view_reply(req, store, ids, call(ids), fmt)

        def run() -> Reply:
            return self._view_reply(req, store, ids, call(ids), fmt)

        return Job(run, "view", store.name)

    def _view_reply(
        self, req: Request, store: Store, ids: np.ndarray, result: Any, fmt: str
    ) -> Reply:
        records = np.ascontiguousarray(np.asarray(result))
        if records.dtype != np.uint8:
            records = records.view(np.uint8) if records.flags.c_contiguous else records
        self.ctx.limits.check_response(records.nbytes, 1)  # whatever the view returned
        if fmt == P.CT_JSON:
            return self._encoded(req, store, ids, records, fmt, "view", True)
        hd = (
            b"HTTP/1.1 200 OK\r\nServer: engramdb/%s\r\nDate: %s\r\n"
            b"Content-Type: application/octet-stream\r\nX-Engramdb-Shape: %s\r\n"
            b"Content-Length: %d\r\n%s\r\n"
            % (
                self.version,
                self.date,
                P.format_shape(records.shape).encode(),
                records.nbytes,
                req.conn_header(),
            )
        )
        return Reply(
            200,
            [hd, records.reshape(-1).data],
            "view",
            store.name,
            rows=ids.size,
            nbytes=records.nbytes,
        )

    # -- metric labels ---------------------------------------------------------------------------
    def table_of(self, path: str) -> str:
        """The table label of a path: only names of real tables (no unbounded label growth)."""
        if path.startswith("/v1/tables/"):
            name = unquote(path[len("/v1/tables/") :].split("/", 1)[0])
            if name in self.ctx.db:
                return name
        return ""


def endpoint_of(path: str) -> str:
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


def _b64_len(nbytes: int) -> int:
    """Bytes of ``nbytes`` bytes in base64."""
    return 4 * ((nbytes + 2) // 3)


def _json_depth_ok(body: bytes) -> bool:
    """True unless the body opens more than `P.MAX_NDIM` + 1 nested containers (checked
    before parsing: a deep body is refused in one C-speed pass, never recursed into)."""
    if body.count(b"[") + body.count(b"{") <= P.MAX_NDIM + 1:
        return True
    depth = 0
    opened = np.frombuffer(body, np.uint8)
    step = (opened == ord("[")).astype(np.int8) + (opened == ord("{"))
    step -= (opened == ord("]")).astype(np.int8) + (opened == ord("}"))
    if step.size:
        depth = int(np.cumsum(step, dtype=np.int64).max())
    return depth <= P.MAX_NDIM + 1


def _json_ids(body: bytes, key: str) -> np.ndarray:
    """Ids from a JSON body: a nested list, or an object whose ``key`` holds one."""
    if not _json_depth_ok(body):
        raise InvalidArgument(
            f"request body nests lists deeper than {P.MAX_NDIM + 1} levels; ids have at most "
            f"{P.MAX_NDIM} dimensions"
        )
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
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
    except (ValueError, OverflowError, TypeError) as e:
        raise ShapeMismatch(f"{key!r} is not a rectangular list of integers: {e}") from None
    if arr.dtype == object or arr.dtype.kind in "SUV":
        raise InvalidDtype(f"{key!r} must hold integers that fit in int64")
    if arr.ndim > P.MAX_NDIM:
        raise ShapeMismatch(f"{key!r} has {arr.ndim} dimensions, at most {P.MAX_NDIM} allowed")
    return np.ascontiguousarray(as_rowids(arr))


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
