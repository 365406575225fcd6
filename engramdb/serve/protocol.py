"""The wire contract of ``engramdb serve``, shared by the server and the client. Pure: no I/O.

HTTP/1.1 with keep-alive. Three body encodings, chosen by ``Content-Type`` (request) and
``Accept`` (response):

* **binary** (``application/octet-stream``): row ids are raw little-endian int64, rows come
  back as raw bytes with their shape in ``X-Engramdb-Shape: d0,d1,...,row_bytes``. No JSON
  anywhere on this path: it is the fast one.
* **JSON** (``application/json``): ids as a (nested) list, rows as one base64 string of the
  C-order bytes plus their ``shape``.
* **Arrow IPC stream** (``application/vnd.apache.arrow.stream``, responses only, needs
  pyarrow): a record batch with a ``row`` column of ``fixed_size_binary[row_bytes]``.

Errors are JSON ``{"error": {"type", "message", "status"}}`` where ``type`` is the name of
an `EngramDBError` subclass; the client raises that same class again (`error_class`).

The HTTP parser here is deliberately minimal (request line, ``Name: value`` headers,
``Content-Length`` bodies): it accepts what this service needs and refuses the rest with a
`MalformedRequest` that names the problem, rather than guessing. docs/serve.md has the
measurement that made a hand-written parser worth it.
"""

from __future__ import annotations

import json
from typing import Any

import engramdb.errors as _errors
from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    MissingDependency,
    RowIdOutOfRange,
    ShapeMismatch,
    StoreClosed,
    TableNotFound,
    TokenIdOutOfRange,
)

API_PREFIX = "/v1"
DEFAULT_PORT = 7070

CT_BINARY = "application/octet-stream"
CT_JSON = "application/json"
CT_ARROW = "application/vnd.apache.arrow.stream"
CT_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"

H_SHAPE = "x-engramdb-shape"
H_ROW_BYTES = "x-engramdb-row-bytes"

#: Most dimensions an id array may have on the wire (the local Store has no limit, but a
#: header naming 1,000 dimensions is an attack, not a request).
MAX_NDIM = 8
#: Largest element count an id shape may describe, even an empty one (a dimension of 10**17
#: next to a 0 is refused: numpy cannot even describe the output array).
MAX_SHAPE_ELEMENTS = 1 << 40


def ascii_uint(text: str) -> int | None:
    """``text`` as a non-negative integer if it is 1 to 18 ASCII digits, else None.
    (``str.isdigit`` alone accepts ``"²"`` and other Unicode digits ``int`` refuses.)"""
    if 0 < len(text) <= 18 and text.isascii() and text.isdigit():
        return int(text)
    return None


def check_dims(dims: tuple[int, ...], what: str) -> None:
    """Refuse a shape with a negative dimension, or one whose dimensions (zeros skipped)
    multiply past `MAX_SHAPE_ELEMENTS`: `ShapeMismatch` naming ``what``."""
    total = 1
    for d in dims:
        if d < 0:
            raise ShapeMismatch(f"{what} {dims} has a negative dimension")
        if d:
            total *= d
            if total > MAX_SHAPE_ELEMENTS:
                raise ShapeMismatch(
                    f"{what} {dims} describes more than {MAX_SHAPE_ELEMENTS:,} ids "
                    "(zero dimensions aside)"
                )


# --- errors that exist only because there is a network in between ---------------------------
class ServiceError(EngramDBError):
    """Root of the errors that only a remote table can raise."""


class AuthenticationFailed(ServiceError, PermissionError):
    """The request carried no token, or the wrong one (HTTP 401)."""


class MalformedRequest(ServiceError, InvalidArgument):
    """The HTTP request itself cannot be parsed (bad request line, header or length)."""


class RequestTooLarge(ServiceError, InvalidArgument):
    """A request exceeds a server limit (body bytes, rows, response bytes, header bytes)."""


class UnsupportedMediaType(ServiceError, InvalidArgument):
    """The request body's ``Content-Type`` is not one the endpoint reads."""


class NotAcceptable(ServiceError, InvalidArgument):
    """No response encoding in the request's ``Accept`` header is one the server writes."""


class UnknownEndpoint(ServiceError, LookupError):
    """No endpoint at that path, or the endpoint needs a feature this build lacks (HTTP 404)."""


