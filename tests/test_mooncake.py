"""EngramDB on a real Mooncake store: master + storage host in a private network namespace.

No mocks: every test talks to a real ``mooncake_master`` and a real storage host
(``mooncake_client``) over TCP on loopback; second clients are separate processes.
"""

from __future__ import annotations

import itertools
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import engramdb
from engramdb import EngramStore, EngramStoreConfig
from engramdb.errors import (
    CorruptFile,
    InvalidArgument,
    InvalidDtype,
    LayerExists,
    LayerNotReady,
    LookupBoundsError,
    LookupTypeError,
    RowIdOutOfRange,
    StoreClosed,
    TableExists,
    TableNotFound,
)
from engramdb.integrations import mooncake as mc
from engramdb.table_api import RowTable
from engramdb.testing.dbs import TableSpec, make_db

try:
    import mooncake.store  # noqa: F401
except ImportError:
    pytest.skip(
        f"the Mooncake store client is not installed (pip install 'engramdb[{mc.EXTRA}]')",
        allow_module_level=True,
    )

from mooncake_harness import Cluster, module_cluster, run_python

RB = 264
SIZES = [17, 19, 23, 29]
_layer_ids = itertools.count(100)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from module_cluster()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[Any]:
    c = cluster.connect()
    yield c
    c.close()


def cfg(sizes: list[int] = SIZES, row_bytes: int = RB) -> EngramStoreConfig:
    return EngramStoreConfig(sizes, row_bytes)


def tables(sizes: list[int] = SIZES, row_bytes: int = RB, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in sizes]


def rand_ids(rng: np.random.Generator, b: int, l: int, sizes: list[int] = SIZES) -> np.ndarray:  # noqa: E741
    return np.ascontiguousarray(np.stack([rng.integers(0, n, (b, l)) for n in sizes], -1))


def expected(tabs: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.stack([tabs[h][ids[..., h]] for h in range(len(tabs))], axis=-2)


def output_for(ids: np.ndarray, row_bytes: int = RB) -> np.ndarray:
    return np.full(ids.shape + (row_bytes,), 0xAB, dtype=np.uint8)


@pytest.fixture
def layer(client: Any) -> Iterator[tuple[EngramStore, int, list[np.ndarray]]]:
    """A fresh layer id populated in the store; removed (forced) afterwards."""
    layer_id = next(_layer_ids)
    es = EngramStore({layer_id: cfg()}, store=client)
    tabs = tables(seed=layer_id)
    es.populate(layer_id, tabs)
    yield es, layer_id, tabs
    es.remove_from_store(layer_id, force=True)


# --- EngramStore on the store --------------------------------------------------------------
def test_populate_then_lookup_random_ids(client: Any, layer: Any) -> None:
    es, layer_id, tabs = layer
    rng = np.random.default_rng(7)
    for b, l in [(1, 1), (3, 5), (8, 64)]:  # noqa: E741
        ids = rand_ids(rng, b, l)
        out = output_for(ids)
        with mc.registered(client, out):
            calls = es.mooncake_layers.counters.calls
            es.lookup_into(layer_id, ids, out)
            assert es.mooncake_layers.counters.calls == calls + 1  # one ranged read per batch
        np.testing.assert_array_equal(out, expected(tabs, ids))
    assert all(client.is_exist(k) == 1 for k in es.get_store_keys(layer_id))
    assert repr(es).endswith("backing=mooncake>")


def test_populate_is_create_only(client: Any, layer: Any) -> None:
    es, layer_id, tabs = layer
    with pytest.raises(LayerExists, match="remove_from_store"):
        es.populate(layer_id, tabs)
    other = EngramStore({layer_id: cfg()}, store=client)  # another handle, same keys
    with pytest.raises(LayerExists):
        other.populate(layer_id, tabs)
    with pytest.raises(LayerExists, match="bind_local"):
        es.bind_local(layer_id, tabs)


def test_remove_then_lookup_and_repopulate(client: Any) -> None:
    layer_id = next(_layer_ids)
    es = EngramStore({layer_id: cfg()}, store=client)
    es.populate(layer_id, tables())
    assert es.remove_from_store(layer_id, force=True) == len(SIZES)
    assert [client.is_exist(k) for k in es.get_store_keys(layer_id)] == [0] * len(SIZES)
    assert es.remove_from_store(layer_id, force=True) == 0
    ids = rand_ids(np.random.default_rng(0), 2, 3)
    out = output_for(ids)
    with mc.registered(client, out), pytest.raises(LayerNotReady):
        es.lookup_into(layer_id, ids, out)
    assert not out.any()  # a failed read zero-fills: never half-written
    es.populate(layer_id, tables(seed=5))  # the id is free again
    with mc.registered(client, out):
        es.lookup_into(layer_id, ids, out)
    np.testing.assert_array_equal(out, expected(tables(seed=5), ids))
    time.sleep(0.6)  # past the master's 500 ms read lease: removal without force works
    assert es.remove_from_store(layer_id) == len(SIZES)


def test_second_client_reads_without_populating(
    tmp_path: Path, cluster: Cluster, layer: Any
) -> None:
    _, layer_id, tabs = layer
    ids = rand_ids(np.random.default_rng(3), 4, 16)
    np.save(tmp_path / "ids.npy", ids)
    code = textwrap.dedent(
        f"""
        import numpy as np
        from engramdb import EngramStore, EngramStoreConfig
        from engramdb.integrations import mooncake as mc
        client = mc.connect({cluster.master_addr!r}, {cluster.metadata_url!r})
        es = EngramStore({{{layer_id}: EngramStoreConfig({SIZES!r}, {RB})}}, store=client)
        ids = np.load({str(tmp_path / "ids.npy")!r})
        out = np.zeros(ids.shape + ({RB},), np.uint8)
        with mc.registered(client, out):
            es.lookup_into({layer_id}, ids, out)
        np.save({str(tmp_path / "out.npy")!r}, out)
        client.close()
        print("ok", es.mooncake_layers.counters.calls)
        """
    )
    assert run_python(code, timeout=60).split()[-2:] == ["ok", "1"]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected(tabs, ids))


