"""Object layout, range plans, manifests and shard reads of the Mooncake package: no store needed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import engramdb
from engramdb.errors import CorruptManifest, InvalidArgument
from engramdb.integrations.mooncake import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    ObjectLayout,
    RangePlan,
    check_name,
    layer_layout,
    manifest_key,
    parse_manifest,
    shard_reads,
)
from engramdb.testing.dbs import TableSpec


def apply(plan: RangePlan, objects: dict[str, bytes], nbytes: int) -> bytes:
    """What ``get_into_ranges`` would write for ``plan`` (the reference, per range)."""
    out = bytearray(nbytes)
    for key, dsts, srcs, sizes in zip(plan.keys, plan.dst, plan.src, plan.sizes):
        for d, s, n in zip(dsts, srcs, sizes):
            assert s + n <= len(objects[key])
            out[d : d + n] = objects[key][s : s + n]
    return bytes(out)


def tables(heads: list[int], rb: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, 256, (n, rb), dtype=np.uint8) for n in heads]


def objects_of(layout: ObjectLayout, tabs: list[np.ndarray]) -> dict[str, bytes]:
    return {
        key: tabs[h][first : first + rows].tobytes() for key, h, first, rows in layout.objects()
    }


@pytest.mark.parametrize("object_rows", [None, 1, 3, 7, 64])
def test_plan_local_matches_per_head_gather(object_rows: int | None) -> None:
    rng = np.random.default_rng(1)
    heads, rb = [17, 5, 23, 8], 12
    layout = layer_layout(3, heads, rb, None if object_rows is None else object_rows * rb + 5)
    tabs = tables(heads, rb, rng)
    # every head boundary: first and last row of each head, plus random ids
    edge = np.array([[0] * 4, [n - 1 for n in heads]], dtype=np.int64)
    rand = np.stack([rng.integers(0, n, 30) for n in heads], -1)
    ids = np.ascontiguousarray(np.concatenate([edge, rand]).reshape(2, 16, 4))
    plan = layout.plan_local(ids)
    want = np.stack([tabs[h][ids[..., h]] for h in range(4)], axis=-2)
    got = apply(plan, objects_of(layout, tabs), want.nbytes)
    assert got == want.tobytes()
    assert plan.n_ranges == ids.size
    assert len(plan.keys) == len(set(plan.keys))


@pytest.mark.parametrize("object_rows", [None, 2, 9])
def test_plan_global_maps_rows_across_heads_and_objects(object_rows: int | None) -> None:
    rng = np.random.default_rng(2)
    heads, rb = [10, 1, 31], 8
    layout = ObjectLayout.split(
        heads,
        rb,
        None if object_rows is None else object_rows * rb,
        lambda h, k, n: f"t:h{h}:p{k}",
    )
    tabs = tables(heads, rb, rng)
    table = np.concatenate(tabs)
    g = np.concatenate([np.arange(table.shape[0]), rng.integers(0, table.shape[0], 50)])
    plan = layout.plan_global(g)
    got = apply(plan, objects_of(layout, tabs), g.size * rb)
    assert got == table[g].tobytes()


def test_split_keys_follow_the_contract() -> None:
    whole = layer_layout(14, [5, 6], 264, None)
    assert whole.flat_keys == ["engram:l14:h0", "engram:l14:h1"]
    split = layer_layout(14, [5, 6], 264, 2 * 264)
    assert split.keys == [
        ["engram:l14:h0:p0", "engram:l14:h0:p1", "engram:l14:h0:p2"],
        ["engram:l14:h1:p0", "engram:l14:h1:p1", "engram:l14:h1:p2"],
    ]
    assert [rows for *_, rows in split.objects()] == [2, 2, 1, 2, 2, 2]


def test_object_size_below_one_row_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="smaller than one 264 B row"):
        layer_layout(1, [5], 264, 100)


def test_plan_of_an_empty_batch_has_no_ranges() -> None:
    plan = layer_layout(1, [5, 6], 8, None).plan_local(np.empty((0, 1, 2), np.int64))
    assert plan.n_ranges == 0 and plan.keys == []


def test_layout_refuses_keys_that_disagree_with_the_geometry() -> None:
    with pytest.raises(InvalidArgument, match="must be > 0"):
        ObjectLayout([5], 8, 0, [["a"]])
    with pytest.raises(InvalidArgument, match=r"geometry needs \[3, 1\]"):
        ObjectLayout([5, 2], 8, 2, [["a", "b"], ["c"]])
    with pytest.raises(InvalidArgument, match="objects per head"):
        ObjectLayout([5, 2], 8, 2, [["a", "b", "c"]])


def test_objects_tile_every_head_exactly_once() -> None:
    heads, rb = [10, 1, 31], 8
    layout = ObjectLayout.split(heads, rb, 4 * rb, lambda h, k, n: f"t:h{h}:p{k}")
    assert layout.rows_per_object == 4 and layout.n_objects == 3 + 1 + 8
    assert layout.object_base.tolist() == [0, 3, 4]
    assert layout.head_offsets.tolist() == [0, 10, 11]
    for h, n in enumerate(heads):
        parts = [(first, rows) for _, hh, first, rows in layout.objects() if hh == h]
        assert [f for f, _ in parts] == list(range(0, n, 4))
        assert sum(r for _, r in parts) == n and all(0 < r <= 4 for _, r in parts)
    assert [key for key, *_ in layout.objects()] == layout.flat_keys


def test_plan_counts_payload_and_keeps_rows_uniform() -> None:
    layout = layer_layout(2, [6, 6], 16, 3 * 16)
    ids = np.array([[[0, 5], [2, 3], [1, 0]]], dtype=np.int64)
    plan = layout.plan_local(ids)
    assert plan.n_ranges == 6 and plan.nbytes == 6 * 16 and plan.uniform
    assert all(size == 16 for sizes in plan.sizes for size in sizes)
    assert sum(len(d) for d in plan.dst) == 6
    # each touched object once, in object order
    assert plan.keys == [k for k in layout.flat_keys if k in set(plan.keys)]


def test_plan_positions_writes_where_the_full_batch_would() -> None:
    rng = np.random.default_rng(3)
    heads, rb = [9, 4, 13], 8
    layout = layer_layout(5, heads, rb, 2 * rb)
    tabs = tables(heads, rb, rng)
    objects = objects_of(layout, tabs)
    ids = np.ascontiguousarray(np.stack([rng.integers(0, n, (2, 5)) for n in heads], -1))
    full = np.frombuffer(apply(layout.plan_local(ids), objects, ids.size * rb), np.uint8)
    positions = np.array([1, 4, 7, 9], dtype=np.int64)
    part = np.frombuffer(
        apply(layout.plan_positions(ids, positions), objects, ids.size * rb), np.uint8
    )
    rec = len(heads) * rb
    for p in range(ids.size // len(heads)):
        got = part[p * rec : (p + 1) * rec]
        if p in positions:
            assert got.tobytes() == full[p * rec : (p + 1) * rec].tobytes()
        else:
            assert not got.any()  # positions not asked for are not written


def test_plan_global_takes_any_shape() -> None:
    layout = layer_layout(1, [7, 5], 8, None)
    g = np.arange(12, dtype=np.int64)
    flat = layout.plan_global(g)
    shaped = layout.plan_global(g.reshape(3, 4))
    assert (flat.keys, flat.dst, flat.src) == (shaped.keys, shaped.dst, shaped.src)
    assert flat.keys == ["engram:l1:h0", "engram:l1:h1"]
    assert flat.src == [[r * 8 for r in range(7)], [r * 8 for r in range(5)]]


def test_publication_names_and_manifests() -> None:
    assert manifest_key("db") == "engramdb:db:manifest"
    assert check_name("my-db_1") == "my-db_1"
    for bad in ("", "a:b", "a/b", "a b", 3):
        with pytest.raises(InvalidArgument):
            check_name(bad)  # type: ignore[arg-type]
    doc = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "tables": {}}
    assert parse_manifest(json.dumps(doc).encode(), "db") == doc
    with pytest.raises(CorruptManifest, match="not JSON"):
        parse_manifest(b"{", "db")
    with pytest.raises(CorruptManifest, match="not an EngramDB publication"):
        parse_manifest(b"[]", "db")
    with pytest.raises(CorruptManifest, match="format_version 99"):
        parse_manifest(json.dumps({**doc, "format_version": 99}).encode(), "db")


def test_shard_reads_bring_any_row_range_across_shards(db_factory) -> None:  # type: ignore[no-untyped-def]
    """The reads `publish` issues for an object: exact bytes for ranges that start, end
    and cross anywhere in a table of several shards (checked with plain preads)."""
    spec = TableSpec(264, (700, 300, 48), rows_per_badge=512, shard_bytes=1)
    path, rows = db_factory({"t": spec})
    with engramdb.open(path) as db:
        info = db.manifest.tables["t"]
    assert len(info.shards) == 3
    fds = [os.open(path / s.path, os.O_RDONLY) for s in info.shards]
    try:
        for first, n in [(0, 1048), (0, 512), (511, 2), (512, 1), (100, 900), (1047, 1), (3, 0)]:
            shard, offset, length, dest = shard_reads(info, first, n)
            assert int(length.sum()) == n * 264 and len(shard) == len(set(shard.tolist()))
            buf = bytearray(n * 264)
            for s, o, ln, d in zip(shard.tolist(), offset.tolist(), length.tolist(), dest.tolist()):
                buf[d : d + ln] = os.pread(fds[s], ln, o)
            assert bytes(buf) == rows["t"][first : first + n].tobytes()
    finally:
        for fd in fds:
            os.close(fd)
