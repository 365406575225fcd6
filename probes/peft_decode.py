"""Greedy decoding with engram-peft's real `EngramLayer`: table in RAM vs through EngramDB.

    python probes/peft_decode.py [--quick] [--table-mb 64] [--steps 64] [--reps 3]
                                 [--hidden 768] [--blocks 6] [--dir D] [--keep]

A toy decoder-only model (token embedding, ``--blocks`` residual MLP blocks of width
``--hidden``, an lm head) carries two engram-peft 1.2.7 `EngramLayer`s (after blocks 1 and
3, ``ngram_sizes=[2, 3]``, 8 heads per order, 80-dim heads: 320 B f32 rows). Arms, single
thread (``torch.set_num_threads(1)``), interleaved per repetition:

* **ram**: engram-peft's own in-RAM `MultiHeadEmbedding` (an ``nn.Embedding`` table); row ids
  from the engram-peft keygen kind (equal to engram-peft's hashing, tests/test_keygen_peft.py).
* **disk auto / on / off** (cold: the tables are evicted before every repetition, residency
  checked): the same weights in EngramDB tables, ``Decoder(prefetch=...)`` pushes each
  sampled token at once (keygen + prefetch), the blocks run,
  ``Decoder.fill(layer=)`` writes each layer's rows right before it runs, and the layers
  read them through the
  pre-fetched-rows hook (`engramdb.torch.prefetched_multi_head_embedding`, no copy).
* the same three disk arms warm (tables populated, in this process's mapping).

Correctness first: every disk arm's tokens must equal the in-RAM arm's (the probe exits 1
otherwise). Prints decode ms/step, the ratio in-RAM time / disk time (>= 0.98 is the bar for
cold auto), 32-token prefill cold vs in RAM, and the warm per-step lookup of
`DiskMultiHeadEmbedding` vs engram-peft's `MultiHeadEmbedding` (and ``np.take`` from a
populated mapping, the warm reference). ``--table-mb 2600`` is the 5 GB-class run (two
layers); the default keeps the tables small. Writes probes/out/peft_decode.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import typing
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_note, median, write_json  # noqa: E402
from workload_tables import make_cold, residency  # noqa: E402

import engramdb  # noqa: E402
from engramdb import keygen  # noqa: E402
from engramdb.decode import Decoder  # noqa: E402

if not hasattr(typing, "override"):  # engram-peft 1.2.7 imports typing.override (3.12+)
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]

import torch  # noqa: E402
from torch import nn  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from engram_peft.config import EngramConfig  # noqa: E402
    from engram_peft.layer import EngramLayer  # noqa: E402

from engramdb.torch import DiskMultiHeadEmbedding, prefetched_multi_head_embedding  # noqa: E402

VOCAB = 32_000
ENGRAM_AFTER = {1: 1, 3: 3}  # engram layer id -> the block it follows


class ToyModel(nn.Module):
    def __init__(self, hidden: int, blocks: int, engram: dict[int, nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(blocks)
        )
        self.engram = nn.ModuleDict({str(k): v for k, v in engram.items()})
        self.head = nn.Linear(hidden, VOCAB)
        self.before_layer: Any = None

    def run(
        self, x: torch.Tensor, lo: int, hi: int, hashes: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        for b in range(lo, hi):
            x = x + self.blocks[b](x)
            for lay, after in ENGRAM_AFTER.items():
                if after == b and str(lay) in self.engram:
                    if self.before_layer is not None:
                        self.before_layer(lay)  # the decoder fills this layer's rows now
                    x = self.engram[str(lay)](hidden_states=x, engram_hash_indices=hashes[lay])
        return x


def build(args: argparse.Namespace, root: Path) -> tuple[Any, Any, ToyModel]:
    per_order = max(16, int(args.table_mb * 1e6 / 320 / 2))  # rows per order, per layer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = EngramConfig(
            engram_vocab_size_per_ngram=[per_order, per_order],
            ngram_sizes=[2, 3],
            n_head_per_ngram=8,
            embedding_dim=1280,
            hidden_size=args.hidden,
            hc_mult=1,
            compressed_vocab_size=VOCAB,
            pad_id=0,
            enable_tokenizer_compression=False,
            gating_zero_init=False,
            conv_zero_init=False,
            target_layers=list(ENGRAM_AFTER),
            use_sparse_embeddings=False,
        )
    h = keygen.hasher("engram-peft", cfg)
    torch.manual_seed(0)
    layers = {lay: EngramLayer(cfg, lay, h.primes(lay).tolist()).eval() for lay in ENGRAM_AFTER}
    model = ToyModel(args.hidden, args.blocks, layers).eval()
    with torch.no_grad():
        for lay, mod in layers.items():
            w = mod.multi_head_embedding.embedding.weight
            w.normal_(0, 1.0)  # large rows: a wrong row changes the next token
            engramdb.build(
                root,
                f"l{lay}",
                320,
                [w.detach().contiguous().view(torch.uint8).numpy()],
                heads=h.primes(lay).tolist(),
                dtype="f32",
            )
    return cfg, h, model


def twin_model(model: ToyModel, cfg: Any, h: Any, dec: Decoder) -> ToyModel:
    """The model with each engram layer's table replaced by the hook over ``dec``."""
    layers = {}
    for lay in ENGRAM_AFTER:
        ram = model.engram[str(lay)]
        twin = EngramLayer(cfg, lay, h.primes(lay).tolist()).eval()
        twin.load_state_dict(ram.state_dict())
        twin.multi_head_embedding = prefetched_multi_head_embedding(dec, lay)
        layers[lay] = twin
    m = ToyModel(model.embed.embedding_dim, len(model.blocks), layers).eval()
    m.embed, m.blocks, m.head = model.embed, model.blocks, model.head
    return m