def test_heads_larger_than_one_object(client: Any) -> None:
    layer_id = next(_layer_ids)
    sizes = [1000, 37, 513]
    es = EngramStore({layer_id: cfg(sizes)}, store=client, object_bytes=100 * RB)
    tabs = tables(sizes, seed=9)
    es.populate(layer_id, tabs)
    try:
        keys = es.mooncake_layers.layouts[layer_id].flat_keys
        assert len(keys) == 10 + 1 + 6 and keys[0] == f"engram:l{layer_id}:h0:p0"
        assert all(client.is_exist(k) == 1 for k in keys)
        # every object boundary of every head, plus random rows
        edges = np.array([[r, min(r, 36), min(r, 512)] for r in range(0, 1000, 50)])
        edges = np.concatenate([edges, edges + 49 * (edges < 950)], axis=0)
        edges = np.minimum(edges, np.array(sizes) - 1)
        ids = np.ascontiguousarray(
            np.concatenate([edges, rand_ids(np.random.default_rng(1), 1, 200, sizes)[0]])[None]
        )
        out = output_for(ids)
        with mc.registered(client, out):
            es.lookup_into(layer_id, ids, out)
        np.testing.assert_array_equal(out, expected(tabs, ids))
    finally:
        assert es.remove_from_store(layer_id, force=True) == len(sizes)
    assert not any(client.is_exist(k) for k in keys)


def test_bad_ids_are_typed_and_never_half_written(client: Any, layer: Any) -> None:
    es, layer_id, tabs = layer
    ids = rand_ids(np.random.default_rng(4), 2, 8)
    ids[1, 7, 2] = SIZES[2]  # one past the end of head 2, in the last row
    out = output_for(ids)
    with mc.registered(client, out):
        with pytest.raises(LookupBoundsError, match=r"head 2") as e:
            es.lookup_into(layer_id, ids, out)
        assert isinstance(e.value, IndexError) and isinstance(e.value, RuntimeError)
        assert not out.any()  # the facade zero-fills on a bounds error, as the binding does
        out[:] = 0xAB
        ids[1, 7, 2] = -1
        with pytest.raises(LookupBoundsError, match=r"-1"):
            es.lookup_into(layer_id, ids, out)
        out[:] = 0xAB
        for bad in (ids.astype(np.int32), ids[..., ::-1], ids.tolist()):
            with pytest.raises(LookupTypeError):
                es.lookup_into(layer_id, bad, out)
        assert (out == 0xAB).all()  # type errors leave the output untouched


