"""Attached tables: rows read in place from safetensors / raw files (`engramdb.attach`)."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from warm_checks import fetch_into_fast_when_mapped

import engramdb
from engramdb import keygen
from engramdb.cli import main
from engramdb.decode import Decoder
from engramdb.errors import (
    InvalidLayout,
    InvalidSafetensors,
    SourceChanged,
    SourceError,
    TableExists,
    TruncatedFile,
)
from engramdb.io.uring import IoUringBackend
from engramdb.testing.pages import evict, file_residency
from engramdb.warm import warm_tables

BACKENDS = ["mmap", "preadv", "auto"] + (["io_uring"] if IoUringBackend.availability()[0] else [])
V41_W = "layers.{}.engram.embed.weight"
V41_S = "layers.{}.engram.embed.scale"


def u8(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8))


def v41_checkpoint(root: Path, rng: np.random.Generator, rows: int = 3000) -> dict[str, Any]:
    """Two engram layers (F8_E4M3 [rows, 256] + F8_E8M0 [rows, 8]) in two shard files, with
    unrelated tensors around them, as the V4.1 checkpoint lays them out."""
    root.mkdir(parents=True, exist_ok=True)
    rows_by_layer = {}
    for k, layer in enumerate((1, 14)):
        w, s = u8(rng, rows + k, 256), u8(rng, rows + k, 8)
        tensors = {
            f"layers.{layer}.attn.wq.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
            V41_W.format(layer): w.view(torch.float8_e4m3fn),
            V41_S.format(layer): s.view(torch.float8_e8m0fnu),
        }
        save_file(tensors, str(root / f"model-0000{k + 1}-of-00002.safetensors"))
        rows_by_layer[layer] = np.concatenate([w.numpy(), s.numpy()], axis=1)
    return rows_by_layer


def files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.glob("*.safetensors"))


@pytest.fixture
def v41(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    rows = v41_checkpoint(tmp_path / "ckpt", rng)
    db = tmp_path / "db"
    s = engramdb.attach(
        db, "t", files(tmp_path / "ckpt"), tensor=V41_W.format(1), scale_tensor=V41_S.format(1)
    )
    assert (s.rows, s.row_bytes, s.files) == (3000, 264, 1)
    return db, rows[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_split_rows_equal_tensors_every_backend(
    v41: tuple[Path, np.ndarray], backend: str, rng: np.random.Generator
) -> None:
    db, want = v41
    ids = rng.integers(0, want.shape[0], size=(7, 33))
    with engramdb.open(db, backend=backend) as d:
        st = d["t"]
        assert st.attached and st.row_bytes == 264
        assert np.array_equal(st.fetch(ids), want[ids])
        small = rng.integers(0, want.shape[0], 5)
        assert np.array_equal(st.fetch(small), want[small])
        with pytest.raises(InvalidLayout):
            st.array()  # two tensors per row: no single mapped array


def test_column_split_ram_tier_prefetch_decoder_lookup(
    v41: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    db, want = v41
    with engramdb.open(db, ram_budget="2M") as d:
        st = d["t"]
        ids = rng.integers(0, want.shape[0], 100)  # small batches go through the tier
        for _ in range(3):  # fills, then hits the RAM tier
            assert np.array_equal(st.fetch(ids), want[ids])
        assert st.cache is not None and st.cache.stats.hits > 0
        st.prefetch(ids[:100]).wait()
        assert np.array_equal(st.fetch(ids[:100]), want[ids[:100]])
    with engramdb.open(db) as d:
        st = d["t"]
        st.prefetcher.submit(ids).wait()  # page-cache prefetch through the source files
        out = np.empty((len(ids), 264), np.uint8)
        st.gather_resident(ids, out)
        assert np.array_equal(out, want[ids])
        # [B, L, H] local ids -> 264 B rows (weight then scale), the Mooncake row layout
        local = rng.integers(0, want.shape[0], size=(2, 5, 1))
        got = np.empty((2, 5, 1, 264), np.uint8)
        st.lookup_into(local, got)
        assert np.array_equal(got, want[local])
        assert got.tobytes() == np.concatenate([want[local, :256], want[local, 256:]], -1).tobytes()


def test_multi_layer_files_and_heads(tmp_path: Path, rng: np.random.Generator) -> None:
    rows = v41_checkpoint(tmp_path / "ckpt", rng, rows=1000)
    db = tmp_path / "db"
    engramdb.attach(
        db,
        "l14",
        files(tmp_path / "ckpt"),
        tensor=V41_W.format(14),
        scale_tensor=V41_S.format(14),
        heads=[400, 601],
    )
    with engramdb.open(db, backend="preadv") as d:
        st = d["l14"]
        assert st.heads.tolist() == [400, 601]
        local = np.array([[[0, 600], [399, 1]]])
        want = rows[14][local + np.array([0, 400])]
        got = np.empty(want.shape, np.uint8)
        st.lookup_into(local, got)
        assert np.array_equal(got, want)


def qwen_checkpoint(root: Path, rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    """128 ``ngram_embedding.shard_{s}`` tensors over 4 files (rows of 160 B FP8), out of
    numeric order in the files, plus the scalar ``weight_scale``."""
    root.mkdir(parents=True, exist_ok=True)
    pre = "model.layers.2.ple.ple_embedding.ngram_embedding"
    shards = [u8(rng, 20 + s % 3, 160) for s in range(128)]
    for f in range(4):
        t = {
            f"{pre}.shard_{s}.weight": shards[s].view(torch.float8_e4m3fn) for s in range(f, 128, 4)
        }
        if f == 0:
            t["model.layers.2.ple.ple_embedding.weight_scale"] = torch.tensor(0.5)
        save_file(t, str(root / f"model-{f:05d}.safetensors"))
    return files(root), np.concatenate([s.numpy() for s in shards])


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen_128_shards_numeric_order(
    tmp_path: Path, rng: np.random.Generator, backend: str
) -> None:
    srcs, want = qwen_checkpoint(tmp_path / "q", rng)
    db = tmp_path / "db"
    engramdb.attach(
        db, "ple", srcs, tensor="*ngram_embedding.shard_*.weight", scale_tensor="*weight_scale"
    )
    with engramdb.open(db, backend=backend) as d:
        st = d["ple"]
        assert len(st.heads) == 128 and st.n_rows == want.shape[0]
        ids = rng.integers(0, st.n_rows, 2000)
        assert np.array_equal(st.fetch(ids), want[ids])
        assert np.array_equal(st.fetch(np.arange(st.n_rows)), want)
    scale = json.loads((db / "manifest.json").read_text())["tables"]["ple"]["scale"]
    assert scale["dtype"] == "F32" and bytes.fromhex(scale["hex"]) == struct.pack("<f", 0.5)


def test_gemma_single_tensor_is_one_array(tmp_path: Path, rng: np.random.Generator) -> None:
    w = torch.from_numpy(rng.standard_normal((700, 4 * 64), dtype=np.float32)).bfloat16()
    src = tmp_path / "model.safetensors"
    save_file(
        {
            "model.language_model.embed_tokens_per_layer.weight": w,
            "model.language_model.norm.weight": torch.ones(8),
        },
        str(src),
    )
    engramdb.attach(tmp_path / "db", "ple", [src], tensor="*embed_tokens_per_layer.weight")
    want = w.view(torch.uint8).numpy().reshape(700, 512)
    with engramdb.open(tmp_path / "db", backend="mmap") as d:
        st = d["ple"]
        assert st.info.dtype == "bf16" and st.info.dim == 256
        assert np.array_equal(st.array(), want)  # zero-copy over the file, like a built table
        ids = rng.integers(0, 700, 100)
        assert np.array_equal(st.fetch(ids), want[ids])
        (summary,) = warm_tables(d, ["ple"])
        assert summary.resident_after == 1.0 and st.residency() == 1.0


@pytest.mark.parametrize("backend", ["auto", "mmap"])
def test_single_tensor_fast_path_checks_truncation(
    tmp_path: Path, rng: np.random.Generator, backend: str
) -> None:
    """An attached table whose rows are one mapped array takes the mapped fast path of
    `fetch_into` / `lookup_into` (no lock, no backend call) — and that path still checks the
    source's size first: truncated under the reader, it raises instead of a SIGBUS."""
    w = torch.from_numpy(rng.integers(0, 256, (5000, 160), dtype=np.uint8))
    src = tmp_path / "model.safetensors"
    save_file({"model.embed.weight": w}, str(src))
    engramdb.attach(tmp_path / "db", "t", [src], tensor="*embed.weight")
    want = w.numpy()
    with engramdb.open(tmp_path / "db", backend=backend) as d:
        st = d["t"]
        st.populate()
        big, small = rng.integers(0, 5000, 4096), rng.integers(0, 5000, 16)
        out_big, out_small = np.empty((4096, 160), np.uint8), np.empty((16, 160), np.uint8)
        for _ in range(3):  # the auto rule reaches its mapped state
            st.fetch_into(big, out_big)
        fetch_into_fast_when_mapped(st, [(big, out_big), (small, out_small)])
        assert np.array_equal(out_big, want[big]) and np.array_equal(out_small, want[small])
        os.truncate(src, 4096)
        for ids, out in ((big, out_big), (small, out_small)):
            with pytest.raises(TruncatedFile, match="truncated while open"):
                st.fetch_into(ids, out)


