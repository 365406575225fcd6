"""The end-to-end decode bar: greedy decoding with engram-peft's real `EngramLayer`, the Engram
tables in RAM vs through EngramDB (issues 18 item 5 and 21).

    python probes/e2e_decode.py --quick            # 2 x 128 MB tables, 128 steps, 2 reps
    python probes/e2e_decode.py --full             # 2 x 2.1 GB tables (4.2 GB), 256 steps, 3 reps
    python probes/e2e_decode.py [--table-gb G] [--steps N] [--reps R] [--batches 1,8]
        [--hidden 448] [--blocks 1:10,8:4] [--arms ram,warm:module,...] [--no-train] [--dir D]
        [--keep]
        [--gpu-arms gpu:ram,gpu:host,...] [--gpu-hidden 4096] [--gpu-blocks 32] [--paired]
        [--paired-only] [--engine-cpu N]

The model: a token embedding (8192 tokens), ``--blocks`` residual MLP blocks of width
``--hidden``, an lm head, and two engram-peft 1.2.7 `EngramLayer`s (ids 1 and 3, after blocks 1
and 3; ``ngram_sizes=[2, 3]``, 8 heads per order, 80-dim heads: 320 B f32 rows). ``--blocks``
is one count or one per batch size (``1:10,8:4``; a batch not named takes the count of the
largest named batch below it). The default sizes the model so a decode step takes 5-10 ms on
one thread here (``torch.set_num_threads(1)``) at both batch sizes, the step issue 18 sets its
bar at (10 blocks at B=1: ~5.5 ms; 4 at B=8: ~8 ms); the summary prints each batch's in-RAM
step and says when it falls outside 5-10 ms. ``--blocks 4`` is the old 3.6 ms B=1 step;
``--hidden 1024 --blocks 11 --vocab 32000`` is a ~40 ms-step model at B=1 (~110 ms at B=8),
about the size of the model the issues' outside measurements used (~46 / ~130 ms);
``--blocks 6`` is a ~26 ms one.
The row ids come from the engram-peft keygen kind (equal to engram-peft's own hashing,
tests/test_keygen_peft.py); the model hashes every step itself, as engram-peft's pre-hook does.

Tables: raw f32 files filled with random normals in 64 MB numpy chunks (no per-row Python),
attached in place (`engramdb.attach`, no copy), deleted at exit. ``--built``: the EngramDB
arms read tables built from the same bytes by `engramdb.build` (its default 1 GB shards: the
files a user's ``engramdb build`` makes; the build is kept with ``--keep``) instead.

Every (arm, B) runs in a **fresh process**; arms are interleaved per repetition (ABBA). The page
cache state is set before the process starts: **warm** = `python -m engramdb warm` (the page
cache is hot, the serving process's mapping is not populated: what a server sees after the CLI);
**cold** = the table files' pages dropped with ``POSIX_FADV_DONTNEED`` (no global drop_caches),
residency checked with ``mincore`` in the child. The child opens the database with the
library defaults: a table that fits is warmed and its mapping populated in the background,
started by its first cold read or prefetch, or by its first faulting mapped read, and
locked once warm (``lock="auto"``: reclaim cannot take its pages; the paired lines give the
bytes locked at the end) (``--no-background-warm`` opens with ``background_warm=False``). Arms:

* ``ram``: engram-peft's own `MultiHeadEmbedding` (an ``nn.Embedding``) over the table read into
  anonymous memory (``np.fromfile``): the baseline every ratio is against.
* ``ram:twin``: a second in-RAM copy of the same tables, run like an arm: with ``--paired``,
  the A/A control (how far a paired ratio strays from 1 with nothing of EngramDB in the step).
* ``module``: `engramdb.torch.DiskMultiHeadEmbedding` in place of it, synchronous reads.
* ``module+pf``: the same module; right after sampling, the model hashes the next token and calls
  ``module.prefetch(ids)`` for each layer, so the read overlaps the blocks before the layer.
* ``module+pf:proc``: the same, the prefetches read in a companion process
  (`PrefetchProcess`, opened with the arm's options and kept off ``--engine-cpu``): a prefetch
  is a copy of the ids into shared memory and one atomic add, the forward waits for the
  companion's word for that table and copies the rows out.
* ``decoder``: `Decoder(prefetch="auto")` pushed each sampled token at once (keygen + prefetch
  submit; the model takes the decoder's local ids, `Decoder.local_ids`), ``fill(buf, layer=)``
  right before each layer into a buffer of that layer's own (`Decoder.layer_shape`), and the
  layers served from it by the pre-fetched-rows hook (`DiskMultiHeadEmbedding(decoder=,
  layer=)`, no copy; the hook checks the model's ids equal the decoder's).
  ``decoder:on`` / ``decoder:off`` force prefetch; ``decoder:whole`` fills each layer's
  slice of one step buffer ``[B, L, H, rb]`` instead (strided slices for B > 1).
* ``decoder:proc``: the same decoder in a companion process (`DecoderProcess`, opened with
  the arm's options and kept off ``--engine-cpu``): the push is a copy of the tokens into
  shared memory and one atomic add, the model takes the companion's local ids without a
  wait (``local_ids(lay, wait=False)``: read only at the layer, after its fill), each fill
  waits for the companion's word for that layer and copies the rows.

An arm with a ``nowarm`` part (``cold:nowarm:decoder``) opens its database with
``background_warm=False``: the background warm's cost beside the default, in one run.

**GPU arms** (issue 18 item 6; probes/e2e_gpu.py), run after the CPU arms where a CUDA device
is present (otherwise skipped with the reason printed): the same model on the GPU, sized by
``--gpu-hidden`` / ``--gpu-blocks`` (f32, default 4096 x 16 blocks: 8.6 GB of weights, a
6-8 ms step on an H200; 32 blocks gave 12-14 ms). Rows reach each Engram layer the way an engine's offload
path moves them: into a pinned host buffer (the decoder's ``fill`` writes there directly; a
module's output is copied in), then an H2D copy on a side stream (``non_blocking``, issued by the
host, outside any captured region) that the compute stream waits for. Arms ``gpu:ram`` (the
table in GPU memory: the baseline of the ratios), ``gpu:host`` (in host RAM, staged the same
way: a second ratio column), ``warm:gpu:module``, ``warm:gpu:decoder``, ``cold:gpu:module``,
``cold:gpu:module+pf``, ``cold:gpu:decoder`` (``--gpu-arms``). ``E2E_GPU_DRYRUN=1`` runs their
code on the CPU to check the plumbing (not a measurement).

``--paired`` also runs each arm in a process of its own beside the in-RAM tables, 8-step
blocks alternating (ram, arm, arm, ram, ...); the summary pools the reps' blocks into one
ratio with a 95 % bootstrap interval. ``--paired-only`` skips the separate unpaired processes
of the arms after ``ram``. A paired line also gives the engine thread's waits a step on each
side (voluntary context switches, read per block): a wait for a read, or for the GIL while a
library thread (the background warm) ran Python. The in-RAM side pays for those threads too
(they share its process), so a warm's cost to the engine thread shows there, not in the ratio.
With ``--engine-cpu`` it gives the other CPUs' busy time a step on each side (``/proc/stat``:
what ran beside the engine thread), and it gives when each table's background warm pass ran,
in ms from the arm's first step (a pass that ends before 0 never ran beside the steps).

Correctness first: every arm's tokens must equal the first arm's (exit 1 otherwise). Printed per
B: tokens/s and its ratio to ``ram``, per-step p50/p99, lookup ms per step (the embedding
module's forward, plus push/fill/prefetch calls), minor/major faults per step, RSS anon/file
(MB), 32-token prefill and its ratio, and for a cold arm what the table's background warm read
by the end (and how much of it paced beside the loop's prefetches, `docs/io.md`), and the
share of the decode's steps that ended on a CPU taking the table disk's interrupts (read from
``/proc/interrupts``; on this VM's one-queue disk, CPU 1: a cold arm at B=8 loses ~0.1x when
the scheduler puts the decoding thread there; ``--engine-cpu N`` pins it, from the prefill
on, for both the arm and the in-RAM baseline). Then the warm per-step lookup of the module vs
``nn.Embedding`` (same processes' figures), and the training-side figure: corpus -> e_t
(``db.stream``) -> a torch training step, tokens/s, against the same loop fed by
``np.take`` from the table in anonymous memory (feed only and feed + step), with how many CPUs
the feed's process used, how many other processes took, and what its stream found at open
(the table's resident share, its warm pass). Writes probes/out/e2e_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import typing
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_busy_ticks,
    cpu_note,
    current_cpu,
    disk_irq_cpus,
    median,
    pooled_ratio,
    thread_sleeps,
    write_json,
)

from engramdb.integrations.engines._env import (  # noqa: E402
    apply_inherited_hiding,
    hide_broken_torch_extensions,
)

# Before engram-peft imports transformers' trainer: the parent checks which media packages
# fail to import; its children hide the same ones (inherited) without checking again.
if "--child" in sys.argv:
    apply_inherited_hiding()
else:
    hide_broken_torch_extensions()

if not hasattr(typing, "override"):  # engram-peft 1.2.7 imports typing.override (3.12+)
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]


def _engram_peft_layers() -> None:
    """Import engram-peft; where its package ``__init__`` fails (its trainer extras need
    ``trl``, absent from some machines, e.g. the GPU image), load the package without it:
    the layer, config and hashing modules this probe uses are engram-peft's own files."""
    import importlib.util
    import types

    try:
        import engram_peft  # noqa: F401
    except Exception as e:  # ImportError, or a trainer extra that breaks on import
        spec = importlib.util.find_spec("engram_peft")
        if spec is None or not spec.submodule_search_locations:
            raise
        pkg = types.ModuleType("engram_peft")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["engram_peft"] = pkg
        if "--child" not in sys.argv:
            print(
                f"note: engram_peft's package __init__ does not import here ({e}); its "
                "layer modules are imported without the trainer extras"
            )