class MethodNotAllowed(ServiceError, InvalidArgument):
    """The endpoint exists but not for that HTTP method (HTTP 405)."""

    def __init__(self, message: str, allowed: str = ""):
        super().__init__(message)
        self.allowed = allowed


class ServiceUnavailable(ServiceError, ConnectionError):
    """The server cannot be reached, closed the connection, timed out, or is shutting down."""


class ProtocolError(ServiceError, ConnectionError):
    """The server's response does not follow this protocol (wrong length, bad header)."""


class RemoteError(ServiceError, RuntimeError):
    """The server failed in a way that has no typed error (HTTP 500 ``InternalError``)."""


_STATUS_BY_CLASS: list[tuple[type[BaseException], int]] = [
    (AuthenticationFailed, 401),
    (RequestTooLarge, 413),
    (UnsupportedMediaType, 415),
    (NotAcceptable, 406),
    (MissingDependency, 406),  # e.g. Arrow asked for, pyarrow not installed on the server
    (UnknownEndpoint, 404),
    (TableNotFound, 404),
    (MethodNotAllowed, 405),
    (StoreClosed, 503),
    (ServiceUnavailable, 503),
    (MalformedRequest, 400),
    (RowIdOutOfRange, 400),
    (TokenIdOutOfRange, 400),
    (InvalidDtype, 400),
    (InvalidLayout, 400),
    (ShapeMismatch, 400),
    (InvalidArgument, 400),
]

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def status_for(exc: BaseException) -> int:
    """HTTP status of an exception: 4xx for anything the request did wrong, 503 while the
    server shuts down, 500 for everything else (corrupt file, read error, a bug)."""
    for cls, status in _STATUS_BY_CLASS:
        if isinstance(exc, cls):
            return status
    return 500


def _registry() -> dict[str, type[EngramDBError]]:
    """Every error class a response may name: engramdb.errors plus the service errors above.
    The client re-raises only classes listed here (a name is never evaluated)."""
    candidates = list(vars(_errors).values()) + list(globals().values())
    return {
        obj.__name__: obj
        for obj in candidates
        if isinstance(obj, type) and issubclass(obj, EngramDBError)
    }


ERROR_CLASSES = _registry()


def error_class(type_name: str) -> type[EngramDBError]:
    """The class a response's ``error.type`` names; `RemoteError` for any other name."""
    return ERROR_CLASSES.get(type_name, RemoteError)


def error_payload(exc: BaseException) -> tuple[int, bytes]:
    """(status, JSON body) for an exception. Non-EngramDB exceptions are reported as
    ``InternalError`` without their message (it may hold server paths or data)."""
    status = status_for(exc)
    if isinstance(exc, EngramDBError):
        type_name, message = type(exc).__name__, str(exc)
    else:
        type_name, message = "InternalError", "internal server error (details in the server log)"
    doc = {"error": {"type": type_name, "message": message, "status": status}}
    return status, json.dumps(doc).encode()


