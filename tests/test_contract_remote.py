"""The table contract (`engramdb.testing.tables.TableContract`) on `RemoteStore`, over a real
`engramdb serve` started in-process (a `Server` on a temporary Unix socket and an ephemeral
loopback port): rows over HTTP on TCP, over the binary wire protocol on the Unix socket, and
over HTTP on the Unix socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engramdb.client import connect
from engramdb.serve import Limits, Server
from engramdb.testing import TableContract
from engramdb.testing.dbs import TableSpec, make_db

HEADS = (3000, 5000)
SPEC = TableSpec(160, HEADS, rows_per_badge=128, shard_bytes=1024 * 160)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    db, rows = make_db(tmp_path_factory.mktemp("contract-remote"), {"t": SPEC})
    return db, rows["t"]


@pytest.fixture(scope="module")
def server(built: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    sock = tmp_path_factory.mktemp("sock") / "contract.sock"
    srv = Server(built[0], port=0, unix=str(sock)).start()
    try:
        yield srv
    finally:
        srv.stop()


class _OnRemote(TableContract):
    scheme = "http"
    wire: bool | None = None
    # `RemoteStore.close` releases nothing (the `Client` owns the connections): the contract
    # checks the handle still reads after it, then closes the client.
    close_closes_handle = False

    def close_owner(self, t: Any) -> None:
        t.client.close()

    @pytest.fixture
    def table(
        self, built: tuple[Path, Any], server: Server
    ) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        url = next(u for u in server.urls if u.startswith(self.scheme))
        with connect(url, wire=self.wire) as client:
            t = client["t"]
            assert t.client.wire is bool(self.wire)
            yield t, built[1], HEADS


class TestRemoteHttp(_OnRemote):
    """HTTP on loopback TCP."""

    scheme = "http"
    wire = False


class TestRemoteWire(_OnRemote):
    """The binary wire protocol on the Unix socket."""

    scheme = "unix"
    wire = True


class TestRemoteUnixHttp(_OnRemote):
    """HTTP on the Unix socket."""

    scheme = "unix"
    wire = False


class TestRemoteChunked(_OnRemote):
    """Batches split into several requests (a server row limit below the contract's batches)."""

    scheme = "unix"
    wire = True

    @pytest.fixture
    def table(
        self, built: tuple[Path, Any], tmp_path: Path
    ) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        limits = Limits(max_rows=100)
        srv = Server(built[0], port=None, unix=str(tmp_path / "c.sock"), limits=limits).start()
        try:
            with connect(srv.urls[0]) as client:
                t = client["t"]
                assert t.chunk_rows == 100
                yield t, built[1], HEADS
        finally:
            srv.stop()
