"""Truncated and bit-flipped shards, corrupt manifests, and a build killed mid-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb.errors import ChecksumMismatch, CorruptManifest, TruncatedFile  # noqa: F401


def _build(db: Path, rng: np.random.Generator) -> np.ndarray:
    a = rng.integers(0, 256, (3000, 160), dtype=np.uint8)
    engramdb.build(db, "t", 160, [a], rows_per_badge=128, shard_bytes=128 * 160 * 4)
    return a


def test_truncated_shard_fails_at_open(tmp_path: Path, rng: np.random.Generator) -> None:
    _build(tmp_path, rng)
    shard = tmp_path / engramdb.open(tmp_path).manifest.tables["t"].shards[2].path
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(TruncatedFile, match="shard-00002") as e:
        engramdb.open(tmp_path)
    assert isinstance(e.value, OSError)
    shard.unlink()
    with pytest.raises(TruncatedFile, match="missing"):
        engramdb.open(tmp_path)


def test_bit_flip_found_by_verify(tmp_path: Path, rng: np.random.Generator) -> None:
    _build(tmp_path, rng)
    assert engramdb.verify(tmp_path) == []
    info = engramdb.open(tmp_path).manifest.tables["t"]
    shard = tmp_path / info.shards[1].path
    with open(shard, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x10]))
    problems = engramdb.verify(tmp_path)
    assert len(problems) == 1
    p = problems[0]
    assert p.table == "t" and p.shard == info.shards[1].path and p.start <= 12345 < p.end


def test_corrupt_manifest(tmp_path: Path, rng: np.random.Generator) -> None:
    _build(tmp_path, rng)
    m = tmp_path / "manifest.json"
    doc = json.loads(m.read_text())
    doc["tables"]["t"]["n_rows"] += 1
    m.write_text(json.dumps(doc))
    with pytest.raises(CorruptManifest):
        engramdb.open(tmp_path)
    m.write_text("{not json")
    with pytest.raises(CorruptManifest) as e:
        engramdb.open(tmp_path)
    assert isinstance(e.value, OSError)
    doc["format_version"] = 99
    m.write_text(json.dumps(doc))
    with pytest.raises(CorruptManifest, match="format_version"):
        engramdb.open(tmp_path)


def test_manifest_path_escape_rejected(tmp_path: Path, rng: np.random.Generator) -> None:
    _build(tmp_path, rng)
    m = tmp_path / "manifest.json"
    doc = json.loads(m.read_text())
    doc["tables"]["t"]["shards"][0]["path"] = "../../etc/passwd"
    m.write_text(json.dumps(doc))
    with pytest.raises(CorruptManifest, match="leaves the database"):
        engramdb.open(tmp_path)


KILLED_BUILD = r"""
import sys, time, numpy as np, engramdb
from pathlib import Path
marker = Path(sys.argv[2])
def progress(n):
    marker.touch()
    time.sleep(0.2)
a = np.random.default_rng(1).integers(0, 256, (200_000, 160), dtype=np.uint8)
engramdb.build(sys.argv[1], "t", 160, [a], force=True, progress=progress,
               rows_per_badge=128, shard_bytes=1 << 20)
"""


def test_sigkill_mid_build_leaves_previous_database(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    db = tmp_path / "db"
    a = _build(db, rng)
    before = (db / "manifest.json").read_bytes()
    marker = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(db), str(marker)])
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None, "build child exited early"
            assert time.time() < deadline
            time.sleep(0.02)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (db / "manifest.json").read_bytes() == before
    assert engramdb.verify(db) == []
    with engramdb.open(db) as d:
        assert np.array_equal(d["t"].fetch(np.arange(3000)), a)
    staged = list((db / "t").glob(".staging-*"))
    assert staged, "the killed build had started writing"
    # the next build clears what the killed one left
    engramdb.build(db, "u", 8, [np.zeros((4, 8), np.uint8)])
    assert not list((db / "t").glob(".staging-*"))
    assert len([p for p in (db / "t").iterdir() if p.is_dir()]) == 1