def decode_ram(
    model: ToyModel, h: Any, prompt: np.ndarray, steps: int
) -> tuple[np.ndarray, float, float]:
    """Greedy decode with in-RAM tables: (tokens [B, steps], prefill s, decode s)."""
    nb = len(model.blocks)
    streams = {lay: h.stream(layer=lay, compressed=True, local=True) for lay in ENGRAM_AFTER}
    toks = np.empty((prompt.shape[0], steps), np.int64)
    with torch.no_grad():
        t0 = time.perf_counter()
        hashes = {lay: torch.from_numpy(st.push(prompt)) for lay, st in streams.items()}
        x = model.run(model.embed(torch.from_numpy(prompt)), 0, nb, hashes)
        nxt = model.head(x[:, -1]).argmax(-1).numpy()
        t1 = time.perf_counter()
        for s in range(steps):
            toks[:, s] = nxt
            col = nxt.reshape(-1, 1)
            hashes = {lay: torch.from_numpy(st.push(col)) for lay, st in streams.items()}
            x = model.run(model.embed(torch.from_numpy(col)), 0, nb, hashes)
            nxt = model.head(x[:, -1]).argmax(-1).numpy()
        t2 = time.perf_counter()
    return toks, t1 - t0, t2 - t1


def decode_disk(
    model: ToyModel,
    cfg: Any,
    h: Any,
    stores: dict[int, Any],
    prompt: np.ndarray,
    steps: int,
    prefetch: Any,
) -> tuple[np.ndarray, float, float, Decoder]:
    b = prompt.shape[0]
    dec = Decoder(stores, h, batch=b, prefetch=prefetch, compressed=True)
    m = twin_model(model, cfg, h, dec)
    nb = len(m.blocks)
    # The model hashes for itself (as engram-peft's pre-hook does); the hook checks that its
    # ids equal the rows the decoder prefetched.
    streams = {lay: h.stream(layer=lay, compressed=True, local=True) for lay in ENGRAM_AFTER}
    toks = np.empty((b, steps), np.int64)
    pre = np.empty(dec.prefill_shape(prompt.shape[1]), np.uint8)
    step = np.empty(dec.out_shape, np.uint8)
    buf = {"out": pre}
    m.before_layer = lambda lay: dec.fill(buf["out"], layer=lay)
    with torch.no_grad():
        t0 = time.perf_counter()
        dec.prefill(prompt)
        hashes = {lay: torch.from_numpy(st.push(prompt)) for lay, st in streams.items()}
        x = m.run(m.embed(torch.from_numpy(prompt)), 0, nb, hashes)
        nxt = m.head(x[:, -1]).argmax(-1).numpy()
        t1 = time.perf_counter()
        buf["out"] = step
        for s in range(steps):
            toks[:, s] = nxt
            dec.push(nxt)  # keygen + prefetch submit, before any block runs
            col = nxt.reshape(-1, 1)
            hashes = {lay: torch.from_numpy(st.push(col)) for lay, st in streams.items()}
            x = m.run(m.embed(torch.from_numpy(col)), 0, nb, hashes)
            nxt = m.head(x[:, -1]).argmax(-1).numpy()
        t2 = time.perf_counter()
    for lay in ENGRAM_AFTER:
        hook = m.engram[str(lay)].multi_head_embedding
        assert hook.served_read == 0, "every lookup was served from the decoder's fill"
    return toks, t1 - t0, t2 - t1, dec


