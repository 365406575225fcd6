"""`engramdb serve` as a real process: SIGTERM drains, SIGKILL leaves nothing to repair, and
the command line refuses unsafe or unsupported settings."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import engramdb
from engramdb.cli.serve_cmd import serve
from engramdb.client import connect
from engramdb.serve import ServiceUnavailable
from engramdb.serve import frames as W

SERVE = "from engramdb.cli.serve_cmd import serve; serve()"


@pytest.fixture
def db(db_factory: Any) -> tuple[Path, np.ndarray]:
    path, rows = db_factory({"t": (160, (12000, 8000))}, seed=3)
    return path, rows["t"]


def spawn(db: Path, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(db), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the listeners accept
    if not line.startswith("serving"):
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"server did not start: {line!r} {err}")
    return proc


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it still runs, wait for it, close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]


def sigterm_while_busy(proc: subprocess.Popen[str], idle: socket.socket, sock_path: Path) -> None:
    """SIGTERM a server with one idle and one in-flight connection: the idle one is closed
    at once, the socket file goes, and the process waits for the in-flight request."""
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    idle.settimeout(10)
    assert idle.recv(1) == b"", "idle connections are closed at once"
    deadline = time.monotonic() + 10
    while sock_path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not sock_path.exists(), "no new connections once stopping"
    time.sleep(0.3)
    assert proc.poll() is None, "the server must wait for the in-flight request"


def recv_response(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return head, body


def test_sigterm_lets_in_flight_requests_finish(
    db: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db_path, rows = db
    sock_path = tmp_path / "s.sock"
    proc = spawn(db_path, "--unix", str(sock_path))
    try:
        idle = socket.socket(socket.AF_UNIX)
        idle.connect(str(sock_path))
        idle.sendall(b"GET /v1/health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert recv_response(idle)[0].startswith(b"HTTP/1.1 200")
        # a request in flight: its head and half its body are in, the rest comes later
        ids = np.arange(0, 20000, 7, dtype="<i8")
        body = ids.tobytes()
        busy = socket.socket(socket.AF_UNIX)
        busy.settimeout(10)
        busy.connect(str(sock_path))
        busy.sendall(
            b"POST /v1/tables/t/fetch HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body[: len(body) // 2]
        )
        sigterm_while_busy(proc, idle, sock_path)
        busy.sendall(body[len(body) // 2 :])
        head, data = recv_response(busy)
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head
        assert data == rows[ids].tobytes()
        assert proc.wait(timeout=15) == 0
        assert "stopped after 2 request(s)" in proc.stdout.read()  # type: ignore[union-attr]
        idle.close()
        busy.close()
    finally:
        reap(proc)


def _exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed before the whole reply"
        data += chunk
    return data


def _wire_reply(sock: socket.socket) -> tuple[int, bytes]:
    _magic, status, _f, _r, length = W.RESPONSE.unpack(_exact(sock, W.RESPONSE.size))
    return status, _exact(sock, length)


def _wire_peer(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(W.pack_request(W.OP_HELLO, 0, (), 0))
    assert _wire_reply(sock)[0] == 200
    return sock


def test_sigterm_lets_in_flight_wire_requests_finish(
    db: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db_path, rows = db
    sock_path = tmp_path / "s.sock"
    proc = spawn(db_path, "--unix", str(sock_path))
    try:
        idle = _wire_peer(sock_path)
        busy = _wire_peer(sock_path)
        ids = np.arange(0, 20000, 7, dtype="<i8")
        frame = W.pack_request(W.OP_FETCH, 0, ids.shape, ids.nbytes) + ids.tobytes()
        busy.sendall(frame[: len(frame) // 2])  # a request in flight: half of it is in
        sigterm_while_busy(proc, idle, sock_path)
        busy.sendall(frame[len(frame) // 2 :])
        status, data = _wire_reply(busy)
        assert status == 200 and data == rows[ids].tobytes()
        assert busy.recv(1) == b"", "closed after its last reply"
        assert proc.wait(timeout=15) == 0
        idle.close()
        busy.close()
    finally:
        reap(proc)


def test_sigkill_mid_request_leaves_nothing_to_repair(
    db: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db_path, rows = db
    listing = sorted(str(p.relative_to(db_path)) for p in db_path.rglob("*"))
    sock_path = tmp_path / "s.sock"
    url = f"unix://{sock_path}"
    proc = spawn(db_path, "--unix", str(sock_path))
    errors: list[BaseException] = []
    served = [0]

    def hammer() -> None:
        rng = np.random.default_rng(1)
        try:
            with connect(url, timeout=10) as c:
                t = c["t"]
                while True:
                    ids = rng.integers(0, 20000, 4096)
                    assert np.array_equal(t.fetch(ids), rows[ids])
                    served[0] += 1
        except BaseException as e:  # the kill must surface as a typed connection error
            errors.append(e)

    th = threading.Thread(target=hammer)
    th.start()
    try:
        deadline = time.monotonic() + 10
        while served[0] < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()
        proc.wait()
    finally:
        th.join(timeout=15)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    assert served[0] >= 20
    assert len(errors) == 1 and isinstance(errors[0], ServiceUnavailable), errors
    assert isinstance(errors[0], ConnectionError) and isinstance(errors[0], engramdb.EngramDBError)
    # nothing to repair: same files, checksums intact, opens and reads
    assert sorted(str(p.relative_to(db_path)) for p in db_path.rglob("*")) == listing
    assert engramdb.verify(db_path) == []
    # a new server takes over the dead one's socket path
    proc = spawn(db_path, "--unix", str(sock_path))
    try:
        with connect(url) as c:
            assert np.array_equal(c["t"].fetch([0, 19999]), rows[[0, 19999]])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        reap(proc)


def test_cli_refuses_unsafe_or_unsupported_settings(
    db: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    runner = CliRunner()
    r = runner.invoke(serve, [str(db[0]), "--host", "0.0.0.0", "--port", "0"])
    assert r.exit_code == 1 and "refusing to listen on '0.0.0.0'" in r.output
    assert "--token-file" in r.output
    short = tmp_path / "tok"
    short.write_text("abc")
    r = runner.invoke(serve, [str(db[0]), "--token-file", str(short), "--port", "0"])
    assert r.exit_code == 1 and "at least 16" in r.output
    r = runner.invoke(serve, [str(db[0]), "--unix", str(tmp_path / "s"), "--unix-mode", "9x"])
    assert r.exit_code == 1 and "octal" in r.output
    r = runner.invoke(serve, ["--help"])
    assert r.exit_code == 0 and "--token-file" in r.output and "read-only" in r.output
