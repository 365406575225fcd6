"""`engramdb serve` and `engramdb.connect`, in one process: the server runs on a background
thread on a temporary Unix socket and an ephemeral loopback port, and is always stopped."""

from __future__ import annotations

import base64
import hmac
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.client import connect
from engramdb.errors import (
    InvalidArgument,
    InvalidDtype,
    InvalidLayout,
    RowIdOutOfRange,
    ShapeMismatch,
    StoreClosed,
    TableNotFound,
)
from engramdb.serve import (
    AuthenticationFailed,
    Limits,
    Server,
    ServiceUnavailable,
    UnknownEndpoint,
    open_database,
)
from engramdb.serve.auth import TokenCheck, check_bind, is_loopback, load_token
from engramdb.store import Store
from engramdb.testing.dbs import DEFAULT_TABLES, make_db

# make_db's default tables: "ple" (160 B rows, fp8_e4m3, heads 3000 + 5000), "eng" (264 B)
HEADS = list(DEFAULT_TABLES["ple"].heads)
TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return make_db(tmp_path_factory.mktemp("serve"))


def start(db: Path, tmp: Path, **kw: Any) -> Server:
    sock = tmp / f"s{time.monotonic_ns() % 10**9}.sock"
    return Server(db, port=0, unix=str(sock), **kw).start()