def test_unregistered_output_is_a_clear_error(layer: Any) -> None:
    es, layer_id, _ = layer
    ids = rand_ids(np.random.default_rng(5), 2, 2)
    out = output_for(ids)
    with pytest.raises(mc.OutputNotRegistered, match="register_buffer"):
        es.lookup_into(layer_id, ids, out)
    assert not out.any()  # fully zero-filled, not half-written


def test_empty_batch_needs_no_registration(layer: Any) -> None:
    es, layer_id, _ = layer
    ids = np.empty((0, 3, len(SIZES)), dtype=np.int64)
    es.lookup_into(layer_id, ids, np.empty((0, 3, len(SIZES), RB), np.uint8))


# --- whole databases: publish and open -------------------------------------------------------
@pytest.fixture(scope="module")
def source_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tables; ``engram_l1`` has shards of 512 rows, so objects cross a shard end."""
    engram = TableSpec(RB, (300, 7, 451), "fp8_e4m3+ue8m0", rows_per_badge=512, shard_bytes=1)
    path, _ = make_db(
        tmp_path_factory.mktemp("pub"),
        {"engram_l1": engram, "small": (8, (50,))},
        seed=11,
        name="mydb",
    )
    with engramdb.open(path) as db:
        assert len(db.manifest.tables["engram_l1"].shards) == 2
    return path


def test_publish_cli_then_open_and_read(cluster: Cluster, client: Any, source_db: Path) -> None:
    from engramdb.cli.publish_cmd import publish

    args = [str(source_db), "--mooncake", cluster.master_addr, "--metadata", cluster.metadata_url]
    res = CliRunner().invoke(publish, [*args, "--object-size", "20K", "--name", "cli"])
    assert res.exit_code == 0, res.output
    assert "published 2 table(s) as 'cli'" in res.output and "GB/s" in res.output
    again = CliRunner().invoke(publish, [*args, "--name", "cli"])
    assert again.exit_code == 1 and "TableExists" in again.output
    try:
        with engramdb.open(source_db) as local, mc.open_mooncake(client=client, name="cli") as db:
            assert db.tables == ["engram_l1", "small"]
            for name in db.tables:
                t, ref = db[name], local[name]
                assert t.heads.tolist() == ref.heads.tolist() and t.dtype == ref.dtype
                g = np.random.default_rng(2).integers(0, ref.n_rows, (5, 9))
                np.testing.assert_array_equal(t.fetch(g), ref.fetch(g))
                out = np.empty(g.shape + (t.row_bytes,), np.uint8)
                with db.register(out):
                    t.fetch_into(g, out)
                np.testing.assert_array_equal(out, ref.fetch(g))
            t = db["engram_l1"]
            assert t.layout.rows_per_object == 20 * 1024 // RB
            ids = rand_ids(np.random.default_rng(3), 4, 8, t.heads.tolist())
            out, want = output_for(ids), output_for(ids)
            local["engram_l1"].lookup_into(ids, want)
            with db.register(out):
                t.lookup_into(ids, out)
            np.testing.assert_array_equal(out, want)
            assert t.stats()["mode"] == "ranged" and t.stats()["get_into_ranges_calls"] >= 3
            with pytest.raises(TableNotFound):
                db["nope"]
    finally:
        assert mc.unpublish("cli", client=client) > 0
    with pytest.raises(TableNotFound, match="nothing is published"):
        mc.open_mooncake(client=client, name="cli")


def test_open_mooncake_validates_like_a_local_store(client: Any, source_db: Path) -> None:
    mc.publish(source_db, client=client, name="val", tables=["engram_l1"])
    try:
        with mc.open_mooncake(client=client, name="val") as db:
            t = db["engram_l1"]
            out = output_for(np.zeros((2, 3), np.int64))
            with db.register(out):
                with pytest.raises(RowIdOutOfRange, match=r"758 at position \(1, 2\)"):
                    t.fetch_into(np.array([[0, 1, 2], [3, 4, 758]]), out)
                with pytest.raises(InvalidDtype):
                    t.fetch_into(np.zeros((2, 3)), out)
                assert (out == 0xAB).all()  # validation errors leave the output untouched
                ids = np.zeros((1, 1, 3), np.int64)
                ids[0, 0, 1] = 7
                o = output_for(ids)
                with db.register(o), pytest.raises(RowIdOutOfRange, match="head 1"):
                    t.lookup_into(ids, o)
                assert (o == 0xAB).all()
    finally:
        mc.unpublish("val", client=client)


def test_tables_are_row_tables_and_refuse_reads_once_closed(client: Any, source_db: Path) -> None:
    mc.publish(source_db, client=client, name="cl", tables=["small"])
    try:
        db = mc.open_mooncake(client=client, name="cl")
        t = db["small"]
        assert isinstance(t, RowTable) and not t.closed
        assert t.to_global([[3]]).tolist() == [[3]] and t.nbytes == 50 * 8
        with engramdb.open(source_db) as local:
            np.testing.assert_array_equal(t.fetch([0, 49, 7]), local["small"].fetch([0, 49, 7]))
        db.close()
        assert t.closed
        for call in (lambda: t.fetch([0]), lambda: t.fetch([]), lambda: db["small"]):
            with pytest.raises(StoreClosed, match="publication 'cl' is closed"):
                call()
        with mc.open_mooncake(client=client, name="cl") as db2:
            t2 = db2["small"]
            with t2:  # a table closes on its own; the publication and its client stay open
                assert t2.fetch([1]).shape == (1, 8)
            with pytest.raises(StoreClosed, match="table 'small' of publication 'cl'"):
                t2.fetch([1])
            assert not db2.closed
    finally:
        mc.unpublish("cl", client=client)


def test_host_copy_serves_locally(client: Any, source_db: Path, tmp_path: Path) -> None:
    mc.publish(source_db, client=client, name="hc", object_bytes=30_000)
    try:
        with (
            engramdb.open(source_db) as local,
            mc.open_mooncake(client=client, name="hc", host_copy=tmp_path) as db,
        ):
            t = db["engram_l1"]
            assert t.mode == "host_copy" and len(list(tmp_path.glob("hc.engram_l1.*.rows"))) == 1
            ids = rand_ids(np.random.default_rng(6), 3, 5, t.heads.tolist())
            out, want = output_for(ids), output_for(ids)
            t.lookup_into(ids, out)  # no registration: reads are local
            local["engram_l1"].lookup_into(ids, want)
            np.testing.assert_array_equal(out, want)
            assert t.stats()["get_into_ranges_calls"] == 0
        # a second opener on the host maps the existing copy instead of pulling again
        before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.rows")}
        with mc.open_mooncake(client=client, name="hc", host_copy=tmp_path) as db2:
            assert db2["small"].fetch([0, 49]).shape == (2, 8)
        assert before == {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.rows")}
    finally:
        mc.unpublish("hc", client=client)


def test_publish_refuses_unknown_table(client: Any, source_db: Path) -> None:
    with pytest.raises(TableNotFound, match="nope"):
        mc.publish(source_db, client=client, name="x", tables=["nope"])
    first = mc.publish(source_db, client=client, name="dup", tables=["small"])
    assert first.objects == 1 and first.bytes == 50 * 8
    try:
        with pytest.raises(TableExists, match="already published"):
            mc.publish(source_db, client=client, name="dup", tables=["small"])
    finally:
        assert mc.unpublish("dup", client=client) == 1


# --- failure: the master dies mid-run -----------------------------------------------------------
def test_master_killed_mid_run_is_a_clear_error(tmp_path: Path, cluster: Cluster) -> None:
    """A second deployment on other ports; a child process populates, the master is
    killed, and the child's next lookup must fail with `StoreUnavailable` within bounds."""
    doomed = Cluster(base=31251, segment="64MB").start()
    try:
        code = textwrap.dedent(
            f"""
            import sys, time
            import numpy as np
            from engramdb import EngramStore, EngramStoreConfig
            from engramdb.integrations import mooncake as mc
            client = mc.connect({doomed.master_addr!r}, {doomed.metadata_url!r})
            es = EngramStore({{1: EngramStoreConfig([50, 60], 264)}}, store=client)
            es.populate(1, [np.ones((50, 264), np.uint8), np.ones((60, 264), np.uint8)])
            ids = np.zeros((1, 4, 2), np.int64)
            out = np.full((1, 4, 2, 264), 7, np.uint8)
            client.register_buffer(out.ctypes.data, out.nbytes)
            es.lookup_into(1, ids, out)
            assert (out == 1).all()
            print("READY", flush=True)
            sys.stdin.readline()
            out[:] = 7
            t0 = time.monotonic()
            try:
                es.lookup_into(1, ids, out)
                print("NOERROR")
            except mc.StoreUnavailable as e:
                print("ERR", type(e).__name__, e.code, round(time.monotonic() - t0, 1),
                      int(out.any()), flush=True)
            """
        )
        import subprocess
        import sys

        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            line = child.stdout.readline()
            assert line.strip() == "READY", line
            doomed.kill_master()
            child.stdin.write("\n")
            child.stdin.flush()
            out, _ = child.communicate(timeout=60)  # no hang past a timeout
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        words = out.split()
        assert words[:2] == ["ERR", "StoreUnavailable"], out
        assert float(words[3]) < 30 and words[4] == "0"  # bounded, and output zero-filled
    finally:
        doomed.stop()


