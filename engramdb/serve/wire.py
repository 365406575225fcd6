"""Compatibility home of the wire protocol: the codec now lives in `engramdb.serve.frames`
and the server side in `engramdb.serve.lane`. Re-exports both (removed at the end of the
architecture change)."""

from __future__ import annotations

from engramdb.serve.frames import *  # noqa: F403
from engramdb.serve.frames import (
    MAX_HELLO_BYTES,
    OK_FLAGS,
    OP_FETCH,
    OP_HELLO,
    OP_LOOKUP,
    OPS,
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    SPIN_BACKOFF_MAX,
    error_frame,
    pack_request,
    pack_response,
    parse_hello,
    parse_ids,
)
from engramdb.serve.lane import DEFAULT_SPIN_US, WireLane

__all__ = [
    "DEFAULT_SPIN_US",
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
    "WireLane",
    "error_frame",
    "pack_request",
    "pack_response",
    "parse_hello",
    "parse_ids",
]
