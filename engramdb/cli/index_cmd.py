"""``engramdb index DB CORPUS --preset NAME``: one call to :func:`engramdb.build.index.build_index`."""

from __future__ import annotations

from pathlib import Path

import click

from engramdb.build.index import DEFAULT_CHUNK_TOKENS, DEFAULT_HOT_ROWS, build_index
from engramdb.cli._common import (
    LazyBar,
    echo_result,
    file_option,
    json_option,
    library_errors,
    quiet_option,
    shown_option,
)
from engramdb.cli._progress import wait_for_writer
from engramdb.corpus import BIN_DTYPES
from engramdb.keygen import PRESETS
from engramdb.keygen.presets import is_preset_name


def _preset(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if is_preset_name(value) or (value.endswith(".json") and Path(value).is_file()):
        return value
    raise click.BadParameter(
        f"{value!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a .json keygen "
        f"config file (e.g. an engram-peft config.json)"
    )


@click.command("index")
@click.argument("db", type=click.Path(exists=True, path_type=Path))
@click.argument("corpus", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--preset",
    "preset_name",
    required=True,
    callback=_preset,
    help="Model layout whose row ids to count: a preset name or a .json keygen config "
    "(an engram-peft config.json works).",
)
@click.option("--table", "-t", help="Table to index (default: the database's only table).")
@click.option(
    "--layer", type=int, help="Model layer of the table (needed when the preset has several)."
)
@shown_option(
    "--hot-rows",
    type=click.IntRange(min=0),
    default=DEFAULT_HOT_ROWS,
    help="Size of the hot set: the most frequent rows, with counts.",
)
@click.option(
    "--bin-dtype",
    type=click.Choice(sorted(BIN_DTYPES)),
    help="Element type of raw .bin corpus files.",
)
@click.option(
    "--doc-sep",
    type=int,
    help="DeepSeek: token id that starts a new sequence (Qwen splits at EOS itself).",
)
@click.option("--compressed", is_flag=True, help="DeepSeek: the corpus holds compressed ids.")
@file_option(
    "--token-map", "token_map", "DeepSeek: frozen compression map (.npy) for raw token ids."
)
@shown_option(
    "--chunk-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK_TOKENS,
    help="Tokens hashed per step (bounds working memory).",
)
@quiet_option
@json_option
@library_errors
def index_cmd(
    db: Path,
    corpus: Path,
    preset_name: str,
    table: str | None,
    layer: int | None,
    hot_rows: int,
    bin_dtype: str | None,
    doc_sep: int | None,
    compressed: bool,
    token_map: Path | None,
    chunk_tokens: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Count the row accesses a token CORPUS makes into a table of database DB.

    \b
    Example: engramdb index db/ corpus.npy --preset qwen3.8-flash-next --table ple

    CORPUS is a .npy of token ids ([T] one sequence, [S, T] S sequences), a raw .bin of
    uint32/int32 ids, or a directory of them. Writes DB/<table>/index/ (zstd): hot.zst (the
    most frequent rows with counts), keys.zst (distinct n-gram keys in order of first access,
    with counts) and index.json.
    """
    db, corpus = _db_first(db, corpus)
    wait_for_writer(db, quiet)
    with LazyBar(quiet, "indexing", unit="tokens") as bar:
        summary = build_index(
            corpus,
            db,
            preset=preset_name,
            table=table,
            layer=layer,
            hot_rows=hot_rows,
            bin_dtype=bin_dtype,
            doc_separator=doc_sep,
            compressed=compressed,
            token_map=token_map,
            chunk_tokens=chunk_tokens,
            progress=bar,
        )
    echo_result(as_json, summary)


def _db_first(db: Path, corpus: Path) -> tuple[Path, Path]:
    """(DB, CORPUS); the old order ``index CORPUS DB`` still works, with a note on stderr."""
    if not (db / "manifest.json").is_file() and (corpus / "manifest.json").is_file():
        click.echo(
            "note: `engramdb index CORPUS DB` is deprecated; the database comes first: "
            f"`engramdb index {corpus} {db}`",
            err=True,
        )
        return corpus, db
    return db, corpus
