"""DiskEmbedding equals nn.Embedding with the same weights (fp32, bf16, fp8, fp8+scale)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peft_tables import peft_modules as _peft_modules  # noqa: E402
from peft_tables import peft_tables as _peft_tables  # noqa: E402

import engramdb  # noqa: E402
from engramdb.errors import RowIdOutOfRange  # noqa: E402
from engramdb.testing.pages import drop_mapped_pages, evict  # noqa: E402
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
    # resident: decoded rows come through the mapped gather (`_take_resident`), not torch's
    store.populate()
    for _ in range(200):  # the read rule settles in its mapped state (a while on a busy machine)
        out = multi(local)
        if multi.served_mapped:
            break
        time.sleep(0.05)
    assert multi._table_t is None and multi.served_mapped >= 1
    assert torch.equal(out, emb(local + multi.offsets).detach())


# --- the pre-fetched-rows hook -------------------------------------------------------------
def test_hook_serves_the_decoders_fill_without_a_copy(tmp_path: Path) -> None:
    from engramdb.decode import Decoder
    from engramdb.torch import prefetched_multi_head_embedding

    h, mods = _peft_tables(tmp_path)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 100, (3, 20))
    with engramdb.open(tmp_path) as db:
        dec = Decoder({1: db["l1"], 3: db["l3"]}, h, batch=3, compressed=True)
        hooks = {lay: prefetched_multi_head_embedding(dec, lay) for lay in (1, 3)}
        out = np.empty(dec.prefill_shape(12), np.uint8)
        dec.prefill(toks[:, :12])
        dec.fill(out)
        step = np.empty(dec.out_shape, np.uint8)
        for lay, hook in hooks.items():
            local = torch.from_numpy(h.local_ids(toks[:, :12], layer=lay))
            got = hook(local)
            want = mods[lay].multi_head_embedding(local)
            assert torch.equal(got, want)
            lo, hi = out.ctypes.data, out.ctypes.data + out.nbytes
            assert lo <= got.data_ptr() < hi, "a view of the prefill buffer"
            assert got.flatten(start_dim=-2).data_ptr() == got.data_ptr()
        for t in range(12, 20):
            dec.push(toks[:, t])
            dec.fill(step)
            for lay, hook in hooks.items():
                local = torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=lay)[:, -1:])
                got = hook(local)
                assert step.ctypes.data <= got.data_ptr() < step.ctypes.data + step.nbytes
                assert torch.equal(got, mods[lay].multi_head_embedding(local))
        assert all(hk.served_prefetched == 9 and hk.served_read == 0 for hk in hooks.values())


def test_hook_serves_a_decoder_process_fill(tmp_path: Path) -> None:
    """The hook over a `DecoderProcess` (keygen and reads in its companion): engram-peft's
    own multi-head embedding's values, as a view of the layer's fill buffer, the model's
    ids taken from the companion's buffer without a wait before the fill."""
    from engramdb.decode_process import DecoderProcess
    from engramdb.torch import prefetched_multi_head_embedding

    h, mods = _peft_tables(tmp_path)
    toks = np.random.default_rng(1).integers(0, 100, (3, 12))
    names = {1: "l1", 3: "l3"}
    with DecoderProcess(tmp_path, names, h, batch=3, compressed=True) as dec:
        hooks = {lay: prefetched_multi_head_embedding(dec, lay) for lay in (1, 3)}
        dec.prefill(toks[:, :4])
        bufs: dict[int, np.ndarray] = {}
        for t in range(4, 12):
            dec.push(toks[:, t])
            for lay, hook in hooks.items():
                buf = bufs.setdefault(lay, np.empty(dec.layer_shape, np.uint8))
                ids = torch.from_numpy(dec.local_ids(lay, wait=False)).view(3, 1, -1)
                dec.fill(buf, layer=lay)
                got = hook(ids)
                assert buf.ctypes.data <= got.data_ptr() < buf.ctypes.data + buf.nbytes
                local = torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=lay)[:, -1:])
                assert torch.equal(got, mods[lay].multi_head_embedding(local))
        assert all(hk.served_prefetched == 8 and hk.served_read == 0 for hk in hooks.values())


