"""The Mooncake EngramStore surface in every version users hold.

* the released wheel (0.3.13.post1): single-layer ``EngramStore(layer_id, config, store)``,
  float32 rows, ``lookup(row_ids) -> [B, L, H, D]`` — the behaviour its own test cases
  check, in our words, on our adapter (EngramDB backing, a real Mooncake store) and, as the
  reference, on the wheel's own class;
* current upstream: ``store_client=`` / ``local_dir=``, ``lookup_many_into``,
  ``lookup(table_ids, row_ids[heads, tokens], output)`` with -1 untouched, the binding's
  strict argument types, local ``remove_from_store`` refusing, capsule wrappers;
* ``install_engramstore()``, replaying SGLang's ``connect_store`` / ``_lookup_rows``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb import EngramStore, EngramStoreConfig
from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    LayerExists,
    LookupBoundsError,
)
from engramdb.integrations.engramstore_released import ReleasedEngramStore
from engramdb.integrations.mooncake import MooncakeError, install_engramstore

SIZES = [17, 19, 23, 29]
DIM = 8
_ids = itertools.count(300)


def released_cfg(module: Any = None) -> Any:
    c = module.EngramStoreConfig() if module is not None else EngramStoreConfig()
    c.table_vocab_sizes = list(SIZES)
    c.embedding_dim = DIM
    return c


def float_tables(sizes: list[int] = SIZES, dim: int = DIM) -> list[np.ndarray]:
    return [
        np.arange(n * dim, dtype=np.float32).reshape(n, dim) + h * 1000 for h, n in enumerate(sizes)
    ]


def cfg(sizes: list[int], row_bytes: int) -> EngramStoreConfig:
    return EngramStoreConfig(sizes, row_bytes)


def u8_tables(sizes: list[int], row_bytes: int, salt: int = 0) -> list[np.ndarray]:
    return [
        ((np.arange(n * row_bytes).reshape(n, row_bytes) * 3 + h * 41 + salt) % 253).astype(
            np.uint8
        )
        for h, n in enumerate(sizes)
    ]


# --- backings for the released-API cases ---------------------------------------------------
class Backing:
    """How a case builds a released-API store and checks that its keys are gone."""

    def __init__(
        self,
        make: Callable[..., Any],
        gone: Callable[[Any], bool],
        store: Any,
    ):
        self.make = make
        self.gone = gone
        self.store = store
        self.made: list[Any] = []

    def create(self, layer_id: int | None = None, with_store: bool = True) -> Any:
        layer_id = next(_ids) if layer_id is None else layer_id
        es = self.make(layer_id, self.store if with_store else None)
        if with_store:
            self.made.append(es)
        return es

    def cleanup(self) -> None:
        for es in self.made:
            try:
                es.remove_from_store(force=True)
            except Exception:  # noqa: BLE001 - best-effort cleanup of a test layer
                pass


# The Mooncake client library keeps per-process state: a second cluster in one process
# (tests/test_mooncake.py has its own) cannot be connected to. The cases that need a real
# store therefore run in a child pytest process (test_mooncake_cases_in_a_child_process).
IN_CHILD = os.environ.get("ENGRAMDB_MOONCAKE_CHILD") == "1"
CHILD_SELECTION = "mooncake or wheel or capsule or store_mode"


def test_mooncake_cases_in_a_child_process() -> None:
    if IN_CHILD:
        pytest.skip("this is the child")
    pytest.importorskip("mooncake.store")
    env = {**os.environ, "ENGRAMDB_MOONCAKE_CHILD": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            __file__,
            "-k",
            CHILD_SELECTION,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent,
    )
    tail = proc.stdout[-3000:]
    if "private network namespace" in proc.stdout and " passed" not in proc.stdout:
        pytest.skip("the child could not create a private network namespace")
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 27, tail


@pytest.fixture(scope="module")
def mooncake_client() -> Iterator[Any]:
    if not IN_CHILD:
        pytest.skip("runs in the child process (test_mooncake_cases_in_a_child_process)")
    pytest.importorskip("mooncake.store")
    from mooncake_harness import Cluster, NamespaceUnavailable, enter_private_netns

    try:
        restore = enter_private_netns()
    except NamespaceUnavailable as e:
        pytest.skip(f"cannot create a private network namespace for the Mooncake tests: {e}")
    old = os.environ.get("MC_TCP_BIND_ADDRESS")
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    cluster = Cluster(base=31151)  # ports of its own: another module may have run one
    try:
        cluster.start()
        client = cluster.connect()
        yield client
        client.close()
    finally:
        cluster.stop()
        restore()
        if old is None:
            os.environ.pop("MC_TCP_BIND_ADDRESS", None)
        else:
            os.environ["MC_TCP_BIND_ADDRESS"] = old


def _db_gone(path: Path) -> Callable[[Any], bool]:
    def gone(es: Any) -> bool:
        if not (path / "manifest.json").exists():
            return True
        with engramdb.open(path) as db:
            return es.engram_store.table_name(es.engram_store.get_layer_ids()[0]) not in db

    return gone


@pytest.fixture(params=["engramdb", "mooncake", "wheel"])
def backing(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backing]:
    if request.param == "engramdb":
        b = Backing(
            lambda lid, store: EngramStore(layer_id=lid, config=released_cfg(), store=store),
            _db_gone(tmp_path / "db"),
            tmp_path / "db",
        )
    else:
        client = request.getfixturevalue("mooncake_client")
        if request.param == "mooncake":
            b = Backing(
                lambda lid, store: EngramStore(layer_id=lid, config=released_cfg(), store=store),
                lambda es: all(client.is_exist(k) == 0 for k in es.get_store_keys()),
                client,
            )
        else:  # the wheel's own class: the reference these cases were written against
            import mooncake.store as ms

            b = Backing(
                lambda lid, store: ms.EngramStore(
                    layer_id=lid, config=released_cfg(ms), **({"store": store} if store else {})
                ),
                lambda es: all(client.is_exist(k) == 0 for k in es.get_store_keys()),
                client,
            )
    yield b
    b.cleanup()


# --- the released wheel's cases --------------------------------------------------------------
def test_released_metadata(backing: Backing) -> None:
    es = backing.create()
    assert es.get_num_heads() == len(SIZES)
    assert es.get_embedding_dim() == DIM
    assert es.get_table_vocab_sizes() == SIZES
    assert len(es.get_store_keys()) == len(SIZES)


def test_released_metadata_without_store(backing: Backing) -> None:
    lid = next(_ids)
    es = backing.create(lid, with_store=False)
    assert es.get_num_heads() == len(SIZES) and es.get_embedding_dim() == DIM
    assert es.get_store_keys()[0] == f"engram:l{lid}:h0"


def test_released_lookup_from_lists_has_the_shape_and_finite_rows(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    ids = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 4], [8, 9, 10, 11]]]
    out = np.asarray(es.lookup(ids))
    assert out.shape == (2, 2, len(SIZES), DIM) and out.dtype == np.float32
    assert np.isfinite(out).all()


def test_released_lookup_returns_the_stored_rows(backing: Backing) -> None:
    es = backing.create()
    tabs = float_tables()
    es.populate(tabs)
    ids = np.array([[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]], dtype=np.int64)
    out = np.asarray(es.lookup(ids))
    for pos in range(3):
        for h in range(len(SIZES)):
            assert np.array_equal(out[0, pos, h], tabs[h][ids[0, pos, h]])


def test_released_list_and_array_ids_agree(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    ids = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 4], [8, 9, 10, 11]]]
    assert np.array_equal(
        np.asarray(es.lookup(ids)), np.asarray(es.lookup(np.asarray(ids, dtype=np.int64)))
    )


def test_released_remove_counts_heads_then_zero(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    assert es.remove_from_store(force=True) == len(SIZES)
    assert backing.gone(es)
    assert es.remove_from_store(force=True) == 0


def test_released_populate_is_create_only(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    with pytest.raises(RuntimeError):
        es.populate(float_tables())


def test_released_lookup_before_populate_fails(backing: Backing) -> None:
    es = backing.create()
    with pytest.raises(RuntimeError):
        es.lookup([[[0, 1, 2, 3]]])


def test_released_populate_rejects_a_short_head(backing: Backing) -> None:
    es = backing.create()
    tabs = float_tables()
    tabs[0] = tabs[0][:-1]
    with pytest.raises(RuntimeError):
        es.populate(tabs)


def test_released_lookup_rejects_empty_input(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    with pytest.raises(RuntimeError):
        es.lookup([])


def test_released_lookup_rejects_a_wrong_head_count(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    with pytest.raises(RuntimeError):
        es.lookup(np.zeros((1, 1, len(SIZES) - 1), dtype=np.int64))


def test_released_lookup_rejects_an_out_of_range_id(backing: Backing) -> None:
    es = backing.create()
    es.populate(float_tables())
    with pytest.raises(RuntimeError):
        es.lookup([[[999, 1, 2, 3]]])


def test_released_strict_types_match_the_wheel(tmp_path: Path) -> None:
    for bad in ("1", 1.0, 2**31):
        with pytest.raises(TypeError):
            EngramStore(bad, released_cfg(), tmp_path)
    es = EngramStore(np.int64(3), released_cfg(), tmp_path)
    assert isinstance(es, ReleasedEngramStore)
    with pytest.raises(TypeError):
        es.populate(tuple(float_tables()))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="-600"):
        EngramStore(4, released_cfg()).remove_from_store()


# --- current upstream surface ---------------------------------------------------------------
def test_local_dir_populates_and_remove_refuses(tmp_path: Path) -> None:
    es = EngramStore({1: cfg([5, 7], 16)}, local_dir=tmp_path / "local")
    tabs = u8_tables([5, 7], 16)
    es.populate(1, tabs)
    ids = np.array([[[4, 6], [0, 1]]], dtype=np.int64)
    out = np.empty((1, 2, 2, 16), np.uint8)
    es.lookup_into(1, ids, out)
    assert np.array_equal(out[0, 0, 1], tabs[1][6]) and np.array_equal(out[0, 1, 0], tabs[0][0])
    with pytest.raises(RuntimeError, match="-600") as e:
        es.remove_from_store(1)
    assert isinstance(e.value, MooncakeError) and e.value.code == -600
    bound = EngramStore({1: cfg([5, 7], 16)})
    bound.bind_local(1, tabs)
    with pytest.raises(MooncakeError):
        bound.remove_from_store(1, force=True)
    with pytest.raises(InvalidArgument):
        EngramStore({1: cfg([5], 4)}, tmp_path, local_dir=tmp_path)


@pytest.mark.parametrize("bad", ["1", 1.0, 2**31, -(2**31) - 1, None])
def test_layer_ids_are_strictly_typed(bad: Any, tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        EngramStore({bad: cfg([5], 4)})
    es = EngramStore({1: cfg([5], 4)})
    out = np.empty((1, 1, 1, 4), np.uint8)
    for call in (
        lambda: es.get_num_heads(bad),
        lambda: es.get_store_keys(bad),
        lambda: es.lookup_into(bad, np.zeros((1, 1, 1), np.int64), out),
    ):
        with pytest.raises(TypeError):
            call()
    assert es.get_num_heads(np.int32(1)) == 1  # numpy integers are integers


def test_buffers_must_be_a_list(tmp_path: Path) -> None:
    es = EngramStore({1: cfg([5, 7], 16)}, tmp_path)
    with pytest.raises(TypeError):
        es.populate(1, tuple(u8_tables([5, 7], 16)))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EngramStore({1: cfg([5, 7], 16)}).bind_local(1, tuple(u8_tables([5, 7], 16)))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["local", "engramdb"])
def test_lookup_many_into(mode: str, tmp_path: Path, rng: np.random.Generator) -> None:
    layers = {1: cfg([5, 7], 16), 14: cfg([11, 3, 2], 8)}
    t1, t14 = u8_tables([5, 7], 16), u8_tables([11, 3, 2], 8, salt=9)
    if mode == "local":
        es = EngramStore(layers)
        es.bind_local(1, t1)
        es.bind_local(14, t14)
    else:
        es = EngramStore(layers, tmp_path)
        es.populate(1, t1)
        es.populate(14, t14)
    i1 = np.stack([rng.integers(0, n, (2, 3)) for n in (5, 7)], -1).astype(np.int64)
    i14 = np.stack([rng.integers(0, n, (1, 4)) for n in (11, 3, 2)], -1).astype(np.int64)
    o1, o14 = np.empty((2, 3, 2, 16), np.uint8), np.empty((1, 4, 3, 8), np.uint8)
    es.lookup_many_into([1, 14], [i1, i14], [o1, o14])
    for ids, out, tabs in ((i1, o1, t1), (i14, o14, t14)):
        want = np.stack([tabs[h][ids[..., h]] for h in range(len(tabs))], axis=-2)
        assert np.array_equal(out, want)
    # an out-of-range id in any request zero-fills every output; nothing else is read
    bad = i14.copy()
    bad[0, 0, 2] = 2
    with pytest.raises(LookupBoundsError):
        es.lookup_many_into([1, 14], [i1, bad], [o1, o14])
    assert not o1.any() and not o14.any()
    # a type error leaves the outputs untouched
    o1[:] = 7
    with pytest.raises(TypeError):
        es.lookup_many_into([1, 14], [i1, i14.astype(np.int32)], [o1, o14])
    assert (o1 == 7).all()
    with pytest.raises(ValueError):
        es.lookup_many_into([1, 14], [i1], [o1])
    with pytest.raises(ValueError):  # overlapping outputs
        es.lookup_many_into([1, 1], [i1, i1], [o1, o1])


@pytest.mark.parametrize("mode", ["local", "engramdb"])
def test_flat_lookup_leaves_minus_one_rows_untouched(mode: str, tmp_path: Path) -> None:
    # upstream's callers make one single-head "table" per (layer, head)
    sizes = {10: [5], 11: [7], 12: [4, 3]}
    tabs = {t: u8_tables(s, 8, salt=t) for t, s in sizes.items()}
    layers = {t: cfg(s, 8) for t, s in sizes.items()}
    if mode == "local":
        es = EngramStore(layers)
        for t, tb in tabs.items():
            es.bind_local(t, tb)
    else:
        es = EngramStore(layers, tmp_path)
        for t, tb in tabs.items():
            es.populate(t, tb)
    ids = np.array([[4, -1, 0], [-1, 6, 2], [5, 1, -1]], dtype=np.int64)
    out = np.full((3, 3, 8), 0xEE, np.uint8)
    es.lookup([10, 11, 12], ids, out)
    concat12 = np.concatenate(tabs[12])
    assert np.array_equal(out[0, 0], tabs[10][0][4]) and np.array_equal(out[0, 2], tabs[10][0][0])
    assert np.array_equal(out[1, 1], tabs[11][0][6]) and np.array_equal(out[1, 2], tabs[11][0][2])
    assert np.array_equal(out[2, 0], concat12[5]) and np.array_equal(out[2, 1], concat12[1])
    for i, t in ((0, 1), (1, 0), (2, 2)):
        assert (out[i, t] == 0xEE).all(), "id -1 leaves the row untouched"
    torch = pytest.importorskip("torch")
    tout = torch.zeros((3, 3, 8), dtype=torch.uint8)
    es.lookup([10, 11, 12], ids, tout)
    assert np.array_equal(tout.numpy()[0, 0], tabs[10][0][4])
    before = out.copy()
    for bad_ids in (np.array([[5, 0, 0]]), np.array([[-2, 0, 0]])):
        with pytest.raises(LookupBoundsError):
            es.lookup([10], bad_ids.astype(np.int64), out[:1])
    assert np.array_equal(out, before)
    with pytest.raises(TypeError):
        es.lookup([10], ids[:1].astype(np.int32), out[:1])
    with pytest.raises(TypeError):
        es.lookup([10, 11, 12], ids, out[:, :2])


class _CapsuleWrapper:
    """A store wrapper as engines write them: the capsule method plus the client inside."""

    def __init__(self, client: Any):
        self.store = client

    def _get_pyclient_capsule(self) -> Any:
        return self.store._get_pyclient_capsule()  # noqa: SLF001 - the binding's own hook


class _CapsuleOnly:
    def _get_pyclient_capsule(self) -> Any:
        return None


def test_capsule_wrappers(mooncake_client: Any) -> None:
    lid = next(_ids)
    es = EngramStore({lid: cfg([5, 7], 16)}, store_client=_CapsuleWrapper(mooncake_client))
    assert es.mooncake_layers is not None and es.mooncake_layers.client is mooncake_client
    tabs = u8_tables([5, 7], 16)
    es.populate(lid, tabs)
    try:
        ids = np.array([[[3, 6]]], dtype=np.int64)
        out = np.empty((1, 1, 2, 16), np.uint8)
        mooncake_client.register_buffer(out.ctypes.data, out.nbytes)
        try:
            es.lookup_many_into([lid], [ids], [out])
        finally:
            mooncake_client.unregister_buffer(out.ctypes.data)
        assert np.array_equal(out[0, 0, 0], tabs[0][3]) and np.array_equal(out[0, 0, 1], tabs[1][6])
    finally:
        es.remove_from_store(lid, force=True)
    with pytest.raises(InvalidArgument, match="_get_pyclient_capsule"):
        EngramStore({1: cfg([5], 4)}, store_client=_CapsuleOnly())


# --- install_engramstore: SGLang's call sequence --------------------------------------------
def _sglang_connect_store(config_path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """SGLang's ``engram_mooncake.connect_store`` call sequence (local and store modes)."""
    from mooncake.store import EngramStore as Store
    from mooncake.store import EngramStoreConfig as Config
    from mooncake.store import MooncakeDistributedStore

    config = json.loads(config_path.read_text())
    store = None
    if config.get("mode", "store") == "store":
        store = MooncakeDistributedStore()
        if store.setup(**config["connection"]) != 0:
            raise RuntimeError("Mooncake setup failed")
    layers = {}
    for layer_id, layout in config["layers"].items():
        c = Config()
        c.table_vocab_sizes = layout["table_vocab_sizes"]
        c.row_bytes = layout["row_bytes"]
        layers[int(layer_id)] = c
    table = Store(layers, store)
    if store is None:
        for layer_id, c in layers.items():
            paths = config["local_tables"][str(layer_id)]
            arrays = [
                np.memmap(p, mode="r", dtype=np.uint8, shape=(rows, c.row_bytes))
                for p, rows in zip(paths, c.table_vocab_sizes)
            ]
            table.bind_local(layer_id, arrays)
    return store, table, config