def test_failed_populate_leaves_nothing_behind(cluster: Cluster) -> None:
    """A storage host too small for the layer: the first head fits, the second does not;
    populate fails with a clear error and removes the head it wrote."""
    small = Cluster(base=31351, segment="64MB").start()
    try:
        client = small.connect()
        try:
            es = EngramStore({1: cfg([150_000, 150_000])}, store=client)  # 2 x 39.6 MB
            with pytest.raises(mc.MooncakeError, match="NO_AVAILABLE_HANDLE") as e:
                es.populate(1, tables([150_000, 150_000]))
            assert e.value.code == -200 and "lower the object size" in str(e.value)
            assert [client.is_exist(k) for k in es.get_store_keys(1)] == [0, 0]
        finally:
            client.close()
    finally:
        small.stop()


# --- Store-P views in the store ----------------------------------------------------------------
@pytest.fixture(scope="module")
def view_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A table with a row view of 300 distinct row tuples (one row per head, a corpus's
    first-access order) and a view that cannot serve lookups (2 rows per record)."""
    from engramdb.build.view import build_view

    heads = [300, 7, 451]
    path, _ = make_db(tmp_path_factory.mktemp("views"), {"engram_l1": (RB, heads)}, name="vdb")
    rng = np.random.default_rng(21)
    offsets = np.array([0, 300, 307])
    local = np.stack([rng.integers(0, n, 400) for n in heads], axis=-1)
    local = np.unique(local, axis=0)[:300]
    local = local[rng.permutation(local.shape[0])]  # an access order, not sorted
    build_view(path, table="engram_l1", name="corpus", rows=local + offsets)
    build_view(path, table="engram_l1", name="pairs", rows=(local + offsets)[:, :2])
    return path, local


def test_views_publish_and_serve_lookups_in_runs(
    client: Any, view_db: tuple[Path, np.ndarray]
) -> None:
    path, tuples = view_db
    summary = mc.publish(path, client=client, name="pv", object_bytes=64 * 3 * RB)
    assert summary.views == ("engram_l1/corpus",)
    assert summary.skipped_views and "pairs" in summary.skipped_views[0]
    try:
        with (
            engramdb.open(path) as local,
            mc.open_mooncake(client=client, name="pv", view="corpus") as db,
        ):
            t = db["engram_l1"]
            assert t.mode == "ranged+view:corpus" and sorted(t.views) == ["corpus"]
            assert t.views["corpus"].records == 300 and len(t.views["corpus"].objects) == 5

            def check(ids: np.ndarray) -> None:
                ids = np.ascontiguousarray(ids, dtype=np.int64)
                out, want = output_for(ids), output_for(ids)
                local["engram_l1"].lookup_into(ids, want)
                with db.register(out):
                    t.lookup_into(ids, out)
                np.testing.assert_array_equal(out, want)

            # a replay of the corpus in its access order: whole records in a few runs
            calls0 = t.stats()["get_into_ranges_calls"]
            check(tuples[:256].reshape(4, 64, 3))
            s = t.stats()
            assert s["get_into_ranges_calls"] == calls0 + 1  # one call per batch
            assert s["view_hits"] == 256 and s["view_misses"] == 0
            assert s["view_runs"] <= 5  # split only where an object ends
            # the same records again: all from the reader's cache, no store call at all
            check(tuples[:256].reshape(4, 64, 3))
            s1 = t.stats()
            assert s1["view_cache_hits"] == 256 and s1["get_into_ranges_calls"] == calls0 + 1
            assert s1["view_records_read"] == s["view_records_read"]
            # repeats and out-of-order records, and positions the view does not hold
            rng = np.random.default_rng(4)
            mixed = tuples[rng.integers(0, 300, 60)].copy()
            mixed[::3] = rand_ids(rng, 1, 20, [300, 7, 451]).reshape(20, 3)
            check(mixed.reshape(3, 20, 3))
            s2 = t.stats()
            assert s2["view_misses"] >= 1 and s2["view_hits"] > s["view_hits"]
            check(rand_ids(rng, 2, 9, [300, 7, 451]))  # (almost) no hits: rows only
            # validation still comes first and leaves the output untouched
            bad = tuples[:4].reshape(1, 4, 3).copy()
            bad[0, 2, 2] = 451
            o = output_for(bad)
            with db.register(o), pytest.raises(RowIdOutOfRange):
                t.lookup_into(bad, o)
            assert (o == 0xAB).all()
            t.use_view("corpus", cache_bytes=0)  # no cache: every batch reads its records
            check(tuples[:10].reshape(1, 10, 3))
            check(tuples[:10].reshape(1, 10, 3))
            assert t.stats()["view_cache_hits"] == 0 and t.stats()["view_records_read"] >= 20
            with pytest.raises(InvalidArgument):
                t.use_view("corpus", cache_bytes=-1)
            t.use_view(None)
            assert t.mode == "ranged"
            check(tuples[:10].reshape(1, 10, 3))
            with pytest.raises(TableNotFound, match="pairs"):
                t.use_view("pairs")
    finally:
        index_key = "engramdb:pv:engram_l1:view:corpus:index"
        assert client.is_exist(index_key) == 1
        mc.unpublish("pv", client=client)
        assert client.is_exist(index_key) == 0


def test_views_that_cannot_serve_are_refused_by_name(
    client: Any, view_db: tuple[Path, np.ndarray]
) -> None:
    path, _ = view_db
    with pytest.raises(InvalidArgument, match="2 rows"):
        mc.publish(path, client=client, name="pv2", views=["pairs"])
    with pytest.raises(TableNotFound, match="no view 'nope'"):
        mc.publish(path, client=client, name="pv2", views=["nope"])
    assert client.is_exist(mc.manifest_key("pv2")) == 0  # nothing left behind
    s = mc.publish(path, client=client, name="pv2", views=False)
    try:
        assert s.views == () and s.skipped_views == ()
        with mc.open_mooncake(client=client, name="pv2") as db:
            assert db["engram_l1"].views == {}
        with pytest.raises(TableNotFound, match="view 'corpus'"):
            mc.open_mooncake(client=client, name="pv2", view="corpus")
    finally:
        mc.unpublish("pv2", client=client)


def test_a_corrupted_view_index_is_refused(client: Any, view_db: tuple[Path, np.ndarray]) -> None:
    path, _ = view_db
    mc.publish(path, client=client, name="pv3", views=["corpus"])
    try:
        key = "engramdb:pv3:engram_l1:view:corpus:index"
        good = mc.read_object(client, key, client.get_size(key))
        bad = good.copy()
        bad[100] ^= 0xFF  # one flipped bit in a stored hash
        assert mc.remove(client, [key], True) == [key]
        with mc.registered(client, bad):
            mc.put_batch(client, [key], [bad.ctypes.data], [bad.nbytes], None)
        with mc.open_mooncake(client=client, name="pv3") as db:
            with pytest.raises(CorruptFile, match="checksum"):
                db["engram_l1"].use_view("corpus")
            assert db["engram_l1"].mode == "ranged"  # still serves, without the view
    finally:
        mc.unpublish("pv3", client=client)