def test_hook_serves_a_buffer_per_layer_contiguous(tmp_path: Path) -> None:
    """Fills into one buffer per layer (`Decoder.layer_shape`): the hook hands the model
    that layer's rows as a contiguous view of its buffer, fed the decoder's own local ids
    (`Decoder.local_ids`, written by the keygen's compiled step): values equal engram-peft's
    in-memory module at the prefill and every step."""
    from engramdb.decode import Decoder
    from engramdb.torch import prefetched_multi_head_embedding

    h, mods = _peft_tables(tmp_path)
    toks = np.random.default_rng(4).integers(0, 100, (3, 20))
    with engramdb.open(tmp_path) as db:
        dec = Decoder({1: db["l1"], 3: db["l3"]}, h, batch=3, compressed=True)
        hooks = {lay: prefetched_multi_head_embedding(dec, lay) for lay in (1, 3)}
        dec.prefill(toks[:, :8])
        for lay, hook in hooks.items():
            pre = np.empty(dec.layer_shape, np.uint8)  # [3, 8, H, rb]
            dec.fill(pre, layer=lay)
            local = torch.from_numpy(dec.local_ids(lay))
            got = hook(local)
            assert got.is_contiguous() and got.data_ptr() == pre.ctypes.data
            assert torch.equal(got, mods[lay].multi_head_embedding(local))
        bufs = {}
        for t in range(8, 20):
            dec.push(toks[:, t])
            for lay, hook in hooks.items():
                buf = bufs.setdefault(lay, np.empty(dec.layer_shape, np.uint8))  # [3, H, rb]
                dec.fill(buf, layer=lay)
                local = torch.from_numpy(dec.local_ids(lay)).view(3, 1, -1)
                want = h.local_ids(toks[:, : t + 1], layer=lay)[:, -1:]
                assert np.array_equal(local.numpy(), want)
                got = hook(local)
                assert got.is_contiguous() and got.data_ptr() == buf.ctypes.data
                assert torch.equal(got, mods[lay].multi_head_embedding(local))
        assert all(hk.served_prefetched == 13 and hk.served_read == 0 for hk in hooks.values())


def test_hook_falls_back_to_a_read_when_the_ids_differ(tmp_path: Path) -> None:
    from engramdb.decode import Decoder
    from engramdb.torch import DiskMultiHeadEmbedding

    h, mods = _peft_tables(tmp_path, layers=(1,))
    with engramdb.open(tmp_path) as db:
        dec = Decoder(db["l1"], h, compressed=True)
        hook = DiskMultiHeadEmbedding(db["l1"], decoder=dec)
        buf = np.empty(dec.out_shape, np.uint8)
        dec.step(5, buf)
        held = torch.from_numpy(h.local_ids([[5]], layer=1))
        other = held.clone()
        other[0, 0, 1] = (other[0, 0, 1] + 1) % int(h.primes(1)[1])  # one head differs
        got = hook(other)
        assert torch.equal(got, mods[1].multi_head_embedding(other))
        assert not (buf.ctypes.data <= got.data_ptr() < buf.ctypes.data + buf.nbytes)
        assert hook.served_read == 1 and hook.served_prefetched == 0
        two = torch.cat([held, held], dim=1)  # more positions than the fill holds
        assert torch.equal(hook(two), mods[1].multi_head_embedding(two))
        assert hook.served_read == 2
        assert torch.equal(hook(held), mods[1].multi_head_embedding(held))
        assert hook.served_prefetched == 1
        bad = held.clone()
        bad[0, 0, 0] = int(h.primes(1)[0])  # out of its head's range: typed error
        with pytest.raises(RowIdOutOfRange):
            hook(bad)
        with pytest.raises(RowIdOutOfRange):
            DiskMultiHeadEmbedding(db["l1"])(-held)


