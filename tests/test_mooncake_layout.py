"""Object layout and range plans for Mooncake-backed tables: pure, no store needed."""

from __future__ import annotations

import numpy as np
import pytest

from engramdb.errors import InvalidArgument
from engramdb.integrations.mooncake import ObjectLayout, RangePlan, layer_layout


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