def test_raw_shard_directory(tmp_path: Path, rng: np.random.Generator) -> None:
    rows = rng.integers(0, 256, size=(250, 24), dtype=np.uint8)
    d = tmp_path / "raw"
    d.mkdir()
    for i in range(3):
        (d / f"shard_{i:03d}.bin").write_bytes(rows[i * 100 : (i + 1) * 100].tobytes())
    engramdb.attach(tmp_path / "db", "t", [d], row_bytes=24, rows_per_shard=100)
    with engramdb.open(tmp_path / "db", backend="preadv") as db:
        assert np.array_equal(db["t"].fetch(np.arange(250)[::-1]), rows[::-1])
    with pytest.raises(SourceError, match="rows-per-shard"):
        engramdb.attach(tmp_path / "db2", "t", [d], row_bytes=24, rows_per_shard=90)
    with pytest.raises(SourceError, match="whole number"):
        engramdb.attach(tmp_path / "db2", "t", [d], row_bytes=7)


def test_raw_npy_file_skips_its_header(tmp_path: Path, rng: np.random.Generator) -> None:
    """A ``.npy`` attached as raw rows: its header is not rows (300 rows stay 300, each equal
    to the array's), on every backend; Fortran order and a short file are refused."""
    rows = rng.integers(0, 256, size=(300, 40), dtype=np.uint8)
    np.save(tmp_path / "emb.npy", rows)
    engramdb.attach(tmp_path / "db", "t", [tmp_path / "emb.npy"], row_bytes=40)
    for backend in ("mmap", "preadv", "io_uring"):
        with engramdb.open(tmp_path / "db", backend=backend) as db:
            assert db["t"].n_rows == 300
            assert np.array_equal(db["t"].fetch(np.arange(300)[::-1]), rows[::-1])
    np.save(tmp_path / "f.npy", np.asfortranarray(rows))
    with pytest.raises(SourceError, match="Fortran"):
        engramdb.attach(tmp_path / "db2", "t", [tmp_path / "f.npy"], row_bytes=40)
    whole = (tmp_path / "emb.npy").read_bytes()
    (tmp_path / "short.npy").write_bytes(whole[:-40])
    with pytest.raises(SourceError, match="describes 12000 data bytes"):
        engramdb.attach(tmp_path / "db3", "t", [tmp_path / "short.npy"], row_bytes=40)