_engram_peft_layers()

ENGRAM_AFTER = {1: 1, 3: 3}  # engram layer id -> the block it follows
ROW_BYTES, DIM, HEADS = 320, 80, 16
DEFAULT_ARMS = "ram,warm:module,warm:decoder,cold:module,cold:module+pf,cold:decoder"
#: The CUDA engine path's arms (probes/e2e_gpu.py), run where a CUDA device is present.
DEFAULT_GPU_ARMS = (
    "gpu:ram,gpu:host,warm:gpu:module,warm:gpu:decoder,cold:gpu:module,cold:gpu:module+pf,"
    "cold:gpu:decoder"
)


#: The decoder arms' kinds and their ``Decoder(prefetch=)``.
DECODER_MODES: dict[str, Any] = {
    "decoder": "auto",
    "decoder:whole": "auto",
    "decoder:on": True,
    "decoder:off": False,
    "decoder:proc": "auto",
}
#: Every arm kind (``ram:twin`` is the kind ``twin``).
KINDS = frozenset({"ram", "host", "twin", "module", "module+pf", "module+pf:proc", *DECODER_MODES})


def parse_arm(arm: str) -> tuple[str, str, bool]:
    """``[state:][nowarm:][gpu:]kind`` -> (state, kind, on the GPU); an unknown kind exits
    naming it (``nowarm``: `background_warm`)."""
    parts = [p for p in arm.split(":") if p != "nowarm"]
    gpu = "gpu" in parts
    if gpu:
        parts.remove("gpu")
    state = parts[0] if parts[0] in ("warm", "cold", "warm+pop") else ""
    kind = ":".join(parts[1:] if state else parts)
    kind = "twin" if kind == "ram:twin" else kind
    if kind not in KINDS:
        known = sorted(KINDS - {"twin"} | {"ram:twin"})
        raise SystemExit(f"unknown arm {arm!r} (kinds: {', '.join(known)})")
    return state, kind, gpu


def background_warm(arm: str, args: argparse.Namespace) -> bool:
    """Whether the arm's process opens the database with the background warm (the library's
    default): not under ``--no-background-warm``, nor for an arm with a ``nowarm`` part."""
    return not args.no_background_warm and "nowarm" not in arm.split(":")