def test_engram_layer_decodes_identically_through_the_hook(tmp_path: Path) -> None:
    """engram-peft's real EngramLayer: in-RAM table vs the hook fed by a Decoder."""
    from engramdb.decode import Decoder
    from engramdb.torch import prefetched_multi_head_embedding

    h, mods = _peft_tables(tmp_path)
    layer_mod, _ = _peft_modules()
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 100, (2, 24))
    with engramdb.open(tmp_path) as db:
        dec = Decoder({1: db["l1"], 3: db["l3"]}, h, batch=2, compressed=True)
        disk = {}
        for lay, ram in mods.items():
            twin = layer_mod.EngramLayer(ram.config, lay, h.primes(lay).tolist()).eval()
            twin.load_state_dict(ram.state_dict())
            twin.multi_head_embedding = prefetched_multi_head_embedding(dec, lay)
            disk[lay] = twin
        pre = np.empty(dec.prefill_shape(16), np.uint8)
        dec.prefill(toks[:, :16])
        dec.fill(pre)
        step = np.empty(dec.out_shape, np.uint8)
        hidden = torch.randn(2, 24, 16)
        with torch.no_grad():
            for t in range(16, 25):
                if t > 16:
                    dec.push(toks[:, t - 1])
                    dec.fill(step)
                lo, hi = (0, 16) if t == 16 else (t - 1, t)
                for lay in mods:
                    hashes = torch.from_numpy(h.local_ids(toks[:, :hi], layer=lay)[:, lo:hi])
                    want = mods[lay](hidden_states=hidden[:, lo:hi], engram_hash_indices=hashes)
                    got = disk[lay](hidden_states=hidden[:, lo:hi], engram_hash_indices=hashes)
                    assert torch.equal(got, want)
        assert all(d.multi_head_embedding.served_read == 0 for d in disk.values())


class _TwoLayerModel(torch.nn.Module):
    """Two real engram-peft EngramLayers in a container (what `serve_from_decoder` walks)."""

    def __init__(self, layers):  # type: ignore[no-untyped-def]
        super().__init__()
        self.engram = torch.nn.ModuleDict({str(k): v for k, v in layers.items()})


def test_serve_from_decoder_installs_the_hook_on_real_engram_layers(tmp_path: Path) -> None:
    import copy

    from engramdb.decode import Decoder
    from engramdb.errors import InvalidArgument
    from engramdb.integrations.peft import serve_from_decoder

    h, mods = _peft_tables(tmp_path)
    ram = _TwoLayerModel(mods)
    model = copy.deepcopy(ram)
    rng = np.random.default_rng(11)
    toks = rng.integers(0, 100, (2, 20))
    hidden = torch.randn(2, 20, 16)
    with engramdb.open(tmp_path) as db:
        dec = Decoder({1: db["l1"], 3: db["l3"]}, h, batch=2, compressed=True)
        with pytest.raises(InvalidArgument):
            serve_from_decoder(model, dec, layers=[7])
        originals = {k: m.multi_head_embedding for k, m in model.engram.items()}
        undo = serve_from_decoder(model, dec)
        hooks = {int(k): m.multi_head_embedding for k, m in model.engram.items()}
        assert all(isinstance(hk, DiskMultiHeadEmbedding) for hk in hooks.values())
        pre = np.empty(dec.prefill_shape(12), np.uint8)
        step = np.empty(dec.out_shape, np.uint8)
        dec.prefill(toks[:, :12])
        with torch.no_grad():
            for t in range(12, 21):
                buf = pre if t == 12 else step
                if t > 12:
                    dec.push(toks[:, t - 1])
                lo, hi = (0, 12) if t == 12 else (t - 1, t)
                for lay in (1, 3):
                    dec.fill(buf, layer=lay)  # each layer right before it runs
                    ids = torch.from_numpy(h.local_ids(toks[:, :hi], layer=lay)[:, lo:hi])
                    want = ram.engram[str(lay)](
                        hidden_states=hidden[:, lo:hi], engram_hash_indices=ids
                    )
                    got = model.engram[str(lay)](
                        hidden_states=hidden[:, lo:hi], engram_hash_indices=ids
                    )
                    assert torch.equal(got, want)
            assert all(hk.served_prefetched == 9 and hk.served_read == 0 for hk in hooks.values())
            # ids the decoder does not hold (another sequence): a verified miss, a synchronous
            # read, the same output
            other = torch.from_numpy(h.local_ids(toks[::-1, :hi], layer=1)[:, lo:hi].copy())
            got = model.engram["1"](hidden_states=hidden[:, lo:hi], engram_hash_indices=other)
            want = ram.engram["1"](hidden_states=hidden[:, lo:hi], engram_hash_indices=other)
            assert torch.equal(got, want) and hooks[1].served_read == 1
        undo()
        assert all(model.engram[k].multi_head_embedding is v for k, v in originals.items())


