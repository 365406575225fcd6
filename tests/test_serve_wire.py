"""The binary wire protocol of `engramdb serve` (`engramdb.serve.frames`): the client's row
path on Unix sockets, and what a raw peer can send that the client never would."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_serve import HEADS, TOKEN, Raw, start, uds_path

import engramdb
from engramdb.client import connect
from engramdb.errors import RowIdOutOfRange, ShapeMismatch, TableNotFound
from engramdb.serve import AuthenticationFailed, Limits, ProtocolError, Server
from engramdb.serve import frames as W
from engramdb.serve.auth import TokenCheck
from engramdb.serve.context import ServingContext
from engramdb.serve.lane import WireLane
from engramdb.testing.dbs import make_db


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return make_db(tmp_path_factory.mktemp("wire"))


@pytest.fixture(scope="module")
def server(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start(database[0], tmp_path_factory.mktemp("sock"))
    try:
        yield srv
    finally:
        srv.stop()


def urls(srv: Server) -> dict[str, str]:
    return {u.split(":")[0]: u for u in srv.urls}


class Peer(Raw):
    """A raw wire-protocol peer on the server's Unix socket."""

    def __init__(self, srv: Server, token: bytes = b"", hello: bool = True):
        super().__init__(srv)
        self.tables: list[str] = []
        if hello:
            status, body = self.call(W.OP_HELLO, 0, (), token)
            assert status == 200, body
            self.tables = json.loads(body)["tables"]

    def frame(self, op: int, table: int, dims: tuple[int, ...], payload: bytes) -> None:
        self.send(W.pack_request(op, table, dims, len(payload)) + payload)

    def reply(self) -> tuple[int, bytes]:
        head = self._exact(W.RESPONSE.size)
        magic, status, _f, _r, length = W.RESPONSE.unpack(head)
        assert magic == W.RESPONSE_MAGIC
        return status, self._exact(length)

    def call(self, op: int, table: int, dims: tuple[int, ...], payload: bytes) -> tuple[int, bytes]:
        self.frame(op, table, dims, payload)
        return self.reply()

    def fetch(self, table: str, ids: Any) -> tuple[int, bytes]:
        arr = np.asarray(ids, dtype="<i8")
        return self.call(W.OP_FETCH, self.tables.index(table), arr.shape, arr.tobytes())

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed by the server")
            data += chunk
        return data


def error_type(body: bytes) -> str:
    return str(json.loads(body)["error"]["type"])


# --- the client ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["unix", "http"])
def test_wire_roundtrips_equal_local(
    server: Server, database: tuple[Path, dict[str, np.ndarray]], where: str
) -> None:
    rng = np.random.default_rng(3)
    rows = database[1]
    with connect(urls(server)[where], wire=True) as c:
        assert c.wire
        for _ in range(20):
            ids = rng.integers(0, sum(HEADS), int(rng.integers(1, 700)))
            assert np.array_equal(c["ple"].fetch(ids), rows["ple"][ids])
        ids2 = rng.integers(0, 4000, (5, 7))
        out = np.empty((5, 7, 264), np.uint8)
        c["eng"].fetch_into(ids2, out)
        assert np.array_equal(out, rows["eng"][ids2])
        local = np.stack([rng.integers(0, h, (4, 3)) for h in HEADS], axis=-1)
        got = np.empty((4, 3, 2, 160), np.uint8)
        c["ple"].lookup_into(np.ascontiguousarray(local), got)
        assert np.array_equal(got, rows["ple"][local + np.array([0, HEADS[0]])])
        stats = c["ple"].stats()
        assert stats["requests"] == stats["fetch_calls"] == 21


