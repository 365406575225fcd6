"""The one progress display, the wait for another writer's lock, and --json everywhere."""

from __future__ import annotations

import fcntl
import io
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from engramdb.build.index import build_index
from engramdb.build.view import build_view
from engramdb.cli import main
from engramdb.cli._progress import Progress, lock_holder, wait_for_writer
from engramdb.disk.publish import LOCK_NAME
from engramdb.units import format_bytes, format_rate


def run(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def test_units_one_formatter() -> None:
    assert format_bytes(64 << 20) == "64 MiB" and format_bytes(1536 << 20) == "1.5 GiB"
    assert format_bytes(100) == "100 B" and format_bytes(0) == "0 B"
    assert format_rate(1.234e9) == "1.23 GB/s" and format_rate(1.2e7, "rows") == "12.00 M rows/s"
    assert format_rate(5e6) == "0.005 GB/s"  # a small rate keeps its digits, never 0.00


def test_progress_line_has_rows_bytes_rate_eta() -> None:
    buf = io.StringIO()
    with Progress("building t", total=1 << 20, row_bytes=256, stream=buf, force_draw=True) as p:
        time.sleep(0.06)
        p.update(1 << 19)
        time.sleep(0.06)
        p.update(1 << 18)
        p.phase("gathering", 100, "records")
        p(40, 100)
    lines = buf.getvalue().replace("\r", "\n").splitlines()
    text = [ln for ln in lines if "768 KiB / 1 MiB" in ln]
    assert text, buf.getvalue()
    assert "(3,072 rows)" in text[-1] and "GB/s" in text[-1] and "ETA" in text[-1]
    assert any("40 records / 100 records" in ln and "records/s" in ln for ln in lines)


def test_progress_is_silent_off_a_terminal() -> None:
    buf = io.StringIO()  # not a TTY
    with Progress("x", total=10, stream=buf) as p:
        p.update(5)
        p(10, 10)
    assert buf.getvalue() == ""


def test_index_reports_smoothly(tmp_path: Path) -> None:
    from tests.test_index import make_db

    db = make_db(tmp_path / "db", {"l14": 384_016_682})
    ids = (np.arange(1 << 21, dtype=np.uint32) % 50)
    np.save(tmp_path / "c.npy", ids)
    calls: list[tuple[int, int]] = []
    build_index(
        tmp_path / "c.npy", db, preset="deepseek-v4.1-flash", layer=14, compressed=True,
        progress=lambda d, t: calls.append((d, t)),
    )  # fmt: skip
    assert len(calls) >= 30 and calls[0][0] == 0 and calls[-1][0] == calls[-1][1] == 1 << 21
    steps = np.diff([0] + [c[0] for c in calls])
    assert steps.max() <= (1 << 21) // 20  # no 0 -> 41 -> 83 % jumps
    # index files are readable as the shards are
    for f in (db / "l14" / "index").iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f


def test_view_build_reports_phases_and_records(db_factory) -> None:  # type: ignore[no-untyped-def]
    db, _ = db_factory({"t": (64, (20_000,))})
    seen: list[str] = []

    class P:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def phase(self, label: str, total: int | None, unit: str) -> None:
            seen.append(label)

        def update(self, n: int) -> None:
            pass

        def __call__(self, done: int, total: int) -> None:
            self.calls.append((done, total))

    p = P()
    rows = np.random.default_rng(1).integers(0, 20_000, (60_000, 2))
    build_view(db, table="t", name="v", rows=rows, populate=True, progress=p)
    assert seen[-1] == "gathering" and "populating table" in seen
    assert p.calls[0] == (0, 60_000) and p.calls[-1] == (60_000, 60_000) and len(p.calls) >= 10


def test_wait_for_writer_names_the_pid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "db"
    db.mkdir()
    assert wait_for_writer(db) == 0.0  # no lock file yet
    fd = os.open(db / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert lock_holder(db) == os.getpid()
    threading.Timer(0.4, lambda: os.close(fd)).start()
    waited = wait_for_writer(db)
    err = capsys.readouterr().err
    assert waited >= 0.3 and f"held by PID {os.getpid()}" in err and "got the writer lock" in err
    assert wait_for_writer(db) == 0.0


def test_json_on_every_result(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.integers(0, 256, (300, 64), dtype=np.uint8)
    np.save(tmp_path / "a.npy", a)
    db = tmp_path / "db"
    code, out = run("build", db, tmp_path / "a.npy", "-t", "t", "-r", 64, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["rows"] == 300 and doc["bytes"] == 300 * 64 and "line" in doc
    a.tofile(tmp_path / "a.bin")
    code, out = run("attach", db, tmp_path / "a.bin", "-t", "att", "-r", 64, "--json")
    assert code == 0 and json.loads(out)["rows"] == 300
    np.save(tmp_path / "rows.npy", np.arange(20).reshape(10, 2))
    code, out = run("view", "build", db, "-t", "t", "--view", "r", "--rows", tmp_path / "rows.npy", "--json")
    assert code == 0 and json.loads(out)["records"] == 10, out
    code, out = run("warm", db, "-t", "t", "--json")
    assert code == 0 and json.loads(out)[0]["table"] == "t"
    code, out = run("warm", db, "-t", "t", "--check", "--json")
    assert code == 0 and json.loads(out)["t"]["bytes"] == 300 * 64
    code, out = run("verify", db, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["problems"] == []
    code, out = run("info", db, "--json")
    doc = json.loads(out)
    assert "r" in json.dumps(doc["tables"]["t"]) and doc["tables"]["t"]["index"] is None
    code, out = run("gc", db, "--json")
    assert code == 0 and json.loads(out)["removed"] == []
    code, out = run("drop", db, "-t", "att", "--json")
    assert code == 0 and json.loads(out) == {"dropped": "att"}


def test_build_waits_for_a_writer_and_does_not_time_the_wait(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    import re
    import subprocess
    import sys

    np.save(tmp_path / "a.npy", rng.integers(0, 256, (100, 64), dtype=np.uint8))
    db = tmp_path / "db"
    assert run("build", db, tmp_path / "a.npy", "-t", "a", "-r", 64, "-q")[0] == 0
    fd = os.open(db / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "engramdb", "build", str(db), str(tmp_path / "a.npy"),
           "-t", "b", "-r", "64"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stderr is not None
    first = p.stderr.readline()  # said before it blocks
    time.sleep(1.5)
    os.close(fd)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert f"waiting for the writer lock of {db} held by PID {os.getpid()}" in first
    assert "got the writer lock after" in err
    m = re.search(r"in 1 shard\(s\), ([0-9.]+) s", out)
    assert m and float(m.group(1)) < 1.0, out  # the 1.5 s wait is not build time


def test_library_build_does_not_time_a_wait_for_the_writer_lock(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """`engramdb.build` called while another writer holds the lock waits, and its summary's
    seconds count from the moment it got the lock."""
    from engramdb.build.table import build

    rows = rng.integers(0, 256, (100, 64), dtype=np.uint8)
    db = tmp_path / "db"
    build(db, "a", 64, [rows])
    fd = os.open(db / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    got: dict[str, float] = {}
    worker = threading.Thread(target=lambda: got.update(s=build(db, "b", 64, [rows]).seconds))
    t0 = time.perf_counter()
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive()  # blocked on the lock
    os.close(fd)
    worker.join(60)
    assert time.perf_counter() - t0 >= 1.0 and got["s"] < 0.9, got