def _sglang_lookup_rows(table: Any, layer_id: int, ids: Any, padding: Any, output: Any) -> None:
    end = np.flatnonzero(~padding)[-1] + 1 if padding.any() else len(ids)
    table.lookup_into(layer_id, ids[None, :end], output[:, :end])
    output[0, padding] = 0


def test_install_engramstore_replays_sglang_local_mode(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store")
    torch = pytest.importorskip("torch")
    import mooncake.store as ms

    native = ms.EngramStore
    primes = [7, 11, 13]
    rb = 256 + 8
    tabs = u8_tables(primes, rb, salt=3)
    paths = []
    for h, t in enumerate(tabs):
        p = tmp_path / f"l14_h{h}.bin"
        t.tofile(p)
        paths.append(str(p))
    manifest = {
        "mode": "local",
        "layers": {"14": {"table_vocab_sizes": primes, "head_dim": 256, "row_bytes": rb}},
        "local_tables": {"14": paths},
    }
    cpath = tmp_path / "engram.json"
    cpath.write_text(json.dumps(manifest))
    with install_engramstore() as undo:
        store, table, _ = _sglang_connect_store(cpath)
        assert store is None and type(table).__module__ == "engramdb.integrations.engramstore"
        offsets = np.cumsum([0] + primes[:-1], dtype=np.int64)
        global_ids = np.array([[6, 7 + 10, 18 + 12], [0, 7, 18], [0, 0, 0]], dtype=np.int64)
        host = torch.zeros((1, 3, 3, rb), dtype=torch.uint8)  # SGLang: one buffer per length
        padding = np.all(global_ids == 0, axis=-1)
        local = np.ascontiguousarray(global_ids - offsets)
        local[padding] = 0
        _sglang_lookup_rows(table, 14, local, padding, host.numpy())
        got = host.numpy()[0]
        for t in range(2):
            for h in range(3):
                assert np.array_equal(got[t, h], tabs[h][local[t, h]])
        assert not got[2].any()  # the padding token is zeroed by SGLang, never read
    assert ms.EngramStore is native and not undo.active


def test_install_engramstore_replays_sglang_store_mode(
    mooncake_client: Any, tmp_path: Path
) -> None:
    import mooncake.store as ms
    from mooncake_harness import Cluster  # noqa: F401 - the client fixture's cluster is up

    lid = next(_ids)
    primes = [5, 9]
    rb = 16
    tabs = u8_tables(primes, rb, salt=1)
    with install_engramstore():
        writer = ms.EngramStore({lid: cfg(primes, rb)}, store_client=mooncake_client)
        writer.populate(lid, tabs)
        try:
            table = ms.EngramStore({lid: cfg(primes, rb)}, mooncake_client)
            ids = np.array([[4, 8], [1, 2]], dtype=np.int64)
            host = np.zeros((1, 2, 2, rb), np.uint8)
            mooncake_client.register_buffer(host.ctypes.data, host.nbytes)
            try:
                _sglang_lookup_rows(table, lid, ids, np.zeros(2, bool), host)
            finally:
                mooncake_client.unregister_buffer(host.ctypes.data)
            assert np.array_equal(host[0, 0, 1], tabs[1][8])
            assert np.array_equal(host[0, 1, 0], tabs[0][1])
        finally:
            writer.remove_from_store(lid, force=True)
    assert isinstance(writer, EngramStore)


def test_errors_keep_the_binding_classes(tmp_path: Path) -> None:
    es = EngramStore({1: cfg([5], 4)}, tmp_path)
    es.populate(1, u8_tables([5], 4))
    with pytest.raises(LayerExists):
        es.populate(1, u8_tables([5], 4))
    with pytest.raises(EngramDBError):
        es.lookup_into(1, np.array([[[5]]], np.int64), np.empty((1, 1, 1, 4), np.uint8))
