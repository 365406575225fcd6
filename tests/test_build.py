"""build: every source kind, head splits, provenance, several tables, replacement."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb.errors import InvalidArgument, InvalidSafetensors, SourceError, TableExists


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Minimal safetensors writer for any dtype (incl. FP8), used to make test inputs."""
    header: dict[str, object] = {}
    blobs = []
    pos = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def rows_of(db: Path, table: str) -> np.ndarray:
    with engramdb.open(db) as d:
        s = d[table]
        return s.fetch(np.arange(s.n_rows))


def test_npy_any_dtype_viewed_as_bytes(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.standard_normal((50, 40)).astype(np.float32)  # 160 B rows
    np.save(tmp_path / "a.npy", a)
    s = engramdb.build(tmp_path / "db", "t", 160, [tmp_path / "a.npy"])
    assert s.rows == 50 and s.bytes == 8000
    got = rows_of(tmp_path / "db", "t")
    assert np.array_equal(got.view(np.float32), a)


def test_npy_3d_and_bad_shapes(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.integers(0, 9, (20, 4, 2), dtype=np.int16)  # 16 B rows
    np.save(tmp_path / "a.npy", a)
    engramdb.build(tmp_path / "db", "t", 16, [tmp_path / "a.npy"])
    assert np.array_equal(rows_of(tmp_path / "db", "t").view(np.int16).reshape(20, 4, 2), a)
    with pytest.raises(SourceError, match="expected row_bytes=15"):
        engramdb.build(tmp_path / "db", "u", 15, [tmp_path / "a.npy"])
    np.save(tmp_path / "f.npy", np.asfortranarray(rng.integers(0, 9, (8, 4), dtype=np.int32)))
    with pytest.raises(SourceError, match="Fortran"):
        engramdb.build(tmp_path / "db", "u", 16, [tmp_path / "f.npy"])
    with pytest.raises(SourceError, match="does not exist"):
        engramdb.build(tmp_path / "db", "u", 16, [tmp_path / "missing.npy"])


def test_truncated_npy_source(tmp_path: Path, rng: np.random.Generator) -> None:
    np.save(tmp_path / "a.npy", rng.integers(0, 255, (100, 16), dtype=np.uint8))
    raw = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "a.npy").write_bytes(raw[:-5])
    with pytest.raises(SourceError, match="truncated"):
        engramdb.build(tmp_path / "db", "t", 16, [tmp_path / "a.npy"])
    assert not (tmp_path / "db" / "manifest.json").exists()


def test_raw_bin_and_heads_split(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.integers(0, 256, (30, 264), dtype=np.uint8)
    a.tofile(tmp_path / "a.bin")
    engramdb.build(tmp_path / "db", "t", 264, [tmp_path / "a.bin"], heads=[10, 5, 15])
    with engramdb.open(tmp_path / "db") as d:
        assert d["t"].heads.tolist() == [10, 5, 15]
        assert d["t"].head_offsets.tolist() == [0, 10, 15]
    assert np.array_equal(rows_of(tmp_path / "db", "t"), a)
    with pytest.raises(SourceError, match="sum to 29"):
        engramdb.build(tmp_path / "db", "u", 264, [tmp_path / "a.bin"], heads=[10, 5, 14])
    (tmp_path / "odd.bin").write_bytes(b"x" * 265)
    with pytest.raises(SourceError, match="whole number"):
        engramdb.build(tmp_path / "db", "u", 264, [tmp_path / "odd.bin"])
    with pytest.raises(InvalidArgument):
        engramdb.build(tmp_path / "db", "u", 264, [tmp_path / "a.bin"], heads=[30, 0])


def test_one_source_per_head(tmp_path: Path, rng: np.random.Generator) -> None:
    parts = [rng.integers(0, 256, (n, 7), dtype=np.uint8) for n in (3, 9, 4)]
    paths = []
    for i, p in enumerate(parts):
        np.save(tmp_path / f"h{i}.npy", p)
        paths.append(tmp_path / f"h{i}.npy")
    engramdb.build(tmp_path / "db", "t", 7, paths)
    with engramdb.open(tmp_path / "db") as d:
        assert d["t"].heads.tolist() == [3, 9, 4]
    assert np.array_equal(rows_of(tmp_path / "db", "t"), np.concatenate(parts))


def test_safetensors_fp8_single_tensor(tmp_path: Path, rng: np.random.Generator) -> None:
    w = rng.integers(0, 256, (40, 160), dtype=np.uint8)
    write_safetensors(
        tmp_path / "w.safetensors", {"embed.weight": ("F8_E4M3", [40, 160], w.tobytes())}
    )
    engramdb.build(tmp_path / "db", "t", 160, [tmp_path / "w.safetensors"], dtype="fp8_e4m3")
    assert np.array_equal(rows_of(tmp_path / "db", "t"), w)
    m = engramdb.open(tmp_path / "db").info()["tables"]["t"]
    assert m["dtype"] == "fp8_e4m3"
    assert m["sources"][0]["tensor"] == "embed.weight" and m["sources"][0]["dtype"] == "F8_E4M3"


def test_safetensors_library_written_file(tmp_path: Path, rng: np.random.Generator) -> None:
    st = pytest.importorskip("safetensors.numpy")
    w = rng.standard_normal((12, 80)).astype(np.float16)
    st.save_file({"t": w}, str(tmp_path / "x.safetensors"))
    engramdb.build(tmp_path / "db", "t", 160, [tmp_path / "x.safetensors"])
    assert np.array_equal(rows_of(tmp_path / "db", "t").view(np.float16), w)


def test_sharded_checkpoint_numeric_order(tmp_path: Path, rng: np.random.Generator) -> None:
    """A table split over shard_{s} tensors in two files concatenates as 0, 1, 2, ..., 11."""
    shards = {s: rng.integers(0, 256, (5 + s, 16), dtype=np.uint8) for s in range(12)}
    name = "model.layers.1.ple.ngram_embedding.shard_{}.weight"
    f1 = {name.format(s): ("BF16", [5 + s, 8], shards[s].tobytes()) for s in (0, 2, 10, 11, 4)}
    f2 = {name.format(s): ("BF16", [5 + s, 8], shards[s].tobytes()) for s in (1, 3, 5, 6, 7, 8, 9)}
    f1["other.bias"] = ("F32", [4], b"\0" * 16)
    write_safetensors(tmp_path / "a.safetensors", f1)
    write_safetensors(tmp_path / "b.safetensors", f2)
    engramdb.build(
        tmp_path / "db",
        "ple",
        16,
        [tmp_path / "b.safetensors", tmp_path / "a.safetensors"],
        tensor="*ngram_embedding.shard_*.weight",
    )
    want = np.concatenate([shards[s] for s in range(12)])
    assert np.array_equal(rows_of(tmp_path / "db", "ple"), want)
    src = engramdb.open(tmp_path / "db").info()["tables"]["ple"]["sources"]
    assert [s["tensor"] for s in src] == [name.format(s) for s in range(12)]
    assert [s["first_row"] for s in src] == np.concatenate(
        [[0], np.cumsum([5 + s for s in range(11)])]
    ).tolist()
    with pytest.raises(SourceError, match="6 tensors"):
        engramdb.build(tmp_path / "db", "x", 16, [tmp_path / "a.safetensors"])
    with pytest.raises(SourceError, match="no tensor matches"):
        engramdb.build(tmp_path / "db", "x", 16, [tmp_path / "a.safetensors"], tensor="nothing*")


def test_corrupt_safetensors_header(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(SourceError, match="header length"):
        engramdb.build(tmp_path / "db", "t", 4, [tmp_path / "x.safetensors"])
    write_safetensors(tmp_path / "y.safetensors", {"w": ("F32", [4, 4], b"\0" * 60)})
    with pytest.raises(SourceError, match="offsets"):
        engramdb.build(tmp_path / "db", "t", 16, [tmp_path / "y.safetensors"])


def test_existing_table_needs_force(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.integers(0, 256, (10, 8), dtype=np.uint8)
    b = rng.integers(0, 256, (12, 8), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 8, [a])
    with pytest.raises(TableExists):
        engramdb.build(tmp_path, "t", 8, [b])
    assert np.array_equal(rows_of(tmp_path, "t"), a)
    old_dirs = {p.name for p in (tmp_path / "t").iterdir()}
    engramdb.build(tmp_path, "t", 8, [b], force=True)
    assert np.array_equal(rows_of(tmp_path, "t"), b)
    new_dirs = {p.name for p in (tmp_path / "t").iterdir()}
    assert not (old_dirs & new_dirs), "the replaced generation is removed"


def test_open_snapshot_survives_rebuild(tmp_path: Path, rng: np.random.Generator) -> None:
    a = rng.integers(0, 256, (10, 8), dtype=np.uint8)
    engramdb.build(tmp_path, "t", 8, [a])
    with engramdb.open(tmp_path) as d:
        s = d["t"]
        engramdb.build(tmp_path, "t", 8, [a[::-1].copy()], force=True)
        assert np.array_equal(s.fetch(np.arange(10)), a)


def test_bad_names_and_row_bytes(tmp_path: Path) -> None:
    a = np.zeros((4, 4), np.uint8)
    for bad in ("", ".hidden", "a/b", "x" * 200, "-x"):
        with pytest.raises(InvalidArgument):
            engramdb.build(tmp_path, bad, 4, [a])
    for rb in (0, -4, 4.0, True):
        with pytest.raises(InvalidArgument):
            engramdb.build(tmp_path, "t", rb, [a])  # type: ignore[arg-type]
    with pytest.raises(SourceError):
        engramdb.build(tmp_path, "t", 4, [])
    with pytest.raises(SourceError, match="unknown kind"):
        engramdb.build(tmp_path, "t", 4, [tmp_path / "x.csv"])


def test_drop_table(tmp_path: Path) -> None:
    engramdb.build(tmp_path, "a", 4, [np.zeros((4, 4), np.uint8)])
    engramdb.build(tmp_path, "b", 4, [np.ones((4, 4), np.uint8)])
    engramdb.drop_table(tmp_path, "a")
    with engramdb.open(tmp_path) as d:
        assert d.tables == ["b"]
    assert not (tmp_path / "a").exists()


def test_geometry_badges_tile_pages() -> None:
    from engramdb.layouts import badge_rows_for, plan_geometry

    for rb in (1, 7, 160, 264, 2560, 4096, 5000, 4097, 17920):
        rpb = badge_rows_for(rb)
        assert (rpb * rb) % 4096 == 0
        if rb in (160, 264, 2560, 4096):
            assert (rpb * rb) % (2 << 20) == 0
    assert badge_rows_for(160) == 65536  # 10 MiB badges
    g = plan_geometry(10**6, 160, shard_bytes=64 << 20)
    assert g.rows_per_shard % g.rows_per_badge == 0 and g.shard_bytes % (2 << 20) == 0
    shard, off = g.locate(np.array([0, g.rows_per_shard, g.rows_per_shard + 3]))
    assert shard.tolist() == [0, 1, 1] and off.tolist() == [0, 0, 480]


def test_build_reads_safetensors_by_the_attach_rules(tmp_path: Path) -> None:
    """build's sources parse headers with the one parser attach uses: overlapping tensors
    are refused with `InvalidSafetensors` (a `SourceError`) naming both."""
    header = json.dumps(
        {
            "a": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [2, 4], "data_offsets": [4, 12]},
        }
    ).encode()
    path = tmp_path / "o.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    with pytest.raises(InvalidSafetensors, match="'a' and 'b' overlap"):
        engramdb.build(tmp_path / "db", "t", 4, [path], tensor="*")