def lookup_bench(model: ToyModel, stores: dict[int, Any], h: Any, reps: int) -> dict[str, Any]:
    """Warm per-step lookup: DiskMultiHeadEmbedding vs engram-peft's MultiHeadEmbedding."""
    lay = 1
    ref = model.engram[str(lay)].multi_head_embedding
    disk = DiskMultiHeadEmbedding(stores[lay])
    table = stores[lay].array()
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {}
    for b in (1, 8):
        toks = rng.integers(0, VOCAB, (b, 600))
        ids = [
            torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=lay, compressed=True)[:, -1:])
            for t in range(0, 600, 1)
        ][:500]
        glob = [(i.numpy() + h.offsets(lay)).reshape(-1) for i in ids]
        buf = np.empty((b * 16, 320), np.uint8)
        res: dict[str, list[float]] = {"engram_peft": [], "engramdb": [], "np_take": []}

        def take(g: np.ndarray, buf: np.ndarray = buf) -> None:
            np.take(table, g, axis=0, out=buf, mode="clip")

        with torch.no_grad():
            for i in ids[:50]:
                assert torch.equal(disk(i), ref(i))
            for _ in range(reps * 5):
                for name, fn in (
                    ("engram_peft", lambda i, g: ref(i)),
                    ("engramdb", lambda i, g: disk(i)),
                    ("np_take", lambda i, g: take(g)),
                ):
                    t0 = time.perf_counter()
                    for i, g in zip(ids, glob):
                        fn(i, g)
                    res[name].append((time.perf_counter() - t0) / len(ids) * 1e6)
        meds = {k: median(v) for k, v in res.items()}
        out[f"B{b}"] = {
            **{f"{k}_us": v for k, v in meds.items()},
            "ratio_vs_engram_peft": meds["engramdb"] / meds["engram_peft"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 steps, 2 reps, 32 MB tables")
    ap.add_argument("--table-mb", type=float, default=64.0, help="MB per layer table")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.reps, args.table_mb = 32, 2, min(args.table_mb, 32.0)
    torch.set_num_threads(1)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="peft_decode_"))
    doc: dict[str, Any] = {"args": vars(args), "cpu": cpu_note()}
    ok = True
    try:
        t0 = time.perf_counter()
        cfg, h, model = build(args, root)
        print(
            f"tables: 2 x {h.table_rows(1) * 320 / 1e6:.0f} MB, built in {time.perf_counter() - t0:.1f} s"
        )
        rng = np.random.default_rng(0)
        with engramdb.open(root) as db:
            stores = {lay: db[f"l{lay}"] for lay in ENGRAM_AFTER}
            for b in (1, 8):
                prompt = rng.integers(0, VOCAB, (b, 32))
                arms: dict[str, dict[str, list[float]]] = {}
                ref_toks, _, _ = decode_ram(model, h, prompt, args.steps)
                for rep in range(args.reps):
                    order = [
                        "ram",
                        "cold auto",
                        "cold on",
                        "cold off",
                        "warm auto",
                        "warm on",
                        "warm off",
                    ]
                    if rep % 2:
                        order = order[:1] + order[1:4][::-1] + order[4:][::-1]
                    for arm in order:
                        if arm == "ram":
                            toks, pre_s, dec_s = decode_ram(model, h, prompt, args.steps)
                        else:
                            state, mode = arm.split()
                            pf = {"auto": "auto", "on": True, "off": False}[mode]
                            for s in stores.values():
                                if state == "cold":
                                    left = make_cold(s)
                                    if left > 0.05:
                                        print(f"  warning: {left:.0%} of a table still resident")
                                else:
                                    s.populate()
                            toks, pre_s, dec_s, dec = decode_disk(
                                model, cfg, h, stores, prompt, args.steps, pf
                            )
                            share = dec.prefetched / ((args.steps + 1) * len(dec.layers))
                            arms.setdefault(arm, {"prefill": [], "decode": [], "pf": []})
                            arms[arm]["pf"].append(share)
                        if not np.array_equal(toks, ref_toks):
                            ok = False
                            print(f"  B={b} {arm}: TOKENS DIFFER from the in-RAM run")
                        a = arms.setdefault(arm, {"prefill": [], "decode": [], "pf": []})
                        a["prefill"].append(pre_s)
                        a["decode"].append(dec_s / args.steps)
                ram_step = median(arms["ram"]["decode"])
                ram_pre = median(arms["ram"]["prefill"])
                rows = {}
                print(
                    f"B={b}: in-RAM step {ram_step * 1e3:.2f} ms, prefill(32) {ram_pre * 1e3:.1f} ms; tokens identical: {ok}"
                )
                for arm, a in arms.items():
                    if arm == "ram":
                        continue
                    step_s, pre_s = median(a["decode"]), median(a["prefill"])
                    rows[arm] = {
                        "step_ms": step_s * 1e3,
                        "prefill_ms": pre_s * 1e3,
                        "decode_vs_ram": ram_step / step_s,
                        "prefill_vs_ram": pre_s / ram_pre,
                        "prefetched_share": median(a["pf"]),
                    }
                    print(
                        f"  {arm:9s} step {step_s * 1e3:6.2f} ms  decode speed vs RAM {ram_step / step_s:5.3f}x  prefill {pre_s * 1e3:6.1f} ms = {pre_s / ram_pre:4.2f}x RAM  prefetched {median(a['pf']):.0%} of steps"
                    )
                for state in ("cold", "warm"):
                    best = max(
                        rows[f"{state} on"]["decode_vs_ram"], rows[f"{state} off"]["decode_vs_ram"]
                    )
                    print(
                        f"  {state}: auto {rows[f'{state} auto']['decode_vs_ram']:.3f} vs better of on/off {best:.3f}"
                    )
                doc[f"B{b}"] = {
                    "ram_step_ms": ram_step * 1e3,
                    "ram_prefill_ms": ram_pre * 1e3,
                    "arms": rows,
                }
            for s in stores.values():
                s.populate()
            print(f"warm residency {np.mean([residency(s) for s in stores.values()]):.2f}")
            lk = lookup_bench(model, stores, h, args.reps)
            for k, v in lk.items():
                print(
                    f"warm lookup {k}: engram-peft MultiHeadEmbedding {v['engram_peft_us']:.1f} us, DiskMultiHeadEmbedding {v['engramdb_us']:.1f} us (ratio {v['ratio_vs_engram_peft']:.2f}), np.take {v['np_take_us']:.1f} us"
                )
            doc["lookup"] = lk
        doc["tokens_identical"] = ok
        print(f"wrote {write_json('peft_decode', doc)}")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
