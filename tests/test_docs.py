"""Docs that run: every ```python / ```bash block of README.md and docs/*.md is executed.

sqlite-utils style: the blocks are extracted from the Markdown and run in order, one working
directory per page holding a small fixture (``corpus.npy``, ``ple.npy``, a one-file
safetensors checkpoint; for the pages under docs/ also ``DB`` / ``db``: the
``qwen3.8-flash-next`` preset at ``--scale tiny`` with synthetic rows, its index and view
``corpus``). The python blocks of one page share one namespace (a page reads top to bottom);
bash blocks run with ``bash -e`` and an ``engramdb`` on ``PATH`` that is this checkout's CLI.
README.md starts without a database: its tour builds ``DB`` itself.

A block is steered by an HTML comment on the line just above its fence:

* ``<!-- docs-test: skip REASON -->`` — not run (e.g. the install commands, a Mooncake
  master on another host); the reason is reported.
* ``<!-- docs-test: needs=server -->`` — run while ``engramdb serve DB`` listens on a Unix
  socket; ``/run/engramdb.sock`` in the block means that socket.
* ``<!-- docs-test: needs=MODULE[,cmd:PROGRAM] -->`` — skipped (with the reason) when a module
  is not importable or a program is not on ``PATH``.

Blocks that are not meant to run are fenced ```text. The count of executed blocks is
printed and asserted.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
RUN_LANGS = {"python", "py", "bash", "sh", "console"}
FENCE = re.compile(r"^(\s*)```\s*([\w-]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
SOCK_IN_DOCS = "/run/engramdb.sock"


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    directive: str

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def extract(page: str) -> list[Block]:
    """The fenced blocks of ``page`` whose language runs, with their directive."""
    lines = (ROOT / page).read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        if lang in RUN_LANGS:
            d = DIRECTIVE.match(lines[i - 1]) if i else None
            body = "\n".join(line[indent:] for line in lines[i + 1 : j])
            blocks.append(Block(page, i + 1, lang, body, d.group(1) if d else ""))
        i = j + 1
    return blocks


def _tiny_safetensors(path: Path, rows: np.ndarray, names: list[str]) -> None:
    """A safetensors file holding ``rows`` split evenly over ``names`` (U8 tensors)."""
    import json

    parts = np.array_split(rows, len(names))
    header, off = {}, 0
    for name, part in zip(names, parts, strict=True):
        header[name] = {
            "dtype": "U8",
            "shape": list(part.shape),
            "data_offsets": [off, off + part.nbytes],
        }
        off += part.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for part in parts:
            f.write(np.ascontiguousarray(part).tobytes())


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engramdb.build import build_view
    from engramdb.build.index import build_index
    from engramdb.build.table import build

    base = tmp_path_factory.mktemp("docs-fixture")
    inputs = base / "inputs"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    np.save(inputs / "corpus.npy", (rng.zipf(1.3, (2, 4096)) % 248_320).astype(np.int32))
    np.save(inputs / "ple.npy", rng.integers(0, 256, (1_000, 160), dtype=np.uint8))
    _tiny_safetensors(
        inputs / "model-00001-of-00001.safetensors",
        rng.integers(0, 256, (1_000, 160), dtype=np.uint8),
        [f"model.ngram_embedding.shard_{i}.weight" for i in range(4)],
    )
    db = base / "DB"
    build(db, "ple", None, [], preset="qwen3.8-flash-next", scale="tiny", synthetic=1)
    build_index(inputs / "corpus.npy", db, preset="qwen3.8-flash-next", table="ple")
    build_view(db, table="ple", name="corpus", from_index=True)
    bindir = base / "bin"
    bindir.mkdir()
    shim = bindir / "engramdb"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m engramdb "$@"\n')
    shim.chmod(0o755)
    return base


def _workdir(fixture: Path, tmp: Path, page: str) -> Path:
    work = tmp / re.sub(r"\W", "_", page)
    shutil.copytree(fixture / "inputs", work)
    if page != "README.md":  # the README's tour builds its own DB
        for name in ("DB", "db"):  # hard links: writers publish new files, never rewrite
            shutil.copytree(fixture / "DB", work / name, copy_function=os.link)
    return work


def _missing(directive: str) -> list[str]:
    m = re.search(r"needs=([\w,.-]+)", directive)
    names = [] if not m else [n for n in m.group(1).split(",") if n != "server"]
    return [
        n
        for n in names
        if (
            shutil.which(n[4:]) is None
            if n.startswith("cmd:")
            else importlib.util.find_spec(n) is None
        )
    ]


@contextlib.contextmanager
def _server(work: Path) -> Iterator[Path]:
    from engramdb.serve.server import Server

    sock = work / "engramdb.sock"
    server = Server(work / "DB", port=None, unix=sock).start()
    try:
        yield sock
    finally:
        server.stop()


def _close_all(ns: dict[str, object]) -> None:
    """Close what a page left open (databases, clients, views), as its reader's exit would."""
    for value in list(ns.values()):
        close = getattr(value, "close", None)
        if (
            callable(close)
            and not isinstance(value, type)
            and type(value).__module__.startswith("engramdb")
        ):
            with contextlib.suppress(Exception):
                close()
    ns.clear()
    gc.collect()


