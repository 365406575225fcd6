"""Tables with the Qwen PLE geometry (16 heads x 160 B rows) for the workload probes.

The published table has 320 M rows (51 GB); the probes shrink ``ngram_vocab_size_base`` so the
same hashing (same multipliers, 16 columns, prime-sized heads) addresses a table of a chosen
size, built from random bytes under a work directory that the probe deletes afterwards.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import engramdb
from engramdb import keygen
from engramdb.testing.pages import drop_mapped_pages, evict, file_residency

PRESET = "qwen3.8-flash-next"
LAYER = 2
VOCAB = 248_320
EOS = 248_044


def hasher_for_bytes(table_bytes: int) -> keygen.Hasher:
    """The Qwen PLE hasher with its heads shrunk so the table holds ~``table_bytes``."""
    base = max(1000, table_bytes // 160 // 16)
    return keygen.preset(PRESET, ngram_vocab_size_base=base)


def build_table(work: Path, h: keygen.Hasher, name: str = "ple", seed: int = 1) -> Path:
    """Build table ``name`` of ``h``'s size at ``work/db`` (random rows). Returns the db path."""
    db = work / "db"
    if (db / "manifest.json").exists():
        with engramdb.open(db) as existing:
            if name in existing.tables and existing[name].n_rows == h.table_rows(LAYER):
                return db
    rows = h.table_rows(LAYER)
    src = work / f"src-{name}.npy"
    mm = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(rows, 160))
    rng = np.random.default_rng(seed)
    step = 1 << 20
    for i in range(0, rows, step):
        k = min(step, rows - i)
        mm[i : i + k] = rng.integers(0, 256, size=(k, 160), dtype=np.uint8)
    mm.flush()
    del mm
    t0 = time.perf_counter()
    engramdb.build(db, name, 160, [src], shard_bytes=8 << 30, force=True)
    print(
        f"  built {rows:,} rows x 160 B ({rows * 160 / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s"
    )
    fd = os.open(src, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    src.unlink()
    return db


def shard_paths(store: engramdb.Store) -> list[Path]:
    return [store.db_path / s.path for s in store.info.shards]


def make_cold(store: engramdb.Store) -> float:
    """Drop the store's own page-table entries, evict its files; returns the residency left
    (mincore over the files)."""
    drop_mapped_pages(store.array())
    left = [evict(p) for p in shard_paths(store)]
    return float(np.mean(left))


def residency(store: engramdb.Store) -> float:
    return float(np.mean([file_residency(p) for p in shard_paths(store)]))


def token_stream(rng: np.random.Generator, n: int, eos_every: int = 2000) -> np.ndarray:
    """Random token ids (the hash spreads them uniformly over the table anyway) with an EOS
    about every ``eos_every`` tokens."""
    t = rng.integers(0, VOCAB, n)
    t[rng.random(n) < 1.0 / eos_every] = EOS
    return t
