"""Tokenizer compression maps: building with ``tokenizers``, freezing, loading, checking."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engramdb import keygen
from engramdb.errors import (
    ChecksumMismatch,
    CorruptFile,
    InvalidArgument,
    InvalidDtype,
    MissingDependency,
    ShapeMismatch,
    TokenIdOutOfRange,
)


def _vectors() -> dict[str, Any] | None:
    env = os.environ.get("ENGRAMDB_KEYGEN_VECTORS")
    candidates = [Path(env)] if env else []
    candidates += [
        p / "shared" / "vectors" / "keygen.json" for p in Path(__file__).resolve().parents
    ]
    # a copy travels with the tests, so a checkout without shared/ still runs every vector
    candidates.append(Path(__file__).resolve().parent / "data" / "keygen.json")
    found = next((c for c in candidates if c.is_file()), None)
    return None if found is None else json.loads(found.read_text())


VECTORS = _vectors()
needs_vectors = pytest.mark.skipif(VECTORS is None, reason="shared/vectors/keygen.json not found")


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes map to themselves, the rest to
    code points from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def standin_tokenizer_json(path: Path, vectors: dict[str, Any]) -> Path:
    """A byte-level ``tokenizer.json`` for the vector file's stand-in vocabulary: 3 specials,
    the 256 byte tokens (id 3 + byte) and the extra words listed in ``selected_rows``."""
    tk = pytest.importorskip("tokenizers")
    cs = vectors["compression_standin"]
    raw = {row["token_id"]: row["raw_token"] for row in cs["selected_rows"]}
    alphabet = _bytes_to_unicode()
    vocab = {raw[i]: i for i in range(3)}
    vocab.update({alphabet[b]: 3 + b for b in range(256)})
    vocab.update({raw[i]: i for i in range(259, cs["vocab_size"])})
    assert len(vocab) == cs["vocab_size"]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(raw[i], special=True) for i in range(3)])
    tok.save(str(path))
    return path


@needs_vectors
def test_build_from_tokenizer_json_matches_reference(tmp_path: Path) -> None:
    assert VECTORS is not None
    cs = VECTORS["compression_standin"]
    path = standin_tokenizer_json(tmp_path / "tokenizer.json", VECTORS)
    tmap = keygen.build_token_map(path)
    assert tmap.table.tolist() == cs["lookup_table"]
    assert tmap.compressed_vocab_size == cs["compressed_vocab_size"]
    assert tmap.tokenizer_sha256 == keygen.file_sha256(path)
    assert keygen.TokenMap.from_tokenizer(path) == tmap


@needs_vectors
@pytest.mark.parametrize("table", ["normaliser_multichar_checks", "normaliser_unicode_scan"])
def test_normaliser_matches_tokenizers_reference(table: str) -> None:
    pytest.importorskip("tokenizers")
    assert VECTORS is not None
    cases = VECTORS[table] if isinstance(VECTORS[table], list) else VECTORS[table]["examples"]
    norm = keygen.compression_normalizer()
    for case in cases:
        assert norm.normalize_str(case["input"]) == case["tokenizers"], case


def test_missing_tokenizers_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_import = builtins.__import__

    def no_tokenizers(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError("No module named 'tokenizers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(MissingDependency, match=r"engramdb\[tokenizers\]"):
        keygen.build_token_map(tmp_path / "tokenizer.json")
    with pytest.raises(ImportError):
        keygen.compression_normalizer()


def test_save_load_round_trip_and_checks(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"stand": "in"}')
    table = np.array([0, 1, 2, 1, 3, 0, 4], dtype=np.int64)
    tmap = keygen.TokenMap(table, tokenizer_sha256=keygen.file_sha256(tok))
    path = tmap.save(tmp_path / "map.npy")
    assert np.load(path).dtype == np.dtype("<u4")
    side = json.loads((tmp_path / "map.npy.json").read_text())
    assert side["vocab_size"] == 7 and side["compressed_vocab_size"] == 5
    back = keygen.load_token_map(path, tokenizer=tok, vocab_size=7, compressed_vocab_size=5)
    assert back == tmap and back.tokenizer_sha256 == tmap.tokenizer_sha256
    assert keygen.TokenMap.coerce(str(path)) == tmap
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    with pytest.raises(InvalidArgument, match="sha256"):
        keygen.load_token_map(path, tokenizer_sha256="0" * 64)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(InvalidArgument, match="built for tokenizer"):
        keygen.load_token_map(path, tokenizer=other)
    with pytest.raises(InvalidArgument, match="has 7 ids"):
        keygen.load_token_map(path, vocab_size=8)
    with pytest.raises(InvalidArgument, match="compresses to 5"):
        keygen.load_token_map(path, compressed_vocab_size=4)

    damaged = np.load(path)
    damaged[3] = 2
    np.save(path, damaged)
    with pytest.raises(ChecksumMismatch):
        keygen.load_token_map(path)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(CorruptFile):
        keygen.load_token_map(tmp_path / "junk.npy")
    # a bare .npy without sidecar loads, but cannot prove its tokenizer
    np.save(tmp_path / "bare.npy", table.astype("<u4"))
    assert keygen.load_token_map(tmp_path / "bare.npy") == tmap
    with pytest.raises(InvalidArgument, match="None"):
        keygen.load_token_map(tmp_path / "bare.npy", tokenizer=tok)


def test_map_validation_and_apply() -> None:
    with pytest.raises(InvalidArgument, match="first appearance"):
        keygen.TokenMap([0, 2, 1])
    with pytest.raises(InvalidArgument, match="first appearance"):
        keygen.TokenMap([1, 0])
    with pytest.raises(InvalidDtype):
        keygen.TokenMap([0.0, 1.0])
    with pytest.raises(ShapeMismatch):
        keygen.TokenMap([])
    tmap = keygen.TokenMap([0, 0, 1, 2, 1])
    assert tmap.apply(np.array([[4, 0], [2, 3]], dtype=np.uint32)).tolist() == [[1, 0], [1, 2]]
    with pytest.raises(TokenIdOutOfRange, match="5"):
        tmap.apply([5])
    assert tmap.apply([-4, 9], strict=False).tolist() == [0, 1]
    assert repr(tmap) == "<TokenMap 5 -> 3 ids>"
