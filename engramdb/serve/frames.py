"""The EngramDB wire protocol's codec: frame layouts, magics, ops, and the pack / parse
helpers both sides share. Pure (no sockets, no server); the client imports only this.

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

The server side (`engramdb.serve.lane.WireLane`) tells the protocols apart by the first
four bytes of a connection, on every listener, so one socket serves both.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from engramdb.errors import ShapeMismatch
from engramdb.serve import protocol as P

__all__ = [
    "MAX_HELLO_BYTES",
    "OK_FLAGS",
    "OPS",
    "OP_FETCH",
    "OP_HELLO",
    "OP_LOOKUP",
    "REQUEST",
    "REQUEST_MAGIC",
    "RESPONSE",
    "RESPONSE_MAGIC",
    "SPIN_BACKOFF_MAX",
    "error_frame",
    "pack_request",
    "pack_response",
    "parse_hello",
    "parse_ids",
]

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
#: Flags of a 200 reply.
OK_FLAGS = 0
#: Busy-poll back-off cap: after ``k`` spin windows in a row without work, the next
#: ``~2**(k-1)`` waits (at most this many) skip the spin (server lane and client alike).
SPIN_BACKOFF_MAX = 64


def pack_request(op: int, table: int, dims: tuple[int, ...], nbytes: int) -> bytes:
    """Request header plus the dimension block for a payload of ``nbytes`` id bytes."""
    head = REQUEST.pack(REQUEST_MAGIC, op, len(dims), 0, table, 0, 8 * len(dims) + nbytes)
    if not dims:
        return head
    return head + struct.pack(f"<{len(dims)}q", *dims)


def pack_response(status: int, length: int) -> bytes:
    """A response header for a payload of ``length`` bytes."""
    return RESPONSE.pack(RESPONSE_MAGIC, status, OK_FLAGS, 0, length)


def error_frame(exc: BaseException) -> tuple[int, bytes]:
    """(status, frame bytes) of the JSON error ``exc`` maps to."""
    status, body = P.error_payload(exc)
    return status, RESPONSE.pack(RESPONSE_MAGIC, status, 0, 0, len(body)) + body


def parse_ids(payload: memoryview, ndim: int) -> np.ndarray:
    """The int64 ids of a FETCH / LOOKUP payload (a view of ``payload``, no copy)."""
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
    P.check_dims(dims, "frame shape")
    if math.prod(dims) != n:
        raise ShapeMismatch(f"frame shape {dims} holds {math.prod(dims)} ids, the payload {n}")
    return words[ndim:].reshape(dims)


def parse_hello(body: bytes) -> dict[str, Any]:
    """The HELLO reply's document (client side)."""
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise P.ProtocolError(f"HELLO reply is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), list):
        raise P.ProtocolError("HELLO reply has no table list")
    return doc
