"""The published EngramDB Python API's entry points, run on this package with real data.

Every call is checked against the in-RAM reference (the numpy array the files were written
from): same bytes, and typed errors where the published implementation returned garbage.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
import warnings
from pathlib import Path

import numpy as np
import pytest

import engramdb
from engramdb.decode import Decoder
from engramdb.errors import (
    BackendUnavailable,
    CorruptFile,
    CorruptManifest,
    InvalidArgument,
    RowIdOutOfRange,
    SourceChanged,
    TableNotFound,
    TruncatedFile,
)

ROOT = Path(__file__).resolve().parent.parent


def write_raw(path: Path, table: np.ndarray, rows_per_shard: int) -> int:
    """Write ``table`` as raw shards ``shard_{i:03d}.bin``; returns the shard count."""
    path.mkdir(parents=True, exist_ok=True)
    n = -(-table.shape[0] // rows_per_shard)
    for i in range(n):
        table[i * rows_per_shard : (i + 1) * rows_per_shard].tofile(path / f"shard_{i:03d}.bin")
    return n


@pytest.fixture
def rows() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (2_900, 160), dtype=np.uint8)


# -- Store(path, shards, rows_per_shard, width) ---------------------------------------------
@pytest.mark.parametrize("rps", [1_000, 256, 2_900])  # unaligned x3, page multiples, one shard
def test_raw_store_fetch_equals_reference(tmp_path: Path, rows: np.ndarray, rps: int) -> None:
    n = write_raw(tmp_path, rows, rps)
    store = engramdb.Store(str(tmp_path), n, rps, 160)  # positional, as engram-peft calls it
    aligned = n == 1 or (rps * 160) % 4096 == 0
    assert isinstance(store, engramdb.Store)  # whatever the geometry
    assert store.attached == (not aligned)  # unaligned shards: an attached table
    assert store.n_rows == rows.shape[0] and store.width == 160
    ids = [0, 2_899, 999, 1_000, 1_001, 5, 5, 2_000]
    got = store.fetch(ids)
    assert got.tobytes() == rows[ids].tobytes()
    assert np.frombuffer(store.fetch(ids), np.uint8).tobytes() == rows[ids].tobytes()
    arr = np.array([[3, 2_500], [1_999, 0]], dtype=np.int32)
    assert store.fetch(arr).tobytes() == rows[arr].tobytes()
    assert store.fetch_one(1_234).tobytes() == rows[1_234].tobytes()
    assert np.frombuffer(store.fetch([]), np.float32).size == 0
    for bad in ([2_900], [-1], [0, 10**12]):
        with pytest.raises(RowIdOutOfRange):
            store.fetch(bad)
    store.close()


def test_raw_store_keywords_threads_and_bad_input(tmp_path: Path, rows: np.ndarray) -> None:
    write_raw(tmp_path, rows[:1_024], 256)
    s = engramdb.Store(tmp_path, shards=4, rows_per_shard=256, width=160, threads=8)
    assert isinstance(s, engramdb.Store) and s.threads == 8
    assert s.fetch(np.arange(1_024)).tobytes() == rows[:1_024].tobytes()
    s.close()
    with pytest.raises(TruncatedFile, match="shard_004.bin"):
        engramdb.Store(tmp_path, 5, 256, 160)
    with pytest.raises(CorruptFile):
        engramdb.Store(tmp_path, 4, 200, 160)  # shards hold more than 200 rows
    with pytest.raises(CorruptFile):
        engramdb.Store(tmp_path, 4, 256, 150)  # 40960 B is not a multiple of 150
    with pytest.raises(InvalidArgument):
        engramdb.Store(tmp_path, 4, 256)  # width missing
    with pytest.raises(InvalidArgument):
        engramdb.Store(tmp_path, 0, 256, 160)
    with pytest.raises(InvalidArgument):
        engramdb.Store(tmp_path / "nope", 1, 256, 160)


def _unaligned(tmp_path: Path, rows: np.ndarray) -> Path:
    """3 shards of 1,000 rows x 160 B = 160,000 B (not page multiples), the last 900 rows."""
    write_raw(tmp_path / "u", rows, 1_000)
    return tmp_path / "u"


@pytest.mark.parametrize("backend", ["auto", "preadv", "io_uring", "mmap"])
@pytest.mark.parametrize("ram_budget", [None, "64K"])
def test_unaligned_raw_shards_have_every_read_path(
    tmp_path: Path, rows: np.ndarray, backend: str, ram_budget: str | None
) -> None:
    path = _unaligned(tmp_path, rows)
    try:
        store = engramdb.Store(
            path, 3, 1_000, 160, backend=backend, ram_budget=ram_budget, heads=[2_000, 900]
        )
    except BackendUnavailable as e:
        pytest.skip(str(e))
    with store:
        assert isinstance(store, engramdb.Store) and store.attached
        assert store.n_rows == 2_900 and store.heads.tolist() == [2_000, 900]
        assert (store.cache is not None) == (ram_budget is not None)
        ids = np.random.default_rng(3).integers(0, 2_900, 4_000)  # every shard, repeats
        for _ in range(2):  # cold, then warm / from the RAM tier
            assert store.fetch(ids).tobytes() == rows[ids].tobytes()
        out = np.empty((ids.size, 160), np.uint8)
        assert store.fetch_into(ids, out) is out and out.tobytes() == rows[ids].tobytes()
        local = np.array([[[999, 899], [1_000, 0], [0, 5]]], np.int64)  # [B, L, H]
        got = store.lookup_into(local, np.empty((1, 3, 2, 160), np.uint8))
        assert got.tobytes() == rows[local + np.array([0, 2_000])].tobytes()
        ticket = store.prefetch([998, 999, 1_000, 2_899])  # the rows read below
        ticket.wait()
        assert store.stats()["prefetch"]["submitted"] == 1
        near = [998, 999, 1_000, 2_899]  # across the shard boundary, and the last row
        assert store.fetch(near).tobytes() == rows[near].tobytes()
        if ram_budget is not None:
            assert store.stats()["cache"]["hits"] > 0
        with pytest.raises(RowIdOutOfRange):
            store.fetch([2_900])


def test_unaligned_raw_shards_serve_the_decoder_and_check_identity(
    tmp_path: Path,
) -> None:
    h = engramdb.keygen.preset("qwen3.8-flash-next", ngram_vocab_size_base=2_000)
    n = h.table_rows(2)
    full = np.random.default_rng(5).integers(0, 256, (n, 160), dtype=np.uint8)
    shards = write_raw(tmp_path / "ple", full, 1_000)
    toks = np.random.default_rng(6).integers(0, 248_320, 40)
    expect = full[h.row_ids(toks, layer=2)]
    with engramdb.Store(tmp_path / "ple", shards, 1_000, 160) as store:
        assert store.attached and shards > 1
        dec = Decoder(store, h, prefetch=True)
        out = np.empty(dec.out_shape, np.uint8)
        for t in range(toks.size):
            dec.push(int(toks[t]))
            dec.fill(out)
            assert np.array_equal(out, expect[t]), f"step {t}"
        assert dec.prefetched == toks.size
    # The shard files' identity is recorded at open, as attach records it: a file replaced
    # under the same size opens only after it is described again (a new Store).
    info = engramdb.Store(tmp_path / "ple", shards, 1_000, 160)
    described = info.info
    info.close()
    (full[:1_000] ^ 0xFF).tofile(tmp_path / "ple" / "shard_000.bin")
    with pytest.raises(SourceChanged, match="shard_000.bin"):
        engramdb.Store(tmp_path / "ple", described)
    with engramdb.Store(tmp_path / "ple", shards, 1_000, 160) as again:
        assert again.fetch([0]).tobytes() == (full[:1] ^ 0xFF).tobytes()


def test_store_of_a_built_database_by_table_name(tmp_path: Path, rows: np.ndarray) -> None:
    engramdb.build(tmp_path, "t", 160, [rows], heads=[2_000, 900])
    with engramdb.Store(tmp_path, table="t") as s:
        assert s.fetch([1, 2_899]).tobytes() == rows[[1, 2_899]].tobytes()
        assert s.heads.tolist() == [2_000, 900]
    info = engramdb.open(tmp_path).manifest.tables["t"]
    with engramdb.Store(tmp_path, info) as s:  # today's handle
        assert s.fetch([7]).tobytes() == rows[[7]].tobytes()
    with pytest.raises(TableNotFound):
        engramdb.Store(tmp_path, table="other")
    with pytest.raises(InvalidArgument):
        engramdb.Store(tmp_path)


def test_database_of_a_directory_of_tables(tmp_path: Path, rows: np.ndarray) -> None:
    engramdb.build(tmp_path, "alpha", 160, [rows[:100]])
    engramdb.build(tmp_path, "beta", 160, [rows[100:300]])
    db = engramdb.Database(tmp_path)
    assert db.tables == ["alpha", "beta"]
    assert db["beta"].fetch([0, 199]).tobytes() == rows[[100, 299]].tobytes()
    db.close()


def _raw_tables(root: Path, rows: np.ndarray) -> dict[str, tuple[np.ndarray, int, int, int]]:
    """Two raw-shard tables under ``root``: name -> (reference, shards, rows_per_shard, width)."""
    wide = np.random.default_rng(11).integers(0, 256, (700, 96), dtype=np.uint8)
    out = {"ple": (rows, 1_000, 160), "small": (wide, 256, 96)}  # unaligned, aligned x3
    return {n: (t, write_raw(root / n, t, rps), rps, w) for n, (t, rps, w) in out.items()}


def test_database_of_raw_tables_fetch_equals_store(tmp_path: Path, rows: np.ndarray) -> None:
    tables = _raw_tables(tmp_path, rows)
    (tmp_path / "notes").mkdir()  # a sub-directory without shard_000.bin is not a table
    (tmp_path / "README.txt").write_text("x")
    db = engramdb.Database(tmp_path)
    assert db.list_tables() == db.tables == ["ple", "small"] and "ple" in db and len(db) == 2
    for name, (ref, n, rps, w) in tables.items():
        ids = [0, ref.shape[0] - 1, rps - 1, rps, 3, 3]
        got = db.fetch(name, ids, shards=n, rows_per_shard=rps, width=w)
        assert got.dtype == np.uint8 and got.tobytes() == ref[ids].tobytes()
        with engramdb.Store(tmp_path / name, n, rps, w) as direct:
            assert direct.fetch(ids).tobytes() == got.tobytes()
        arr = np.array([[1, 2], [ref.shape[0] - 2, 0]], dtype=np.int64)
        assert db.fetch(name, arr, shards=n, rows_per_shard=rps, width=w).tobytes() == (
            ref[arr].tobytes()
        )
        assert db.fetch(name, [], shards=n, rows_per_shard=rps, width=w).size == 0
        with pytest.raises(RowIdOutOfRange):
            db.fetch(name, [ref.shape[0]], shards=n, rows_per_shard=rps, width=w)
        with pytest.raises(RowIdOutOfRange):
            db.fetch(name, [0, -1], shards=n, rows_per_shard=rps, width=w)
    t = db.table("ple", shards=3, rows_per_shard=1_000, width=160)
    assert isinstance(t, engramdb.Store) and t.attached  # 160,000 B shards: not page multiples
    assert db.table("ple", shards=3, rows_per_shard=1_000, width=160) is t  # cached
    small = db.table("small", shards=3, rows_per_shard=256, width=96)
    assert isinstance(small, engramdb.Store) and small.name == "small"
    assert db.info()["tables"]["ple"]["opened_geometries"] == [(3, 1_000, 160)]
    db.close()
    assert t.closed and small.closed
    with pytest.raises(engramdb.StoreClosed):
        db.fetch("ple", [0], shards=3, rows_per_shard=1_000, width=160)


def test_database_of_raw_tables_typed_errors(tmp_path: Path, rows: np.ndarray) -> None:
    _raw_tables(tmp_path, rows)
    db = engramdb.open(tmp_path)
    with pytest.raises(TableNotFound, match=r"'nope'.*\['ple', 'small'\]"):
        db.fetch("nope", [0], shards=1, rows_per_shard=1, width=1)
    with pytest.raises(TableNotFound):
        db.fetch("../ple", [0], shards=3, rows_per_shard=1_000, width=160)
    with pytest.raises(InvalidArgument, match="rows_per_shard, width"):
        db.fetch("ple", [0], shards=3)
    for bad in ({"shards": 0}, {"width": -160}, {"rows_per_shard": True}, {"width": 1.5}):
        geom = {"shards": 3, "rows_per_shard": 1_000, "width": 160, **bad}
        with pytest.raises(InvalidArgument, match=repr(next(iter(bad.values())))):
            db.fetch("ple", [0], **geom)
    for geom in ((4, 1_000, 160), (3, 900, 160), (3, 1_000, 150)):  # the files disagree
        with pytest.raises(InvalidArgument, match="'ple'") as e:
            db.fetch("ple", [0], shards=geom[0], rows_per_shard=geom[1], width=geom[2])
        assert isinstance(e.value.__cause__, CorruptFile)
    with pytest.raises(InvalidArgument, match="geometry"):
        db["ple"]
    with pytest.raises(TableNotFound):
        db["nope"]
    with pytest.raises(InvalidArgument, match="populate"):
        engramdb.Database(tmp_path, populate=True)
    db.close()
    (tmp_path / "empty").mkdir()
    with pytest.raises(engramdb.DatabaseNotFound):
        engramdb.Database(tmp_path / "empty")
    with pytest.raises(engramdb.DatabaseNotFound):
        engramdb.open(tmp_path / "missing")


def test_built_database_has_the_published_calls(tmp_path: Path, rows: np.ndarray) -> None:
    engramdb.build(tmp_path, "alpha", 160, [rows[:100]])
    engramdb.build(tmp_path, "beta", 160, [rows[100:300]])
    (tmp_path / "raw").mkdir()  # a manifest wins over raw-looking sub-directories
    rows[:10].tofile(tmp_path / "raw" / "shard_000.bin")
    with engramdb.Database(tmp_path) as db:
        assert db.list_tables() == ["alpha", "beta"] and db.raw_tables is None
        assert db.fetch("beta", [0, 199, 7]).tobytes() == rows[[100, 299, 107]].tobytes()
        got = db.fetch("beta", [5], shards=9, rows_per_shard=1, width=160)  # raw-only: ignored
        assert got.tobytes() == rows[[105]].tobytes()
        assert db.table("alpha") is db["alpha"]
        with pytest.raises(InvalidArgument, match="width=96"):
            db.fetch("alpha", [0], width=96)
        with pytest.raises(TableNotFound, match=r"'raw'.*\['alpha', 'beta'\]"):
            db.fetch("raw", [0])
        with pytest.raises(RowIdOutOfRange):
            db.fetch("alpha", [100])


# -- View(path) on a published raw slot view -------------------------------------------------
def _raw_view(tmp_path: Path, table: np.ndarray, heads: int, slots: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, table.shape[0], (slots, heads))
    record = table[keys].reshape(slots, -1)
    slot_bytes = -(-record.shape[1] // 512) * 512
    data = np.zeros((slots, slot_bytes), np.uint8)
    data[:, : record.shape[1]] = record
    data.tofile(tmp_path / "view.bin")
    (tmp_path / "view.keys.txt").write_text(
        "\n".join(",".join(str(int(x)) for x in k) for k in keys) + "\n"
    )
    manifest = {"grans": slots, "heads": heads, "slot_bytes": slot_bytes, "width": 160}
    (tmp_path / "view.manifest.json").write_text(json.dumps(manifest))
    return keys


def test_raw_view_reads_records(tmp_path: Path, rows: np.ndarray) -> None:
    keys = _raw_view(tmp_path, rows, heads=4, slots=50)
    want = rows[keys].reshape(50, -1)
    for path in (tmp_path / "view.bin", tmp_path, tmp_path / "view.manifest.json"):
        with engramdb.View(path) as v:
            assert len(v) == 50 and v.record_bytes == 640 and v.slot_bytes == 1024
            assert v.read_record(17) == want[17].tobytes()
            ids = [49, 0, 17, 17]
            assert v.read_records(ids).tobytes() == want[ids].tobytes()
            assert v.slot_keys().tolist() == keys.tolist()
            assert v.find(keys[[3, 40]]).tolist() == [3, 40]
            assert v.find([[-5, 0, 0, 0]]).tolist() == [-1]
            with pytest.raises(RowIdOutOfRange):
                v.read_record(50)
            with pytest.raises(RowIdOutOfRange):
                v.read_records([0, -1])


def test_raw_view_checks_its_files(tmp_path: Path, rows: np.ndarray) -> None:
    _raw_view(tmp_path, rows, heads=4, slots=50)
    with open(tmp_path / "view.bin", "r+b") as f:
        f.truncate(49 * 1024)
    with pytest.raises(TruncatedFile):
        engramdb.View(tmp_path)
    (tmp_path / "view.manifest.json").write_text(json.dumps({"grans": 50, "heads": 4}))
    with pytest.raises(CorruptManifest, match="slot_bytes"):
        engramdb.View(tmp_path)


# -- rowids_for_seq ----------------------------------------------------------------------------
def _engram_peft() -> types.ModuleType:
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("engram_peft.hashing")


def test_rowids_for_seq_equals_engram_peft_qwen_ple() -> None:
    hashing = _engram_peft()
    tokens = [9707, 11, 1879, 42, 248_044, 0, 0, 77]
    mapping = hashing.create_hash_mapping(
        engine="qwen_ple",
        compressed_vocab_size=248_320,
        engram_vocab_size_per_ngram=[160_000_000, 160_000_000],
        ngram_sizes=[2, 3],
        n_head_per_ngram=8,
        layer_ids=[1],
        pad_id=2,
        seed=0,
    )
    local = np.asarray(mapping.hash(np.array([tokens]))[1][0])
    rows = engramdb.rowids_for_seq(tokens)
    assert rows.shape == (8, 16) and rows.dtype == np.int64
    offsets = engramdb.keygen.preset("qwen3.8-flash-next").offsets()
    assert (rows - offsets).tolist() == local.tolist()
    tail = engramdb.rowids_for_seq_with_history(tokens[:3], tokens[3:])
    assert tail.tolist() == rows[3:].tolist()
    with pytest.raises(InvalidArgument):
        engramdb.rowids_for_seq([[1, 2]])
    assert "rowids_for_seq" in engramdb.__all__


# -- module paths ---------------------------------------------------------------------------
def test_module_paths_exist() -> None:
    from engramdb.integrations import (
        install_disk_multi_head_embedding,
        install_real_qwen_ple_embedding,
    )
    from engramdb.sglang import install_sglang_io_uring_reader, install_sglang_ple
    from engramdb.vllm_plugin import DiskPleEmbedding, install_vllm_ple

    assert callable(install_disk_multi_head_embedding) and callable(install_real_qwen_ple_embedding)
    assert callable(install_sglang_ple) and callable(install_sglang_io_uring_reader)
    assert callable(install_vllm_ple) and isinstance(DiskPleEmbedding, type)


def test_sglang_io_uring_reader_installs_and_undoes(tmp_path: Path, rows: np.ndarray) -> None:
    import os

    from engramdb.io import IoUringPageReader
    from engramdb.sglang import SGLangPageReader, install_sglang_io_uring_reader

    assert install_sglang_io_uring_reader("engramdb_no_such_storage_module") is False
    storage = types.ModuleType("sglang_storage_under_test")

    class PreviousReader:
        pass

    storage.IoUringReader = PreviousReader  # type: ignore[attr-defined]
    undo = install_sglang_io_uring_reader(storage)
    assert undo and storage.IoUringReader is SGLangPageReader  # type: ignore[attr-defined]
    assert issubclass(storage.IoUringReader, IoUringPageReader)  # type: ignore[attr-defined]
    path = tmp_path / "pages.bin"
    rows[:256].tofile(path)  # 40 KiB
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = storage.IoUringReader(page_size=4096)  # type: ignore[attr-defined]
    except BackendUnavailable as e:
        pytest.skip(f"io_uring unavailable here: {e}")
    try:
        pages = reader.read_pages([fd, fd], [8192, 0])
        flat = rows[:256].reshape(-1)
        assert pages == [flat[8192:12288].tobytes(), flat[:4096].tobytes()]
    finally:
        reader.close()
        os.close(fd)
    assert not isinstance(undo, bool)
    undo()
    assert storage.IoUringReader is PreviousReader  # type: ignore[attr-defined]


def test_disk_ple_embedding_on_raw_rows(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from engramdb.vllm_plugin import DiskPleEmbedding

    weight = torch.randn(600, 40).to(torch.bfloat16)
    write_raw(tmp_path, weight.view(torch.uint8).numpy(), 250)
    store = engramdb.Store(tmp_path, 3, 250, 80)
    emb = DiskPleEmbedding(store, num_embeddings=600, embedding_dim=40, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 599, 250], [249, 3, 3]])
    assert torch.equal(emb(ids), weight[ids])
    with pytest.raises(RowIdOutOfRange):
        DiskPleEmbedding(store, 500, 40, torch.bfloat16)(torch.tensor([500]))


# -- README: "Coming from the EngramDB Python API" ---------------------------------------------
def _readme_snippets() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Coming from the EngramDB Python API")
    end = text.find("\n## ", start + 3)
    section = text[start : end if end > 0 else None]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_section_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snippets = _readme_snippets()
    assert len(snippets) >= 3
    monkeypatch.chdir(tmp_path)
    _engram_peft()  # the engram-peft snippet needs typing.override on Python 3.11
    import engram_peft.layer as layer

    monkeypatch.setattr(layer, "MultiHeadEmbedding", layer.MultiHeadEmbedding)
    scope: dict[str, object] = {}
    for code in snippets:
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
