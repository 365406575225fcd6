"""`engramdb bench --quick`: the ratio table, the JSON document and the PNG it draws."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from engramdb.cli import main
from engramdb.cli._bench_suite import RESULT_KEYS


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_bench_quick_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    r = CliRunner().invoke(
        main, ["bench", "--quick", "--json", str(out_json), "--plot", str(out_png)]
    )
    assert r.exit_code == 0, r.output
    # the ratio table names each figure against its baseline
    assert "np.take(out=) on a populated mapping" in r.output and "x  warm gather" in r.output
    doc = json.loads(out_json.read_text())
    assert tuple(sorted(doc)) == tuple(sorted(RESULT_KEYS))
    cfg = doc["config"]
    assert cfg["quick"] and cfg["table_bytes"] == cfg["rows"] * cfg["row_bytes"]
    backends = {w["backend"] for w in doc["warm"]}
    assert {"np.take", "mmap", "preadv", "auto"} <= backends
    assert all(w["rows_per_s"] > 0 and w["batch"] >= 1 for w in doc["warm"])
    assert doc["cold"]["rows"] > 0 and doc["cold"]["resident_before"] < 0.5
    assert len(doc["convergence"]) >= 3
    assert [p["t_s"] for p in doc["convergence"]] == sorted(p["t_s"] for p in doc["convergence"])
    dec = doc["decode"]
    assert dec["latencies_us"] == sorted(dec["latencies_us"]) and dec["p50_us"] <= dec["p99_us"]
    assert doc["stream"]["tokens"] > 0 and doc["view"]["records"] > 0
    assert doc["serve"]["points"] and doc["serve"]["points"][0]["rows_per_s"] > 0
    names = [x["name"] for x in doc["ratios"]]
    assert len(names) >= 4 and all(math.isfinite(x["ratio"]) for x in doc["ratios"])
    # the figure: four panels, 1200 x 850 px, several series, not a blank image
    assert _png_size(out_png) == (1200, 850)
    assert out_png.stat().st_size > 40_000
    assert "series in 4 panels" in r.output
    n_series = int(r.output.split("wrote " + str(out_png) + " (")[1].split(" ")[0])
    assert n_series >= 8
    assert doc["seconds"] < 60


def test_bench_json_to_stdout_is_one_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--json -``: the document alone on stdout (the run itself is the test above)."""
    import engramdb.cli._bench_suite as suite

    seen: dict[str, object] = {}

    def fake(directory: object, **kw: object) -> dict[str, object]:
        seen.update(kw)
        return {k: None for k in RESULT_KEYS} | {"ratios": [], "seconds": 0.5}

    monkeypatch.setattr(suite, "run_bench", fake)
    r = CliRunner().invoke(main, ["bench", "--quick", "--no-serve", "--json", "-"])
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)) == set(RESULT_KEYS)
    assert seen == {"quick": True, "echo": seen["echo"], "serve": False}


def test_plot_without_matplotlib_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_mpl(name: str, *a: object, **k: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real(name, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    r = CliRunner().invoke(main, ["bench", "--quick", "--plot", "x.png"])
    assert r.exit_code == 1 and "engramdb[plots]" in r.output
