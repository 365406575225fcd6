"""DiskEmbedding equals nn.Embedding with the same weights (fp32, bf16, fp8, fp8+scale)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import engramdb  # noqa: E402
from engramdb.errors import RowIdOutOfRange  # noqa: E402
from engramdb.torch import DiskEmbedding, DiskMultiHeadEmbedding  # noqa: E402


def _table(tmp_path: Path, weight_bytes: np.ndarray, hint: str, heads=None, dim=None):  # type: ignore[no-untyped-def]
    engramdb.build(
        tmp_path, "t", weight_bytes.shape[1], [weight_bytes], dtype=hint, heads=heads, dim=dim
    )
    return engramdb.open(tmp_path)["t"]


@pytest.mark.parametrize(
    "dtype,hint", [(torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")]
)
def test_disk_embedding_equals_nn_embedding(tmp_path: Path, dtype, hint) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 48, generator=g).to(dtype)
    emb = torch.nn.Embedding(1000, 48, _weight=weight.clone(), dtype=dtype)
    store = _table(tmp_path, weight.view(torch.uint8).numpy(), hint)
    disk = DiskEmbedding(store)
    assert disk.embedding_dim == 48 and disk.num_embeddings == 1000
    for shape in [(7,), (3, 5), (2, 4, 6), (0,)]:
        ids = torch.randint(0, 1000, shape, generator=g)
        got = disk(ids)
        want = emb(ids).detach()
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert not got.requires_grad
    # outputs do not alias one another
    a = disk(torch.tensor([1, 2]))
    disk(torch.tensor([3, 4]))
    assert torch.equal(a, weight[[1, 2]])
    with pytest.raises(IndexError):
        disk(torch.tensor([1000]))
    with pytest.raises(RowIdOutOfRange):
        disk(torch.tensor([-1]))
    with pytest.raises(TypeError):
        disk(torch.tensor([1.0]))


def test_fp8_and_scalar_scale(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(300, 160, generator=g) * 4).to(torch.float8_e4m3fn)
    store = _table(tmp_path, weight.view(torch.uint8).numpy(), "fp8_e4m3")
    ids = torch.randint(0, 300, (4, 9), generator=g)
    got = DiskEmbedding(store)(ids)
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), weight[ids].view(torch.uint8))
    scaled = DiskEmbedding(store, scale=0.5, out_dtype=torch.bfloat16)(ids)
    assert torch.equal(scaled, (weight.to(torch.bfloat16) * 0.5)[ids])


def test_fp8_with_ue8m0_block_scales(tmp_path: Path) -> None:
    """A DeepSeek-style 264 B row: 256 FP8 values then 8 E8M0 scales (one per 32 values)."""
    g = torch.Generator().manual_seed(2)
    n = 200
    w = (torch.randn(n, 256, generator=g) * 3).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 135, (n, 8), generator=g, dtype=torch.uint8)
    rows = torch.cat([w.view(torch.uint8), exps], dim=1)
    dequant = (
        w.to(torch.float32).view(n, 8, 32)
        * torch.pow(2.0, exps.to(torch.float32) - 127).unsqueeze(-1)
    ).view(n, 256)
    emb = torch.nn.Embedding(n, 256, _weight=dequant.clone())
    store = _table(tmp_path, rows.numpy(), "fp8_e4m3+ue8m0", heads=[120, 80])
    disk = DiskEmbedding(store)
    assert disk.embedding_dim == 256
    ids = torch.randint(0, n, (3, 17), generator=g)
    assert torch.equal(disk(ids), emb(ids).detach())
    multi = DiskMultiHeadEmbedding(store)
    local = torch.stack(
        [torch.randint(0, 120, (2, 5), generator=g), torch.randint(0, 80, (2, 5), generator=g)],
        dim=-1,
    )
    out = multi(local)
    assert out.shape == (2, 5, 2, 256)
    assert torch.equal(out, emb(local + multi.offsets).detach())
    assert multi.offsets.tolist() == [0, 120]
    with pytest.raises(IndexError, match="head 1"):
        multi(torch.tensor([[[0, 80]]]))