def test_unix_uses_the_wire_and_http_is_still_there(
    server: Server, database: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = database[1]["ple"]
    before = server.metrics.requests.get(("hello", "", 200), 0)
    with connect(urls(server)["unix"]) as c:
        assert c.wire
        assert np.array_equal(c["ple"].fetch([5, 6]), rows[[5, 6]])
    assert server.metrics.requests.get(("hello", "", 200), 0) == before + 1
    with connect(urls(server)["unix"], wire=False) as c:
        assert not c.wire
        assert np.array_equal(c["ple"].fetch([5, 6]), rows[[5, 6]])
    with connect(urls(server)["http"]) as c:
        assert not c.wire


def test_wire_errors_are_the_local_types(server: Server) -> None:
    with connect(urls(server)["unix"]) as c:
        out = np.full((3, 160), 7, np.uint8)
        with pytest.raises(RowIdOutOfRange, match="8000"):
            c["ple"].fetch_into(np.array([1, 8000, 2]), out)
        assert (out == 7).all(), "the output is untouched on an error"
        with pytest.raises(RowIdOutOfRange):
            c["ple"].lookup_into(
                np.array([[[0, 5000]]], dtype=np.int64), np.empty((1, 1, 2, 160), np.uint8)
            )
        assert c["ple"].fetch([1]).shape == (1, 160)  # the connection is still good


def test_wire_token_required_and_enforced(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    srv = start(database[0], tmp_path, token=TOKEN)
    try:
        unix = urls(srv)["unix"]
        # connect() reads the table list over HTTP first: that is refused as well
        with pytest.raises(AuthenticationFailed):
            connect(unix)
        for token in (b"", b"x" * len(TOKEN), TOKEN.encode() + b"x"):
            peer = Peer(srv, hello=False)
            status, body = peer.call(W.OP_HELLO, 0, (), token)
            assert status == 401 and error_type(body) == "AuthenticationFailed"
            assert peer.closed_by_peer()
            peer.close()
        # no HELLO: a read is refused and the connection closed
        peer = Peer(srv, hello=False)
        status, body = peer.call(W.OP_FETCH, 0, (1,), struct.pack("<q", 1))
        assert status == 401 and peer.closed_by_peer()
        peer.close()
        peer = Peer(srv, token=TOKEN.encode())
        status, body = peer.fetch("ple", [1, 2])
        assert status == 200 and body == database[1]["ple"][[1, 2]].tobytes()
        peer.close()
        with connect(unix, token=TOKEN) as c:
            assert np.array_equal(c["eng"].fetch([3]), database[1]["eng"][[3]])
    finally:
        srv.stop()


def test_refused_frames_keep_the_connection_malformed_ones_close_it(
    server: Server, database: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = database[1]["ple"]
    peer = Peer(server)
    t = peer.tables.index("ple")
    refusals = [
        (W.OP_FETCH, 99, (1,), struct.pack("<q", 1), 404, "UnknownEndpoint"),
        (W.OP_FETCH, t, (2,), struct.pack("<q", 1), 400, "ShapeMismatch"),  # says 2, holds 1
        (W.OP_FETCH, t, (1,), struct.pack("<q", 8000), 400, "RowIdOutOfRange"),
        (W.OP_FETCH, t, (), b"", 400, "ShapeMismatch"),  # no dimensions
        (W.OP_LOOKUP, t, (1, 3), struct.pack("<3q", 0, 0, 0), 400, "ShapeMismatch"),  # 3 != 2 heads
    ]
    for op, table, dims, payload, status, etype in refusals:
        got, body = peer.call(op, table, dims, payload)
        assert (got, error_type(body)) == (status, etype), body
        # ... and the same connection keeps serving
        got, body = peer.fetch("ple", [4])
        assert got == 200 and body == rows[[4]].tobytes()
    # a payload that is not whole int64 words cannot be framed as ids: refused, kept open
    got, body = peer.call(W.OP_FETCH, t, (1,), b"\x01\x02\x03")
    assert got == 400
    peer.close()
    # frames that cannot be parsed: an error, then the connection is closed
    for raw in (
        W.REQUEST.pack(W.REQUEST_MAGIC, 77, 1, 0, 0, 0, 8) + bytes(8),  # unknown op
        W.REQUEST.pack(W.REQUEST_MAGIC, W.OP_FETCH, 1, 0, 0, 0, 1 << 40),  # oversized
        W.REQUEST.pack(W.REQUEST_MAGIC, W.OP_HELLO, 0, 0, 0, 0, 1 << 20),  # oversized HELLO
        b"XXXX" + bytes(20),  # bad magic after HELLO
    ):
        peer = Peer(server)
        peer.sock.sendall(raw)
        status, body = peer.reply()
        assert status in (400, 413), body
        assert peer.closed_by_peer()
        peer.close()
    # the server is unharmed
    with connect(urls(server)["unix"]) as c:
        assert np.array_equal(c["ple"].fetch([9]), rows[[9]])


def test_pipelined_frames_are_answered_in_order(
    server: Server, database: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = database[1]["eng"]
    peer = Peer(server)
    t = peer.tables.index("eng")
    batches = [[1, 2], list(range(0, 4000, 2)), [8000], [3]]  # big one fills the socket
    data = b""
    for ids in batches:
        arr = np.asarray(ids, "<i8")
        data += W.pack_request(W.OP_FETCH, t, arr.shape, arr.nbytes) + arr.tobytes()
    peer.sock.sendall(data)
    for ids in batches:
        status, body = peer.reply()
        if 8000 in ids:
            assert status == 400 and error_type(body) == "RowIdOutOfRange"
        else:
            assert status == 200 and body == rows[ids].tobytes()
    peer.close()


def test_large_reads_go_to_the_worker_pool(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    rows = database[1]["eng"]
    srv = start(database[0], tmp_path, limits=Limits(inline_max_bytes=1024))
    try:
        with connect(urls(srv)["unix"]) as c, connect(urls(srv)["unix"]) as d:
            rng = np.random.default_rng(5)
            for _ in range(3):
                ids = rng.integers(0, 4000, 3000)  # 792 KB: more than the socket buffer
                assert np.array_equal(c["eng"].fetch(ids), rows[ids])
                assert np.array_equal(d["eng"].fetch(ids[:2]), rows[ids[:2]])
            with pytest.raises(RowIdOutOfRange):  # raised on the worker thread
                c["eng"].fetch(np.append(ids, 4000))
            assert np.array_equal(c["eng"].fetch([1]), rows[[1]])
        with connect(urls(srv)["http"]) as h:
            text = h.metrics()
        expected = 3 * 3002 + 1
        assert f'engramdb_rows_total{{endpoint="fetch",table="eng"}} {expected}' in text
    finally:
        srv.stop()


def test_idle_wire_connections_are_closed_and_reopened(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    srv = start(database[0], tmp_path, limits=Limits(idle_timeout=0.2))
    try:
        with connect(urls(srv)["unix"]) as c:
            c["ple"].fetch([1])
            assert srv.n_wire_connections == 1
            deadline = time.monotonic() + 10
            while srv.n_wire_connections and time.monotonic() < deadline:
                time.sleep(0.05)
            assert srv.n_wire_connections == 0
            assert np.array_equal(c["ple"].fetch([2]), database[1]["ple"][[2]])
    finally:
        srv.stop()


def test_wire_connections_count_against_the_limit(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    srv = start(database[0], tmp_path, limits=Limits(max_connections=2))
    try:
        a, b = Peer(srv), Peer(srv)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        c.connect(uds_path(srv))
        assert c.recv(65536).startswith(b"HTTP/1.1 503")
        for s in (a, b):
            s.close()
        c.close()
    finally:
        srv.stop()


def test_wire_can_be_switched_off(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    srv = start(database[0], tmp_path, wire=False)
    try:
        peer = Peer(srv, hello=False)
        peer.sock.sendall(W.pack_request(W.OP_HELLO, 0, (), 0))
        # without the lane a wire frame gets an HTTP 400 at once, then the close
        assert peer.sock.recv(65536).startswith(b"HTTP/1.1 400")
        peer.close()
        with connect(urls(srv)["unix"]) as c, pytest.raises(ProtocolError, match="wire=False"):
            c["ple"].fetch([1])
        with connect(urls(srv)["unix"], wire=False) as c:
            assert np.array_equal(c["ple"].fetch([1]), database[1]["ple"][[1]])
    finally:
        srv.stop()


def test_unknown_table_on_the_client(server: Server) -> None:
    with connect(urls(server)["unix"]) as c, pytest.raises(TableNotFound):
        c["nope"]


def test_spin_is_validated(server: Server) -> None:
    with pytest.raises(ValueError):
        connect(urls(server)["unix"], spin_us=-1)
    with pytest.raises(ValueError):
        Server(server.db, port=None, unix="/tmp/never.sock", spin_us=-5).start()


def test_shape_errors_name_the_shape(server: Server) -> None:
    peer = Peer(server)
    status, body = peer.call(W.OP_FETCH, 0, (2, 2), struct.pack("<3q", 1, 2, 3))
    assert status == 400 and error_type(body) == ShapeMismatch.__name__
    assert "(2, 2)" in json.loads(body)["error"]["message"]
    peer.close()


def test_lane_runs_over_a_context_without_a_server(
    database: tuple[Path, dict[str, np.ndarray]],
) -> None:
    rows = database[1]["eng"]
    with engramdb.open(database[0]) as db, ThreadPoolExecutor(1) as pool:
        ctx = ServingContext(
            db, Limits(inline_max_bytes=1024), auth=TokenCheck(None), executor=pool
        )
        lane = WireLane(ctx, spin_us=0)
        lane.start()
        ours, theirs = socket.socketpair()
        try:
            theirs.setblocking(False)
            hello = W.pack_request(W.OP_HELLO, 0, (), 0)
            lane.adopt(theirs, hello[:5])  # bytes already read by whoever accepted it
            ours.settimeout(10)
            ours.sendall(hello[5:])

            def exact(n: int) -> bytes:
                data = b""
                while len(data) < n:
                    chunk = ours.recv(n - len(data))
                    assert chunk, "closed by the lane"
                    data += chunk
                return data

            def reply() -> tuple[int, bytes]:
                _m, status, _f, _r, length = W.RESPONSE.unpack(exact(W.RESPONSE.size))
                return status, exact(length)

            status, body = reply()
            assert status == 200 and json.loads(body)["tables"] == ctx.table_names
            t = ctx.table_names.index("eng")
            for ids in ([3, 1], list(range(0, 4000, 3))):  # inline, then on the worker pool
                arr = np.asarray(ids, "<i8")
                ours.sendall(W.pack_request(W.OP_FETCH, t, arr.shape, arr.nbytes) + arr.tobytes())
                assert reply() == (200, rows[ids].tobytes())
            assert lane.n_connections == 1 and lane.in_flight == 0
            assert ctx.metrics.requests[("fetch", "eng", 200)] == 2
        finally:
            lane.stop(1.0)
            ours.close()
