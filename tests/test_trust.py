"""Files, the file protocol and the read paths under faults and hostile input (issue 16,
findings 5-13)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engramdb
from engramdb.build import build
from engramdb.errors import InvalidArgument


# -- 5. an open database serves the generation it opened --------------------------------------
def test_open_database_serves_its_generation_after_a_rebuild(db_factory: Any) -> None:
    db, written = db_factory({"t": (32, (3000,)), "u": (16, (100,))})
    old = written["t"]
    with engramdb.open(db) as opened:
        opened["u"].fetch(np.arange(4))  # one table in use, "t" not opened yet
        new = np.random.default_rng(1).integers(0, 256, old.shape, dtype=np.uint8)
        build(db, "t", 32, [new], force=True)  # GC unlinks the old generation
        assert not any((db / s.path).exists() for s in opened.manifest.tables["t"].shards)
        got = opened["t"].fetch(np.arange(3000))
        assert np.array_equal(got, old)  # the generation it opened, not a TruncatedFile
    with engramdb.open(db) as fresh:
        assert np.array_equal(fresh["t"].fetch(np.arange(3000)), new)


def test_open_database_serves_its_view_generation_after_a_rebuild(db_factory: Any) -> None:
    """A view not yet opened, rebuilt with force (and its old files collected), then opened
    through the open `Database`: the records of the generation it opened, no
    `TruncatedFile`; the same when the view's table is rebuilt under it."""
    from engramdb.disk.publish import gc
    from engramdb.layouts.view import parse_views

    db, written = db_factory({"t": (24, (2000, 3000))})
    rng = np.random.default_rng(3)
    rows = np.stack([rng.integers(0, 2000, 300), 2000 + rng.integers(0, 3000, 300)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    engramdb.build_view(db, table="t", name="w", rows=rows[:50])
    want = written["t"][rows].reshape(300, -1)
    with engramdb.open(db) as opened:
        snap = parse_views(opened.manifest.tables["t"])
        engramdb.build_view(db, table="t", name="v", rows=rows[:7], force=True)
        new = rng.integers(0, 256, written["t"].shape, dtype=np.uint8)
        build(db, "t", 24, [new[:2000], new[2000:]], force=True)
        gc(db)
        assert not any((db / f.path).exists() for f in snap["v"].files)  # collected
        v = opened["t"].view("v")
        assert len(v) == 300 and np.array_equal(v.read_records(np.arange(300)), want)
        w = opened["t"].view("w")
        assert np.array_equal(w.read_records(np.arange(50)), want[:50])
        v.close()  # reopened later: still the generation opened
        assert len(opened["t"].view("v")) == 300


# -- 11. `out` aliasing the ids ----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["mmap", "preadv", "auto"])
def test_out_sharing_memory_with_the_ids(db_factory: Any, backend: str) -> None:
    db, written = db_factory({"t": (32, (8000,))})
    table = written["t"]
    rng = np.random.default_rng(11)
    with engramdb.open(db, backend=backend) as opened:
        t = opened["t"]
        out = np.empty((5000, 32), np.uint8)
        ids = out.reshape(-1)[: 5000 * 8].view(np.int64)  # the ids live inside `out`
        ids[:] = rng.integers(0, 8000, 5000)
        want = table[ids.copy()]
        t.fetch_into(ids, out)
        assert np.array_equal(out, want)
        # lookup_into: [B, L, H] per-head local ids inside the output
        out4 = np.empty((10, 50, 1, 32), np.uint8)
        local = out4.reshape(-1)[: 500 * 8].view(np.int64).reshape(10, 50, 1)
        local[:] = rng.integers(0, 8000, (10, 50, 1))
        want4 = table[local.reshape(-1).copy()].reshape(10, 50, 1, 32)
        t.lookup_into(local, out4)
        assert np.array_equal(out4, want4)


# -- 13. huge empty shapes and the per-call row limit --------------------------------------------
def test_huge_and_empty_shapes_are_typed(db_factory: Any) -> None:
    from engramdb.validate import MAX_ROWS_PER_CALL

    db, _ = db_factory({"t": (32, (100,))})
    with engramdb.open(db) as opened:
        t = opened["t"]
        with pytest.raises(InvalidArgument, match="per-call limit"):
            t.fetch(np.zeros((0, 10**9, 10**9), np.int64))
        big = np.broadcast_to(np.int64(0), (MAX_ROWS_PER_CALL + 1,))
        with pytest.raises(InvalidArgument, match="split the batch"):
            t.fetch(big)
        with pytest.raises(InvalidArgument, match="per-call limit"):
            t.fetch_into(np.zeros((0, 10**9, 10**9), np.int64), np.empty((0, 32), np.uint8))
        assert t.fetch(np.zeros((0, 5), np.int64)).shape == (0, 5, 32)


# -- 6. the index is published as a set ---------------------------------------------------------
_KILL_SECOND_WRITE = """
import importlib, os, sys
bi = importlib.import_module("engramdb.build.index")
from engramdb import keygen
from test_index import QWEN_TINY
real, calls = bi._write_arrays, []
def dying(path, arrays):
    calls.append(path)
    if len(calls) == 2:  # killed after hot.zst, before keys.zst and index.json
        os._exit(9)
    return real(path, arrays)
bi._write_arrays = dying
bi.build_index(sys.argv[1], sys.argv[2], preset=keygen.hasher("qwen4exp", QWEN_TINY))
"""


def test_index_build_killed_midway_keeps_the_previous_index(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from test_index import QWEN_TINY, make_db

    from engramdb import keygen
    from engramdb.build.index import build_index
    from engramdb.disk.publish import collect_garbage, read_manifest
    from engramdb.read.index import load_index

    h = keygen.hasher("qwen4exp", QWEN_TINY)
    db = make_db(tmp_path / "db", {"ple": 88})
    np.save(tmp_path / "a.npy", np.arange(40) % 9)
    np.save(tmp_path / "b.npy", np.arange(60) % 13)
    build_index(tmp_path / "a.npy", db, preset=h)
    before = load_index(db, "ple")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    rc = subprocess.run(
        [sys.executable, "-c", _KILL_SECOND_WRITE, str(tmp_path / "b.npy"), str(db)],
        env=env,
        timeout=120,
    ).returncode
    assert rc == 9
    after = load_index(db, "ple")  # still the previous index, whole
    assert np.array_equal(after.hot_rows, before.hot_rows)
    assert np.array_equal(after.keys, before.keys)
    collect_garbage(db, read_manifest(db))  # what the next writer does (or `engramdb gc`)
    left = [p.name for p in (db / "ple").iterdir()]
    assert left == ["index"], left
    assert sorted(p.name for p in (db / "ple" / "index").iterdir()) == [
        "hot.zst",
        "index.json",
        "keys.zst",
    ]


def test_verify_checks_the_index(db_factory: Any, tmp_path: Path) -> None:
    from test_index import QWEN_TINY

    from engramdb import keygen
    from engramdb.build.index import build_index
    from engramdb.verify import verify

    h = keygen.hasher("qwen4exp", QWEN_TINY)
    rows = int(sum(h.head_rows(1)))
    db, _ = db_factory({"ple": (160, (rows,))})
    np.save(tmp_path / "c.npy", np.arange(40) % 9)
    build_index(tmp_path / "c.npy", db, preset=h)
    assert verify(db) == []
    keys = db / "ple" / "index" / "keys.zst"
    blob = bytearray(keys.read_bytes())
    blob[-5] ^= 0xFF
    keys.write_bytes(bytes(blob))
    problems = verify(db)
    assert len(problems) == 1 and "index" in problems[0].line()
    (db / "ple" / "index" / "index.json").write_text('{"format": "engramdb-index", "version": 1}')
    problems = verify(db)
    assert len(problems) == 1 and "hot.rows" in problems[0].what


# -- 7. symlinks are never followed --------------------------------------------------------------
def test_symlinked_shard_is_refused(db_factory: Any, tmp_path: Path) -> None:
    from engramdb.errors import CorruptFile
    from engramdb.verify import verify

    db, _ = db_factory({"t": (32, (1000,))})
    opened = engramdb.open(db)
    shard = db / opened.manifest.tables["t"].shards[0].path
    opened.close()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(shard.read_bytes())  # the same bytes: geometry and checksum match
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CorruptFile, match="symlink"):
        engramdb.open(db)
    problems = verify(db)
    assert len(problems) == 1 and "symlink" in problems[0].what


def test_gc_never_deletes_through_a_symlink(db_factory: Any, tmp_path: Path) -> None:
    db, written = db_factory({"t": (32, (1000,))})
    outside = tmp_path / "x"
    (outside / "g-important").mkdir(parents=True)
    (outside / "g-important" / "data").write_text("keep me")
    (db / "elsewhere").symlink_to(outside)  # a symlinked non-table directory in the DB
    (db / "t" / "g-link").symlink_to(outside / "g-important")
    (db / "afile").write_text("x")
    (db / "t" / "views").mkdir()
    (db / "t" / "views" / ".staging-z").symlink_to(outside)
    build(db, "t", 32, [written["t"]], force=True)  # builds and collects garbage
    assert (outside / "g-important" / "data").read_text() == "keep me"
    with engramdb.open(db) as opened:
        assert np.array_equal(opened["t"].fetch(np.arange(10)), written["t"][:10])


def test_lock_symlink_is_refused(db_factory: Any, tmp_path: Path) -> None:
    from engramdb.errors import CorruptFile

    db, written = db_factory({"t": (32, (1000,))})
    target = tmp_path / "created-outside"
    lock = db / ".lock"
    if lock.exists():
        lock.unlink()
    lock.symlink_to(target)
    with pytest.raises(CorruptFile, match="symlink"):
        build(db, "t", 32, [written["t"]], force=True)
    assert not target.exists()


# -- 8. special files and hostile values ---------------------------------------------------------
_OPEN_FIFO = """
import sys, engramdb
from engramdb.errors import CorruptFile
from engramdb.verify import verify
try:
    engramdb.open(sys.argv[1])
except CorruptFile as e:
    print("open:", e)
print("verify:", [p.what for p in verify(sys.argv[1])])
"""


def test_fifo_shard_is_refused_not_waited_on(db_factory: Any) -> None:
    import os
    import subprocess
    import sys

    db, _ = db_factory({"t": (32, (1000,))})
    opened = engramdb.open(db)
    shard = db / opened.manifest.tables["t"].shards[0].path
    opened.close()
    shard.unlink()
    os.mkfifo(shard)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_FIFO, str(db)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # on a FIFO, an open without O_NONBLOCK waits forever
    )
    assert out.returncode == 0, out.stderr
    assert "open:" in out.stdout and "FIFO" in out.stdout
    assert "verify:" in out.stdout and "FIFO" in out.stdout.split("verify:")[1]


def _valid_manifest_doc(db: Path) -> dict[str, Any]:
    import json

    return json.loads((db / "manifest.json").read_text())


def _with_views(db: Path) -> dict[str, Any]:
    """The manifest of ``db`` with a real rows view ``v`` of table ``t`` and a key view ``k``
    derived from it (the entry only: parsing reads no file)."""
    from engramdb.layouts.view import key_index_bytes

    rows = np.stack([np.arange(0, 300), 600 + np.arange(0, 300)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    doc = _valid_manifest_doc(db)
    v = doc["tables"]["t"]["views"]["v"]
    k = {**v, "source": "keys", "rows": None, "key_width": 2, "key_hash": "xxh64"}
    k["index"] = {
        "path": "t/views/k.keys",
        "bytes": key_index_bytes(v["slots"], 2),
        "xxh3_64": "0123456789abcdef",
        "blocks": [],
    }
    k["hasher"] = {
        "preset": None,
        "name": "custom",
        "kind": "x",
        "layer": 0,
        "max_ngram": 2,
        "n_heads": 2,
        "fingerprint": "0123456789abcdef",
    }
    doc["tables"]["t"]["views"]["k"] = k
    return doc


@pytest.mark.parametrize(
    ("view", "key", "value", "field"),
    [
        ("v", "provenance", [1], "provenance"),
        ("v", "provenance", 3, "provenance"),
        ("v", "budget_bytes", "9", "budget_bytes"),
        ("v", "slots", 2**40, "slots"),
        ("v", "slots", True, "slots"),
        ("v", "record_bytes", 1.0, "record_bytes"),
        ("v", "rows_per_record", 3, "record_bytes"),
        ("v", "key_width", 4, "key_width"),
        ("v", "file.path", "t/views/\0x", "path"),
        ("v", "file.path", "t/views/", "path"),
        ("v", "file.path", "t/views/./x", "path"),
        ("v", "file.path", "t/views/a/b", "path"),
        ("v", "file.path", 5, "path"),
        ("v", "file.blocks", None, "blocks"),
        ("v", "file.bytes", "4096", "bytes"),
        ("v", "rows", 7, "rows"),
        ("v", "source", ["rows"], "source"),
        ("v", "build_id", 12, "build_id"),
        ("k", "hasher", [1], "hasher"),
        ("k", "hasher", None, "hasher"),
        ("k", "hasher.preset", ["x"], "hasher.preset"),
        ("k", "hasher.fingerprint", 7, "hasher.fingerprint"),
        ("k", "key_width", 0, "key_width"),
        ("k", "key_width", 99, "key_width"),
        ("k", "key_hash", {}, "key_hash"),
        ("k", "index.path", "/etc/passwd", "path"),
    ],
)
def test_hostile_view_entry_values(
    db_factory: Any, view: str, key: str, value: Any, field: str
) -> None:
    import json

    from engramdb.errors import CorruptManifest
    from engramdb.layouts.manifest import parse_manifest
    from engramdb.layouts.view import parse_views

    db, _ = db_factory({"t": (32, (600, 400))})
    doc = _with_views(db)
    info = parse_manifest(json.dumps(doc)).tables["t"]
    assert set(parse_views(info)) == {"v", "k"}  # the unmutated entries parse
    entry = doc["tables"]["t"]["views"][view]
    *parents, last = key.split(".")
    for part in parents:
        entry = entry[part]
    entry[last] = value
    info = parse_manifest(json.dumps(doc)).tables["t"]
    with pytest.raises(CorruptManifest, match=field.replace(".", r"\.")):
        parse_views(info)


def test_view_header_disagreeing_with_the_manifest_names_the_field(db_factory: Any) -> None:
    """A view file whose header page (sealed with a valid checksum) disagrees with its
    manifest entry on rows per record or key width is refused, naming the field."""
    import struct

    import xxhash

    from engramdb.errors import CorruptFile
    from engramdb.layouts.view import CHECKSUM_AT

    db, _ = db_factory({"t": (32, (600, 400))})
    rows = np.stack([np.arange(0, 300), 600 + np.arange(0, 300)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    entry = _valid_manifest_doc(db)["tables"]["t"]["views"]["v"]
    path = db / entry["file"]["path"]
    page = bytearray(path.read_bytes()[:4096])
    # key_width sits after layer (q) in "<8sIIQQQIIQQqII..."
    off = struct.calcsize("<8sIIQQQIIQQq")
    struct.pack_into("<I", page, off, 3)
    struct.pack_into("<Q", page, CHECKSUM_AT, xxhash.xxh3_64_intdigest(bytes(page[:CHECKSUM_AT])))
    with open(path, "r+b") as f:
        f.write(page)
    with engramdb.open(db) as opened, pytest.raises(CorruptFile, match="key_width"):
        opened["t"].view("v")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d, t: t.__setitem__("shards", 7), "shards"),
        (lambda d, t: t["shards"][0].__setitem__("blocks", 5), "blocks"),
        (lambda d, t: t["shards"][0].__setitem__("blocks", None), "blocks"),
        (lambda d, t: t.__setitem__("sources", 3), "sources"),
        (lambda d, t: t.__setitem__("provenance", [1]), "provenance"),
        (lambda d, t: t["shards"][0].__setitem__("path", "t/\0x"), "path"),
        (lambda d, t: t["shards"][0].__setitem__("path", ""), "path"),
        (lambda d, t: t["shards"][0].__setitem__("path", "."), "path"),
        (lambda d, t: d.__setitem__("format_version", 1.0), "format_version"),
        (lambda d, t: d.__setitem__("format_version", True), "format_version"),
        (lambda d, t: t["heads"].__setitem__(0, [1]), "heads"),
        (lambda d, t: t.__setitem__("dim", "x"), "dim"),
        (lambda d, t: d.__setitem__("generation", "7"), "generation"),
    ],
)
def test_hostile_manifest_values(db_factory: Any, mutate: Any, field: str) -> None:
    import json

    from engramdb.errors import CorruptManifest
    from engramdb.layouts.manifest import parse_manifest

    db, _ = db_factory({"t": (32, (1000,))})
    doc = _valid_manifest_doc(db)
    mutate(doc, doc["tables"]["t"])
    with pytest.raises(CorruptManifest, match=field):
        parse_manifest(json.dumps(doc))


def test_deeply_nested_manifest() -> None:
    from engramdb.errors import CorruptManifest
    from engramdb.layouts.manifest import parse_manifest

    deep = '{"format": "engramdb", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(CorruptManifest, match="deeper"):
        parse_manifest(deep)


def test_hostile_index_json(tmp_path: Path) -> None:
    from test_index import make_db

    from engramdb.errors import CorruptFile
    from engramdb.read.index import load_index

    db = make_db(tmp_path / "db", {"ple": 88})
    d = db / "ple" / "index"
    d.mkdir(parents=True)
    for text, field in [
        ("[]", "object"),
        ('{"format": "engramdb-index", "version": 1, "hot": {}}', "hot.rows"),
        ('{"format": "engramdb-index", "version": 1.0}', "version"),
        ('{"format": "engramdb-index", "version": 1, "hot": {"rows": "3"}}', "hot.rows"),
    ]:
        (d / "index.json").write_text(text)
        with pytest.raises(CorruptFile, match=field):
            load_index(db, "ple")
    (d / "index.json").unlink()
    (d / "index.json").symlink_to("/dev/zero")
    with pytest.raises(CorruptFile, match="symlink"):
        load_index(db, "ple")


def test_hostile_manifest_fuzz(db_factory: Any) -> None:
    """10,000 seeded mutations of a real manifest (wrong JSON types, removed fields, hostile
    paths, numbers out of range, truncation): `parse_manifest` returns or raises
    `CorruptManifest`, nothing else."""
    import json

    from engramdb.errors import CorruptManifest
    from engramdb.layouts.manifest import parse_manifest
    from engramdb.layouts.view import parse_views

    db, _ = db_factory({"t": (32, (600, 400)), "u": (24, (50,))})
    base = _with_views(db)
    r = np.random.default_rng(8)
    values: list[Any] = [
        None,
        True,
        False,
        0,
        -1,
        1.0,
        2**70,
        "",
        "x",
        ".",
        "..",
        "/abs",
        "a/../b",
        "a\0b",
        [],
        [1],
        {},
        {"a": 1},
        [[[]]],
        1e308,
    ]

    def nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        out = [path]
        if isinstance(doc, dict):
            for k, v in doc.items():
                out += nodes(v, path + (k,))
        elif isinstance(doc, list):
            for i, v in enumerate(doc[:3]):
                out += nodes(v, path + (i,))
        return out

    paths = nodes(base)[1:]
    in_views = [p for p in paths if "views" in p]  # half the mutations hit a view entry
    assert len(in_views) > 40
    outcomes = {"ok": 0, "corrupt": 0}
    for _ in range(10_000):
        doc = json.loads(json.dumps(base))
        for _ in range(int(r.integers(1, 4))):
            pool = in_views if r.random() < 0.5 else paths
            p = pool[int(r.integers(0, len(pool)))]
            parent = doc
            try:
                for k in p[:-1]:
                    parent = parent[k]
                op = int(r.integers(0, 3))
                if op == 0:
                    parent[p[-1]] = values[int(r.integers(0, len(values)))]
                elif op == 1 and isinstance(parent, dict):
                    del parent[p[-1]]
                else:
                    parent[p[-1]] = [parent[p[-1]]]
            except (KeyError, IndexError, TypeError):
                continue  # an earlier mutation removed the path
        text = json.dumps(doc)
        if r.random() < 0.05:
            text = text[: int(r.integers(0, len(text)))]
        try:
            for info in parse_manifest(text).tables.values():
                parse_views(info)
            outcomes["ok"] += 1
        except CorruptManifest:
            outcomes["corrupt"] += 1
    assert outcomes["corrupt"] > 5000


# -- 12. warm verifies the bytes it reads ------------------------------------------------------
def test_warm_finds_a_flipped_byte(db_factory: Any) -> None:
    from engramdb.errors import ChecksumMismatch
    from engramdb.warm import warm_tables

    db, written = db_factory({"t": (32, (3000,))})
    with engramdb.open(db) as opened:
        assert warm_tables(opened)[0].table == "t"  # intact: no error
        shard = db / opened.manifest.tables["t"].shards[0].path
    data = bytearray(shard.read_bytes())
    data[32 * 1234 + 5] ^= 0x40
    shard.write_bytes(bytes(data))
    with engramdb.open(db) as opened:
        # reads do not re-hash (documented): the row comes back as stored ...
        assert not np.array_equal(opened["t"].fetch([1234])[0], written["t"][1234])
        # ... and warm names the damaged range
        with pytest.raises(ChecksumMismatch, match=r"bytes \[0, 96000\).*rows 0 to 2999"):
            warm_tables(opened)
        warm_tables(opened, verify=False)  # opt out: no hashing


# -- 10. leftovers are reported and collected ------------------------------------------------------
def test_info_reports_leftovers_and_gc_removes_them(db_factory: Any) -> None:
    import json

    from click.testing import CliRunner

    from engramdb.cli import main

    db, written = db_factory({"t": (32, (1000,))})
    staging = db / "t" / ".staging-killed"
    staging.mkdir()
    (staging / "shard-00000.edb").write_bytes(b"\0" * 100_000)
    (db / ".manifest.json.tmp-dead").write_text("{")
    runner = CliRunner()
    res = runner.invoke(main, ["info", str(db), "--json"])
    assert res.exit_code == 0, res.output
    left = {d["path"]: d["bytes"] for d in json.loads(res.output)["leftovers"]}
    assert left == {"t/.staging-killed": 100_000, ".manifest.json.tmp-dead": 1}
    assert "engramdb gc" in runner.invoke(main, ["info", str(db)]).output
    res = runner.invoke(main, ["gc", str(db)])
    assert res.exit_code == 0 and "removed 2 leftover(s)" in res.output, res.output
    assert not staging.exists() and not (db / ".manifest.json.tmp-dead").exists()
    with engramdb.open(db) as opened:
        assert np.array_equal(opened["t"].fetch(np.arange(5)), written["t"][:5])
    assert json.loads(runner.invoke(main, ["info", str(db), "--json"]).output)["leftovers"] == []


# -- 9. a full disk and Ctrl-C name their cause -------------------------------------------------
@pytest.mark.parametrize("cause", ["enospc", "interrupt"])
def test_build_failure_names_its_cause(
    db_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    import errno
    import importlib

    from click.testing import CliRunner

    from engramdb.cli import main

    bt = importlib.import_module("engramdb.build.table")

    db, written = db_factory({"t": (32, (70_000,))})
    src = tmp_path / "new.npy"
    np.save(src, np.random.default_rng(9).integers(0, 256, (70_000, 32), dtype=np.uint8))

    def failing(self: Any, data: memoryview) -> None:
        if cause == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise KeyboardInterrupt

    monkeypatch.setattr(bt._ShardWriter, "_write_all", failing)
    with pytest.raises(OSError if cause == "enospc" else KeyboardInterrupt) as info:
        build(db, "t", 32, [src], force=True)
    assert not isinstance(info.value, BufferError)
    res = CliRunner().invoke(
        main, ["build", str(db), str(src), "--table", "t", "--row-bytes", "32", "--force"]
    )
    assert res.exit_code != 0
    lines = [x for x in res.output.splitlines() if x.strip()]
    if cause == "enospc":
        assert lines[-1].startswith("Error: No space left on device while writing shard 0")
        assert "of table 't' (needs" in lines[-1] and "Traceback" not in res.output
    else:
        assert lines[-1].startswith("Aborted")
    assert not isinstance(res.exception, BufferError)
    with engramdb.open(db) as opened:  # intact: the previous table
        assert np.array_equal(opened["t"].fetch(np.arange(100)), written["t"][:100])


# -- 14. publish with no reachable master fails fast and quietly ----------------------------------
def test_publish_without_a_master_fails_within_seconds(db_factory: Any) -> None:
    import socket
    import time

    from click.testing import CliRunner

    from engramdb.cli import main

    db, _ = db_factory({"t": (32, (1000,))})
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    t0 = time.monotonic()
    res = CliRunner().invoke(
        main,
        [
            "publish",
            str(db),
            "--mooncake",
            f"127.0.0.1:{port}",
            "--metadata",
            f"http://127.0.0.1:{port}/metadata",
            "-q",
            "--connect-timeout",
            "2",
        ],
    )
    elapsed = time.monotonic() - t0
    assert res.exit_code != 0 and elapsed < 10, (elapsed, res.output)
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "not reachable" in lines[0] and f":{port}" in lines[0], lines


def test_hostile_index_sizes_are_capped_before_allocating(tmp_path: Path) -> None:
    """Declared sizes that agree with each other but not with the file or the table (a
    10^12-key index in a few bytes, more hot rows than the table has) are refused before a
    byte is inflated."""
    import json

    from test_index import make_db

    from engramdb.errors import CorruptFile
    from engramdb.read.index import load_index

    db = make_db(tmp_path / "db", {"ple": 88})
    d = db / "ple" / "index"
    d.mkdir(parents=True)
    import xxhash
    import zstandard

    blob = zstandard.ZstdCompressor().compress(b"")  # a valid frame of 0 raw bytes
    (d / "hot.zst").write_bytes(blob)
    (d / "keys.zst").write_bytes(blob)

    def meta(n_hot: int, n_keys: int) -> dict[str, Any]:
        part = {"bytes": len(blob), "xxh3_64": xxhash.xxh3_64_hexdigest(blob)}
        return {
            "format": "engramdb-index",
            "version": 1,
            "hot": {"file": "hot.zst", "raw_bytes": 16 * n_hot, "rows": n_hot, **part},
            "keys": {
                "file": "keys.zst",
                "raw_bytes": 32 * n_keys,
                "keys": n_keys,
                "width": 3,
                **part,
            },
        }

    for doc, field in [(meta(89, 0), "hot.rows"), (meta(0, 10**12), "keys.raw_bytes")]:
        (d / "index.json").write_text(json.dumps(doc))
        with pytest.raises(CorruptFile, match=field):
            load_index(db, "ple")


def test_load_index_across_a_republish_reads_the_new_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that read ``index.json`` just before a republish and the data files after it
    (simulated: the first ``index.json`` read returns the old one) gets the new index whole,
    not a `ChecksumMismatch`; an index that is really corrupt still raises."""
    from test_index import QWEN_TINY, make_db

    from engramdb import keygen
    from engramdb.build.index import build_index
    from engramdb.errors import ChecksumMismatch
    from engramdb.read import index as ix

    h = keygen.hasher("qwen4exp", QWEN_TINY)
    db = make_db(tmp_path / "db", {"ple": 88})
    np.save(tmp_path / "a.npy", np.arange(40) % 9)
    np.save(tmp_path / "b.npy", np.arange(60) % 13)
    build_index(tmp_path / "a.npy", db, preset=h)
    old_meta = ix.read_index_meta(db, "ple")
    build_index(tmp_path / "b.npy", db, preset=h)
    want = ix.load_index(db, "ple")
    real = ix.read_index_meta
    calls = iter([old_meta])
    monkeypatch.setattr(ix, "read_index_meta", lambda d, t: next(calls, None) or real(d, t))
    got = ix.load_index(db, "ple")
    assert np.array_equal(got.keys, want.keys) and np.array_equal(got.hot_rows, want.hot_rows)
    monkeypatch.setattr(ix, "read_index_meta", real)
    hot = db / "ple" / "index" / want.meta["hot"]["file"]
    blob = bytearray(hot.read_bytes())
    blob[-1] ^= 1
    hot.write_bytes(bytes(blob))
    with pytest.raises(ChecksumMismatch):
        ix.load_index(db, "ple")


def test_hostile_view_header_fuzz(db_factory: Any) -> None:
    """600 seeded mutations of the header pages of a view's files (random bytes in the
    fields, resealed with a valid checksum so they reach the field checks): opening the view
    either works (an unused byte) or raises `CorruptFile` / `TruncatedFile`, nothing else."""
    import struct

    import xxhash

    from engramdb.errors import CorruptFile, TruncatedFile
    from engramdb.layouts.manifest import parse_manifest
    from engramdb.layouts.view import CHECKSUM_AT, parse_views
    from engramdb.view import View

    db, _ = db_factory({"t": (32, (600, 400))})
    rows = np.stack([np.arange(0, 300), 600 + np.arange(0, 300)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    info = parse_manifest((db / "manifest.json").read_bytes()).tables["t"]
    entry = parse_views(info)["v"]
    files = [db / f.path for f in entry.files]
    pages = [p.read_bytes()[:4096] for p in files]
    r = np.random.default_rng(16)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(600):
        which = int(r.integers(0, len(files)))
        page = bytearray(pages[which])
        for _ in range(int(r.integers(1, 4))):
            at = int(r.integers(8, 100))  # past the magic, the fields and a name
            page[at] = int(r.integers(0, 256))
        struct.pack_into(
            "<Q", page, CHECKSUM_AT, xxhash.xxh3_64_intdigest(bytes(page[:CHECKSUM_AT]))
        )
        with open(files[which], "r+b") as f:
            f.write(page)
        try:
            View(db, table="t", name="v", info=info).close()
            outcomes["ok"] += 1
        except (CorruptFile, TruncatedFile):
            outcomes["refused"] += 1
        finally:
            with open(files[which], "r+b") as f:
                f.write(pages[which])
    assert outcomes["refused"] > 400