def raise_for_error(status: int, body: bytes, *, where: str) -> None:
    """Raise the typed exception an error response describes (the client's side)."""
    try:
        err = json.loads(body)["error"]
        type_name, message = str(err["type"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        snippet = body[:200].decode("utf-8", "replace")
        raise ProtocolError(
            f"{where}: HTTP {status} with a non-JSON error body: {snippet!r}"
        ) from None
    raise error_class(type_name)(message)


# --- request heads ---------------------------------------------------------------------------
class RequestHead:
    """One parsed request line and header block. Header names are lower-case ``str``; the
    fields every request needs are computed once here (the binary fetch path reads each of
    them, so a property that re-parses would be paid several times per request)."""

    __slots__ = (
        "method",
        "path",
        "query",
        "version",
        "headers",
        "content_length",
        "media_type",
        "keep_alive",
    )

    def __init__(self, method: str, path: str, query: str, version: str, headers: dict[str, str]):
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        self.content_length = ascii_uint(headers.get("content-length", "0")) or 0
        ctype = headers.get("content-type")
        #: the body's media type without parameters (``; charset=...``), lower-case
        self.media_type = "" if ctype is None else ctype.split(";", 1)[0].strip().lower()
        conn = headers.get("connection")
        if conn is None:
            self.keep_alive = version == "HTTP/1.1"
        elif version == "HTTP/1.0":
            self.keep_alive = "keep-alive" in conn.lower()
        else:
            self.keep_alive = "close" not in conn.lower()


_METHODS = frozenset({"GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"})
#: Headers that must not appear twice: two lengths (or two tokens) is how request
#: smuggling starts.
_SINGLE = frozenset({"content-length", "transfer-encoding", "authorization", H_SHAPE})


def parse_request_head(head: bytes, *, max_header_bytes: int) -> RequestHead:
    """Parse the bytes before the blank line of a request. Raises `MalformedRequest` naming
    what is wrong, or `RequestTooLarge` for an oversized header block.

    Cost: one split and one partition per header line, about 2 us for a 5-header request.
    """
    if len(head) > max_header_bytes:
        raise RequestTooLarge(
            f"request header block is {len(head)} bytes, the limit is {max_header_bytes}"
        )
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise MalformedRequest(f"bad request line {lines[0][:100]!r}")
    method, target, version = parts
    if method not in _METHODS:
        raise MalformedRequest(f"unknown HTTP method {method[:20]!r}")
    if version != "HTTP/1.1" and version != "HTTP/1.0":
        raise MalformedRequest(f"unsupported HTTP version {version[:20]!r} (HTTP/1.1 expected)")
    if target[:1] != "/":
        raise MalformedRequest(f"request target must be a path, got {target[:100]!r}")
    path, _, query = target.partition("?")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name[-1] == " " or name[0] == " ":
            raise MalformedRequest(f"bad header line {line[:100]!r}")
        key = name.lower()
        value = value.strip()
        if key in headers:
            if key in _SINGLE:
                raise MalformedRequest(f"header {name!r} given twice")
            headers[key] = headers[key] + ", " + value
        else:
            headers[key] = value
    if "transfer-encoding" in headers:
        raise MalformedRequest(
            f"Transfer-Encoding {headers['transfer-encoding']!r} is not supported; send the "
            "body with a Content-Length"
        )
    cl = headers.get("content-length")
    if cl is not None and ascii_uint(cl) is None:
        raise MalformedRequest(f"bad Content-Length {cl[:40]!r} (ASCII digits expected)")
    return RequestHead(method, path, query, version, headers)


# --- shapes ----------------------------------------------------------------------------------
def format_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(int(d)) for d in shape)


def parse_shape(text: str, *, what: str = H_SHAPE) -> tuple[int, ...]:
    """``"4,16"`` -> ``(4, 16)``. Raises `ShapeMismatch` naming the header value."""
    text = text.strip()
    if not text:
        return ()
    dims = text.split(",")
    if len(dims) > MAX_NDIM:
        raise ShapeMismatch(f"{what} has {len(dims)} dimensions, at most {MAX_NDIM} allowed")
    out: list[int] = []
    for d in dims:
        n = ascii_uint(d.strip())
        if n is None:
            raise ShapeMismatch(
                f"{what} {text[:100]!r} is not a comma-separated list of sizes (ASCII digits)"
            )
        out.append(n)
    shape = tuple(out)
    check_dims(shape, what)
    return shape


# --- responses (the client's parser) -----------------------------------------------------------
class ResponseHead:
    """A response's status and lower-case headers (the client's side)."""

    __slots__ = ("status", "headers", "content_length", "keep_alive")

    def __init__(self, status: int, headers: dict[str, str]):
        self.status = status
        self.headers = headers
        self.content_length = ascii_uint(headers.get("content-length", "0")) or 0
        self.keep_alive = "close" not in headers.get("connection", "").lower()


def parse_response_head(head: bytes) -> ResponseHead:
    """Parse a response's status line and headers; `ProtocolError` if they do not parse."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or ascii_uint(parts[1]) is None:
        raise ProtocolError(f"bad status line {lines[0][:100]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"bad response header line {line[:100]!r}")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise ProtocolError("chunked responses are not part of this protocol")
    cl = headers.get("content-length", "0")
    if ascii_uint(cl) is None:
        raise ProtocolError(f"bad Content-Length {cl[:40]!r} in response")
    return ResponseHead(int(parts[1]), headers)


def json_dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()
