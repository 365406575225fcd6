"""engram-peft 1.2.7 on tables served by this package, against the real engram-peft classes.

* ``EngramConfig(table_source="engramdb:store")`` builds a model through engram-peft's own
  EngramDB path; its forward equals the in-memory model's bit for bit.
* The disk-backed ``MultiHeadEmbedding`` is a substitute for what engram-peft reads: an
  ``nn.Embedding`` at ``.embedding`` over the table's file (no RAM copy), sparse gradients,
  the SparseAdam optimizer group, state dicts that carry the table's reference (its bytes
  only when asked or written), strict loads, dtype passes that do not copy the table, and
  FP8 tables dequantised by ``install_real_qwen_ple_embedding``.

engram-peft never uninstalls what it installs; every test here restores
``engram_peft.layer.MultiHeadEmbedding`` afterwards.
"""

from __future__ import annotations

import sys
import typing
import warnings
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import engramdb  # noqa: E402
from engramdb.errors import InvalidArgument, ShapeMismatch  # noqa: E402
from engramdb.integrations import (  # noqa: E402
    install_disk_multi_head_embedding,
    install_real_qwen_ple_embedding,
)

PRIMES = [211, 223, 307, 311]  # engram-peft's primes for vocab [400, 600], 2 heads, layer 1
DIM = 8


@pytest.fixture
def ep(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real engram-peft (1.2.7 imports ``typing.override``: supplied on 3.11)."""
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = pytest.importorskip("engram_peft.layer")
        import engram_peft.config as config
        import engram_peft.model as model
        import engram_peft.utils as utils
    monkeypatch.setattr(layer, "MultiHeadEmbedding", layer.MultiHeadEmbedding)
    return type("EP", (), {"layer": layer, "config": config, "model": model, "utils": utils})


def write_raw(path: Path, table: np.ndarray, rows_per_shard: int) -> int:
    path.mkdir(parents=True, exist_ok=True)
    n = -(-table.shape[0] // rows_per_shard)
    for i in range(n):
        table[i * rows_per_shard : (i + 1) * rows_per_shard].tofile(path / f"shard_{i:03d}.bin")
    return n


def f32_table(tmp_path: Path, rows_per_shard: int = 1_052) -> tuple[torch.Tensor, Any]:
    g = torch.Generator().manual_seed(5)
    table = torch.randn(sum(PRIMES), DIM, generator=g)
    n = write_raw(tmp_path, table.numpy().view(np.uint8), rows_per_shard)
    return table, engramdb.Store(tmp_path, n, rows_per_shard, DIM * 4)


def mapped_file_of(t: torch.Tensor) -> str | None:
    """The file mapped at ``t``'s first byte, from /proc/self/maps (None: anonymous)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


# -- engram-peft's own EngramDB path ----------------------------------------------------------
class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        return (self.linear(x),)


class TinyLM(nn.Module):
    """A deterministic decoder stand-in with the attributes engram-peft discovers."""

    def __init__(self, hidden: int = 32, vocab: int = 100):
        super().__init__()
        self.config = MagicMock()
        self.config.model_type = "tiny"
        self.config.hidden_size = hidden
        self.config.vocab_size = vocab
        self.config.pad_token_id = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Block(hidden) for _ in range(3)])

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        assert input_ids is not None
        x = self.embed(input_ids)
        for block in self.model.layers:
            x = block(x)[0]
        return x


CFG = dict(
    ngram_sizes=[2, 3],
    n_head_per_ngram=2,
    embedding_dim=32,
    hidden_dim=32,
    hc_mult=1,
    target_layers=[1],
    engram_vocab_size_per_ngram=[100, 120],
    enable_tokenizer_compression=False,
    hidden_size=32,
    gating_zero_init=False,
    conv_zero_init=False,
)


