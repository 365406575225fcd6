"""An attached table published to a real Mooncake store (master + storage host in a private
network namespace, as in ``test_mooncake.py``) and read back: rows equal the source
tensors, V4.1 weight+scale as 264 B Mooncake rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_attach import V41_S, V41_W, files, v41_checkpoint

import engramdb
from engramdb.integrations import mooncake as mc

try:
    import mooncake.store  # noqa: F401
except ImportError:
    pytest.skip(
        f"the Mooncake store client is not installed (pip install 'engramdb[{mc.EXTRA}]')",
        allow_module_level=True,
    )

from mooncake_harness import Cluster, module_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from module_cluster()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[Any]:
    c = cluster.connect()
    yield c
    c.close()


def test_publish_attached_v41_then_read_from_mooncake(
    client: Any, tmp_path: Path, rng: np.random.Generator
) -> None:
    rows = v41_checkpoint(tmp_path / "ckpt", rng, rows=1500)
    db = tmp_path / "db"
    heads = [700, 800]
    for layer in (1, 14):
        engramdb.attach(
            db,
            f"engram_l{layer}",
            files(tmp_path / "ckpt"),
            tensor=V41_W.format(layer),
            scale_tensor=V41_S.format(layer),
            heads=heads if layer == 1 else None,
        )
    summary = mc.publish(db, client=client, name="att", object_bytes=64 * 264)
    try:
        assert summary is not None
        with mc.open_mooncake(client=client, name="att") as pub, engramdb.open(db) as local:
            assert pub.tables == ["engram_l1", "engram_l14"]
            for layer in (1, 14):
                t, want = pub[f"engram_l{layer}"], rows[layer]
                assert t.row_bytes == 264 and t.n_rows == want.shape[0]
                ids = rng.integers(0, want.shape[0], (6, 11))
                assert np.array_equal(t.fetch(ids), want[ids])  # the tensors' bytes
                out = np.empty(ids.shape + (264,), np.uint8)
                with pub.register(out):
                    t.fetch_into(ids, out)
                assert (
                    out.tobytes()
                    == np.concatenate([want[ids, :256], want[ids, 256:]], -1).tobytes()
                )
            # [B, L, H] local ids through the published layer == the attached table locally
            t = pub["engram_l1"]
            assert t.heads.tolist() == heads
            local_ids = np.stack([rng.integers(0, h, (3, 4)) for h in heads], axis=-1).astype(
                np.int64
            )
            got = np.full(local_ids.shape + (264,), 0xAB, np.uint8)
            ref = np.full_like(got, 0xCD)
            with pub.register(got):
                t.lookup_into(local_ids, got)
            local["engram_l1"].lookup_into(local_ids, ref)
            assert np.array_equal(got, ref)
            glob = local_ids + np.array([0, heads[0]])
            assert np.array_equal(got, rows[1][glob])
    finally:
        assert mc.unpublish("att", client=client) > 0