# -- setup (both sides) -----------------------------------------------------------------------
def engram_config(args: argparse.Namespace) -> Any:
    from engram_peft.config import EngramConfig

    per_order = max(64, int(args.table_gb * 1e9 / ROW_BYTES / 2 / len(ENGRAM_AFTER)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return EngramConfig(
            engram_vocab_size_per_ngram=[per_order, per_order],
            ngram_sizes=[2, 3],
            n_head_per_ngram=8,
            embedding_dim=DIM * HEADS,
            hidden_size=args.hidden,
            hc_mult=1,
            compressed_vocab_size=args.vocab,
            pad_id=0,
            enable_tokenizer_compression=False,
            gating_zero_init=False,
            conv_zero_init=False,
            target_layers=list(ENGRAM_AFTER),
            use_sparse_embeddings=False,
        )


def table_path(root: Path, lay: int) -> Path:
    return root / f"l{lay}.f32"


def db_dir(root: Path, built: bool) -> Path:
    """The database the EngramDB arms open: the attached tables, or (``--built``) the built."""
    return root / ("built" if built else "db")


def table_files(root: Path, lay: int, built: bool) -> list[Path]:
    """The files an EngramDB arm reads layer ``lay``'s rows from: the raw file it attaches,
    or (``--built``) its built table's shards."""
    if not built:
        return [table_path(root, lay)]
    import engramdb

    with engramdb.open(db_dir(root, True), background_warm=False) as db:
        return [db_dir(root, True) / sh.path for sh in db[f"l{lay}"].info.shards]


def residency(root: Path, built: bool) -> float:
    """The share of the EngramDB arms' table files in the page cache (``mincore``)."""
    from engramdb.testing.pages import file_residency

    files = [f for lay in ENGRAM_AFTER for f in table_files(root, lay, built)]
    sizes = np.array([f.stat().st_size for f in files], np.float64)
    return float(np.dot([file_residency(f) for f in files], sizes) / sizes.sum())


def build_copies(root: Path, h: Any) -> None:
    """``--built``: each raw table file built into a table of the default shard size."""
    import engramdb

    for lay in ENGRAM_AFTER:
        raw = np.memmap(table_path(root, lay), np.uint8, "r").reshape(-1, ROW_BYTES)
        engramdb.build(
            db_dir(root, True), f"l{lay}", ROW_BYTES, [raw],
            heads=h.primes(lay).tolist(), dtype="f32", dim=DIM,
        )  # fmt: skip


def build_tables(args: argparse.Namespace, root: Path, h: Any) -> None:
    """Raw f32 row files (random normals, 64 MB chunks), attached in place."""
    import engramdb

    for lay in ENGRAM_AFTER:
        n = int(h.table_rows(lay)) * DIM
        rng = np.random.default_rng(100 + lay)
        chunk = 16 << 20
        with open(table_path(root, lay), "wb") as f:
            for i in range(0, n, chunk):
                f.write(rng.standard_normal(min(chunk, n - i), dtype=np.float32).data)
        engramdb.attach(
            root / "db",
            f"l{lay}",
            [str(table_path(root, lay))],
            row_bytes=ROW_BYTES,
            heads=h.primes(lay).tolist(),
            dtype="f32",
            dim=DIM,
        )


def evict_tables(root: Path, built: bool = False) -> None:
    """Drop the table files' pages (the raw files, and with ``built`` the built tables'
    shards too); exits naming the cause where they stay (a cold arm would measure a warm
    table): pages some process ``mlock``s cannot be dropped (a table opened with the default
    ``lock="auto"`` and warmed, or ``engramdb warm --lock``)."""
    from engramdb.testing.pages import file_residency

    paths = [table_path(root, lay) for lay in ENGRAM_AFTER]
    if built:
        paths += [f for lay in ENGRAM_AFTER for f in table_files(root, lay, True)]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        left = file_residency(path)
        if left > 0.05:
            raise SystemExit(
                f"{path}: {left:.0%} stays in the page cache after POSIX_FADV_DONTNEED: a "
                "process locks it (a table opened and warmed with lock='auto', or `engramdb "
                "warm --lock`); stop it, then run again"
            )


def warm_tables(root: Path, built: bool = False) -> None:
    subprocess.run(
        [sys.executable, "-m", "engramdb", "warm", str(db_dir(root, built)), "-q"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


# -- the child: one (arm, B) ------------------------------------------------------------------
def proc_status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("RssAnon", "RssFile", "VmHWM"):
                out[k] = int(line.split()[1]) / 1024
    return out


class Clock:
    """Seconds spent in table access (module forwards, push / fill / prefetch calls), in all
    and per part."""

    total = 0.0
    parts: dict[str, float] = {}

    @classmethod
    def add(cls, part: str, dt: float) -> None:
        cls.total += dt
        cls.parts[part] = cls.parts.get(part, 0.0) + dt


def build_model(args: argparse.Namespace, cfg: Any, h: Any, device: str = "cpu") -> Any:
    """The toy model with engram-peft layers whose tables are left unallocated (meta), its
    weights created (and initialised) on ``device``."""
    import engram_peft.layer as ep_layer
    import torch
    from torch import nn

    orig = ep_layer.MultiHeadEmbedding

    def meta_table(*a: Any, **kw: Any) -> Any:
        with torch.device("meta"):
            return orig(*a, **kw)

    class Timed(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = self.inner(ids)
            Clock.add("forward", time.perf_counter() - t0)
            return out  # type: ignore[no-any-return]

    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args.hidden
            self.embed = nn.Embedding(args.vocab, d)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                for _ in range(blocks_for(args.blocks, getattr(args, "batch", 1)))
            )
            ep_layer.MultiHeadEmbedding = meta_table
            try:
                self.engram = nn.ModuleDict(
                    {
                        str(lay): ep_layer.EngramLayer(cfg, lay, h.primes(lay).tolist())
                        for lay in ENGRAM_AFTER
                    }
                )
            finally:
                ep_layer.MultiHeadEmbedding = orig
            self.head = nn.Linear(d, args.vocab)
            self.before_layer: Any = None

        def set_table(self, lay: int, module: nn.Module) -> None:
            self.engram[str(lay)].multi_head_embedding = Timed(module)

        def forward(self, tokens: torch.Tensor, hashes: dict[int, torch.Tensor]) -> torch.Tensor:
            x = self.embed(tokens.to(self.head.weight.device, non_blocking=True))
            for b, block in enumerate(self.blocks):
                x = x + block(x)
                for lay, after in ENGRAM_AFTER.items():
                    if after == b:
                        if self.before_layer is not None:
                            self.before_layer(lay)
                        x = self.engram[str(lay)](hidden_states=x, engram_hash_indices=hashes[lay])
            # the sampled token back on the host (on the GPU: the step's one synchronisation)
            return self.head(x[:, -1]).argmax(-1).cpu()  # type: ignore[no-any-return]

    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        model = ToyModel().eval()
        if device != "cpu":  # stray CPU buffers over too; the meta tables stay put (replaced)
            metas = {lay: model.engram[str(lay)].multi_head_embedding for lay in ENGRAM_AFTER}
            for lay in ENGRAM_AFTER:
                model.engram[str(lay)].multi_head_embedding = nn.Identity()
            model.to(device)
            for lay, m in metas.items():
                model.engram[str(lay)].multi_head_embedding = m
    with torch.no_grad():  # large engram branch: a wrong row changes the next token
        for lay in ENGRAM_AFTER:
            for p in model.engram[str(lay)].gating.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
    return model


def ram_table(root: Path, lay: int, h: Any) -> Any:
    """engram-peft's own MultiHeadEmbedding over the table in anonymous memory."""
    import torch
    from engram_peft.layer import MultiHeadEmbedding
    from torch import nn

    with torch.device("meta"):
        mhe = MultiHeadEmbedding(h.primes(lay).tolist(), DIM, sparse=False)
    w = np.fromfile(table_path(root, lay), dtype=np.float32).reshape(-1, DIM)
    mhe.embedding = nn.Embedding(w.shape[0], DIM, _weight=torch.from_numpy(w))
    mhe.register_buffer("offsets", torch.from_numpy(h.offsets(lay).copy()))
    return mhe


def child(args: argparse.Namespace) -> None:
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    import torch

    torch.set_num_threads(1)
    import engramdb
    from engramdb import keygen
    from engramdb.decode import Decoder
    from engramdb.decode_process import DecoderProcess
    from engramdb.prefetch_process import PrefetchProcess
    from engramdb.torch import DiskMultiHeadEmbedding, prefetched_multi_head_embedding

    root = Path(args.root)
    state, kind, gpu = parse_arm(args.child)
    irq_cpus = disk_irq_cpus(table_path(root, next(iter(ENGRAM_AFTER))))
    b = args.batch
    cfg = engram_config(args)
    h = keygen.hasher("engram-peft", cfg)
    resident = residency(root, args.built)
    stager: Any = None
    if gpu:  # the CUDA engine path: the model on the GPU, rows staged through pinned memory
        import e2e_gpu

        torch.backends.cuda.matmul.allow_tf32 = False
        stager = e2e_gpu.Stager(e2e_gpu.device())
    model = build_model(args, cfg, h, stager.device.type if gpu else "cpu")

    def baseline(lay: int, on_device: bool = True) -> Any:
        """The in-RAM table as the model gets it: on the GPU path in GPU memory (``gpu:ram``,
        and the paired baseline) or staged from host RAM (``gpu:host``)."""
        mhe = ram_table(root, lay, h)
        if not gpu:
            return mhe
        if on_device:
            return e2e_gpu.gpu_table_module(mhe, stager.device)
        return e2e_gpu.staged_module(mhe, stager, lay)

    ram_mods: dict[int, Any] = {}
    if args.paired and kind not in ("ram", "host"):
        # The in-RAM baseline in this same process, read before the store opens; a cold arm's
        # files are dropped from the page cache again afterwards (nothing maps them yet).
        ram_mods = {lay: baseline(lay) for lay in ENGRAM_AFTER}
        if state == "cold":
            evict_tables(root, args.built)
        elif args.built:  # the raw files were only the baseline's source: out of the way
            evict_tables(root)
        resident = residency(root, args.built)
    # The library default: a table that fits is warmed in the background by its first cold
    # read (or its first faulting mapped read); --no-background-warm measures without it.
    db = engramdb.open(db_dir(root, args.built), background_warm=background_warm(args.child, args))
    stores = {lay: db[f"l{lay}"] for lay in ENGRAM_AFTER}
    stores_names = [f"l{lay}" for lay in ENGRAM_AFTER]
    procs = None  # the module arm's `PrefetchProcess` (module+pf:proc)
    dec = None
    mods: dict[int, Any] = {}  # EngramDB's modules (prefetch calls, counters)
    tables: dict[int, Any] = {}  # what the model's layers call
    if kind == "twin":  # the A/A control: a second copy of the in-RAM tables
        tables = {lay: baseline(lay) for lay in ENGRAM_AFTER}
    elif kind in ("ram", "host"):
        if kind == "host" and not gpu:
            raise SystemExit("the host arm is a GPU arm (gpu:host)")
        tables = {lay: baseline(lay, on_device=kind == "ram") for lay in ENGRAM_AFTER}
    elif kind in DECODER_MODES:
        if kind == "decoder:proc":  # the same decoder, its keygen and reads in a process
            opts = {"background_warm": background_warm(args.child, args)}
            names = {lay: f"l{lay}" for lay in ENGRAM_AFTER}
            # the companion stays off the engine's CPU (``--engine-cpu``)
            cpus = set(os.sched_getaffinity(0)) - {args.engine_cpu} or None
            dec = DecoderProcess(
                db, names, h, batch=b, compressed=True, open_options=opts, cpus=cpus
            )
        else:
            dec = Decoder(stores, h, batch=b, prefetch=DECODER_MODES[kind], compressed=True)
        for i, lay in enumerate(ENGRAM_AFTER):
            mods[lay] = prefetched_multi_head_embedding(dec, lay)
            tables[lay] = e2e_gpu.decoder_rows_module(mods[lay], stager, i) if gpu else mods[lay]
    else:  # module, module+pf[:proc] (`parse_arm` refuses any other kind)
        if kind == "module+pf:proc":  # the module's prefetches read in a process
            opts = {"background_warm": background_warm(args.child, args)}
            cpus = set(os.sched_getaffinity(0)) - {args.engine_cpu} or None
            procs = PrefetchProcess(db, list(stores_names), open_options=opts, cpus=cpus)
        for lay in ENGRAM_AFTER:
            mods[lay] = DiskMultiHeadEmbedding(stores[lay], process=procs)
            tables[lay] = e2e_gpu.staged_module(mods[lay], stager, lay) if gpu else mods[lay]
    for lay, t in tables.items():
        model.set_table(lay, t)
    if state == "warm+pop":  # this process's mapping populated too (RssFile: the table)
        for st in stores.values():
            st.populate()
    prefetch_module = kind.startswith("module+pf")
    bufs: dict[str, np.ndarray] = {}
    fill_layer = None
    if dec is not None:
        d = dec
        fill_layer = (
            e2e_gpu.decoder_before_layer(d, stager, bufs)
            if gpu
            else (lambda lay: d.fill(bufs["out"], layer=lay))
            if kind == "decoder:whole"
            else (lambda lay: d.fill(bufs[lay], layer=lay))
        )
        fl = fill_layer

        def before(lay: int) -> None:
            t0 = time.perf_counter()
            fl(lay)
            Clock.add(f"fill{lay}", time.perf_counter() - t0)

        model.before_layer = before

    def run(prompt: np.ndarray, steps: int) -> dict[str, Any]:
        streams = {lay: h.stream(layer=lay, compressed=True, local=True) for lay in ENGRAM_AFTER}
        if dec is not None:
            dec.reset()
            new_bufs(bufs, dec, prompt.shape[1])
        toks = np.empty((b, steps), np.int64)
        step_s = np.empty(steps)
        lookup_s = np.empty(steps)
        cpu_of = np.empty(steps, np.int64)

        def feed(col: np.ndarray) -> dict[int, torch.Tensor]:
            if dec is not None:
                # The decoder hashes for the model: its local ids (row ids less the head
                # offsets) are the layers' ids (the hook verifies them against its fill).
                t0 = time.perf_counter()
                dec.push(col[:, 0]) if col.shape[1] == 1 else dec.prefill(col)
                Clock.add("push", time.perf_counter() - t0)
                return {lay: model_ids(dec, lay, col.shape[1]) for lay in dec.layers}
            hashes = {lay: torch.from_numpy(st.push(col)) for lay, st in streams.items()}
            if prefetch_module:
                t0 = time.perf_counter()
                for lay, ids in hashes.items():
                    mods[lay].prefetch(ids)
                Clock.add("prefetch", time.perf_counter() - t0)
            return hashes

        with torch.no_grad():
            Clock.total = 0.0
            t0 = time.perf_counter()
            nxt = model(torch.from_numpy(prompt), feed(prompt)).numpy()
            prefill = time.perf_counter() - t0
            prefill_lookup = Clock.total
            pin_engine(args)  # after the prefill: the library's threads exist by now
            if dec is not None:
                new_bufs(bufs, dec)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            Clock.parts = {}
            for s in range(steps):
                toks[:, s] = nxt
                Clock.total = 0.0
                t0 = time.perf_counter()
                col = nxt.reshape(-1, 1)
                nxt = model(torch.from_numpy(col), feed(col)).numpy()
                step_s[s] = time.perf_counter() - t0
                lookup_s[s] = Clock.total
                cpu_of[s] = current_cpu()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
        med = float(np.median(step_s))
        slow = step_s > 1.3 * med
        return {
            "tokens": toks,
            "prefill_ms": prefill * 1e3,
            "prefill_lookup_ms": prefill_lookup * 1e3,
            "decode_s": float(step_s.sum()),
            "step_p50_ms": med * 1e3,
            "step_p99_ms": float(np.percentile(step_s, 99) * 1e3),
            # where the time above the median step went: steps over 1.3x the median, and
            # all steps' excess over it (a stall outside the lookup shows here, not there)
            "slow_steps": int(slow.sum()),
            "excess_ms": float(np.maximum(step_s - med, 0).sum() * 1e3),
            "slow_lookup_ms": float(lookup_s[slow].sum() * 1e3),
            "lookup_ms": float(lookup_s.mean() * 1e3),
            "lookup_parts_us": {k: v / steps * 1e6 for k, v in Clock.parts.items()},
            "minflt": (ru1.ru_minflt - ru0.ru_minflt) / steps,
            "majflt": (ru1.ru_majflt - ru0.ru_majflt) / steps,
            # the share of steps that ended on a CPU taking the table disk's interrupts
            "irq_cpu_share": float(np.isin(cpu_of, list(irq_cpus)).mean()),
        }

    rng = np.random.default_rng(1000 + b)
    run(rng.integers(0, args.vocab, (b, 8)), 4)  # compute warm-up (touches ~0.01 % of rows)
    prompt = np.random.default_rng(b).integers(0, args.vocab, (b, args.prompt))
    if ram_mods:  # a --paired child: only the paired figure
        pdoc = paired_steps(
            args, model, h, prompt, ram_mods, tables, mods, dec, fill_layer, bufs, b
        )
        pdoc.update(arm=args.child, batch=b, resident_before=resident)
        pdoc["irq_cpu_share"] = float(np.isin(pdoc.pop("arm_cpus"), list(irq_cpus)).mean())
        pdoc["irq_cpus"] = sorted(irq_cpus)
        pdoc.update(arm_state(stores, dec, mods, kind, procs, pdoc.pop("first_step_at")))
        # which memory held the tables: the A/A control holds two anonymous copies, an
        # EngramDB arm one (the in-RAM side's) and its mapping's pages as file memory
        pdoc.update(proc_status())
        pdoc["resident_after"] = residency(root, args.built)
        for companion in (dec, procs):
            if isinstance(companion, (DecoderProcess, PrefetchProcess)):
                companion.close()
        db.close()
        print("RESULT " + json.dumps(pdoc))
        return
    r = run(prompt, args.steps)
    toks = r.pop("tokens")
    doc: dict[str, Any] = {
        **r,
        "arm": args.child,
        "batch": b,
        "tokens_per_s": b * args.steps / r["decode_s"],
        "resident_before": resident,
        "tokens": toks.tolist(),
        "irq_cpus": sorted(irq_cpus),
        **proc_status(),
    }
    doc.update(arm_state(stores, dec, mods, kind, procs))
    for companion in (dec, procs):
        if isinstance(companion, (DecoderProcess, PrefetchProcess)):
            companion.close()
    db.close()
    print("RESULT " + json.dumps(doc))


def arm_state(
    stores: dict[int, Any],
    dec: Any,
    mods: dict[int, Any],
    kind: str,
    procs: Any = None,
    first: float | None = None,
) -> dict[str, Any]:
    """What an arm's tables and decoder did by the end: the share of steps prefetched, the
    auto rule's switches, the hook's misses, the background warm's bytes (and, given the
    ``time.monotonic()`` of the arm's ``first`` step, when each table's pass ran:
    `warm_pass_times`)."""
    doc: dict[str, Any] = {}
    # a `DecoderProcess` or `PrefetchProcess`: its companion's
    st = dec.stats() if hasattr(dec, "stats") else procs.stats() if procs is not None else None
    if dec is not None:
        d = st if st is not None else {"prefetched": dec.prefetched, "steps": dec.steps}
        doc["prefetched_share"] = d["prefetched"] / max(1, d["steps"] * len(dec.layers))
        doc["auto_switches"] = st["auto_switches"] if st is not None else dec.auto_switches
        doc["served_read"] = sum(m.served_read for m in mods.values())
        doc["served_prefetched"] = sum(m.served_prefetched for m in mods.values())
    if procs is not None and st is not None:  # what its companion did with the requests
        for k in ("requests", "read", "gathered"):
            doc[f"companion_{k}"] = st[k]
    if kind.startswith("module+pf"):
        doc["module_prefetches"] = sum(m.prefetches for m in mods.values())
    if kind not in ("ram", "twin", "host"):
        c = st["counters"] if st is not None else [s.counters() for s in stores.values()]
        doc["rows_fetched"] = sum(x["rows_fetched"] for x in c)
        doc["prefetched_gathers"] = sum(x["prefetched_gathers"] for x in c)
        # the background warm, by the end
        w = st["warm"] if st is not None else [s.memory()["warm"] for s in stores.values()]
        doc["warm_bytes_read"] = sum(x["bytes_read"] for x in w)
        doc["warm_paced_bytes"] = sum(x["paced_pieces"] for x in w) << 20
        if first is not None:
            doc["warm_pass_ms"] = warm_pass_times(w, first)
        if st is None:  # this process's tables: locked by the ``lock`` option at the end
            doc["locked_bytes"] = sum(s.memory()["locked_bytes"] for s in stores.values())
    return doc


def warm_pass_times(passes: list[dict[str, Any]], first: float) -> list[list[float]]:
    """Each table's last background warm pass (its ``Store.memory()["warm"]``), ``[start,
    end]`` in ms from ``first`` (``time.monotonic()`` is the system's monotonic clock, one
    across processes: a companion's passes too); end NaN while it still runs, [] for a table
    without a pass. Where it ends before 0 the arm's steps never ran beside it."""
    out = []
    for w in passes:
        t0, t1 = w.get("started_at", 0.0), w.get("ended_at", 0.0)
        if not t0:
            out.append([])
            continue
        out.append([(t0 - first) * 1e3, (t1 - first) * 1e3 if t1 else float("nan")])
    return out


_IDS: dict[int, tuple[np.ndarray, Any]] = {}


def new_bufs(bufs: dict[Any, np.ndarray], dec: Any, t: int | None = None) -> None:
    """The decoder arm's fill buffers for a step (``t``: a prefill of ``t`` positions):
    ``bufs['out']`` of the whole step (every layer) and ``bufs[layer]``, one per layer, of
    that layer's rows alone (the decoder arms but ``decoder:whole`` fill those)."""
    shape = dec.out_shape if t is None else dec.prefill_shape(t)
    bufs["out"] = np.empty(shape, np.uint8)
    for lay in dec.layers:
        bufs[lay] = np.empty(shape[:-3] + shape[-2:], np.uint8)


def model_ids(dec: Any, lay: int, t: int) -> Any:
    """Layer ``lay``'s ids for the model after a push or prefill of ``t`` positions: the
    decoder's local ids (`Decoder.local_ids`, a buffer it reuses) as a ``[B, t, H]`` tensor
    made once per buffer."""
    # (a `DecoderProcess`'s companion writes them by the layer's fill: no wait here)
    buf = dec.local_ids(lay, wait=False) if hasattr(dec, "stats") else dec.local_ids(lay)
    c = _IDS.get(lay)
    if c is None or c[0] is not buf:
        import torch  # (here: an import statement costs inside a model step too)

        c = _IDS[lay] = (buf, torch.from_numpy(buf).view(-1, t, HEADS))
    return c[1]


def paired_steps(
    args: argparse.Namespace,
    model: Any,
    h: Any,
    prompt: np.ndarray,
    ram_mods: dict[int, Any],
    tables: dict[int, Any],
    mods: dict[int, Any],
    dec: Any,
    fill_layer: Any,
    bufs: dict[str, np.ndarray],
    b: int,
) -> dict[str, Any]:
    """A ``--paired`` child: the in-RAM tables and this arm decode the same prompt in one
    process, alternating blocks of ``PAIR_BLOCK`` steps (ram, arm, arm, ram, ...), so drift
    of the machine cancels; returns the ratio of their summed step times, the per-block
    ratios' median, and whether the two token sequences are equal. The arm starts first: a
    cold arm's first reads are measured cold."""
    import torch

    class Side:
        def __init__(
            self, tables: dict[int, Any], mods: dict[int, Any], dec: Any, prefetch: bool
        ) -> None:
            self.tables, self.mods, self.dec, self.prefetch = tables, mods, dec, prefetch
            self.streams = {
                lay: h.stream(layer=lay, compressed=True, local=True) for lay in ENGRAM_AFTER
            }
            self.wrapped: dict[int, Any] = {}
            self.toks: list[np.ndarray] = []
            self.cpus: list[int] = []
            self.nxt: np.ndarray | None = None
            self.feed_s = 0.0
            self.look_s = 0.0
            self.feeds: list[float] = []  # per step (not the prefills)
            self.sleeps = 0  # the engine thread's waits (voluntary switches) in its steps
            self.others = 0  # busy ticks of the CPUs other than --engine-cpu in its blocks
            self.first_at = 0.0  # time.monotonic() at its first step

        def enter(self) -> None:
            for lay in ENGRAM_AFTER:
                if lay not in self.wrapped:
                    model.set_table(lay, self.tables[lay])
                    self.wrapped[lay] = model.engram[str(lay)].multi_head_embedding
                model.engram[str(lay)].multi_head_embedding = self.wrapped[lay]
            model.before_layer = None if self.dec is None else self.timed_fill

        def timed_fill(self, lay: int) -> None:
            t0 = time.perf_counter()
            fill_layer(lay)
            Clock.add("fill", time.perf_counter() - t0)

        def feed(self, col: np.ndarray) -> dict[int, Any]:
            t0 = time.perf_counter()
            try:
                return self._feed(col)
            finally:
                self.feed_s += time.perf_counter() - t0

        def _feed(self, col: np.ndarray) -> dict[int, Any]:
            d = self.dec
            if d is not None:
                d.push(col[:, 0]) if col.shape[1] == 1 else d.prefill(col)
                return {lay: model_ids(d, lay, col.shape[1]) for lay in d.layers}
            hashes = {lay: torch.from_numpy(st.push(col)) for lay, st in self.streams.items()}
            if self.prefetch:
                for lay, ids in hashes.items():
                    self.mods[lay].prefetch(ids)
            return hashes

        def start(self) -> None:
            self.enter()
            if self.dec is not None:
                self.dec.reset()
                new_bufs(bufs, self.dec, prompt.shape[1])
            self.nxt = model(torch.from_numpy(prompt), self.feed(prompt)).numpy()
            if self.dec is not None:
                new_bufs(bufs, self.dec)

        def steps(self, n: int) -> float:
            self.enter()
            if self.dec is not None and bufs["out"].shape != self.dec.out_shape:
                new_bufs(bufs, self.dec)
            total = 0.0
            s0 = thread_sleeps()  # (read per block: a /proc read inside a step would cost)
            c0 = cpu_busy_ticks() if args.engine_cpu is not None else []
            if not self.first_at:
                self.first_at = time.monotonic()
            for _ in range(n):
                assert self.nxt is not None
                self.toks.append(self.nxt.copy())
                Clock.total = 0.0
                t0 = time.perf_counter()
                col = self.nxt.reshape(-1, 1)
                f0 = self.feed_s
                self.nxt = model(torch.from_numpy(col), self.feed(col)).numpy()
                total += time.perf_counter() - t0
                self.feeds.append(self.feed_s - f0)
                self.look_s += Clock.total
                self.cpus.append(current_cpu())
            self.sleeps += thread_sleeps() - s0
            c1 = cpu_busy_ticks() if c0 else []
            if c0 and len(c0) == len(c1):
                self.others += sum(
                    b - a for i, (a, b) in enumerate(zip(c0, c1)) if i != args.engine_cpu
                )
            return total

    ram = Side(ram_mods, {}, None, False)
    arm = Side(tables, mods, dec, "module+pf" in args.child)
    with torch.no_grad():
        arm.start()  # first: the cold arm's first reads are part of what is measured
        ram.start()
        pin_engine(args)  # after both starts: the library's threads exist by now
        blocks = args.steps // PAIR_BLOCK
        t_ram, t_arm, ratios, times = 0.0, 0.0, [], []
        for k in range(blocks):
            first, second = (ram, arm) if k % 2 == 0 else (arm, ram)
            a = first.steps(PAIR_BLOCK)
            c = second.steps(PAIR_BLOCK)
            tr, ta = (a, c) if first is ram else (c, a)
            t_ram += tr
            t_arm += ta
            ratios.append(tr / ta)
            times.append((tr, ta))
    diff = [i for i, (x, y) in enumerate(zip(ram.toks, arm.toks)) if not np.array_equal(x, y)]
    first = None
    if diff:  # where the two decodes part: the step, and which sequences of the batch
        i = diff[0]
        first = {"step": i, "sequences": np.flatnonzero(ram.toks[i] != arm.toks[i]).tolist()}
    doc: dict[str, Any] = {
        "paired_vs_ram": t_ram / t_arm,
        "paired_block_median": float(np.median(ratios)),
        "paired_blocks": blocks,
        "paired_block_times": times,
        "paired_tokens_identical": not diff and len(ram.toks) == len(arm.toks),
        "paired_first_difference": first,
        "arm_cpus": arm.cpus,
        # per step, [in-RAM, arm]: the ids' keygen (or the decoder's push), the table calls
        # inside the forward (module forwards, fills), and the whole step
        "paired_feed_us": [sum(x.feeds) / max(1, len(x.feeds)) * 1e6 for x in (ram, arm)],
        # the per-step feed's p50 / p90 / max (us), [in-RAM, arm]
        "paired_feed_pcts_us": [
            (np.percentile(x.feeds, [50, 90, 100]) * 1e6).tolist() for x in (ram, arm)
        ],
        "paired_lookup_us": [x.look_s / max(1, len(x.toks)) * 1e6 for x in (ram, arm)],
        "paired_step_us": [t * 1e6 / max(1, blocks * PAIR_BLOCK) for t in (t_ram, t_arm)],
        # the engine thread's waits a step, [in-RAM, arm]: for a read, or for the GIL while
        # another thread of the process (a background warm, a prefetcher) ran Python
        "paired_sleeps_per_step": [x.sleeps / max(1, len(x.toks)) for x in (ram, arm)],
        "first_step_at": arm.first_at,
    }
    if args.engine_cpu is not None:
        # the other CPUs' busy time a step (ms), [in-RAM, arm]: what ran beside the engine
        # thread (the library's threads, the kernel's reads, other jobs)
        doc["paired_other_cpus_ms"] = [
            x.others * 1e3 / TICKS / max(1, len(x.toks)) for x in (ram, arm)
        ]
    return doc


def pin_engine(args: argparse.Namespace) -> None:
    """``--engine-cpu N``: the decoding thread from here on runs on CPU ``N`` only. The
    library's worker threads it starts later (submitters, warm, prefetch) leave that pin:
    they run on the process's other CPUs (`engramdb._cpus`)."""
    if args.engine_cpu is not None:
        os.sched_setaffinity(0, {args.engine_cpu})


#: Steps per block of the ``--paired`` alternation.
PAIR_BLOCK = 8
#: Clock ticks a second (``/proc/stat``'s unit).
TICKS = os.sysconf("SC_CLK_TCK")


# -- the training-side figure -------------------------------------------------------------------
def train_child(args: argparse.Namespace) -> None:
    """corpus -> e_t -> a training step (layer 1's table, warm): db.stream vs np.take from RAM."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    import engramdb
    from engramdb import keygen

    root = Path(args.root)
    cfg = engram_config(args)
    h = keygen.hasher("engram-peft", cfg)
    lay, bt = 1, 8192
    corpus = np.random.default_rng(5).integers(0, args.vocab, args.train_tokens)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM * HEADS, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    target = torch.zeros(bt, 1)

    def train_step(e: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(net(e), target[: e.shape[0]])
        opt.zero_grad()
        loss.backward()
        opt.step()

    out: dict[str, Any] = {}
    for with_step in (False, True):
        db = engramdb.open(db_dir(root, args.built))
        c0, p0 = sum(cpu_busy_ticks()), os.times()
        t0 = time.perf_counter()
        n = 0
        s = db.stream(corpus, preset=h, table=f"l{lay}", layer=lay, batch_tokens=bt)
        for toks, e_t in s:
            e = torch.from_numpy(e_t).view(torch.float32).view(-1, DIM * HEADS)
            if with_step:
                train_step(e)
            n += len(toks)
        wall = time.perf_counter() - t0
        c1, p1 = sum(cpu_busy_ticks()), os.times()
        key = "stream_train" if with_step else "stream_feed"
        out[key] = n / wall
        # what the stream had (both CPUs?) and found (the table resident? a warm pass first?)
        own = (p1.user - p0.user) + (p1.system - p0.system)
        st = s.stats()
        out[key + "_run"] = {
            "cores": own / wall,
            "others_cores": max(0.0, (c1 - c0) / TICKS - own) / wall if c0 and c1 else None,
            "mode": st.get("mode"),
            "resident_before": st.get("resident_before"),
            "warm_seconds": st.get("warm_seconds"),
        }
        db.close()
    table = np.fromfile(table_path(root, lay), dtype=np.uint8).reshape(-1, ROW_BYTES)
    buf = np.empty((bt * HEADS, ROW_BYTES), np.uint8)
    for with_step in (False, True):
        t0 = time.perf_counter()
        for i in range(0, corpus.size, bt):
            ids = h.row_ids(corpus[max(0, i - 2) : i + bt], layer=lay, compressed=True)
            ids = ids[min(i, 2) :].reshape(-1)
            np.take(table, ids, axis=0, out=buf[: ids.size], mode="clip")
            e = torch.from_numpy(buf[: ids.size]).view(torch.float32).view(-1, DIM * HEADS)
            if with_step:
                train_step(e)
        out["ram_train" if with_step else "ram_feed"] = corpus.size / (time.perf_counter() - t0)
    print("RESULT " + json.dumps(out))


# -- the parent ---------------------------------------------------------------------------------
def spawn(
    args: argparse.Namespace, root: Path, arm: str, b: int, paired: bool = False
) -> dict[str, Any]:
    state, _, gpu = parse_arm(arm)
    if state == "cold":
        evict_tables(root, args.built)
    elif state.startswith("warm"):
        warm_tables(root, args.built)
    cmd = [sys.executable, __file__, "--child", arm, "--batch", str(b), "--root", str(root)]
    size = {"hidden": args.gpu_hidden, "blocks": args.gpu_blocks} if gpu else {}
    size.setdefault("blocks", blocks_for(args.blocks, b))
    for k in ("table_gb", "steps", "hidden", "blocks", "vocab", "prompt", "train_tokens"):
        cmd += [f"--{k.replace('_', '-')}", str(size.get(k, getattr(args, k)))]
    if args.no_background_warm:
        cmd.append("--no-background-warm")
    if args.switch_interval_ms is not None:
        cmd += ["--switch-interval-ms", str(args.switch_interval_ms)]
    if args.engine_cpu is not None:
        cmd += ["--engine-cpu", str(args.engine_cpu)]
    if args.built:
        cmd.append("--built")
    if paired:
        cmd.append("--paired")
    return run_child(cmd, f"arm {arm} B={b}", args.arm_timeout)


#: The decode step (ms, p50 of the in-RAM arm) issue 18's end-to-end bar is set at.
STEP_BAR_MS = (5.0, 10.0)


def blocks_for(spec: str | int, batch: int) -> int:
    """The model's block count at ``batch`` from ``--blocks``: ``"4"``, or ``"1:10,8:4"`` (a
    batch not named takes the count of the largest named batch below it, else the first)."""
    text = str(spec)
    if ":" not in text:
        return int(text)
    pairs = sorted((int(b), int(n)) for b, n in (p.split(":") for p in text.split(",") if p))
    below = [n for b, n in pairs if b <= batch]
    return below[-1] if below else pairs[0][1]


class ArmFailed(Exception):
    """A child process (one arm and B, or the training side) failed or ran past
    ``--arm-timeout``."""


def _ratio(times: list[tuple[float, float]]) -> float:
    """In-RAM over arm time summed over paired blocks ``(in-RAM, arm)`` (nan: none)."""
    arm = sum(t[1] for t in times)
    return sum(t[0] for t in times) / arm if arm else float("nan")


def run_child(cmd: list[str], what: str, timeout: float) -> dict[str, Any]:
    """Run a child of this probe; the JSON of its last ``RESULT`` line."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ArmFailed(f"{what} ran past {timeout} s") from e
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise ArmFailed(f"{what} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(lines[-1][7:])  # type: ignore[no-any-return]


def summarize(runs: dict[str, list[dict[str, Any]]], b: int) -> tuple[dict[str, Any], bool]:
    """Per arm: medians and ratios to the first arm (the in-RAM table); on the GPU path also
    to ``gpu:host`` (the table in host RAM, staged like the EngramDB arms)."""
    ram = next(iter(runs.values()))
    host = runs.get("gpu:host")
    host_tps = median([r["tokens_per_s"] for r in host]) if host else None
    ref = ram[0]["tokens"]
    ram_tps = median([r["tokens_per_s"] for r in ram])
    ram_pre = median([r["prefill_ms"] for r in ram])
    ram_lk = median([r["lookup_ms"] for r in ram])
    ok = True
    rows: dict[str, Any] = {}
    print(
        f"B={b}  {'arm':18s} {'tok/s':>8s} {'vs RAM':>7s} {'p50 ms':>7s} {'p99 ms':>7s} "
        f"{'lookup ms':>9s} {'minflt':>7s} {'majflt':>7s} {'anon MB':>8s} {'file MB':>8s} "
        f"{'prefill ms':>10s} {'vs RAM':>6s} {'resident':>9s} same"
    )
    for arm, rs in runs.items():
        same = all(r["tokens"] == ref for r in rs)
        ok &= same
        m = {
            k: median([r[k] for r in rs])
            for k in (
                "tokens_per_s",
                "step_p50_ms",
                "step_p99_ms",
                "lookup_ms",
                "minflt",
                "majflt",
                "RssAnon",
                "RssFile",
                "prefill_ms",
                "resident_before",
                "slow_steps",
                "excess_ms",
                "slow_lookup_ms",
                "irq_cpu_share",
            )
        }
        m["decode_vs_ram"] = m["tokens_per_s"] / ram_tps
        m["prefill_vs_ram"] = m["prefill_ms"] / ram_pre
        m["lookup_vs_ram"] = m["lookup_ms"] / ram_lk
        m["decode_vs_ram_reps"] = [r["tokens_per_s"] / ram_tps for r in rs]
        if host_tps:
            m["decode_vs_host"] = m["tokens_per_s"] / host_tps
        m["tokens_identical"] = same
        m["lookup_parts_us"] = {
            k: median([r["lookup_parts_us"].get(k, 0.0) for r in rs])
            for k in rs[0]["lookup_parts_us"]
        }
        for k in (
            "prefetched_share",
            "served_read",
            "auto_switches",
            "module_prefetches",
            "warm_bytes_read",
            "warm_paced_bytes",
        ):
            if k in rs[0]:
                m[k] = median([r[k] for r in rs])
        rows[arm] = m
        print(
            f"     {arm:18s} {m['tokens_per_s']:8.1f} {m['decode_vs_ram']:6.3f}x "
            f"{m['step_p50_ms']:7.2f} {m['step_p99_ms']:7.2f} {m['lookup_ms']:9.3f} "
            f"{m['minflt']:7.1f} {m['majflt']:7.1f} {m['RssAnon']:8.0f} {m['RssFile']:8.0f} "
            f"{m['prefill_ms']:10.1f} {m['prefill_vs_ram']:5.2f}x {m['resident_before']:8.1%} "
            f"{'yes' if same else 'NO'}"
            + (
                f"  (prefetched {m['prefetched_share']:.0%} of steps, "
                f"{m['served_read']:.0f} hook misses, {m['auto_switches']:.0f} auto switches)"
                if "prefetched_share" in m
                else ""
            )
            + (
                f"  (background warm read {m['warm_bytes_read'] / 1e9:.2f} GB, "
                f"{m['warm_paced_bytes'] / 1e9:.2f} GB of it paced)"
                if "warm_bytes_read" in m
                else ""
            )
        )
        print(
            f"     {'':18s} per rep vs RAM: "
            + " ".join(f"{x:.3f}" for x in m["decode_vs_ram_reps"])
            + "; lookup us/step: "
            + ", ".join(f"{k} {v:.0f}" for k, v in m["lookup_parts_us"].items())
            + f"; {m['slow_steps']:.0f} steps > 1.3x p50 ({m['slow_lookup_ms']:.0f} ms of lookup"
            + f" in them), {m['excess_ms']:.0f} ms over p50 in all"
            + (
                f"; {m['irq_cpu_share']:.0%} of steps on the disk's interrupt CPUs "
                f"{rs[0]['irq_cpus']}"
                if rs[0].get("irq_cpus")
                else "; the disk's interrupt CPUs not found"
            )
            + (f"; vs gpu:host {m['decode_vs_host']:.3f}x" if host_tps else "")
        )
    step = rows[next(iter(rows))]["step_p50_ms"]
    if not STEP_BAR_MS[0] <= step <= STEP_BAR_MS[1]:
        print(
            f"  note: the in-RAM step is {step:.2f} ms at B={b}, outside the "
            f"{STEP_BAR_MS[0]:.0f}-{STEP_BAR_MS[1]:.0f} ms the end-to-end bar is set at"
        )
    return rows, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 x 128 MB tables, 128 steps, 2 reps")
    ap.add_argument("--full", action="store_true", help="2 x 2.1 GB tables, 256 steps, 3 reps")
    ap.add_argument("--table-gb", type=float, default=1.0, help="GB of tables in all")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--hidden", type=int, default=448)
    ap.add_argument(
        "--blocks",
        default="1:10,8:4",
        help="MLP blocks: a count, or per batch size (B:N,...); default: a 5-10 ms step here",
    )
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="CPU arms ('' for none)")
    ap.add_argument(
        "--gpu-arms",
        default=DEFAULT_GPU_ARMS,
        help="the CUDA engine path's arms, run where a CUDA device is present ('' for none)",
    )
    ap.add_argument("--gpu-hidden", type=int, default=4096, help="GPU model width")
    ap.add_argument(
        "--gpu-blocks",
        type=int,
        default=16,
        help="GPU model blocks (f32; 4096 x 16 blocks: 8.6 GB of weights, a 6-8 ms step on an "
        "H200; 32 blocks: 12-14 ms)",
    )
    ap.add_argument("--train-tokens", type=int, default=1 << 20)
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument(
        "--arm-timeout", type=float, default=600.0, help="seconds one arm's process may run"
    )
    ap.add_argument(
        "--no-background-warm",
        action="store_true",
        help="open tables with background_warm=False (default: the library default, on: a "
        "first cold or faulting read of a table that fits warms and populates it)",
    )
    ap.add_argument(
        "--paired",
        action="store_true",
        help="also decode with the in-RAM tables inside each arm's process, alternating blocks "
        "of 8 steps with the arm (drift cancels), and report that ratio per arm",
    )
    ap.add_argument(
        "--paired-only",
        action="store_true",
        help="with --paired: run only the paired process of each arm but the first (no "
        "separate, unpaired arm processes)",
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval in each arm's process (default: Python's 5 ms)",
    )
    ap.add_argument(
        "--engine-cpu",
        type=int,
        default=None,
        help="run each arm's decoding thread on this CPU only, from its prefill on (default: "
        "the scheduler's choice; the summary reports the share of steps on the CPUs that "
        "take the table disk's interrupts)",
    )
    ap.add_argument(
        "--built",
        action="store_true",
        help="EngramDB arms read tables built by engramdb.build (1 GB shards), not attached",
    )
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the tables")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "train":
        train_child(args)
        return
    if args.child:
        child(args)
        return
    if args.quick:
        args.table_gb, args.steps, args.reps, args.train_tokens = 0.256, 128, 2, 1 << 19
    if args.full:
        args.table_gb, args.steps, args.reps = 4.2, 256, 3
    arms = [a for a in args.arms.split(",") if a]
    if arms and arms[0] != "ram":
        raise SystemExit("the first arm must be ram (the baseline)")
    gpu_arms = [a for a in args.gpu_arms.split(",") if a]
    for a in arms + gpu_arms:  # an unknown arm exits here, before any table is built
        parse_arm(a)
    batches = [int(x) for x in args.batches.split(",")]
    last = max(ENGRAM_AFTER.values())  # the block the last Engram layer follows
    for b in batches:
        n = blocks_for(args.blocks, b)
        if arms and n <= last:  # (the layer would never run: one table, not two)
            raise SystemExit(
                f"--blocks {args.blocks} gives {n} blocks at B={b}: the Engram layer after "
                f"block {last} needs at least {last + 1}"
            )
    if gpu_arms and args.gpu_blocks <= last:
        raise SystemExit(
            f"--gpu-blocks {args.gpu_blocks}: the Engram layer after block {last} needs at "
            f"least {last + 1}"
        )
    if gpu_arms and gpu_arms[0] != "gpu:ram":
        raise SystemExit("the first GPU arm must be gpu:ram (the baseline)")
    if gpu_arms:
        import e2e_gpu

        why = e2e_gpu.cuda_note()
        if why is not None:
            print(f"GPU arms skipped: {why}")
            gpu_arms = []
        else:  # cuBLAS picks the same kernels in every arm's process: identical tokens
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="e2e_decode_"))
    root.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"args": vars(args), "cpu": cpu_note()}
    ok = True
    try:
        from engramdb import keygen

        h = keygen.hasher("engram-peft", engram_config(args))
        t0 = time.perf_counter()
        if not (root / "db" / "manifest.json").exists():
            build_tables(args, root, h)
        if args.built and not (db_dir(root, True) / "manifest.json").exists():
            build_copies(root, h)
        gb = sum(table_path(root, lay).stat().st_size for lay in ENGRAM_AFTER) / 1e9
        print(
            f"tables: {len(ENGRAM_AFTER)} layers, {gb:.2f} GB in all, ready in "
            f"{time.perf_counter() - t0:.1f} s; model hidden {args.hidden}, blocks {args.blocks}, "
            f"vocab {args.vocab}; {args.steps} steps, {args.reps} reps, fresh process per arm"
        )
        doc["table_gb"] = gb
        for path, path_arms in (("cpu", arms), ("gpu", gpu_arms)):
            if not path_arms:
                continue
            if path == "gpu":
                print(
                    f"GPU arms on {e2e_gpu.device_name()}: model hidden {args.gpu_hidden}, "
                    f"{args.gpu_blocks} blocks (f32); rows staged through pinned host memory, "
                    "H2D on a side stream; baselines gpu:ram (table in GPU memory) and gpu:host "
                    "(table in host RAM, staged the same way)"
                )
            for b in batches:
                rows, same = run_batch(args, root, path_arms, b)
                ok &= same
                doc[f"B{b}" if path == "cpu" else f"gpu_B{b}"] = rows
        if not args.no_train:
            warm_tables(root, args.built)
            tr = train_run(args, root)
            doc["train"] = tr
            print(
                f"training side (layer 1 table, warm, batch 8192 tokens, torch on one thread): e_t feed "
                f"db.stream {tr['stream_feed'] / 1e6:.2f} M tokens/s vs np.take from RAM "
                f"{tr['ram_feed'] / 1e6:.2f} M ({tr['stream_feed'] / tr['ram_feed']:.2f}x; bar >= "
                f"1 M/s); feed + training step {tr['stream_train'] / 1e3:.1f} k vs "
                f"{tr['ram_train'] / 1e3:.1f} k tokens/s ({tr['stream_train'] / tr['ram_train']:.2f}x)"
            )
            run = tr.get("stream_feed_run")
            if run:  # what a slow feed figure had and found
                others = run["others_cores"]
                print(
                    f"  the feed's stream: {run['mode']} mode, table "
                    f"{(run['resident_before'] or 0):.1%} resident at open, its warm pass "
                    + (f"{run['warm_seconds']:.2f} s" if run["warm_seconds"] else "not run")
                    + f"; the process used {run['cores']:.2f} CPUs"
                    + (f", other processes {others:.2f}" if others is not None else "")
                )
        doc["tokens_identical"] = ok
        print(f"tokens identical in every arm: {ok}; wrote {write_json('e2e_decode', doc)}")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


