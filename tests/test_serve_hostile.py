"""`engramdb serve` under hostile clients (issue 16, findings 1-4): pre-auth memory, slowloris,
the response limit on every endpoint, malformed numbers, and a seeded hostile-request fuzz.
Loopback and Unix sockets only; every loop is bounded."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.serve import Limits, Server
from engramdb.serve import frames as F

TOKEN = "s3cret-token-0123456789"


def _uds(tmp: Path) -> str:
    return str(tmp / f"h{time.monotonic_ns() % 10**9}.sock")


def _unix(path: str, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def _read_response(s: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one HTTP response; raises on timeout (a hang fails the test)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            length = int(v.strip())
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, rest[:length]


def _http(path: str, raw: bytes) -> tuple[int, bytes]:
    s = _unix(path)
    try:
        s.sendall(raw)
        return _read_response(s)
    finally:
        s.close()


# -- 1. pre-auth memory ----------------------------------------------------------------------
_SERVER_SCRIPT = textwrap.dedent(
    """
    import sys
    from engramdb.serve import Limits, Server
    srv = Server(sys.argv[1], port=None, unix=sys.argv[2], token=sys.argv[3],
                 limits=Limits(header_timeout=120.0))
    srv.start()
    print("ready", flush=True)
    sys.stdin.read()
    srv.stop(grace=0.1)
    """
)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_preauth_memory_is_bounded_per_connection(tmp_path: Path, db_factory: Any) -> None:
    """500 unauthenticated connections (wire headers claiming 16 MiB, a HELLO claiming 4 KiB,
    partial HTTP heads, an unauthenticated 16 MiB POST, silent ones) cost the server process
    at most 64 KiB each (the test-only probe: the server runs in its own process)."""
    db, _ = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(Path(engramdb.__file__).parent.parent))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_SCRIPT, str(db), sock, TOKEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    conns: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        # warm the server up (imports, buffers, one real request of each protocol)
        client = engramdb.connect(f"unix://{sock}", token=TOKEN)
        assert client["t"].fetch(np.arange(16)).shape == (16, 32)
        client.close()
        for _ in range(20):
            _unix(sock).close()
        time.sleep(0.3)
        before = _rss(proc.pid)
        fetch16m = struct.pack("<4sBBHIIQ", b"EDBW", F.OP_FETCH, 1, 0, 0, 0, 16 << 20)
        hello4k = struct.pack("<4sBBHIIQ", b"EDBW", F.OP_HELLO, 0, 0, 0, 0, 4096) + b"x" * 100
        post16m = (
            b"POST /v1/tables/t/fetch HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/octet-stream\r\nContent-Length: 16777216\r\n\r\n" + b"\0" * 60_000
        )
        head8k = b"GET /v1/tables HTTP/1.1\r\nX-Pad: " + b"a" * 8000
        kinds = [fetch16m, hello4k, post16m, head8k, b""]
        for i in range(500):
            s = _unix(sock)
            data = kinds[i % len(kinds)]
            if data:
                s.sendall(data)
            conns.append(s)
        time.sleep(1.0)
        after = _rss(proc.pid)
        per_conn = (after - before) / 500
        print(f"server RSS per unauthenticated connection: {per_conn:,.0f} B")
        assert per_conn <= 64 * 1024, f"{per_conn:,.0f} B of server RSS per connection"
    finally:
        for s in conns:
            s.close()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_wire_frame_before_hello_is_refused_from_its_header(
    tmp_path: Path, db_factory: Any
) -> None:
    db, _ = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    with Server(db, port=None, unix=sock, token=TOKEN):
        s = _unix(sock)
        s.sendall(struct.pack("<4sBBHIIQ", b"EDBW", F.OP_FETCH, 1, 0, 0, 0, 16 << 20))
        head = s.recv(F.RESPONSE.size)  # answered without a byte of the payload sent
        _, status, _, _, length = F.RESPONSE.unpack(head)
        assert status == 401
        s.close()


# -- 2. slowloris ----------------------------------------------------------------------------
_FLOOD = textwrap.dedent(
    """
    import socket, sys, time
    held, t_end, told = [], time.monotonic() + 20.0, False
    while time.monotonic() < t_end:  # half-open heads, one byte at a time, never finished
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1.0)
            s.connect(sys.argv[1])
            s.sendall(b"G")
            held.append(s)
        except OSError:
            pass
        for old in held[-50:-40]:
            try:
                old.sendall(b"E")
            except OSError:
                pass
        if len(held) > 200 and not told:
            print("flooding", flush=True)
            told = True
        time.sleep(0.002)
    """
)


def test_slowloris_leaves_an_authenticated_client_served(tmp_path: Path, db_factory: Any) -> None:
    """A flood of half-open HTTP heads (its own process, still opening new ones) past
    ``max_connections``: an authenticated client connects and is served within 100 ms."""
    db, written = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    limits = Limits(max_connections=64, reserved_connections=8, header_timeout=30.0)
    with Server(db, port=None, unix=sock, token=TOKEN, limits=limits) as srv:
        flood = subprocess.Popen(
            [sys.executable, "-c", _FLOOD, sock], stdout=subprocess.PIPE, text=True
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
            deadline = time.monotonic() + 2.0  # the flood keeps the unproven slots full
            while srv.n_connections < 56 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.n_connections >= 56, srv.n_connections
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                client = engramdb.connect(f"unix://{sock}", token=TOKEN, pool_size=1)
                got = client["t"].fetch(np.arange(8))
                times.append(time.perf_counter() - t0)
                client.close()
                assert np.array_equal(got, written["t"][:8])
            assert max(times) <= 0.1, f"authenticated client took {times} s"
        finally:
            flood.kill()
            flood.wait()
            if flood.stdout is not None:
                flood.stdout.close()


def test_header_deadline_is_not_reset_by_bytes(tmp_path: Path, db_factory: Any) -> None:
    db, _ = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    with Server(db, port=None, unix=sock, limits=Limits(header_timeout=1.0)):
        for opening in (b"GET /v1/tables HTTP/1.1\r\n", b"EDBW\x01"):
            s = _unix(sock)
            s.sendall(opening)
            t0 = time.monotonic()
            closed = False
            while time.monotonic() - t0 < 8.0:  # a byte every 0.2 s would keep it alive forever
                try:
                    s.sendall(b"X")
                    s.settimeout(0.2)
                    if s.recv(4096) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            s.close()
            assert closed and time.monotonic() - t0 < 4.0, opening


def test_per_peer_cap_on_tcp(tmp_path: Path, db_factory: Any) -> None:
    db, _ = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    srv = Server(db, port=0, unix=sock, limits=Limits(max_connections_per_peer=4)).start()
    try:
        host, port = srv.urls[0][len("http://") :].rsplit(":", 1)
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
        extra = socket.create_connection((host, int(port)), timeout=5)
        status, body = _read_response(extra)
        assert status == 503 and b"max_connections_per_peer=4" in body
        extra.close()
        # Unix-socket peers are not counted; a closed TCP connection frees its slot
        assert _http(sock, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
        held.pop().close()
        time.sleep(0.2)
        again = socket.create_connection((host, int(port)), timeout=5)
        again.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(again)[0] == 200
        again.close()
        for s in held:
            s.close()
    finally:
        srv.stop()


# -- 3. one response limit for every endpoint ----------------------------------------------
def test_view_responses_obey_the_response_limit(
    tmp_path: Path, rng: np.random.Generator, db_factory: Any
) -> None:
    db, written = db_factory({"t": (24, (2000, 3000))})
    rows = np.stack([rng.integers(0, 2000, 300), 2000 + rng.integers(0, 3000, 300)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    sock = _uds(tmp_path)
    limits = Limits(max_response_bytes=1 << 20, inline_max_bytes=4096)
    with Server(db, port=None, unix=sock, limits=limits) as srv:
        ids = rng.integers(0, 300, 150_000).astype("<i8")
        raw = (
            b"POST /v1/tables/t/views/v/records HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/octet-stream\r\nContent-Length: %d\r\n\r\n" % ids.nbytes
        ) + ids.tobytes()
        status, body = _http(sock, raw)
        assert status == 413 and "max_response_bytes" in json.loads(body)["error"]["message"]
        # JSON is checked on its encoded size (base64 is 4/3 of the bytes)
        n = (1 << 20) // 48 - 10
        doc = json.dumps({"ids": [int(i) for i in ids[:n]]}).encode()
        raw = (
            b"POST /v1/tables/t/views/v/records HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(doc)
        ) + doc
        assert _http(sock, raw)[0] == 413
        # a large allowed request is served (off the loop) and right
        client = engramdb.connect(f"unix://{sock}")
        got = client["t"].view("v").read_records(ids[:5000])
        want = written["t"][rows[ids[:5000]]].reshape(5000, -1)
        assert np.array_equal(np.asarray(got).reshape(5000, -1), want)
        client.close()
        assert srv.n_connections >= 0


# -- 4. malformed numbers and nesting are 4xx naming the field --------------------------------
def _post(path: str, headers: str, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path.encode(), headers.encode("latin-1")) + body
    )


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"POST /v1/tables/t/fetch HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", "Content-Length"),
        (
            _post(
                "/v1/tables/t/fetch",
                "Content-Type: application/octet-stream\r\n"
                "X-Engramdb-Shape: \xb9\r\nContent-Length: 8\r\n",
                b"\0" * 8,
            ),
            "x-engramdb-shape",
        ),
        (
            _post(
                "/v1/tables/t/fetch",
                "Content-Type: application/octet-stream\r\n"
                "X-Engramdb-Shape: 0,100000000000000000\r\nContent-Length: 0\r\n",
                b"",
            ),
            "x-engramdb-shape",
        ),
        (
            _post(
                "/v1/tables/t/fetch",
                "Content-Type: application/json\r\nContent-Length: 200000\r\n",
                b"[" * 100_000 + b"]" * 100_000,
            ),
            "nests",
        ),
    ],
    ids=["content-length-superscript", "shape-superscript", "shape-huge-empty", "deep-json"],
)
def test_malformed_numbers_are_4xx(tmp_path: Path, db_factory: Any, raw: bytes, field: str) -> None:
    db, _ = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    with Server(db, port=None, unix=sock):
        status, body = _http(sock, raw)
        assert 400 <= status < 500 and field in json.loads(body)["error"]["message"]


def test_wire_huge_empty_dims_are_4xx(tmp_path: Path, db_factory: Any) -> None:
    db, _ = db_factory({"t": (32, (1000,))})
    sock = _uds(tmp_path)
    with Server(db, port=None, unix=sock):
        s = _unix(sock)
        s.sendall(F.pack_request(F.OP_HELLO, 0, (), 0))
        _, status, _, _, length = F.RESPONSE.unpack(s.recv(F.RESPONSE.size))
        s.recv(length)
        s.sendall(F.pack_request(F.OP_FETCH, 0, (0, 1 << 62), 0))
        _, status, _, _, length = F.RESPONSE.unpack(s.recv(F.RESPONSE.size))
        body = s.recv(length)
        assert status == 400 and "frame shape" in json.loads(body)["error"]["message"]
        s.close()


# -- the hostile-request fuzz ----------------------------------------------------------------
_DIGITS = [
    "0",
    "1",
    "8",
    "16",
    "\xb2",
    "\xb9",
    "-1",
    "1e3",
    " 8",
    "99999999999999999999",
    "0x10",
    "",
    "100000000000000000",
    "4294967296",
]


def _fuzz_case(r: np.random.Generator) -> bytes:
    kind = int(r.integers(0, 6))

    def pick(xs: list[str]) -> str:
        return xs[int(r.integers(0, len(xs)))]

    path = pick(
        [
            "/v1/tables/t/fetch",
            "/v1/tables/t/lookup",
            "/v1/tables/t/views/v/records",
            "/v1/tables/t",
            "/v1/tables/%ff/fetch",
            "/v1/tables",
            "/metrics",
            "/x",
        ]
    )
    if kind == 0:  # a binary request with hostile shape / length headers
        n = int(r.integers(0, 40))
        body = r.integers(-5, 2000, n).astype("<i8").tobytes()
        shape = ",".join(pick(_DIGITS) for _ in range(int(r.integers(0, 4))))
        return _post(
            path,
            f"Content-Type: application/octet-stream\r\nX-Engramdb-Shape: "
            f"{shape}\r\nContent-Length: {len(body)}\r\n",
            body,
        )
    if kind == 1:  # a hostile Content-Length (a body of that size where it is a small number)
        cl = pick(_DIGITS)
        v = cl.strip()  # the server strips header values, as HTTP says
        n = int(v) if v.isascii() and v.isdigit() and int(v) <= 1000 else 0
        return _post(path, f"Content-Length: {cl}\r\n", b"\0" * n)
    if kind == 2:  # JSON of random depth / content
        depth = int(r.integers(1, 40))
        leaf = pick(
            ["1", "-1", "1.5", '"a"', "null", "true", "[]", "{}", "1e400", "99999999999999999999"]
        )
        doc = ("[" * depth + leaf + "]" * depth).encode()
        if r.random() < 0.3:
            doc = b'{"ids": ' + doc + b"}"
        if r.random() < 0.2:
            doc = doc[: int(r.integers(0, len(doc) + 1))]
        return _post(path, f"Content-Type: application/json\r\nContent-Length: {len(doc)}\r\n", doc)
    if kind == 3:  # random header bytes
        junk = bytes(r.integers(0, 256, int(r.integers(1, 60))).astype(np.uint8))
        return b"POST " + path.encode() + b" HTTP/1.1\r\n" + junk + b"\r\n\r\n"
    if kind == 4:  # a wrong method / version / request line
        line = (
            pick(["GET", "POST", "BREW", "get"])
            + " "
            + path
            + " "
            + pick(["HTTP/1.1", "HTTP/2", "HTTP/1.0", "x"])
        )
        return line.encode() + b"\r\nHost: x\r\n\r\n"
    # an Accept / Content-Type mix
    body = np.arange(int(r.integers(0, 5)), dtype="<i8").tobytes()
    return _post(
        path,
        f"Content-Type: {pick(['application/octet-stream', 'text/plain', ''])}"
        f"\r\nAccept: {pick(['application/json', 'image/png', '*/*', ''])}\r\n"
        f"Content-Length: {len(body)}\r\n",
        body,
    )


def test_hostile_request_fuzz(tmp_path: Path, rng: np.random.Generator, db_factory: Any) -> None:
    """10,000 seeded hostile requests: every answer is a 2xx or a typed 4xx, never a 5xx, a
    raw exception or a hang (each read has a 5 s timeout)."""
    db, _ = db_factory({"t": (16, (500, 500))})
    rows = np.stack([rng.integers(0, 500, 50), 500 + rng.integers(0, 500, 50)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    sock = _uds(tmp_path)
    r = np.random.default_rng(16)
    statuses: dict[int, int] = {}
    with Server(db, port=None, unix=sock, limits=Limits(max_rows=1000)):
        s = _unix(sock)
        for i in range(10_000):
            raw = _fuzz_case(r)
            try:
                s.sendall(raw)
                status, body = _read_response(s)
            except TimeoutError:
                raise AssertionError(f"case {i} hung: {raw[:300]!r}") from None
            except (ConnectionError, BrokenPipeError):  # framing error: closed after a 4xx
                s.close()
                s = _unix(sock)
                s.sendall(raw)
                status, body = _read_response(s)
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (i, raw[:200], body[:300])
            if status >= 400:
                err = json.loads(body)["error"]
                assert err["type"] != "InternalError" and err["message"], (raw[:200], err)
            if status >= 400:  # it may have closed the connection: start a fresh one
                s.close()
                s = _unix(sock)
        s.close()
    assert sum(statuses.values()) == 10_000 and statuses.get(200, 0) > 0
