"""The shared file protocol (`engramdb.disk`): hashing writer, checker, Problem, publication."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from engramdb.disk.checksum import BlockHasher, HashedWriter, Problem, check_file
from engramdb.disk.files import fsync_dir, open_checked, open_shards
from engramdb.disk.publish import (
    collect_garbage,
    new_staging_dir,
    read_manifest,
    read_manifest_or_empty,
)
from engramdb.errors import CorruptFile, DatabaseNotFound, TruncatedFile
from engramdb.layouts.manifest import CHECK_BLOCK_BYTES, EMPTY, FileEntry, ShardInfo


def test_hashed_writer_blocks_match_a_direct_hash(tmp_path: Path) -> None:
    data = np.random.default_rng(3).integers(0, 256, CHECK_BLOCK_BYTES + 1000, dtype=np.uint8)
    w = HashedWriter(tmp_path / "f")
    for lo in range(0, data.size, 7_777_777):  # chunks that straddle the block boundary
        w.write(data[lo : lo + 7_777_777])
    entry = w.finish("f")
    raw = data.tobytes()
    assert type(entry) is FileEntry and entry.bytes == len(raw)
    assert entry.xxh3_64 == xxhash.xxh3_64_hexdigest(raw)
    assert entry.blocks == (
        xxhash.xxh3_64_hexdigest(raw[:CHECK_BLOCK_BYTES]),
        xxhash.xxh3_64_hexdigest(raw[CHECK_BLOCK_BYTES:]),
    )
    assert (tmp_path / "f").read_bytes() == raw
    assert check_file(tmp_path, entry, "file", table="t") == []
    with pytest.raises(FileExistsError):
        HashedWriter(tmp_path / "f")


def test_check_file_names_the_damaged_block(tmp_path: Path) -> None:
    h = BlockHasher()
    raw = bytes(range(256)) * 1000
    h.update(raw)
    digest, blocks = h.finish()
    (tmp_path / "f").write_bytes(raw)
    entry = FileEntry("f", len(raw), digest, blocks)
    seen: list[int] = []
    assert check_file(tmp_path, entry, "file", table="t", progress=seen.append) == []
    assert sum(seen) == len(raw)
    damaged = bytearray(raw)
    damaged[5] ^= 1
    (tmp_path / "f").write_bytes(bytes(damaged))
    (p,) = check_file(tmp_path, entry, "shard file", table="t")
    assert (p.start, p.end, p.what, p.view) == (0, len(raw), "block checksum mismatch", None)
    assert check_file(tmp_path, entry, "file", table="t", full=False) == []
    (tmp_path / "f").write_bytes(raw[:-1])
    (p,) = check_file(tmp_path, entry, "file", table="t", view="v")
    assert p.what == f"size is {len(raw) - 1}, manifest says {len(raw)}" and p.view == "v"
    (tmp_path / "f").unlink()
    (p,) = check_file(tmp_path, entry, "shard file", table="t")
    assert p.what == "shard file is missing"


def test_one_problem_type_renders_shards_and_views() -> None:
    shard = Problem("t", "t/g-1/shard-00000.edb", 0, 8, "block checksum mismatch")
    assert shard.shard == shard.file
    assert shard.line() == (
        "table 't' shard 't/g-1/shard-00000.edb' bytes [0, 8): block checksum mismatch"
    )
    view = Problem("t", "t/views/a.edv", 4096, 6656, "slot 0 differs", view="v")
    assert view.line() == (
        "table 't' view 'v' file 't/views/a.edv' bytes [4096, 6656): slot 0 differs"
    )


def test_open_checked_and_open_shards(tmp_path: Path, db_factory) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "f").write_bytes(b"x" * 10)
    fd = open_checked(tmp_path, "f", 10, "view 't/v'")
    os.close(fd)
    with pytest.raises(TruncatedFile, match=r"view 't/v': file 'f' has 10 bytes, the manifest"):
        open_checked(tmp_path, "f", 11, "view 't/v'")
    with pytest.raises(CorruptFile):
        open_checked(tmp_path, "f", 9, "view 't/v'")
    with pytest.raises(TruncatedFile, match="is missing"):
        open_checked(tmp_path, "g", 9, "view 't/v'")
    db, _ = db_factory({"t": (8, (64,))})
    info = read_manifest(db).tables["t"]
    assert isinstance(info.shards[0], ShardInfo) and isinstance(info.shards[0], FileEntry)
    fds = open_shards(db, info)
    assert len(fds) == len(info.shards)
    for fd in fds:
        os.close(fd)


def test_manifest_readers_and_garbage(tmp_path: Path, db_factory) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DatabaseNotFound):
        read_manifest(tmp_path / "none")
    assert read_manifest_or_empty(tmp_path) is EMPTY
    db, _ = db_factory({"t": (8, (64,))})
    manifest = read_manifest(db)
    stray_gen = db / "t" / "g-stray"
    stray_gen.mkdir()
    staging = new_staging_dir(db / "t" / "views", "0001")
    assert staging.name == ".staging-0001" and staging.is_dir()
    stray_view = db / "t" / "views" / "old.edv"
    stray_view.write_bytes(b"")
    collect_garbage(db, manifest)
    assert not stray_gen.exists() and not staging.exists() and not stray_view.exists()
    assert read_manifest(db) == manifest


def test_fsync_dir_strict_and_lenient(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "none")
    fsync_dir(tmp_path / "none", strict=False)