@pytest.mark.parametrize(
    ("rows_per_shard", "mode"),
    [(128, "embedding"), (256, "embedding"), (50, "lookup")],  # page-multiple shards, one, raw
)
def test_table_source_engramdb_store_forward_bit_identical(
    tmp_path: Path, ep: Any, rows_per_shard: int, mode: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        ref = ep.model.get_engram_model(TinyLM(), ep.config.EngramConfig(**CFG))
        table = ref.engram_layers["1"].multi_head_embedding.embedding.weight.detach()
        n = write_raw(tmp_path, table.numpy().view(np.uint8), rows_per_shard)
        cfg = ep.config.EngramConfig(
            **CFG,
            table_source="engramdb:store",
            table_store_path=str(tmp_path),
            table_shards=n,
            table_rows_per_shard=rows_per_shard,
            table_width=table.shape[1] * 4,
        )
        torch.manual_seed(0)
        disk = ep.model.get_engram_model(TinyLM(), cfg)
    emb = disk.engram_layers["1"].multi_head_embedding
    assert type(emb).__name__ == "DiskBackedMultiHeadEmbedding" and emb.mode == mode
    assert torch.equal(emb.offsets, ref.engram_layers["1"].multi_head_embedding.offsets)
    # The substitute does not draw the table's init from the RNG: align the other weights.
    state = {k: v for k, v in ref.state_dict().items() if "multi_head_embedding" not in k}
    missing, unexpected = disk.load_state_dict(state, strict=False)
    assert not unexpected and all("multi_head_embedding" in k for k in missing)
    ids = torch.randint(0, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    ref.eval()
    disk.eval()
    with torch.no_grad():
        want = ref(input_ids=ids)
        got = disk(input_ids=ids)
    assert torch.equal(got, want)
    if mode == "embedding":
        assert mapped_file_of(emb.embedding.weight) == str(tmp_path / "shard_000.bin")
    else:
        with pytest.raises(NotImplementedError, match="sparse gradients"):
            _ = emb.embedding


# -- the substitute, module by module ----------------------------------------------------------
def test_embedding_is_a_copy_on_write_view_with_sparse_gradients(tmp_path: Path, ep: Any) -> None:
    table, store = f32_table(tmp_path)
    install_disk_multi_head_embedding(store)
    m = ep.layer.MultiHeadEmbedding(primes=PRIMES, embedding_dim_per_head=DIM, sparse=True)
    assert isinstance(m.embedding, nn.Embedding) and m.embedding.sparse is True
    w = m.embedding.weight
    assert isinstance(w, nn.Parameter) and w.requires_grad and w.shape == (1_052, DIM)
    assert mapped_file_of(w) == str(tmp_path / "shard_000.bin")  # the file, not a RAM copy
    local = torch.tensor([[[0, 1, 2, 3], [210, 222, 306, 310]]])
    out = m(local)
    assert torch.equal(out, table[local + m.offsets])
    out.sum().backward()
    assert w.grad is not None and w.grad.is_sparse
    hit = sorted(set(w.grad.coalesce().indices()[0].tolist()))
    assert hit == sorted(set((local + m.offsets).reshape(-1).tolist()))
    # a write goes to private pages: the module sees it, the file does not change
    with torch.no_grad():
        w.add_(1.0)
    assert m.embedding.written
    assert torch.equal(m(local), table[local + m.offsets] + 1.0)
    on_disk = np.fromfile(tmp_path / "shard_000.bin", dtype=np.float32).reshape(-1, DIM)
    assert np.array_equal(on_disk, table.numpy())


@pytest.mark.parametrize(("rows_per_shard", "mode"), [(1_100, "embedding"), (500, "lookup")])
def test_unaligned_raw_shards_are_an_attached_store_in_both_modes(
    tmp_path: Path, ep: Any, rows_per_shard: int, mode: str
) -> None:
    # 1,100 x 32 B and 500 x 32 B shards are not page multiples: the Store is attached; the
    # embedding mode maps the first shard when it holds rows [0, sum(primes)).
    table = torch.randn(sum(PRIMES) + 300, DIM, generator=torch.Generator().manual_seed(8))
    n = write_raw(tmp_path, table.numpy().view(np.uint8), rows_per_shard)
    store = engramdb.Store(tmp_path, n, rows_per_shard, DIM * 4)
    assert isinstance(store, engramdb.Store) and store.attached and n > 1
    install_disk_multi_head_embedding(store)
    m = ep.layer.MultiHeadEmbedding(primes=PRIMES, embedding_dim_per_head=DIM)
    assert m.mode == mode
    if mode == "embedding":
        assert mapped_file_of(m.embedding.weight) == str((tmp_path / "shard_000.bin").resolve())
    local = torch.tensor([[[0, 1, 2, 3], [210, 222, 306, 310]]])
    assert torch.equal(m(local), table[local + m.offsets])
    store.close()


def test_optimizer_grouping_puts_the_table_in_sparse_adam(tmp_path: Path, ep: Any) -> None:
    table, store = f32_table(tmp_path)
    install_disk_multi_head_embedding(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ep.config.EngramConfig(**{**CFG, "engram_vocab_size_per_ngram": [400, 600]})
        model = ep.model.get_engram_model(TinyLM(), cfg)
    groups = ep.utils.get_trainable_param_groups(model)
    assert len(groups["engram_sparse"]) == 1
    assert groups["engram_sparse"][0].shape == (1_052, DIM)
    opt = ep.utils.get_optimizer(model)
    assert isinstance(opt.optimizers[0], torch.optim.SparseAdam)
    assert len(opt.optimizers) == 2  # SparseAdam, Adam (backbone frozen)
    model.train()
    model(input_ids=torch.randint(0, 100, (2, 7))).sum().backward()
    opt.step()
    emb = model.engram_layers["1"].multi_head_embedding.embedding
    assert emb.written  # the step wrote private pages ...
    on_disk = np.fromfile(tmp_path / "shard_000.bin", dtype=np.float32).reshape(-1, DIM)
    assert np.array_equal(on_disk, table.numpy())  # ... never the table


def test_state_dict_saves_the_reference_unless_asked_or_written(tmp_path: Path, ep: Any) -> None:
    original = ep.layer.MultiHeadEmbedding
    table, store = f32_table(tmp_path)
    install_disk_multi_head_embedding(store)
    m = ep.layer.MultiHeadEmbedding(PRIMES, DIM)
    assert set(m.state_dict()) == {"offsets"}
    assert m.table_source == str(tmp_path)
    # strict loads accept a state dict without the table (it is the file) ...
    m.load_state_dict({"offsets": m.offsets.clone()}, strict=True)
    assert not m.embedding.written
    # ... and one with it (weight transfer, a checkpoint saved with the table's bytes)
    new = torch.full((1_052, DIM), 0.5)
    m.load_state_dict({"offsets": m.offsets.clone(), "embedding.weight": new}, strict=True)
    assert m.embedding.written and torch.equal(m.embedding.weight, new)
    assert set(m.state_dict()) == {"offsets", "embedding.weight"}  # written: bytes saved
    on_disk = np.fromfile(tmp_path / "shard_000.bin", dtype=np.float32).reshape(-1, DIM)
    assert np.array_equal(on_disk, table.numpy())
    install_disk_multi_head_embedding(store, save_table=True)
    asked = ep.layer.MultiHeadEmbedding(PRIMES, DIM)
    sd = asked.state_dict()
    assert torch.equal(sd["embedding.weight"], table)
    assert mapped_file_of(sd["embedding.weight"]) == str(tmp_path / "shard_000.bin")
    # engram-peft's in-memory module loads what the substitute saved
    memory = original(PRIMES, DIM)
    memory.load_state_dict(sd, strict=True)
    assert torch.equal(memory.embedding.weight, table)


def test_save_pretrained_round_trip_with_the_installer_active(tmp_path: Path, ep: Any) -> None:
    table, store = f32_table(tmp_path / "rows")
    install_disk_multi_head_embedding(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ep.config.EngramConfig(**{**CFG, "engram_vocab_size_per_ngram": [400, 600]})
        model = ep.model.get_engram_model(TinyLM(), cfg)
        model.save_pretrained(str(tmp_path / "clean"))
        again = ep.model.EngramModel.from_pretrained(TinyLM(), str(tmp_path / "clean"))
        emb = model.engram_layers["1"].multi_head_embedding.embedding
        with torch.no_grad():
            emb.weight.add_(1.0)
        model.save_pretrained(str(tmp_path / "written"))
        trained = ep.model.EngramModel.from_pretrained(TinyLM(), str(tmp_path / "written"))
    got = again.engram_layers["1"].multi_head_embedding.embedding.weight
    assert torch.equal(got, table)  # saved by reference: the table itself
    got = trained.engram_layers["1"].multi_head_embedding.embedding.weight
    assert torch.equal(got, table + 1.0)  # written: its bytes were saved and restored


def test_dtype_passes_do_not_copy_the_table(tmp_path: Path, ep: Any) -> None:
    table, store = f32_table(tmp_path)
    install_disk_multi_head_embedding(store)
    m = ep.layer.MultiHeadEmbedding(PRIMES, DIM)
    ptr = m.embedding.weight.data_ptr()
    local = torch.tensor([[[3, 4, 5, 6]]])
    m.float()
    m.to(torch.bfloat16)
    assert m.embedding.weight.data_ptr() == ptr and m.embedding.weight.dtype == torch.float32
    out = m(local)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, table[local + m.offsets].to(torch.bfloat16))
    m.to(torch.float32)
    assert m(local).dtype == torch.float32


def test_one_store_serves_every_layer_and_checks_geometry(tmp_path: Path, ep: Any) -> None:
    table, store = f32_table(tmp_path)
    install_disk_multi_head_embedding(store)
    small = ep.layer.MultiHeadEmbedding([211, 223], DIM)  # rows [0, 434) of the same store
    local = torch.tensor([[[210, 222]]])
    assert torch.equal(small(local), table[local + small.offsets])
    with pytest.raises(ShapeMismatch, match="1052 rows"):
        ep.layer.MultiHeadEmbedding([2_000, 2_003], DIM)
    with pytest.raises(ShapeMismatch):
        ep.layer.MultiHeadEmbedding(PRIMES, DIM * 2)


def _fp8_table(tmp_path: Path) -> tuple[np.ndarray, Any]:
    g = torch.Generator().manual_seed(9)
    vals = (torch.randn(sum(PRIMES), DIM, generator=g) * 8).to(torch.float8_e4m3fn)
    raw = vals.view(torch.uint8).numpy()
    write_raw(tmp_path, raw, 500)  # 3 raw shards, not page multiples
    return raw, engramdb.Store(tmp_path, 3, 500, DIM)


def test_real_qwen_ple_fp8_table_dequantised(tmp_path: Path, ep: Any) -> None:
    raw, store = _fp8_table(tmp_path / "rows")
    scale = 0.00019931793212890625
    install_real_qwen_ple_embedding(store, scale=scale)
    m = ep.layer.MultiHeadEmbedding(PRIMES, DIM)
    assert m.mode == "lookup"
    local = torch.tensor([[[0, 222, 306, 310], [5, 5, 5, 5]]])
    rows = torch.from_numpy(raw[(local + m.offsets).numpy()]).view(torch.float8_e4m3fn)
    want = rows.to(torch.float32) * scale
    got = m(local)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="optimizer grouping"):
        _ = m.embedding
    assert list(m.state_dict()) == ["offsets"]
    # the scale read from a checkpoint directory
    from safetensors.numpy import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    key = "model.embed_tokens_per_layer.weight_scale"
    save_file({key: np.array([scale * 2], np.float32)}, str(ckpt / "model.safetensors"))
    install_real_qwen_ple_embedding(store, model_dir=ckpt)
    m2 = ep.layer.MultiHeadEmbedding(PRIMES, DIM)
    assert torch.equal(m2(local), rows.to(torch.float32) * np.float32(scale * 2).item())
    with pytest.raises(InvalidArgument, match="scale= or model_dir="):
        install_real_qwen_ple_embedding(store)
    with pytest.raises(InvalidArgument, match="weight_scale"):
        install_real_qwen_ple_embedding(store, model_dir=tmp_path / "rows")