def test_serve_from_decoder_refuses_a_table_of_other_heads(tmp_path: Path) -> None:
    from engramdb.decode import Decoder
    from engramdb.errors import ShapeMismatch
    from engramdb.integrations.peft import serve_from_decoder

    h, mods = _peft_tables(tmp_path)
    swapped = _TwoLayerModel({1: mods[3]})  # layer 3's module (other primes) named layer 1
    swapped.engram["1"].layer_id = 1
    with engramdb.open(tmp_path) as db:
        dec = Decoder({1: db["l1"], 3: db["l3"]}, h, batch=1, compressed=True)
        with pytest.raises(ShapeMismatch):
            serve_from_decoder(swapped, dec)


def test_module_prefetch_then_forward_equals_the_table(tmp_path: Path) -> None:
    h, mods = _peft_tables(tmp_path, layers=(1,))
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 100, (3, 10))
    # no background warm: the first prefetch would make the table resident and mapped, and
    # prefetches of a mapped table start nothing (below)
    with engramdb.open(tmp_path, background_warm=False) as db:
        m = DiskMultiHeadEmbedding(db["l1"])
        m.resident_recheck_s = 3600.0  # looked at once (cold), then always prefetched
        for t in range(1, 10):
            ids = torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=1)[:, -1:].copy())
            assert m.prefetch(ids)
            if t % 2:
                m._hot.ticket.wait()  # read in the background: the forward gathers it
            assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        # every forward from its prefetch: straight from the step reader's staging buffer,
        # or (waited for) from the rows the ticket collected
        assert m.prefetches == 9 and m.served_from_prefetch == 9
        # a prefetch of other ids is dropped, the forward still reads the right rows
        ids = torch.from_numpy(h.local_ids(toks, layer=1)[:, -1:].copy())
        m.prefetch(ids + 1)
        assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        # the very tensor a prefetch was given, changed in place before the forward: the
        # forward reads the new ids (the tensor's version moved), not the prefetched rows
        assert m.prefetch(ids)
        ids[0, 0, 0] = (ids[0, 0, 0] + 1) % int(h.primes(1)[0])
        assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        served = m.served_from_prefetch
        assert m.prefetch(ids)  # unchanged: straight from the prefetch
        assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        assert m.served_from_prefetch == served + 1
        bad = ids.clone()
        bad[0, 0, 0] = -1
        assert not m.prefetch(bad)  # out of range: nothing started, the forward raises
        with pytest.raises(RowIdOutOfRange):
            m(bad)
        # a refused prefetch of ids of another shape leaves the pending one whole: its
        # forward still comes from it, in its own shape
        served = m.served_from_prefetch
        assert m.prefetch(ids)
        assert m.prefetch(ids[:, :, :2].contiguous()) is False  # not [..., H]: refused
        assert not m.prefetch(torch.cat([bad, bad], dim=1))  # [B, 2, H], out of range
        got = m(ids)
        assert got.shape == (*ids.shape, m.codec.dim) and m.served_from_prefetch == served + 1
        assert torch.equal(got, mods[1].multi_head_embedding(ids))