def hostile(
    path: Path, header: dict[str, Any], data: bytes = b"\0" * 64, n: int | None = None
) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if n is None else n) + text + data)
    return path


@pytest.mark.parametrize(
    ("header", "n", "match"),
    [
        ({"a": {"dtype": "U8", "shape": [100], "data_offsets": [0, 100]}}, None, "past the end"),
        (
            {
                "a": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]},
                "b": {"dtype": "U8", "shape": [32], "data_offsets": [16, 48]},
            },
            None,
            "overlap",
        ),
        ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 1 << 40, "exceeds"),
        ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 10_000, "past the end"),
        ({"a": {"dtype": "BF16", "shape": [8, 2], "data_offsets": [0, 16]}}, None, "32 bytes"),
        ({"a": {"dtype": "F99", "shape": [8], "data_offsets": [0, 8]}}, None, "unknown dtype"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 8]}}, None, "bad shape"),
    ],
)
def test_hostile_headers_are_typed_errors(tmp_path: Path, header: Any, n: Any, match: str) -> None:
    src = hostile(tmp_path / "bad.safetensors", header, n=n)
    with pytest.raises(InvalidSafetensors, match=match) as e:
        engramdb.attach(tmp_path / "db", "t", [src])
    assert "bad.safetensors" in str(e.value)
    assert not (tmp_path / "db" / "manifest.json").exists()


