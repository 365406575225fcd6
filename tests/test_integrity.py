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
from engramdb.testing.dbs import TableSpec

#: One table of 3000 rows x 160 B in shards of four 128-row badges (six shards).
SMALL = {"t": TableSpec(160, (3000,), rows_per_badge=128, shard_bytes=128 * 160 * 4)}


@pytest.fixture
def small(db_factory):  # type: ignore[no-untyped-def]
    """``(db, rows)``: the `SMALL` database and the rows of its table."""
    db, rows = db_factory(SMALL)
    return db, rows["t"]


def test_truncated_shard_fails_at_open(small: tuple[Path, np.ndarray]) -> None:
    db, _ = small
    shard = db / engramdb.open(db).manifest.tables["t"].shards[2].path
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(TruncatedFile, match="shard-00002") as e:
        engramdb.open(db)
    assert isinstance(e.value, OSError)
    shard.unlink()
    with pytest.raises(TruncatedFile, match="missing"):
        engramdb.open(db)


def test_bit_flip_found_by_verify(small: tuple[Path, np.ndarray]) -> None:
    db, _ = small
    assert engramdb.verify(db) == []
    info = engramdb.open(db).manifest.tables["t"]
    shard = db / info.shards[1].path
    with open(shard, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x10]))
    problems = engramdb.verify(db)
    assert len(problems) == 1
    p = problems[0]
    assert p.table == "t" and p.shard == info.shards[1].path and p.start <= 12345 < p.end


def test_corrupt_manifest(small: tuple[Path, np.ndarray]) -> None:
    db, _ = small
    m = db / "manifest.json"
    doc = json.loads(m.read_text())
    doc["tables"]["t"]["n_rows"] += 1
    m.write_text(json.dumps(doc))
    with pytest.raises(CorruptManifest):
        engramdb.open(db)
    m.write_text("{not json")
    with pytest.raises(CorruptManifest) as e:
        engramdb.open(db)
    assert isinstance(e.value, OSError)
    doc["format_version"] = 99
    m.write_text(json.dumps(doc))
    with pytest.raises(CorruptManifest, match="format_version"):
        engramdb.open(db)


def test_manifest_path_escape_rejected(small: tuple[Path, np.ndarray]) -> None:
    db, _ = small
    m = db / "manifest.json"
    doc = json.loads(m.read_text())
    doc["tables"]["t"]["shards"][0]["path"] = "../../etc/passwd"
    m.write_text(json.dumps(doc))
    with pytest.raises(CorruptManifest, match="leaves the database"):
        engramdb.open(db)


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
    tmp_path: Path, small: tuple[Path, np.ndarray]
) -> None:
    db, a = small
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
