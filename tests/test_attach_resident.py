"""Attached column-split tables: chunked gathers and RAM-resident narrow columns
(``engramdb.read.attached``), and a Gemma ``embed_tokens_per_layer`` checkpoint attached
with its preset, on every backend."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from test_attach import BACKENDS, V41_S, V41_W, files, v41_checkpoint

import engramdb
from engramdb.build.attach import preset_tables
from engramdb.cli import main
from engramdb.errors import InvalidArgument, TruncatedFile
from engramdb.read import attached as att
from engramdb.read import resident
from engramdb.testing.pages import evict


def segments_need(db: Path) -> int:
    """Bytes of record a table of ``db`` holds once loaded."""
    with engramdb.open(db, backend="preadv") as d:
        seg = segments(d["t"])
        assert seg.record.wait(30)
        return seg.record.nbytes


def segments(st: Any) -> att.SourceSegments:
    seg = st._segments
    assert isinstance(seg, att.SourceSegments)
    return seg


@pytest.fixture
def big_v41(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    """A V4.1 layer with more rows than a few gather chunks."""
    rows = v41_checkpoint(tmp_path / "ckpt", rng, rows=3 * att.CHUNK_ROWS + 77)
    db = tmp_path / "db"
    engramdb.attach(
        db, "t", files(tmp_path / "ckpt"), tensor=V41_W.format(1), scale_tensor=V41_S.format(1)
    )
    return db, rows[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_scale_column_every_backend(
    big_v41: tuple[Path, np.ndarray], backend: str, rng: np.random.Generator
) -> None:
    db, want = big_v41
    n = want.shape[0]
    with engramdb.open(db, backend=backend) as d:
        st = d["t"]
        seg = segments(st)
        assert seg.record.state == "idle"  # nothing is read at open
        assert st.fetch(np.arange(3)).tobytes() == want[:3].tobytes()
        assert seg.record.wait(30) and seg.record.state == "ready"
        # the 8 B scale column, not the weight (plus the weight rows' bytes on a cache line
        # of their own: tests/test_attach_record.py)
        spill = seg.record.spill
        assert seg.record.nbytes == n * (8 + (spill[1] if spill else 0))
        ((_, width),) = [(c.start, c.width) for c in seg.columns if c.resident is not None]
        assert width == 8
        for size in (1, 5, att.CHUNK_ROWS - 1, att.CHUNK_ROWS + 1, 2 * att.CHUNK_ROWS + 301):
            ids = rng.integers(0, n, size)
            assert np.array_equal(st.fetch(ids), want[ids]), size
        evict(files(db.parent / "ckpt")[0])
        ids = rng.integers(0, n, (3, 700))
        assert np.array_equal(st.fetch(ids), want[ids])  # cold: reads + the RAM column
        if backend != "mmap":
            # a cold read of a row is one read of its weight bytes: the scale is in RAM
            plan = seg.plan(np.unique(ids.reshape(-1)))
            assert plan.shard.size == plan.row_ids.size and set(plan.length.tolist()) == {256}
        out = np.empty((2, 700, 264), np.uint8)
        st.fetch_into(ids[:2], out)
        assert np.array_equal(out, want[ids[:2]])
    assert seg.record.state == "closed" and seg.record.nbytes == 0


def test_unaligned_output_and_fill_after_reads(
    big_v41: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    db, want = big_v41
    n = want.shape[0]
    with engramdb.open(db, backend="preadv") as d:
        st = d["t"]
        seg = segments(st)
        seg.record.wait(30)
        ids = rng.integers(0, n, 3000)
        buf = np.empty(3000 * 264 + 1, np.uint8)
        out = buf[1:].reshape(3000, 264)  # not 8-byte aligned: still exact
        seg.take(ids, out)
        assert np.array_equal(out, want[ids])
        plan = seg.plan(ids)
        scratch = np.zeros(plan.scratch_bytes, np.uint8)
        st.backend.read(
            st.fd_array[plan.shard], plan.offset, plan.length, scratch, plan.dest_offset
        )
        rows = scratch[: plan.row_ids.size * 264].reshape(-1, 264)
        assert not np.array_equal(rows[:, 256:], want[plan.row_ids][:, 256:])  # left out
        seg.fill_resident(plan.row_ids, rows)
        assert np.array_equal(rows, want[plan.row_ids])


def test_budget_off_reads_sources_and_is_released(
    big_v41: tuple[Path, np.ndarray], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, want = big_v41
    ids = rng.integers(0, want.shape[0], 5000)
    need = segments_need(db)
    monkeypatch.setenv(att.RESIDENT_ENV, "0")
    with engramdb.open(db) as d:
        st = d["t"]
        seg = segments(st)
        assert not seg.record.wait(5)
        assert seg.record.state.startswith("over budget")
        st.populate()
        assert np.array_equal(st.fetch(ids), want[ids])
        plan = seg.plan(np.unique(ids))
        assert plan.shard.size == 2 * plan.row_ids.size  # weight and scale read from the file
    gc.collect()  # tables other tests left unclosed return their share when collected
    # room for one more table (its scale and spill) besides what other open tables hold
    monkeypatch.setenv(att.RESIDENT_ENV, str(resident.resident_used() + need))
    with engramdb.open(db) as d1, engramdb.open(db) as d2:
        a, b = segments(d1["t"]), segments(d2["t"])
        assert a.record.wait(30)
        assert not b.record.wait(5) and b.record.state.startswith("over budget")
        assert np.array_equal(d2["t"].fetch(ids), want[ids])
        d1.close()  # releases its share: the next table fits
        with engramdb.open(db) as d3:
            assert segments(d3["t"]).record.wait(30)
    monkeypatch.setenv(att.RESIDENT_ENV, "lots")
    with pytest.raises(InvalidArgument, match=att.RESIDENT_ENV):
        att.resident_budget()


def test_truncation_with_resident_scale_still_raises(
    big_v41: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db, want = big_v41
    src = files(tmp_path / "ckpt")[0]
    with engramdb.open(db, backend="mmap") as d:
        st = d["t"]
        st.populate()
        assert segments(st).record.state == "ready"
        with open(src, "r+b") as f:
            f.truncate(4096)
        with pytest.raises(TruncatedFile, match="truncated while open") as e:
            st.fetch(np.arange(0, want.shape[0], 3))
        assert src in str(e.value)


def test_truncated_before_load_fails_the_load_not_the_process(
    big_v41: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db, _ = big_v41
    src = files(tmp_path / "ckpt")[0]
    with engramdb.open(db, backend="preadv") as d:
        st = d["t"]
        seg = segments(st)
        with open(src, "r+b") as f:
            f.truncate(8192)
        assert not seg.record.wait(30)
        assert seg.record.state.startswith("failed") and src in seg.record.state
        with pytest.raises(TruncatedFile, match="truncated while open"):
            st.fetch(np.array([5]))
    assert seg.record.nbytes == 0


def gemma_checkpoint(root: Path, rng: np.random.Generator, layers: int = 3) -> np.ndarray:
    """Gemma 3n-shaped: ``embed_tokens_per_layer.weight`` BF16 ``[vocab, layers * 256]``
    among other tensors, split over two files (the table lies in the second)."""
    root.mkdir(parents=True, exist_ok=True)
    vocab = 1100
    w = torch.from_numpy(rng.standard_normal((vocab, layers * 256), dtype=np.float32))
    w = w.bfloat16()
    save_file(
        {
            "model.language_model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
            "model.language_model.layers.0.mlp.up_proj.weight": torch.ones(8, 8),
        },
        str(root / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "model.language_model.per_layer_model_projection.weight": torch.ones(4, 4),
            "model.language_model.embed_tokens_per_layer.weight": w,
        },
        str(root / "model-00002-of-00002.safetensors"),
    )
    return w.view(torch.uint8).numpy().reshape(vocab, layers * 512)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma_embed_tokens_per_layer_preset_every_backend(
    tmp_path: Path, rng: np.random.Generator, backend: str
) -> None:
    want = gemma_checkpoint(tmp_path / "ckpt", rng)
    db = tmp_path / "db"
    if backend == BACKENDS[0]:  # the CLI once; the API for the others
        res = CliRunner().invoke(
            main, ["attach", str(db), "--preset", "gemma3n-e2b", *files(tmp_path / "ckpt")]
        )
        assert res.exit_code == 0, res.output
    else:
        (spec,) = preset_tables("gemma3n-e2b", files(tmp_path / "ckpt"))
        assert spec["table"] == "ple" and spec["scale_tensor"] is None
        engramdb.attach(db, "ple", files(tmp_path / "ckpt"), tensor=spec["tensor"])
    with engramdb.open(db, backend=backend) as d:
        st = d["ple"]
        assert st.attached and st.info.dtype == "bf16" and st.row_bytes == 3 * 512
        assert segments(st).single is not None  # one tensor: one mapped array
        ids = rng.integers(0, want.shape[0], (4, 9))
        assert np.array_equal(st.fetch(ids), want[ids])
        evict(files(tmp_path / "ckpt")[1])
        ids = rng.integers(0, want.shape[0], 600)
        assert np.array_equal(st.fetch(ids), want[ids])
        assert np.array_equal(st.fetch(np.array([0, want.shape[0] - 1])), want[[0, -1]])