def test_module_prefetch_of_a_repeated_shape_takes_the_short_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module's prefetches of one step shape after its first: the step reader's short
    submission (`submit_fast`), for ids of any integer dtype, rows equal to the table's."""
    from engramdb.read.steps import StepReader

    h, mods = _peft_tables(tmp_path, layers=(1,))
    fast: list[bool] = []
    submit_fast = StepReader.submit_fast

    def spy(self: StepReader, *args: object) -> bool:
        fast.append(submit_fast(self, *args))  # type: ignore[arg-type]
        return fast[-1]

    monkeypatch.setattr(StepReader, "submit_fast", spy)
    toks = np.random.default_rng(5).integers(0, 100, (4, 12))
    with engramdb.open(tmp_path, background_warm=False) as db:
        m = DiskMultiHeadEmbedding(db["l1"])
        if not m._reader_ok:
            pytest.skip("no step reader here")
        m.resident_recheck_s = 3600.0  # looked at once (cold), then always prefetched
        for t in range(1, 12):
            ids = torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=1)[:, -1:].copy())
            if t == 6:
                ids = ids.to(torch.int32)  # the ids' numpy check; the same short submission
            assert m.prefetch(ids)
            assert torch.equal(m(ids), mods[1].multi_head_embedding(ids.long()))
        # every step but the first (its reader had read no step yet: the long way)
        assert fast == [False] + [True] * 10
        assert m.prefetches == 11 and m.served_from_prefetch == 11


def test_module_prefetch_ids_compiled_and_numpy_agree(tmp_path: Path) -> None:
    """A prefetch's validated global ids: the compiled call (contiguous CPU int64 tensors)
    and the numpy path give the same rows, accept each head's last row and refuse one past
    it or a negative id; int32 and strided tensors take the numpy path."""
    h, mods = _peft_tables(tmp_path, layers=(1,))
    with engramdb.open(tmp_path, background_warm=False) as db:
        m = DiskMultiHeadEmbedding(db["l1"])
        if m._global_at is None:
            pytest.skip("compiled gather not built")
        heads = torch.tensor([int(p) for p in h.primes(1)], dtype=torch.int64)
        offsets = torch.from_numpy(db["l1"].head_offsets.copy())
        rng = np.random.default_rng(4)
        base = torch.from_numpy(rng.integers(0, int(heads.min()), (3, 2, len(heads))))
        cases = [base, base[:, :1].contiguous(), heads.expand(2, 1, -1) - 1]
        for ids in cases:
            got, _ = m._global(ids)
            assert got is not None and got.dtype == np.int64
            assert np.array_equal(got, (ids + offsets).reshape(-1).numpy())
            compiled, m._global_at = m._global_at, None
            try:
                assert np.array_equal(m._global(ids)[0], got)  # the numpy path
            finally:
                m._global_at = compiled
            m.prefetch(ids)
            assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        for bad_at, value in ((0, int(heads[0])), (len(heads) - 1, -1)):
            bad = base.clone()
            bad[1, 1, bad_at] = value
            assert m._global(bad)[0] is None
            assert not m.prefetch(bad)
            with pytest.raises(RowIdOutOfRange):
                m(bad)
        for other in (base.to(torch.int32), base.transpose(0, 1)):
            assert np.array_equal(m._global(other)[0], (other.long() + offsets).reshape(-1).numpy())


def test_module_prefetch_of_a_mapped_table_starts_nothing(tmp_path: Path) -> None:
    """Once the read rule serves the table from its mapping, `prefetch` returns False and
    counts a skip (the forward's gather is cheaper than a background read); out of the
    mapped state it looks at the rows (mincore): resident, still a skip; evicted, the
    prefetch starts again."""
    h, mods = _peft_tables(tmp_path, layers=(1,))
    toks = np.random.default_rng(5).integers(0, 100, (2, 12))
    with engramdb.open(tmp_path, background_warm=False) as db:
        st = db["l1"]
        st.populate()
        m = DiskMultiHeadEmbedding(st)
        ids = torch.from_numpy(h.local_ids(toks, layer=1)[:, -1:].copy())
        for _ in range(20):  # the read rule settles in its mapped state
            m(ids)
            if st.mapped_state():
                break
        else:
            pytest.skip("the read rule did not reach its mapped state (a busy machine)")
        assert not m.prefetch(ids) and m.prefetch_skips == 1 and m.prefetches == 0
        assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        # while the table's background warm reads it, the rows come from the device anyway
        st.warming = lambda: True  # type: ignore[method-assign]
        w = DiskMultiHeadEmbedding(st)
        assert w.prefetch(ids) and w.prefetches == 1 and w.prefetch_skips == 0
        assert torch.equal(w(ids), mods[1].multi_head_embedding(ids))
        del st.warming
        m.resident_recheck_s = 0.0  # look at every call
        st.backend.feedback(st.backend.mapped, 16, 1.0)  # what a faulting gather reports
        assert not m.prefetch(ids) and m.prefetch_skips == 2  # the rows are resident
        assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        drop_mapped_pages(st.array())
        for p in tmp_path.rglob("*.edb"):
            evict(p)
        st.backend.feedback(st.backend.mapped, 16, 1.0)
        if st.rows_resident(np.arange(0, st.n_rows, 97)):
            pytest.skip("this filesystem does not drop cached pages on request")
        assert m.prefetch(ids) and m.prefetches == 1
        assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))