@pytest.fixture(scope="module")
def server(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start(database[0], tmp_path_factory.mktemp("sock"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(params=["http", "unix"])
def url(request: pytest.FixtureRequest, server: Server) -> str:
    return next(u for u in server.urls if u.startswith(request.param))


def uds_path(srv: Server) -> str:
    return next(u for u in srv.urls if u.startswith("unix://"))[len("unix://") :]


# --- a raw HTTP/1.1 peer, to send what the client never would ------------------------------
class Raw:
    def __init__(self, srv: Server):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(uds_path(srv))
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before a response")
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        n = int(headers.get("content-length", "0"))
        while len(rest) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed mid-body")
            rest += chunk
        self.buf = rest[n:]
        return status, headers, rest[:n]

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        hd = f"{method} {path} HTTP/1.1\r\nHost: t\r\n"
        for k, v in (headers or {}).items():
            hd += f"{k}: {v}\r\n"
        if body or method == "POST":
            hd += f"Content-Length: {len(body)}\r\n"
        self.send(hd.encode() + b"\r\n" + body)
        return self.response()

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def ids_body(ids: Any) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


BIN = {"Content-Type": "application/octet-stream"}


def error_of(body: bytes) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(body)["error"]
    return err


# --- round trips ---------------------------------------------------------------------------
def test_roundtrip_equals_local(
    url: str, database: tuple[Path, dict[str, np.ndarray]], rng: np.random.Generator
) -> None:
    db_path, rows = database
    with connect(url) as client, engramdb.open(db_path) as local:
        assert client.tables == local.tables == ["eng", "ple"]
        for name in client.tables:
            remote, loc = client[name], local[name]
            assert (remote.n_rows, remote.row_bytes, remote.dtype, remote.dim) == (
                loc.n_rows,
                loc.row_bytes,
                loc.dtype,
                loc.dim,
            )
            assert np.array_equal(remote.heads, loc.heads)
            assert np.array_equal(remote.head_offsets, loc.head_offsets)
            for shape in [(1,), (16,), (4096,), (3, 5), (0,)]:
                ids = rng.integers(0, loc.n_rows, shape)
                assert np.array_equal(remote.fetch(ids), loc.fetch(ids))
                out = np.empty(shape + (loc.row_bytes,), np.uint8)
                assert remote.fetch_into(ids, out) is out
                assert np.array_equal(out, rows[name][ids])
            # every head boundary, both sides of it
            edges = np.concatenate([[0, loc.n_rows - 1], loc.head_offsets, loc.head_offsets - 1])
            edges = edges[(edges >= 0) & (edges < loc.n_rows)]
            assert np.array_equal(remote.fetch(edges), rows[name][edges])
            assert np.array_equal(remote.fetch(edges.tolist()), rows[name][edges])


def test_lookup_into_equals_local(
    url: str, database: tuple[Path, dict[str, np.ndarray]], rng: np.random.Generator
) -> None:
    db_path, _ = database
    with connect(url) as client, engramdb.open(db_path) as local:
        remote, loc = client["ple"], local["ple"]
        local_ids = np.stack([rng.integers(0, h, (4, 7)) for h in HEADS], axis=-1).astype(np.int64)
        local_ids[0, 0] = [HEADS[0] - 1, HEADS[1] - 1]  # last row of each head
        local_ids[0, 1] = [0, 0]
        a = np.empty((4, 7, 2, 160), np.uint8)
        b = np.empty_like(a)
        remote.lookup_into(local_ids, a)
        loc.lookup_into(local_ids, b)
        assert np.array_equal(a, b)
        assert np.array_equal(remote.to_global(local_ids), loc.to_global(local_ids))
        remote.lookup_into(np.empty((0, 3, 2), np.int64), np.empty((0, 3, 2, 160), np.uint8))


def test_errors_are_the_local_types(url: str, database: tuple[Path, dict[str, np.ndarray]]) -> None:
    db_path, _ = database
    with connect(url) as client, engramdb.open(db_path) as local:
        remote, loc = client["ple"], local["ple"]
        cases: list[tuple[Any, ...]] = [
            (lambda s: s.fetch([1, 8000]), RowIdOutOfRange),
            (lambda s: s.fetch(np.array([[5, -1]])), RowIdOutOfRange),
            (lambda s: s.fetch([1.5]), InvalidDtype),
            (lambda s: s.fetch_into([1, 2], np.empty((2, 161), np.uint8)), ShapeMismatch),
            (lambda s: s.fetch_into([1, 2], np.empty((2, 160), np.int8)), InvalidDtype),
            (lambda s: s.fetch_into([1, 2], np.empty((160, 2), np.uint8).T), InvalidLayout),
            (
                lambda s: s.lookup_into(
                    np.array([[[3000, 0]]], np.int64), np.empty((1, 1, 2, 160), np.uint8)
                ),
                RowIdOutOfRange,
            ),
            (
                lambda s: s.lookup_into(
                    np.zeros((1, 1, 3), np.int64), np.empty((1, 1, 3, 160), np.uint8)
                ),
                ShapeMismatch,
            ),
            (
                lambda s: s.lookup_into(
                    np.zeros((1, 1, 2), np.int32), np.empty((1, 1, 2, 160), np.uint8)
                ),
                InvalidDtype,
            ),
        ]
        for call, cls in cases:
            with pytest.raises(cls) as remote_err:
                call(remote)
            with pytest.raises(cls) as local_err:
                call(loc)
            assert str(remote_err.value) == str(local_err.value)
        with pytest.raises(TableNotFound, match="nope"):
            client["nope"]
        with pytest.raises(IndexError):  # still the builtin a numpy user catches
            remote.fetch([10**12])
        # the connection is still good after every error
        assert np.array_equal(remote.fetch([7]), loc.fetch([7]))


def test_batches_beyond_the_row_limit_are_split(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, rng: np.random.Generator
) -> None:
    db_path, rows = database
    srv = start(db_path, tmp_path, limits=Limits(max_rows=1000, inline_max_bytes=4096))
    try:
        with connect(srv.urls[1]) as client:
            t = client["ple"]
            assert t.chunk_rows == 1000
            ids = rng.integers(0, 8000, 5500)
            assert np.array_equal(t.fetch(ids), rows["ple"][ids])
            assert t.stats()["requests"] == 6
            # a bad id in the last chunk: nothing of `out` is written
            ids[-1] = 8000
            out = np.zeros((5500, 160), np.uint8)
            with pytest.raises(RowIdOutOfRange, match="position 5499"):
                t.fetch_into(ids, out)
            assert not out.any()
            local_ids = np.stack([rng.integers(0, h, (30, 40)) for h in HEADS], -1)
            got = np.empty((30, 40, 2, 160), np.uint8)
            t.lookup_into(local_ids.astype(np.int64), got)
            assert np.array_equal(got, rows["ple"][local_ids + np.array([0, HEADS[0]])])
        # a raw request over the limit is refused with 413 naming both numbers
        raw = Raw(srv)
        status, _, body = raw.request("POST", "/v1/tables/ple/fetch", ids_body(range(1001)), BIN)
        assert status == 413 and "1,001 rows" in error_of(body)["message"]
        raw.close()
    finally:
        srv.stop()


# --- security ------------------------------------------------------------------------------
def test_token_required_and_enforced(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    srv = start(database[0], tmp_path, token=TOKEN)
    try:
        for url in srv.urls:
            with pytest.raises(AuthenticationFailed, match="Bearer"):
                connect(url)
            with pytest.raises(AuthenticationFailed, match="not the server's token"):
                connect(url, token=TOKEN + "x")
            with pytest.raises(PermissionError):
                connect(url, token="wrong-token-of-some-length")
            with connect(url, token=TOKEN) as c:
                assert np.array_equal(c["eng"].fetch([3]), database[1]["eng"][[3]])
        raw = Raw(srv)
        status, headers, body = raw.request("POST", "/v1/tables/ple/fetch", ids_body([1]), BIN)
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert error_of(body)["type"] == "AuthenticationFailed"
        for path in ("/v1/tables", "/v1/tables/ple", "/metrics"):
            assert raw.request("GET", path)[0] == 401
        # health answers without a token but says nothing about the data
        status, _, body = raw.request("GET", "/v1/health")
        assert status == 200 and json.loads(body)["auth"] is True
        raw.close()
    finally:
        srv.stop()


def test_token_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    check = TokenCheck(TOKEN.encode())
    assert check.allows("Bearer " + TOKEN)
    assert not check.allows("Bearer " + TOKEN[:-1])
    assert not check.allows(None)
    assert len(calls) == 3  # every check, including a missing header, goes through it
    assert TokenCheck(None).allows(None)


def test_token_file_rules(tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    assert load_token(f) == TOKEN.encode()
    f.write_text("short")
    with pytest.raises(InvalidArgument, match="at least 16"):
        load_token(f)
    f.write_text("has a space in the middle of it")
    with pytest.raises(InvalidArgument, match="printable"):
        load_token(f)
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_token(tmp_path / "missing")


def test_non_loopback_bind_needs_a_token(database: tuple[Path, dict[str, np.ndarray]]) -> None:
    for addr in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(addr)
    for addr in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "8.8.8.8", "fe80::1"):
        assert not is_loopback(addr)
    with pytest.raises(InvalidArgument, match="--token-file"):
        check_bind("0.0.0.0", ["0.0.0.0"], token=None, insecure=False)
    with pytest.raises(InvalidArgument, match="10.1.2.3"):
        check_bind("both", ["127.0.0.1", "10.1.2.3"], token=None, insecure=False)
    check_bind("0.0.0.0", ["0.0.0.0"], token=b"x" * 16, insecure=False)
    check_bind("0.0.0.0", ["0.0.0.0"], token=None, insecure=True)
    check_bind("localhost", ["127.0.0.1", "::1"], token=None, insecure=False)
    # the server itself refuses before binding anything
    with pytest.raises(InvalidArgument, match="refusing to listen on '0.0.0.0'"):
        Server(database[0], host="0.0.0.0", port=0).start()


def test_malformed_requests_get_4xx_json_and_the_server_keeps_serving(
    server: Server, database: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = database[1]["ple"]
    raw = Raw(server)
    # framed correctly but wrong: 4xx, and the SAME connection keeps working
    keep_alive_cases: list[tuple[tuple[Any, ...], int, str]] = [
        (("POST", "/v1/tables/ple/fetch", b"\x01" * 12, BIN), 400, "not a multiple of 8"),
        (
            ("POST", "/v1/tables/ple/fetch", ids_body([1]), {"Content-Type": "text/plain"}),
            415,
            "Content-Type",
        ),
        (("POST", "/v1/tables/ple/fetch", ids_body([1])), 415, "Content-Type"),
        (
            ("POST", "/v1/tables/ple/fetch", b"[1, 2", {"Content-Type": "application/json"}),
            400,
            "not valid JSON",
        ),
        (
            ("POST", "/v1/tables/ple/fetch", b"[1.5]", {"Content-Type": "application/json"}),
            400,
            "integers",
        ),
        (
            ("POST", "/v1/tables/ple/fetch", b'"abc"', {"Content-Type": "application/json"}),
            400,
            "list of integers",
        ),
        (
            (
                "POST",
                "/v1/tables/ple/fetch",
                b"[[1], [2, 3]]",
                {"Content-Type": "application/json"},
            ),
            400,
            "rectangular",
        ),
        (
            ("POST", "/v1/tables/ple/fetch", b'{"x": [1]}', {"Content-Type": "application/json"}),
            400,
            "'ids' field",
        ),
        (
            (
                "POST",
                "/v1/tables/ple/fetch",
                b"[99999999999999999999999]",
                {"Content-Type": "application/json"},
            ),
            400,
            "int64",
        ),
        (
            (
                "POST",
                "/v1/tables/ple/fetch",
                ids_body([1, 2, 3]),
                {**BIN, "X-Engramdb-Shape": "2,2"},
            ),
            400,
            "holds 4 ids",
        ),
        (
            ("POST", "/v1/tables/ple/fetch", ids_body([1]), {**BIN, "X-Engramdb-Shape": "a,b"}),
            400,
            "comma-separated",
        ),
        (
            ("POST", "/v1/tables/ple/fetch", ids_body([1]), {**BIN, "Accept": "text/html"}),
            406,
            "text/html",
        ),
        (("POST", "/v1/tables/ple/fetch", ids_body([-5]), BIN), 400, "row id -5 at position 0"),
        (("POST", "/v1/tables/ple/lookup", ids_body([1, 2]), BIN), 400, "[B, L, H]"),
        (("POST", "/v1/tables/nope/fetch", ids_body([1]), BIN), 404, "no table 'nope'"),
        (("GET", "/v1/tables/ple/fetch"), 405, "takes POST"),
        (("GET", "/v1/nothing"), 404, "no endpoint"),
        (("POST", "/v1/tables/ple/fetch", b"x" * (17 << 20), BIN), 413, "limit is"),
    ]
    for args, status, text in keep_alive_cases:
        got, headers, body = raw.request(*args)
        err = error_of(body)
        assert (got, err["status"]) == (status, status), (args[:2], body[:200])
        assert text in err["message"], (text, err)
        assert headers["content-type"] == "application/json"
        assert "connection" not in headers  # kept alive
        ok, _, data = raw.request("POST", "/v1/tables/ple/fetch", ids_body([5, 6]), BIN)
        assert ok == 200 and data == rows[[5, 6]].tobytes()
    raw.close()
    # not even framed: 4xx, that connection closes, the next one is served
    framing_cases = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/tables/ple/fetch HTTP/1.1\r\nContent-Length: 8\r\nContent-Length: 16\r\n\r\n",
        b"POST /v1/tables/ple/fetch HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/tables/ple/fetch HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"GET /v1/health HTTP/1.1\r\nX-Big: " + b"a" * (20 << 10) + b"\r\n\r\n",
        b"GET /v1/health HTTP/1.1\r\nbad header line\r\n\r\n",
    ]
    for data in framing_cases:
        raw = Raw(server)
        raw.send(data)
        status, headers, body = raw.response()
        assert 400 <= status < 500 and error_of(body)["status"] == status, data[:60]
        assert headers.get("connection") == "close"
        assert raw.closed_by_peer()
        raw.close()
    with connect(server.urls[0]) as c:
        assert np.array_equal(c["ple"].fetch([9]), rows[[9]])


def test_json_path(server: Server, database: tuple[Path, dict[str, np.ndarray]]) -> None:
    rows = database[1]["ple"]
    raw = Raw(server)
    ids = [[1, 2, 3], [7999, 0, 5]]
    for body in (json.dumps(ids), json.dumps({"ids": ids})):
        status, headers, data = raw.request(
            "POST", "/v1/tables/ple/fetch", body.encode(), {"Content-Type": "application/json"}
        )
        doc = json.loads(data)
        assert status == 200 and doc["shape"] == [2, 3, 160] and doc["encoding"] == "base64"
        got = np.frombuffer(base64.b64decode(doc["data"]), np.uint8).reshape(doc["shape"])
        assert np.array_equal(got, rows[np.array(ids)])
    # JSON in, binary out (and the other way round)
    status, headers, data = raw.request(
        "POST",
        "/v1/tables/ple/lookup",
        json.dumps({"row_ids": [[[0, 4999]]]}).encode(),
        {"Content-Type": "application/json", "Accept": "application/octet-stream"},
    )
    assert status == 200 and headers["x-engramdb-shape"] == "1,1,2,160"
    assert data == rows[[0, 7999]].tobytes()
    status, _, data = raw.request(
        "POST", "/v1/tables/ple/fetch", ids_body([4]), {**BIN, "Accept": "application/json"}
    )
    assert base64.b64decode(json.loads(data)["data"]) == rows[4].tobytes()
    # table list and info
    status, _, data = raw.request("GET", "/v1/tables")
    doc = json.loads(data)
    assert [t["name"] for t in doc["tables"]] == ["eng", "ple"]
    assert doc["limits"]["max_rows"] == Limits().max_rows
    status, _, data = raw.request("GET", "/v1/tables/ple")
    info = json.loads(data)
    assert info["heads"] == HEADS and info["head_offsets"] == [0, 3000]
    assert info["dtype"] == "fp8_e4m3" and info["row_bytes"] == 160
    raw.close()


def test_arrow_responses(server: Server, database: tuple[Path, dict[str, np.ndarray]]) -> None:
    rows = database[1]["eng"]
    raw = Raw(server)
    status, headers, data = raw.request(
        "POST",
        "/v1/tables/eng/fetch",
        ids_body([3, 1, 2]),
        {**BIN, "Accept": "application/vnd.apache.arrow.stream"},
    )
    try:
        import pyarrow.ipc
    except ImportError:
        assert status == 406 and error_of(data)["type"] == "MissingDependency"
        assert "engramdb[arrow]" in error_of(data)["message"]
        return
    finally:
        raw.close()
    assert status == 200 and headers["content-type"] == "application/vnd.apache.arrow.stream"
    table = pyarrow.ipc.open_stream(data).read_all()
    assert table.column("id").to_pylist() == [3, 1, 2]
    assert [bytes(v) for v in table.column("row").to_pylist()] == [
        rows[i].tobytes() for i in (3, 1, 2)
    ]
    assert table.schema.metadata[b"engramdb.shape"] == b"3,264"
    with connect(server.urls[0]) as c:
        t = c["eng"].fetch_arrow([0, 5])
        assert bytes(t.column("row")[1].as_py()) == rows[5].tobytes()


def test_health_and_metrics(server: Server) -> None:
    with connect(server.urls[1]) as c:
        assert c.health()["status"] == "ok"
        c["ple"].fetch(np.arange(16))
        with pytest.raises(RowIdOutOfRange):
            c["ple"].fetch([-1])
        text = c.metrics()
    assert 'engramdb_requests_total{endpoint="fetch",table="ple",code="200"}' in text
    assert 'engramdb_errors_total{endpoint="fetch",type="RowIdOutOfRange"}' in text
    assert 'engramdb_request_duration_seconds_bucket{endpoint="fetch",le="+Inf"}' in text
    assert 'engramdb_rows_total{endpoint="fetch",table="ple"}' in text
    assert 'engramdb_response_bytes_total{endpoint="fetch",table="ple"}' in text
    assert "engramdb_process_resident_memory_bytes " in text
    assert 'engramdb_store_rows_fetched{table="ple"}' in text  # Store.stats() fields
    # arbitrary paths and table names do not grow the label set
    raw = Raw(server)
    for i in range(20):
        raw.request("GET", f"/v1/tables/t{i}/x{i}")
    raw.close()
    with connect(server.urls[1]) as c:
        text = c.metrics()
    assert "t1" not in text and "x1" not in text


def test_keep_alive_reuses_one_connection(server: Server, url: str) -> None:
    before = server.metrics.connections_total
    with connect(url) as c:
        for _ in range(50):
            c["ple"].fetch([1, 2, 3])
    # HTTP: one connection for everything; Unix socket: one HTTP connection (table list)
    # and one wire-protocol connection for the 50 fetches
    assert server.metrics.connections_total - before == (2 if url.startswith("unix") else 1)


def test_idle_connection_closed_by_server_is_reopened(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    srv = start(database[0], tmp_path, limits=Limits(idle_timeout=0.2))
    try:
        with connect(srv.urls[1]) as c:
            c["ple"].fetch([1])
            deadline = time.monotonic() + 10  # the once-a-second sweep closes it
            while srv.n_http_connections and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not srv.n_http_connections
            assert np.array_equal(c["ple"].fetch([2]), database[1]["ple"][[2]])
    finally:
        srv.stop()


def test_connection_limit(database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    srv = start(database[0], tmp_path, limits=Limits(max_connections=2))
    try:
        # each connection proves itself before the next comes (an unproven one may be
        # closed for a newcomer: the reserve, test_serve_hostile.py)
        a = Raw(srv)
        a.request("GET", "/v1/health")
        b = Raw(srv)
        b.request("GET", "/v1/health")
        c = Raw(srv)
        status, _, body = c.response()
        assert status == 503 and "max_connections=2" in error_of(body)["message"]
        for r in (a, b, c):
            r.close()
    finally:
        srv.stop()


def test_unix_socket_path_rules(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path = tmp_path / "x.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a socket file whose server is gone
    dead.close()
    srv = Server(database[0], port=None, unix=str(path)).start()
    try:
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        with pytest.raises(InvalidArgument, match="already listening"):
            Server(database[0], port=None, unix=str(path)).start()
    finally:
        srv.stop()
    assert not path.exists()  # removed on stop
    path.write_text("not a socket")
    with pytest.raises(InvalidArgument, match="not a socket"):
        Server(database[0], port=None, unix=str(path)).start()
    with pytest.raises(InvalidArgument, match="nothing to listen on"):
        Server(database[0], port=None)


def test_client_url_and_state_errors(server: Server) -> None:
    with pytest.raises(InvalidArgument, match="plain HTTP"):
        connect("https://localhost:7070")
    with pytest.raises(InvalidArgument, match="unsupported URL"):
        connect("ftp://x")
    with pytest.raises(InvalidArgument, match="absolute path"):
        connect("unix://relative.sock")
    with pytest.raises(ServiceUnavailable, match="cannot connect"):
        connect("unix:///nonexistent/engramdb.sock")
    c = connect(server.urls[0])
    t = c["ple"]
    c.close()
    with pytest.raises(StoreClosed):
        t.fetch([1])


def test_views_follow_the_store(
    server: Server, monkeypatch: pytest.MonkeyPatch, database: tuple[Path, dict[str, np.ndarray]]
) -> None:
    raw = Raw(server)
    if not hasattr(Store, "view"):
        status, _, body = raw.request("GET", "/v1/tables/ple/views/v")
        assert status == 404 and "no Store.view" in error_of(body)["message"]
        with connect(server.urls[1]) as c, pytest.raises(UnknownEndpoint, match="Store.view"):
            c["ple"].view("v")

    rows = database[1]["ple"]

    class FakeView:
        n_records = 10
        record_bytes = 320

        def __init__(self, store: Store, name: str):
            if name != "v":
                raise TableNotFound(f"no view {name!r} of table {store.name!r}")
            self.store = store

        def read_records(self, ids: np.ndarray) -> np.ndarray:
            return self.store.fetch(np.stack([ids, ids + 1], -1)).reshape(len(ids), -1)

    monkeypatch.setattr(Store, "view", lambda self, name: FakeView(self, name), raising=False)
    status, _, body = raw.request("GET", "/v1/tables/ple/views/v")
    assert status == 200 and json.loads(body)["n_records"] == 10
    status, headers, body = raw.request(
        "POST", "/v1/tables/ple/views/v/records", ids_body([4, 0]), BIN
    )
    assert status == 200 and headers["x-engramdb-shape"] == "2,320"
    assert body == np.concatenate([rows[[4, 5]].reshape(-1), rows[[0, 1]].reshape(-1)]).tobytes()
    status, _, body = raw.request("POST", "/v1/tables/ple/views/w/records", ids_body([4]), BIN)
    assert status == 404 and error_of(body)["type"] == "TableNotFound"
    status, _, body = raw.request("POST", "/v1/tables/ple/views/v/explode", ids_body([4]), BIN)
    assert status == 404 and "no view action" in error_of(body)["message"]
    raw.close()
    with connect(server.urls[1]) as c:
        view = c["ple"].view("v")
        expect = rows[[[4, 5], [0, 1]]].reshape(2, 320)
        assert np.array_equal(view.read_records([4, 0]), expect)
        out = np.empty((2, 320), np.uint8)
        assert view.read_records(np.array([4, 0]), out) is out and np.array_equal(out, expect)
        with pytest.raises(ShapeMismatch):
            view.read_records([4], np.empty((1, 321), np.uint8))
        with pytest.raises(TableNotFound, match="no view 'w'"):
            c["ple"].view("w")


def test_ram_budget_is_passed_and_limits_checked(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    open_database(database[0], ram_budget=1 << 20).close()
    with pytest.raises(InvalidArgument):
        Limits(max_rows=0)


def test_server_never_writes_the_database(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    db_path = database[0]

    def snapshot() -> dict[str, tuple[int, int]]:
        return {
            str(p.relative_to(db_path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(db_path.rglob("*"))
        }

    before = snapshot()
    srv = start(db_path, tmp_path)
    try:
        with connect(srv.urls[1]) as c:
            c["ple"].fetch(np.arange(100))
    finally:
        srv.stop()
    assert snapshot() == before
    assert engramdb.verify(db_path) == []


def test_large_responses_gathered_off_loop(
    database: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, rng: np.random.Generator
) -> None:
    rows = database[1]["eng"]
    srv = start(database[0], tmp_path, limits=Limits(inline_max_bytes=1024))
    try:
        with connect(srv.urls[1]) as c:
            ids = rng.integers(0, 4000, 3000)  # 792 KB: more than the socket buffer
            for _ in range(3):
                assert np.array_equal(c["eng"].fetch(ids), rows[ids])
            with pytest.raises(RowIdOutOfRange):  # errors raised on the worker thread
                c["eng"].fetch(np.append(ids, 4000))
            assert np.array_equal(c["eng"].fetch([1]), rows[[1]])
    finally:
        srv.stop()


def test_pipelined_requests_are_answered_in_order(
    server: Server, database: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = database[1]["eng"]
    raw = Raw(server)
    batches = [[1, 2], list(range(0, 4000, 2)), [3]]  # the middle one fills the socket
    data = b""
    for ids in batches:
        body = ids_body(ids)
        data += (
            b"POST /v1/tables/eng/fetch HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
        )
    raw.send(data + b"GET /v1/health HTTP/1.1\r\nHost: t\r\n\r\n")
    for ids in batches:
        status, _, got = raw.response()
        assert status == 200 and got == rows[ids].tobytes()
    assert json.loads(raw.response()[2])["status"] == "ok"
    raw.close()