def run_batch(
    args: argparse.Namespace, root: Path, arms: list[str], b: int
) -> tuple[dict[str, Any], bool]:
    """Every arm at batch ``b``, ``--reps`` times interleaved (ABBA); prints the table."""
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    pairs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms[1:]}
    failed = False
    for rep in range(args.reps):
        order = arms if rep % 2 == 0 else arms[:1] + arms[1:][::-1]
        for arm in order:
            try:  # a failed arm is reported and the others still run (exit status 1)
                pair = args.paired and parse_arm(arm)[1] not in ("ram", "host")
                if not (pair and args.paired_only):
                    runs[arm].append(spawn(args, root, arm, b))
                if pair:
                    pairs[arm].append(spawn(args, root, arm, b, paired=True))
            except ArmFailed as e:
                print(f"FAILED: {e}")
                failed = True
                if arm == arms[0]:
                    return {}, False
    rows, ok = summarize({a: rs for a, rs in runs.items() if rs}, b)
    ok &= not failed
    if args.paired:
        print(f"  B={b} paired in one process (8-step blocks alternating with in-RAM):")
        for arm, ps in pairs.items():
            if not ps:
                continue
            rows.setdefault(arm, {"tokens_identical": True})  # --paired-only: no unpaired row
            rows[arm]["paired_vs_ram"] = median([p["paired_vs_ram"] for p in ps])
            rows[arm]["paired_vs_ram_reps"] = [p["paired_vs_ram"] for p in ps]
            rows[arm]["paired_irq_cpu_share"] = [p["irq_cpu_share"] for p in ps]
            same_p = all(p["paired_tokens_identical"] for p in ps)
            ok &= same_p
            print(
                f"     {arm:18s} {rows[arm]['paired_vs_ram']:.3f}x  per rep "
                + " ".join(f"{p['paired_vs_ram']:.3f}" for p in ps)
                + "  block medians "
                + " ".join(f"{p['paired_block_median']:.3f}" for p in ps)
                + f"  resident at start {median([p['resident_before'] for p in ps]):.1%}"
                + "  steps on the disk's interrupt CPU "
                + " ".join(f"{p['irq_cpu_share']:.0%}" for p in ps)
                + f"  tokens identical {'yes' if same_p else 'NO'}"
                + "".join(
                    f"  (rep {k}: first difference at step {d['step']}, sequences {d['sequences']})"
                    for k, d in enumerate(p.get("paired_first_difference") for p in ps)
                    if d
                )
            )
            lo, mid, hi = pooled_ratio([t for p in ps for t in p["paired_block_times"]])
            rows[arm]["paired_pooled"] = [lo, mid, hi]
            # per rep, each block's (in-RAM, arm) seconds: where in the run the time went
            rows[arm]["paired_block_times"] = [p["paired_block_times"] for p in ps]
            early = [_ratio(p["paired_block_times"][:4]) for p in ps]
            late = [_ratio(p["paired_block_times"][4:]) for p in ps]
            print(
                f"                        pooled over the reps' blocks: {mid:.3f}x "
                f"(95% bootstrap interval {lo:.3f}-{hi:.3f}); per rep, the first 4 blocks "
                + " ".join(f"{x:.3f}" for x in early)
                + ", the rest "
                + " ".join(f"{x:.3f}" for x in late)
            )
            gaps = []
            for p in ps:  # where the arm's extra time a step went
                (fr, fa), (lr, la) = p["paired_feed_us"], p["paired_lookup_us"]
                sr, sa = p["paired_step_us"]
                gaps.append(
                    f"{sa - sr:+.0f} = feed {fa - fr:+.0f} + table calls {la - lr:+.0f} + rest "
                    f"{(sa - fa - la) - (sr - fr - lr):+.0f}"
                )
            print("                        arm - in-RAM per step (us): " + "; ".join(gaps))
            if all(p.get("paired_other_cpus_ms") for p in ps):
                print(
                    "                        other CPUs busy a step (ms), in-RAM / arm: "
                    + "; ".join("{:.2f} / {:.2f}".format(*p["paired_other_cpus_ms"]) for p in ps)
                )
            if any(p.get("warm_pass_ms") for p in ps):
                print(
                    "                        background warm passes (ms from the arm's first "
                    "step, start..end, per table): "
                    + "; ".join(
                        " ".join(
                            f"{w[0]:.0f}..{w[1]:.0f}" if w else "none"
                            for w in p.get("warm_pass_ms", [])
                        )
                        for p in ps
                    )
                )
            if all("paired_sleeps_per_step" in p for p in ps):
                print(
                    "                        engine thread's waits a step (read or GIL), "
                    "in-RAM / arm: "
                    + "; ".join("{:.2f} / {:.2f}".format(*p["paired_sleeps_per_step"]) for p in ps)
                )
            print(
                "                        per rep: feed p50/p90 in-RAM, arm (us) "
                + "; ".join(
                    "{:.0f}/{:.0f}, {:.0f}/{:.0f}".format(
                        *p["paired_feed_pcts_us"][0][:2], *p["paired_feed_pcts_us"][1][:2]
                    )
                    for p in ps
                    if "paired_feed_pcts_us" in p
                )
                + "; resident at the end "
                + " ".join(f"{p.get('resident_after', float('nan')):.1%}" for p in ps)
                + "; process anon/file MB "
                + " ".join(f"{p.get('RssAnon', 0):.0f}/{p.get('RssFile', 0):.0f}" for p in ps)
                + "; background warm read (GB, paced) "
                + " ".join(
                    "{:.2f} ({:.2f})".format(
                        p.get("warm_bytes_read", 0) / 1e9, p.get("warm_paced_bytes", 0) / 1e9
                    )
                    for p in ps
                )
                + (
                    "; locked (GB) " + " ".join(f"{p['locked_bytes'] / 1e9:.2f}" for p in ps)
                    if all("locked_bytes" in p for p in ps)
                    else ""
                )
                + (
                    "; prefetched "
                    + " ".join(f"{p['prefetched_share']:.0%}" for p in ps)
                    + " of steps"
                    if all("prefetched_share" in p for p in ps)
                    else ""
                )
            )
    base = arms[0]
    for warm_arm in ("warm:module", "warm:gpu:module"):
        warm = rows.get(warm_arm)
        if warm is not None and "lookup_ms" in warm:  # --paired-only: no unpaired figure
            print(
                f"  B={b} warm lookup per step: DiskMultiHeadEmbedding ({warm_arm}) "
                f"{warm['lookup_ms'] * 1e3:.1f} us vs nn.Embedding (engram-peft's "
                f"MultiHeadEmbedding, {base}) {rows[base]['lookup_ms'] * 1e3:.1f} us = "
                f"{warm['lookup_vs_ram']:.2f}x" + (" (bar <= 1.5x)" if base == "ram" else "")
            )
    return rows, ok


def train_run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "train", "--root", str(root)]
    for k in ("table_gb", "hidden", "blocks", "vocab", "train_tokens"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.built:
        cmd.append("--built")
    try:
        return run_child(cmd, "the training arm", args.arm_timeout)
    except ArmFailed as e:
        raise SystemExit(str(e)) from e


if __name__ == "__main__":
    main()