def flip_a_sampled_byte(src: str) -> None:
    """Change a byte of the last sampled block (it ends at the file's end) in place, through
    the page cache, and restore the file's mtime: only the block's hash can tell."""
    st = os.stat(src)
    with open(src, "r+b") as f:
        f.seek(st.st_size - 3)
        last = f.read(1)
        f.seek(st.st_size - 3)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_opening_an_attached_table_leaves_its_sources_page_cache_alone(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """The identity check at every open reads the header and the sampled blocks around the
    page cache (its own ``O_DIRECT`` descriptor): an evicted source stays evicted. (Blocks
    read through the page cache would stay there as small folios, and a later populate's
    read-ahead would build no 2 MiB folios past the first of them.) A changed sampled block
    written through the page cache, not yet on the device, is still seen."""
    v41_checkpoint(tmp_path / "ckpt", rng)
    src = files(tmp_path / "ckpt")[0]
    try:
        os.close(os.open(src, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.skip("the file system refuses O_DIRECT: the check reads through the page cache")
    engramdb.attach(tmp_path / "db", "w", [src], tensor=V41_W.format(1))
    os.fsync(fd := os.open(src, os.O_RDONLY))
    os.close(fd)
    evict(src)
    if file_residency(src) > 0:
        pytest.skip("the page cache cannot be dropped here")
    for _ in range(2):
        with engramdb.open(tmp_path / "db", background_warm=False) as d:
            assert d["w"].attached
        assert file_residency(src) == 0.0
    flip_a_sampled_byte(src)
    with pytest.raises(SourceChanged, match="sampled block"):
        engramdb.open(tmp_path / "db")


@pytest.mark.parametrize("refused", ["open", "read"])
def test_the_identity_check_reads_through_the_page_cache_where_o_direct_is_refused(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """Where ``O_DIRECT`` is refused (no such flag, or ``EINVAL`` at the read, as on some
    file systems) the header and the sampled blocks are read through the page cache: attach
    and open work, and a changed sampled block is still `SourceChanged`."""
    v41_checkpoint(tmp_path / "ckpt", rng)
    src = files(tmp_path / "ckpt")[0]
    refusals = []
    if refused == "open":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    else:

        def preadv(*_: Any) -> int:
            refusals.append(1)
            raise OSError(errno.EINVAL, "refused")

        monkeypatch.setattr(os, "preadv", preadv)
    engramdb.attach(tmp_path / "db", "w", [src], tensor=V41_W.format(1))
    with engramdb.open(tmp_path / "db", background_warm=False) as d:
        assert d["w"].attached
    flip_a_sampled_byte(src)
    with pytest.raises(SourceChanged, match="sampled block"):
        engramdb.open(tmp_path / "db", background_warm=False)
    assert bool(refusals) == (refused == "read" and hasattr(os, "O_DIRECT"))


def test_changed_sources_are_refused_naming_the_file(
    v41: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db, _want = v41
    src = Path(files(tmp_path / "ckpt")[0])
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touch
    with pytest.raises(SourceChanged, match="mtime_ns") as e:
        engramdb.open(db)
    assert str(src) in str(e.value)
    # rewrite one sampled data block in place, then restore the mtime: the samples notice
    data = bytearray(src.read_bytes())
    data[-5] ^= 0xFF
    with open(src, "r+b") as f:
        f.seek(len(data) - 5)
        f.write(bytes([data[-5]]))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(SourceChanged, match="sampled block"):
        engramdb.open(db)
    # replaced by a copy (a new inode)
    tmp = src.with_suffix(".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(SourceChanged, match="inode"):
        engramdb.open(db)
    os.truncate(src, st.st_size - 100)
    with pytest.raises(TruncatedFile, match="truncated"):
        engramdb.open(db)


@pytest.mark.parametrize("backend", ["mmap", "auto", "preadv"])
def test_truncation_while_open_raises_not_sigbus(
    v41: tuple[Path, np.ndarray], tmp_path: Path, backend: str
) -> None:
    db, want = v41
    src = files(tmp_path / "ckpt")[0]
    with engramdb.open(db, backend=backend) as d:
        st = d["t"]
        assert np.array_equal(st.fetch(np.arange(10)), want[:10])
        os.truncate(src, 4096)
        for ids in (np.array([2999]), np.arange(0, 3000, 7)):
            with pytest.raises(TruncatedFile, match="truncated while open") as e:
                st.fetch(ids)
            assert src in str(e.value)
        with pytest.raises(TruncatedFile):
            st.populate()


def test_open_rewrites_nothing_and_info_lists_sources(
    v41: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db, _want = v41
    man = db / "manifest.json"
    before = (man.read_bytes(), os.stat(man).st_mtime_ns, sorted(os.listdir(db)))
    srcs = [(p, os.stat(p).st_mtime_ns) for p in files(tmp_path / "ckpt")]
    with engramdb.open(db) as d:
        d["t"].fetch(np.arange(100))
    assert (man.read_bytes(), os.stat(man).st_mtime_ns, sorted(os.listdir(db))) == before
    assert [(p, os.stat(p).st_mtime_ns) for p, _ in srcs] == srcs
    out = CliRunner().invoke(main, ["info", str(db)])
    assert out.exit_code == 0, out.output
    assert "attached to 1 source file(s), 2 column(s)" in out.output
    assert srcs[0][0] in out.output
    doc = json.loads(man.read_text())["tables"]["t"]
    f = doc["attached"]["files"][0]
    assert f["header_xxh3"] and len(f["samples"]) == 4 and f["blocks"] == []


def test_cli_attach_checksum_and_build_from_attached(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    rows = v41_checkpoint(tmp_path / "ckpt", rng, rows=2000)
    db = tmp_path / "db"
    r = CliRunner().invoke(
        main,
        [
            "attach",
            str(db),
            "-t",
            "t",
            "--tensor",
            V41_W.format(14),
            "--scale-tensor",
            V41_S.format(14),
            "--checksum",
            "-q",
            *files(tmp_path / "ckpt"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "attached t: 2,001 rows x 264 B" in r.output
    doc = json.loads((db / "manifest.json").read_text())["tables"]["t"]
    assert len(doc["attached"]["files"][0]["blocks"]) == 1
    r = CliRunner().invoke(main, ["attach", str(db), "-t", "t", *files(tmp_path / "ckpt")])
    assert r.exit_code != 0 and "TableExists" in r.output
    r = CliRunner().invoke(main, ["build", str(db), "-t", "t", "--from-attached", "-q"])
    assert r.exit_code == 0, r.output
    with engramdb.open(db) as d:
        st = d["t"]
        assert not st.attached and len(st.info.shards) >= 1
        assert np.array_equal(st.fetch(np.arange(2001)), rows[14])


def test_preset_deepseek_maps_every_engram_layer(tmp_path: Path, rng: np.random.Generator) -> None:
    ck = tmp_path / "ckpt"
    ck.mkdir()
    h = keygen.preset("deepseek-v4.1-flash", engram_vocab_size=500, engram_num_embeddings=None)
    heads = {layer: [int(x) for x in h.head_rows(layer)] for layer in h.layers}
    want = {}
    for k, layer in enumerate(h.layers):
        n = sum(heads[layer])
        w, s = u8(rng, n, 256), u8(rng, n, 8)
        save_file(
            {
                V41_W.format(layer): w.view(torch.float8_e4m3fn),
                V41_S.format(layer): s.view(torch.float8_e8m0fnu),
            },
            str(ck / f"model-{k:05d}.safetensors"),
        )
        want[layer] = np.concatenate([w.numpy(), s.numpy()], 1)
    (ck / "config.json").write_text(
        json.dumps({"text_config": {"engram_vocab_size": 500, "engram_num_embeddings": None}})
    )
    r = CliRunner().invoke(
        main, ["attach", str(tmp_path / "db"), "--preset", "deepseek-v4.1-flash", *files(ck)]
    )
    assert r.exit_code == 0, r.output
    with engramdb.open(tmp_path / "db") as d:
        for layer in h.layers:
            st = d[f"engram_l{layer}"]
            assert st.heads.tolist() == heads[layer]
            ids = rng.integers(0, st.n_rows, 300)
            assert np.array_equal(st.fetch(ids), want[layer][ids])


def test_decoder_stream_and_view_read_through_attached(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    h = keygen.hasher(
        "qwen4exp",
        {
            "vocab_size": 50,
            "ngram_size": 3,
            "heads_per_ngram": 3,
            "ngram_vocab_size_base": 300,
            "make_ngram_vocab_size_divisible_by": 4,
            "eos_token_id": 1,
            "ple_layer_ids": [1],
        },
        name="small",
    )
    n = h.table_rows()
    data = rng.integers(0, 256, size=(n, 160), dtype=np.uint8)
    save_file(
        {"ple.weight": torch.from_numpy(data).view(torch.float8_e4m3fn)},
        str(tmp_path / "m.safetensors"),
    )
    db = tmp_path / "db"
    engramdb.attach(db, "t", [tmp_path / "m.safetensors"])
    toks = rng.integers(2, 50, 64)
    with engramdb.open(db) as d:
        dec = Decoder(d["t"], h, prefetch=True)
        out = np.empty(dec.out_shape, np.uint8)
        for t in range(toks.size):
            dec.push(int(toks[t]))
            dec.fill(out)
            assert np.array_equal(out, data[h.row_ids(toks[: t + 1])[-1]])
        got = [e for _, e in d.stream(toks, preset=h, batch_tokens=16)]
        assert np.array_equal(
            np.concatenate(got).reshape(64, -1), data[h.row_ids(toks)].reshape(64, -1)
        )
    rows = rng.integers(0, n, size=(40, 2))
    engramdb.build_view(db, table="t", name="v", rows=rows)
    with engramdb.open(db) as d, engramdb.open_view(db, d["t"], "v") as v:
        got = v.read_records(np.arange(40))
        assert np.array_equal(np.asarray(got).reshape(40, -1), data[rows].reshape(40, -1))


def test_attach_refuses_existing_table_and_bad_widths(
    v41: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    db, _ = v41
    with pytest.raises(TableExists):
        engramdb.attach(db, "t", files(tmp_path / "ckpt"), tensor=V41_W.format(1))
    with pytest.raises(SourceError, match="different row widths"):
        engramdb.attach(db, "x", files(tmp_path / "ckpt"), tensor="*engram.embed.*")
    with pytest.raises(SourceError, match="no tensor matches"):
        engramdb.attach(db, "x", files(tmp_path / "ckpt"), tensor="nothing*")


def test_read_range_is_the_bulk_path(tmp_path: Path, rng: np.random.Generator) -> None:
    """`SourceSegments.read_range` (Mooncake publish, build --from-attached) across runs of
    many files and both columns."""
    from engramdb.disk.files import open_sources
    from engramdb.disk.publish import read_manifest
    from engramdb.read.attached import SourceSegments

    srcs, want = qwen_checkpoint(tmp_path / "q", rng)
    engramdb.attach(tmp_path / "db", "ple", srcs, tensor="*ngram_embedding.shard_*.weight")
    info = read_manifest(tmp_path / "db").tables["ple"]
    fds = open_sources(info)
    seg = SourceSegments(info, fds)
    try:
        for first, n in ((0, want.shape[0]), (19, 45), (want.shape[0] - 3, 3)):
            out = np.empty((n, 160), np.uint8)
            seg.read_range(first, n, out)
            assert np.array_equal(out, want[first : first + n])
    finally:
        seg.close()
        for fd in fds:
            os.close(fd)


def test_engramstore_lookup_into_equals_mooncake_row_layout(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """V4.1-shaped checkpoint attached as ``engram_l14`` (the EngramStore table name), served
    through `EngramStore.lookup_into`: ``[B, L, H]`` local ids -> 264 B rows, each the
    F8_E4M3 weight row then the F8_E8M0 scale row (``fp8_e4m3[256]+ue8m0[8]``)."""
    from engramdb.integrations.engramstore import EngramStore, EngramStoreConfig

    ck = tmp_path / "ckpt"
    rows = v41_checkpoint(ck, rng, rows=1500)
    heads = [700, 801]
    engramdb.attach(
        tmp_path / "db",
        "engram_l14",
        files(ck),
        tensor=V41_W.format(14),
        scale_tensor=V41_S.format(14),
        heads=heads,
    )
    es = EngramStore(
        {14: EngramStoreConfig(table_vocab_sizes=heads, row_bytes=264)}, store=str(tmp_path / "db")
    )
    ids = np.stack([rng.integers(0, heads[0], (3, 9)), rng.integers(0, heads[1], (3, 9))], -1)
    out = np.empty((3, 9, 2, 264), np.uint8)
    es.lookup_into(14, np.ascontiguousarray(ids), out)
    g = ids + np.array([0, heads[0]])
    from safetensors import safe_open

    with safe_open(files(ck)[1], "pt") as f:
        w = f.get_tensor(V41_W.format(14)).view(torch.uint8).numpy()
        s = f.get_tensor(V41_S.format(14)).view(torch.uint8).numpy()
    assert out.tobytes() == np.concatenate([w[g], s[g]], axis=-1).tobytes()
    assert np.array_equal(out, rows[14][g])


@pytest.mark.skipif(not IoUringBackend.availability()[0], reason="no io_uring here")
def test_io_uring_o_direct_reads_unaligned_tensor_offsets(
    v41: tuple[Path, np.ndarray], rng: np.random.Generator
) -> None:
    db, want = v41
    with engramdb.open(db, backend="io_uring", direct=True) as d:
        st = d["t"]
        assert st.backend is not None and st.backend.direct
        ids = rng.integers(0, want.shape[0], 3000)
        assert np.array_equal(st.fetch(ids), want[ids])


def test_serve_reads_an_attached_table(v41: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    from engramdb.serve import Server

    db, want = v41
    sock = tmp_path / "s.sock"
    srv = Server(db, port=0, unix=str(sock)).start()
    try:
        client = engramdb.connect(f"unix://{sock}")
        ids = np.array([[0, 2999], [17, 5]])
        assert np.array_equal(client["t"].fetch(ids), want[ids])
        client.close()
    finally:
        srv.stop()


def test_verify_checks_attached_sources(tmp_path: Path, rng: np.random.Generator) -> None:
    ck = tmp_path / "ckpt"
    v41_checkpoint(ck, rng, rows=5000)
    db = tmp_path / "db"
    engramdb.attach(
        db, "t", files(ck), tensor=V41_W.format(1), scale_tensor=V41_S.format(1), checksum=True
    )
    assert engramdb.verify(db) == []
    src = files(ck)[0]
    st = os.stat(src)
    with open(src, "r+b") as f:  # a byte no sampled block covers, mtime restored
        f.seek(st.st_size // 2 + 12345)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    engramdb.open(db).close()  # the sampled identity check cannot see this byte...
    problems = engramdb.verify(db)  # ...the full per-block check does
    assert [p.what for p in problems][:1] == ["block checksum mismatch"]
    assert problems[0].shard == src


@pytest.mark.parametrize("backend", ["mmap", "preadv"])
def test_truncation_of_one_of_many_files(
    tmp_path: Path, rng: np.random.Generator, backend: str
) -> None:
    srcs, want = qwen_checkpoint(tmp_path / "q", rng)
    engramdb.attach(tmp_path / "db", "ple", srcs, tensor="*ngram_embedding.shard_*.weight")
    with engramdb.open(tmp_path / "db", backend=backend) as d:
        st = d["ple"]
        os.truncate(srcs[0], 100)  # shard_0 (rows 0..19) lives in file 0
        with pytest.raises(TruncatedFile, match=srcs[0]):
            st.fetch(np.array([25, 3]))
        ok = np.arange(20, 41)  # shard_1, file 1: still served
        assert np.array_equal(st.fetch(ok), want[ok])


def test_preset_qwen_128_shards_with_padding_head(tmp_path: Path, rng: np.random.Generator) -> None:
    cfg = {
        "vocab_size": 50,
        "ngram_vocab_size_base": 3000,
        "make_ngram_vocab_size_divisible_by": 128,
        "eos_token_id": 1,
    }
    h = keygen.preset("qwen3.8-flash-next", **cfg)
    n = h.table_rows(2)
    data = rng.integers(0, 256, size=(n, 160), dtype=np.uint8)
    ck = tmp_path / "q"
    ck.mkdir()
    pre = "model.layers.2.ple.ple_embedding"
    part = n // 128
    for f in range(2):
        t = {
            f"{pre}.ngram_embedding.shard_{s}.weight": torch.from_numpy(
                data[s * part : (s + 1) * part]
            ).view(torch.float8_e4m3fn)
            for s in range(f * 64, (f + 1) * 64)
        }
        if f == 0:
            t[f"{pre}.weight_scale"] = torch.tensor(0.25)
        save_file(t, str(ck / f"model-{f:05d}.safetensors"))
    (ck / "config.json").write_text(json.dumps({"text_config": cfg}))
    srcs = [str(ck / "model-00000.safetensors"), str(ck / "model-00001.safetensors")]
    r = CliRunner().invoke(
        main, ["attach", str(tmp_path / "db"), "--preset", "qwen3.8-flash-next", srcs[0]]
    )
    assert r.exit_code != 0  # half the shards: the rows do not fill the preset's heads
    r = CliRunner().invoke(
        main, ["attach", str(tmp_path / "db"), "--preset", "qwen3.8-flash-next", *srcs]
    )
    assert r.exit_code == 0, r.output
    with engramdb.open(tmp_path / "db") as d:
        st = d["ple_l2"]
        heads = [int(x) for x in h.head_rows(2)]
        assert st.heads.tolist() == heads + [n - sum(heads)]
        toks = rng.integers(2, 50, 40)
        rows = h.row_ids(toks)
        assert np.array_equal(st.fetch(rows), data[rows])
        assert st.info.extra["scale"]["hex"] == struct.pack("<f", 0.25).hex()
