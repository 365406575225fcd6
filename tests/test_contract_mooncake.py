"""The table contract (`engramdb.testing.tables.TableContract`) on `MooncakeTable`, over a real
Mooncake master and storage host in a private network namespace (`mooncake_harness`): ranged
reads (``get_into_ranges`` into the caller's buffer) and a host copy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import mooncake.store  # noqa: F401
except ImportError:
    pytest.skip("the Mooncake store client is not installed", allow_module_level=True)

from mooncake_harness import Cluster, module_cluster

from engramdb.integrations import mooncake as mc
from engramdb.testing import TableContract
from engramdb.testing.dbs import TableSpec, make_db

HEADS = (3000, 5000)
SPEC = TableSpec(160, HEADS, rows_per_badge=128, shard_bytes=1024 * 160)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from module_cluster()


@pytest.fixture(scope="module")
def mc_client(cluster: Cluster) -> Iterator[Any]:
    c = cluster.connect()
    yield c
    c.close()


@pytest.fixture(scope="module")
def published(
    tmp_path_factory: pytest.TempPathFactory,
    mc_client: Any,
) -> Iterator[tuple[str, Any]]:
    db, rows = make_db(tmp_path_factory.mktemp("contract-mc"), {"t": SPEC})
    # 100 KiB objects: a head spans several objects, so reads cross object ends
    mc.publish(db, client=mc_client, name="contract", object_bytes=100 * 1024)
    try:
        yield "contract", rows["t"]
    finally:
        mc.unpublish("contract", client=mc_client)


class TestMooncakeRanged(TableContract):
    # ranged reads land straight in the caller's buffer, which must be registered with the
    # publication's client (the documented `MooncakeDatabase.register`)
    any_output_buffer = False

    def register_out(self, t: Any, out: Any) -> Any:
        return self.db.register(out)

    @pytest.fixture
    def table(
        self,
        published: tuple[str, Any],
        mc_client: Any,
    ) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        name, rows = published
        with mc.open_mooncake(client=mc_client, name=name) as db:
            self.db = db
            t = db["t"]
            assert t.mode == "ranged" and len(t.layout.flat_keys) > 2
            yield t, rows, HEADS


class TestMooncakeHostCopy(TableContract):
    @pytest.fixture
    def table(
        self,
        published: tuple[str, Any],
        mc_client: Any,
        tmp_path: Path,
    ) -> Iterator[tuple[Any, Any, tuple[int, ...]]]:
        name, rows = published
        with mc.open_mooncake(client=mc_client, name=name, host_copy=tmp_path) as db:
            t = db["t"]
            assert t.mode == "host_copy"
            yield t, rows, HEADS