def test_resident_fast_path_validates_and_equals_the_table(tmp_path: Path) -> None:
    h, mods = _peft_tables(tmp_path, layers=(1,))
    with engramdb.open(tmp_path) as db:
        st = db["l1"]
        st.populate()
        m = DiskMultiHeadEmbedding(st)
        rng = np.random.default_rng(4)
        toks = rng.integers(0, 100, (4, 30))
        ids = torch.from_numpy(h.local_ids(toks, layer=1))
        for _ in range(3):  # the read rule settles in its mapped state
            assert torch.equal(m(ids), mods[1].multi_head_embedding(ids))
        assert m.served_mapped >= 1
        primes = h.primes(1)
        edge = ids.clone()
        edge[..., :] = torch.from_numpy(primes - 1)  # every head's last row
        assert torch.equal(m(edge), mods[1].multi_head_embedding(edge))
        over = edge.clone()
        over[0, 0, 1] = int(primes[1])  # one past head 1's rows: refused, not head 2's row 0
        with pytest.raises(RowIdOutOfRange):
            m(over)
        # one decode step's ids (checked without a numpy reduction): the same answers
        step_edge = edge[:1, :1].clone()
        assert torch.equal(m(step_edge), mods[1].multi_head_embedding(step_edge))
        with pytest.raises(RowIdOutOfRange):
            m(over[:1, :1].clone())
        with pytest.raises(RowIdOutOfRange):
            m(-step_edge - 1)


