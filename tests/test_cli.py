"""The command line, through click's runner (same process) and one real subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

import engramdb
from engramdb.cli import main


def run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def test_build_info_verify(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.integers(0, 256, (100, 264), dtype=np.uint8)
    np.save(tmp_path / "a.npy", a)
    db = tmp_path / "db"
    code, out = run(
        "build",
        db,
        tmp_path / "a.npy",
        "--table",
        "l1",
        "--row-bytes",
        "264",
        "--heads",
        "40,60",
        "--dtype",
        "fp8_e4m3+ue8m0",
        "-q",
    )
    assert code == 0, out
    assert "100 rows" in out and "GB/s" in out
    code, out = run("info", db)
    assert code == 0 and "l1: 100 rows x 264 B" in out and "[40, 60]" in out
    code, out = run("info", db, "--json")
    doc = json.loads(out)
    assert doc["tables"]["l1"]["dtype"] == "fp8_e4m3+ue8m0"
    assert [h["offset"] for h in doc["tables"]["l1"]["heads"]] == [0, 40]
    code, out = run("verify", db, "-q")
    assert code == 0 and "ok" in out
    with engramdb.open(db) as d:
        assert np.array_equal(d["l1"].fetch(np.arange(100)), a)


def test_cli_errors_are_clean(tmp_path: Path, rng: np.random.Generator) -> None:
    np.save(tmp_path / "a.npy", rng.integers(0, 256, (10, 8), dtype=np.uint8))
    db = tmp_path / "db"
    assert run("build", db, tmp_path / "a.npy", "-t", "x", "-r", "8", "-q")[0] == 0
    code, out = run("build", db, tmp_path / "a.npy", "-t", "x", "-r", "8", "-q")
    assert code == 1 and "TableExists" in out and "--force" in out
    assert "Traceback" not in out
    code, out = run("build", db, tmp_path / "a.npy", "-t", "y", "-r", "9", "-q")
    assert code == 1 and "SourceError" in out
    code, out = run("build", db, tmp_path / "a.npy", "-t", "y", "-r", "8", "--heads", "3,x")
    assert code == 2 and "comma-separated" in out
    code, out = run("info", tmp_path)
    assert code == 1 and "DatabaseNotFound" in out


def test_verify_reports_corruption(db_factory) -> None:  # type: ignore[no-untyped-def]
    db, _ = db_factory({"t": (8, (64,))})
    shard = db / engramdb.open(db).manifest.tables["t"].shards[0].path
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", str(db), "-q"])
    assert r.exit_code == 1
    assert "MISMATCH table 't'" in r.output and "bytes [0, 512)" in r.output


def test_drop(db_factory) -> None:  # type: ignore[no-untyped-def]
    db, _ = db_factory({"t": (8, (4,))})
    code, out = run("drop", db, "-t", "t")
    assert code == 0
    assert engramdb.open(db).tables == []


def test_every_command_has_help() -> None:
    def walk(group, prefix):  # type: ignore[no-untyped-def]
        for name, cmd in group.commands.items():
            assert cmd.help and cmd.help.strip(), f"{prefix} {name} has no help"
            code, out = run(*(prefix + [name, "--help"]))
            assert code == 0 and "Usage" in out
            if hasattr(cmd, "commands"):
                walk(cmd, prefix + [name])

    walk(main, [])


def test_demo_end_to_end(tmp_path: Path) -> None:
    """The README's main job, as a real subprocess of the installed console script."""
    exe = shutil.which("engramdb")
    cmd = [exe] if exe else [sys.executable, "-m", "engramdb"]
    r = subprocess.run(
        cmd + ["demo", str(tmp_path / "demo"), "--seconds", "0.2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "M rows/s" in r.stdout and "engramdb info" in r.stdout
    steps = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert [line[:5] for line in steps] == [f"[{i}/8]" for i in range(1, 9)]
    assert all(" | " in line for line in steps)  # every step names its baseline
    assert "np.take(out=) on a populated mapping" in steps[4]
    assert f"files kept in {tmp_path / 'demo'}" in r.stdout
    assert (tmp_path / "demo" / "db" / "manifest.json").is_file()
    r = subprocess.run(
        cmd + ["demo", str(tmp_path / "demo"), "--seconds", "0.05", "--clean"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"removed {tmp_path / 'demo'}" in r.stdout and not (tmp_path / "demo").exists()


def test_build_preset_scale_synthetic_cli(tmp_path: Path) -> None:
    """`build --preset P --scale tiny --synthetic 1`: the preset's heads (pad head included),
    row format and scale recorded; the same seed gives the same bytes."""
    from engramdb.build.table import synthetic_bytes
    from engramdb.database import open as open_db
    from engramdb.keygen.presets import table_heads

    runner = CliRunner()
    for name in ("a", "b"):
        r = runner.invoke(
            main,
            [
                "build",
                str(tmp_path / name),
                "--table",
                "ple",
                "--preset",
                "qwen3.8-flash-next",
                "--scale",
                "tiny",
                "--synthetic",
                "1",
                "--quiet",
            ],
        )
        assert r.exit_code == 0, r.output
    tiny = engramdb.keygen.preset("qwen3.8-flash-next", scale="tiny")
    with open_db(tmp_path / "a") as a, open_db(tmp_path / "b") as b:
        assert list(a["ple"].info.heads) == table_heads(tiny, 2)
        assert a["ple"].row_bytes == 160 and a["ple"].info.dtype == "fp8_e4m3"
        assert a["ple"].info.extra["keygen"] == {"preset": "qwen3.8-flash-next@tiny", "layer": 2}
        ids = np.array([0, 12_345, a["ple"].n_rows - 1])
        got = a["ple"].fetch(ids)
        assert got.tobytes() == b["ple"].fetch(ids).tobytes()
        flat = synthetic_bytes(1, 0, a["ple"].n_rows * 160).reshape(-1, 160)
        assert got.tobytes() == flat[ids].tobytes()
    r = runner.invoke(
        main,
        [
            "build",
            str(tmp_path / "c"),
            "--table",
            "t",
            "--scale",
            "tiny",
            "--synthetic",
            "1",
            "--heads",
            "4",
            "--row-bytes",
            "8",
        ],
    )
    assert r.exit_code != 0 and "--preset" in r.output


# Extras a user may not have: the README's first command (`pip install -e .`) installs none.
OPTIONAL = (
    "torch",
    "safetensors",
    "pyarrow",
    "mooncake",
    "engram_peft",
    "tokenizers",
    "transformers",
)


def test_demo_needs_only_the_core_dependencies(tmp_path: Path) -> None:
    """The README's main job (`pip install -e . && engramdb demo`) with every optional
    package made unimportable: it runs on the core install alone."""
    code = f"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ImportError(f"blocked optional dependency {{name}}")
        return None
sys.meta_path.insert(0, _Block())
from engramdb.cli import main
main(["demo", {str(tmp_path / "demo")!r}, "--seconds", "0.2"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "M rows/s" in r.stdout
    shutil.rmtree(tmp_path / "demo", ignore_errors=True)


def test_demo_json_is_one_document_of_its_steps(tmp_path: Path) -> None:
    """`engramdb demo --json`: the eight steps, each with a figure and (but the serve round
    trip's) a baseline, and the notes saying where the files went."""
    import json as _json

    from click.testing import CliRunner

    from engramdb.cli import main as cli_main

    r = CliRunner().invoke(
        cli_main, ["demo", str(tmp_path / "d"), "--seconds", "0.05", "--clean", "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = _json.loads(r.output)
    assert [s["step"] for s in doc["steps"]] == list(range(1, 9))
    assert all(s["figure"] and s["of"] == 8 for s in doc["steps"])
    assert sum(s["baseline"] is not None for s in doc["steps"]) >= 6
    assert any("removed" in n for n in doc["notes"]) and not (tmp_path / "d").exists()