def _run_python(block: Block, ns: dict[str, object], work: Path) -> None:
    code = compile(block.code, f"{block.label}", "exec")
    old = os.getcwd()
    os.chdir(work)
    try:
        exec(code, ns)  # noqa: S102 - the docs' own code
    finally:
        os.chdir(old)


def _run_bash(block: Block, work: Path, bindir: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (
        f"{block.label} failed:\n{block.code}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    )


def test_block_extraction_sees_every_fence() -> None:
    """The extractor finds the blocks a plain scan finds (no fence silently ignored)."""
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        opened = [
            m.group(2).lower()
            for line in text.split("\n")
            if (m := FENCE.match(line)) and m.group(2)
        ]
        runnable = [lang for lang in opened if lang in RUN_LANGS]
        assert len(extract(page)) == len(runnable), page


def test_docs_blocks_run(
    fixture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    executed: list[str] = []
    skipped: list[str] = []
    failures: list[str] = []
    took: list[tuple[float, str]] = []
    for page in PAGES:
        blocks = extract(page)
        if not blocks:
            continue
        work = _workdir(fixture_dir, tmp_path, page)
        ns: dict[str, object] = {"__name__": "__docs__"}
        for block in blocks:
            if block.directive.startswith("skip"):
                reason = block.directive[4:].strip(" :-")
                assert reason, f"{block.label}: a skip needs a reason"
                skipped.append(f"{block.label} ({reason})")
                continue
            missing = _missing(block.directive)
            if missing:
                skipped.append(f"{block.label} (needs {', '.join(missing)})")
                continue
            t0 = time.perf_counter()
            stack = contextlib.ExitStack()
            with stack:
                if "needs=server" in block.directive:
                    sock = stack.enter_context(_server(work))
                    block.code = block.code.replace(SOCK_IN_DOCS, str(sock))
                try:
                    if block.lang in ("python", "py"):
                        _run_python(block, ns, work)
                    else:
                        _run_bash(block, work, fixture_dir / "bin")
                except BaseException as e:  # report every broken block, not just the first
                    failures.append(f"{block.label}: {type(e).__name__}: {e}"[:3000])
            executed.append(block.label)
            took.append((time.perf_counter() - t0, block.label))
        _close_all(ns)
    with capsys.disabled():
        print(
            f"\ndocs test: executed {len(executed) - len(failures)} of {len(executed)} run blocks "
            f"({len(skipped)} skipped: {'; '.join(skipped)}); slowest: "
            + ", ".join(f"{label} {dt:.1f} s" for dt, label in sorted(took)[::-1][:4])
        )
    assert not failures, "\n\n".join(failures)
    assert len(executed) >= 20
