"""EngramStore conformance: every rule of the Mooncake EngramStore contract."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb import EngramStore, EngramStoreConfig
from engramdb.errors import EngramDBError, LayerExists, LayerNotReady

SIZES = [17, 19, 23, 29]


def cfg(sizes: list[int] = SIZES, row_bytes: int = 264) -> EngramStoreConfig:
    c = EngramStoreConfig()
    c.table_vocab_sizes = list(sizes)
    c.row_bytes = row_bytes
    return c


def tables(sizes: list[int] = SIZES, row_bytes: int = 264, salt: int = 0) -> list[np.ndarray]:
    return [
        (
            (np.arange(n * row_bytes, dtype=np.int64).reshape(n, row_bytes) * 7 + h * 37 + salt)
            % 251
        ).astype(np.uint8)
        for h, n in enumerate(sizes)
    ]


def rand_ids(rng: np.random.Generator, b: int, l: int, sizes: list[int] = SIZES) -> np.ndarray:  # noqa: E741
    return np.ascontiguousarray(
        np.stack([rng.integers(0, n, (b, l)) for n in sizes], axis=-1), dtype=np.int64
    )


def expected(tabs: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.stack([tabs[h][ids[..., h]] for h in range(len(tabs))], axis=-2)


@pytest.fixture(params=["local", "engramdb"])
def backed(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    """An EngramStore with layer 1 filled, either bound to local memory or populated into EngramDB."""
    tabs = tables()
    if request.param == "local":
        es = EngramStore({1: cfg(), 14: cfg([7, 11])})
        es.bind_local(1, tabs)
    else:
        es = EngramStore({1: cfg(), 14: cfg([7, 11])}, store=tmp_path / "db")
        es.populate(1, tabs)
    return es, tabs


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EngramStore({})
    with pytest.raises(ValueError):
        EngramStore({-1: cfg()})
    for rb in (0, -1):
        with pytest.raises(ValueError, match="row_bytes"):
            EngramStore({1: cfg(row_bytes=rb)})
    with pytest.raises(ValueError):
        EngramStore({1: cfg([])})
    with pytest.raises(ValueError):
        EngramStore({1: cfg([5, 0])})
    with pytest.raises(ValueError, match="overflow"):
        EngramStore({1: cfg([2**63 - 1])})
    with pytest.raises(EngramDBError):
        EngramStore({1: EngramStoreConfig()})  # row_bytes defaults to 0: must be set
    with pytest.raises(ValueError):
        EngramStore({1: cfg()}, store=object())


def test_metadata() -> None:
    es = EngramStore({14: cfg([7, 11], 32), 1: cfg()})
    assert es.get_layer_ids() == [1, 14]
    assert es.get_table_vocab_sizes(1) == SIZES
    assert es.get_num_heads(14) == 2 and es.get_row_bytes(14) == 32
    assert es.get_store_keys(14) == ["engram:l14:h0", "engram:l14:h1"]
    for op in (
        es.get_store_keys,
        es.get_row_bytes,
        es.get_num_heads,
        es.get_table_vocab_sizes,
        es.remove_from_store,
    ):
        with pytest.raises(ValueError, match="Unknown Engram layer"):
            op(99)
    with pytest.raises(ValueError, match="Unknown Engram layer"):
        es.populate(99, [])


def test_lookup_matches_tables(backed, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    es, tabs = backed
    for b, l in ((1, 1), (3, 5), (64, 33)):  # noqa: E741
        ids = rand_ids(rng, b, l)
        out = np.full(ids.shape + (264,), 99, np.uint8)
        assert es.lookup_into(1, ids, out) is None
        assert np.array_equal(out, expected(tabs, ids))
    last = (np.array(SIZES, np.int64) - 1)[None, None]
    out = np.empty((1, 1, 4, 264), np.uint8)
    es.lookup_into(1, last, out)
    assert np.array_equal(out[0, 0], np.stack([t[-1] for t in tabs]))


def test_lookup_rejects_implicit_input_conversion(backed) -> None:  # type: ignore[no-untyped-def]
    es, _ = backed
    ids = np.zeros((1, 2, 4), np.int64)
    out = np.empty((1, 2, 4, 264), np.uint8)
    for bad in (ids.tolist(), ids.astype(np.int32), ids[..., ::-1], ids.astype(np.uint64)):
        with pytest.raises(TypeError):
            es.lookup_into(1, bad, out)


def test_lookup_rejects_bad_outputs(backed) -> None:  # type: ignore[no-untyped-def]
    es, tabs = backed
    ids = np.zeros((1, 3, 4), np.int64)
    out = np.empty((1, 3, 4, 264), np.uint8)
    for bad in (out[..., ::-1], out.astype(np.float32), out.tolist()):
        with pytest.raises(TypeError):
            es.lookup_into(1, ids, bad)
    with pytest.raises(RuntimeError):  # the binding's type for these
        es.lookup_into(1, ids, out[..., ::-1])
    with pytest.raises(ValueError):
        es.lookup_into(1, ids, out[..., :-1].copy())
    ro = out.copy()
    ro.setflags(write=False)
    with pytest.raises(TypeError):
        es.lookup_into(1, ids, ro)
    with pytest.raises(ValueError):  # wrong head dimension
        es.lookup_into(1, np.zeros((1, 3, 3), np.int64), np.empty((1, 3, 3, 264), np.uint8))
    with pytest.raises(ValueError):  # not [B, L, H]
        es.lookup_into(1, np.zeros((3, 4), np.int64), np.empty((3, 4, 264), np.uint8))


def test_bounds_per_head_and_output_zeroed(backed) -> None:  # type: ignore[no-untyped-def]
    es, tabs = backed
    for h, n in enumerate(SIZES):
        for bad in (n, -1):
            ids = np.zeros((1, 2, 4), np.int64)
            ids[0, 1, h] = bad
            out = np.full((1, 2, 4, 264), 5, np.uint8)
            with pytest.raises(IndexError, match=f"head {h}") as e:
                es.lookup_into(1, ids, out)
            assert isinstance(e.value, RuntimeError) and isinstance(e.value, EngramDBError)
            assert not out.any(), "a rejected lookup zero-fills, never half-writes"
    # a global id where a local one is expected is out of range for the later heads
    ids = np.array([[[0, 17, 17 + 19, 17 + 19 + 23]]], np.int64)
    with pytest.raises(IndexError):
        es.lookup_into(1, ids, np.empty((1, 1, 4, 264), np.uint8))


def test_type_errors_leave_output_untouched(backed) -> None:  # type: ignore[no-untyped-def]
    es, _ = backed
    out = np.full((1, 2, 4, 264), 5, np.uint8)
    with pytest.raises(TypeError):
        es.lookup_into(1, np.zeros((1, 2, 4), np.int32), out)
    assert (out == 5).all()


def test_empty_batch_is_noop(backed) -> None:  # type: ignore[no-untyped-def]
    es, _ = backed
    ids = np.empty((1, 0, 4), np.int64)
    assert es.lookup_into(1, ids, np.empty((1, 0, 4, 264), np.uint8)) is None
    # even for a layer with no table yet
    es.lookup_into(14, np.empty((0, 3, 2), np.int64), np.empty((0, 3, 2, 264), np.uint8))


def test_unknown_and_unready_layers(backed) -> None:  # type: ignore[no-untyped-def]
    es, _ = backed
    ids = np.zeros((1, 1, 2), np.int64)
    out = np.full((1, 1, 2, 264), 3, np.uint8)
    with pytest.raises(RuntimeError):
        es.lookup_into(14, ids, out)  # configured, never filled
    with pytest.raises(ValueError, match="Unknown Engram layer"):
        es.lookup_into(15, ids, out)
    assert (out == 3).all()


def test_populate_create_only_and_remove(tmp_path: Path, rng: np.random.Generator) -> None:
    es = EngramStore({1: cfg(), 14: cfg([7, 11])}, store=tmp_path)
    tabs = tables()
    es.populate(1, tabs)
    with pytest.raises(LayerExists):
        es.populate(1, tables(salt=1))
    ids = rand_ids(rng, 2, 3)
    out = np.empty(ids.shape + (264,), np.uint8)
    es.lookup_into(1, ids, out)
    assert np.array_equal(out, expected(tabs, ids))
    assert es.remove_from_store(1, force=True) == 4
    assert es.remove_from_store(1, force=True) == 0
    with pytest.raises(LayerNotReady):
        es.lookup_into(1, ids, out)
    new = tables(salt=3)
    es.populate(1, new)
    es.lookup_into(1, ids, out)
    assert np.array_equal(out, expected(new, ids))


def test_populate_validation_and_no_cast(tmp_path: Path) -> None:
    es = EngramStore({1: cfg()}, store=tmp_path)
    tabs = tables()
    with pytest.raises(ValueError):
        es.populate(1, tabs[:3])  # one table per head
    short = list(tabs)
    short[0] = short[0][:-1]
    with pytest.raises(ValueError):
        es.populate(1, short)
    with pytest.raises(TypeError):
        es.populate(1, [np.zeros((n, 264), np.float32) for n in SIZES])
    with pytest.raises(TypeError):
        es.populate(1, [np.zeros((n, 528), np.uint8)[:, ::2] for n in SIZES])
    with pytest.raises(TypeError):
        es.populate(1, tuple(t.tolist() for t in tabs))  # type: ignore[arg-type]
    # nothing was written by the failed attempts
    assert not (tmp_path / "manifest.json").exists() or "engram_l1" not in engramdb.open(tmp_path)
    with pytest.raises(LayerNotReady):
        EngramStore({1: cfg()}).populate(1, tabs)  # no backing store


def test_second_handle_reads_without_repopulating(tmp_path: Path, rng: np.random.Generator) -> None:
    configs = {1: cfg(), 14: cfg([7, 11], 32)}
    writer = EngramStore(configs, store=tmp_path)
    t1, t14 = tables(), tables([7, 11], 32, salt=5)
    writer.populate(1, t1)
    writer.populate(14, t14)
    with engramdb.open(tmp_path) as db:
        reader = EngramStore(configs, store=db)
        assert reader.get_store_keys(14) == writer.get_store_keys(14)
        ids = rand_ids(rng, 2, 2, [7, 11])
        out = np.empty(ids.shape + (32,), np.uint8)
        reader.lookup_into(14, ids, out)
        assert np.array_equal(out, expected(t14, ids))
    writer.remove_from_store(1)
    ids = rand_ids(rng, 1, 1, [7, 11])
    out = np.empty(ids.shape + (32,), np.uint8)
    writer.lookup_into(14, ids, out)  # other layers unaffected
    assert np.array_equal(out, expected(t14, ids))
    mismatched = EngramStore({14: cfg([7, 12], 32)}, store=tmp_path)
    with pytest.raises(LayerExists, match="configured"):
        mismatched.lookup_into(14, ids, out)


def test_bind_local_lifetime_and_rules() -> None:
    es = EngramStore({1: cfg(), 14: cfg()})
    arrays = tables()
    expect_last = np.stack([a[-1].copy() for a in arrays])
    refs = [weakref.ref(a) for a in arrays]
    for a in arrays:
        a.flags.writeable = False  # read-only tables are fine
    es.bind_local(1, arrays)
    del arrays, a
    gc.collect()
    assert all(r() is not None for r in refs), "bound tables are kept alive"
    ids = (np.array(SIZES, np.int64) - 1)[None, None]
    out = np.empty((1, 1, 4, 264), np.uint8)
    es.lookup_into(1, ids, out)
    assert np.array_equal(out[0, 0], expect_last)
    with pytest.raises(LayerExists):
        es.bind_local(1, tables())
    with pytest.raises(RuntimeError):
        es.lookup_into(14, ids, out)
    with pytest.raises(TypeError):
        es.bind_local(14, [t.astype(np.int8) for t in tables()])
    del es
    gc.collect()
    assert all(r() is None for r in refs), "released when the store goes away"


def test_bind_local_rejected_with_store(tmp_path: Path) -> None:
    es = EngramStore({1: cfg()}, store=tmp_path)
    with pytest.raises(LayerExists):
        es.bind_local(1, tables())


def test_bind_memmaps(tmp_path: Path, rng: np.random.Generator) -> None:
    tabs = tables()
    maps = []
    for h, t in enumerate(tabs):
        p = tmp_path / f"h{h}.bin"
        t.tofile(p)
        maps.append(np.memmap(p, dtype=np.uint8, mode="r", shape=t.shape))
    es = EngramStore({1: cfg()})
    es.bind_local(1, maps)
    ids = rand_ids(rng, 64, 40)  # large enough for the split gather
    out = np.empty(ids.shape + (264,), np.uint8)
    es.lookup_into(1, ids, out)
    assert np.array_equal(out, expected(tabs, ids))