@pytest.mark.parametrize("hint,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16)])
def test_resident_forward_gathers_with_torch_and_checks_the_source(  # type: ignore[no-untyped-def]
    tmp_path: Path, hint, dtype
) -> None:
    """A table whose rows are their values (f32, bf16: no decoding) is served while resident
    by ``torch.embedding`` of the mapping: the rows equal the source, the output is a fresh
    tensor (writing to it leaves the table alone), strided ids work, a slow gather reaches
    the read rule, and an attached source truncated while open raises `TruncatedFile`."""
    from engramdb.errors import ShapeMismatch, TruncatedFile
    from engramdb.io.columns import native_enabled

    heads = [300, 211, 157]
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(sum(heads), 24, generator=g).to(dtype)
    src = tmp_path / "rows.bin"
    src.write_bytes(weight.view(torch.uint8).numpy().tobytes())
    engramdb.attach(
        tmp_path / "db",
        "t",
        [src],
        row_bytes=24 * weight.element_size(),
        heads=heads,
        dtype=hint,
        dim=24,
    )
    offsets = torch.tensor([0, heads[0], heads[0] + heads[1]])
    with engramdb.open(tmp_path / "db") as db:
        st = db["t"]
        st.populate()
        m = DiskMultiHeadEmbedding(st)
        assert m._table_t is not None  # the torch path is the one under test
        big = torch.stack([torch.randint(0, h, (4, 40), generator=g) for h in heads], dim=-1)
        for _ in range(3):  # the read rule settles in its mapped state
            out = m(big)
        assert m.served_mapped >= 1 and out.dtype == dtype and out.shape == (4, 40, 3, 24)
        assert torch.equal(out, weight[big + offsets])
        step = big[:, -1:]  # a strided view: one decode step's ids
        assert not step.is_contiguous()
        before = m.served_mapped
        got = m(step)
        assert m.served_mapped == before + 1 and torch.equal(got, weight[step + offsets])
        got.fill_(0)  # a fresh tensor: the mapped table is untouched
        assert torch.equal(m(step), weight[step + offsets])
        step = step.contiguous()  # the compiled bounds check of the ids in place
        assert m._check_at is not None or not native_enabled()
        before = m.served_mapped
        assert torch.equal(m(step), weight[step + offsets])
        assert m.served_mapped == before + 1
        edge = torch.tensor([[[h - 1 for h in heads]]])
        assert torch.equal(m(edge), weight[edge + offsets])
        for bad in ([0, heads[1], 0], [-1, 0, 0], [0, 0, 2**63 - 1]):
            # past head 1's rows: refused, not head 2's row 0; negative; huge
            with pytest.raises(RowIdOutOfRange):
                m(torch.tensor([[bad]]))
        with pytest.raises(ShapeMismatch):  # 6 ids a row, not the 3 heads' (6 = 2 x 3)
            m(torch.zeros((1, 1, 6), dtype=torch.int64))

        def settle() -> None:
            deadline = time.monotonic() + 10.0
            while not st.mapped_state() and time.monotonic() < deadline:
                # a gather above that really was slow (a loaded machine) moved the read rule
                # off its mapped state: its next residency check brings it back
                m(step)
                time.sleep(0.01)
            assert st.mapped_state()

        settle()  # the forced-slow gather below must take the mapped path
        seen = []
        real = st.note_mapped_gather
        st.note_mapped_gather = lambda rows, s: (seen.append(rows), real(rows, s))  # type: ignore[method-assign]
        m._slow_s = -1.0  # every gather counts as slow
        m(step)
        assert seen == [step.numel()]
        m._slow_s = 10e-6
        settle()
        os.truncate(src, 100)
        before = m.served_mapped
        with pytest.raises(TruncatedFile, match="truncated while open"):
            m(step)
        assert m.served_mapped == before + 1  # raised on the torch path, before its gather


def test_hook_steady_state_compares_the_ids_in_place(tmp_path: Path) -> None:
    """After its first step the hook answers a contiguous id tensor by comparing the ids with
    the decoder's filled rows in place (compiled) and returning the cached view of the fill
    buffer: each step's rows are the new fill's; one differing id, another shape, or an id
    out of range never gets the view."""
    from engramdb.decode import Decoder
    from engramdb.io.columns import native_enabled
    from engramdb.torch import prefetched_multi_head_embedding

    h, mods = _peft_tables(tmp_path, layers=(1, 3))
    toks = np.random.default_rng(8).integers(0, 100, (2, 16))
    with engramdb.open(tmp_path) as db:
        dec = Decoder({1: db["l1"], 3: db["l3"]}, h, batch=2, compressed=True)
        hooks = {lay: prefetched_multi_head_embedding(dec, lay) for lay in (1, 3)}
        assert all((hk._match_at is not None) == native_enabled() for hk in hooks.values())
        step = np.empty(dec.out_shape, np.uint8)
        views = {}
        for t in range(16):
            dec.push(toks[:, t])
            dec.fill(step)
            for lay, hook in hooks.items():
                local = torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=lay)[:, -1:].copy())
                assert local.is_contiguous()
                got = hook(local)
                assert torch.equal(got, mods[lay].multi_head_embedding(local))
                assert step.ctypes.data <= got.data_ptr() < step.ctypes.data + step.nbytes
                views.setdefault(lay, got)
                assert got is views[lay]  # the cached view, refilled in place
                other = local.clone()
                other[1, 0, 2] = (other[1, 0, 2] + 1) % int(h.primes(lay)[2])
                miss = hook(other)
                assert torch.equal(miss, mods[lay].multi_head_embedding(other))
                assert not (step.ctypes.data <= miss.data_ptr() < step.ctypes.data + step.nbytes)
                bad = local.clone()
                bad[0, 0, 0] = -1
                with pytest.raises(RowIdOutOfRange):
                    hook(bad)
                first = local[:1].clone()  # another shape: not the cached view
                assert torch.equal(hook(first), mods[lay].multi_head_embedding(first))
        assert all(hk.served_prefetched == 16 for hk in hooks.values())
        assert all(hk.served_read == 48 for hk in hooks.values())
