"""The layer map's rules that import-linter cannot state: the root package is a facade no
module imports, modules stay small, and light entry points stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import engramdb

PACKAGE = Path(engramdb.__file__).resolve().parent
MAX_LINES = 600
# Modules allowed past MAX_LINES; each says why in its docstring.
LONG_OK = {"read/table.py"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imports_root(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "engramdb" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "engramdb" and node.level == 0:
            lines.append(node.lineno)
    return lines


def test_no_module_imports_the_package_root() -> None:
    offenders = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "__init__.py" or rel.startswith("cli/") or rel == "__main__.py":
            continue
        for line in _imports_root(ast.parse(path.read_text(), rel)):
            offenders.append(f"{rel}:{line}")
    assert offenders == [], "import the submodule, not the facade: " + ", ".join(offenders)


def test_modules_stay_small() -> None:
    long = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_OK:
            long[rel] = n
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
    for rel in LONG_OK:  # an exception says why in its docstring
        doc = ast.get_docstring(ast.parse((PACKAGE / rel).read_text())) or ""
        assert "Why this module is past 600 lines" in doc, rel


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(m for m in sys.modules if m.startswith('engramdb')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_engramdb_loads_only_the_facade() -> None:
    # engramdb._cpus: the start-up CPU mask is read at import (one system call, no imports)
    facade = {"engramdb", "engramdb._version", "engramdb.errors", "engramdb._cpus"}
    assert _loaded_after("import engramdb") == facade


@pytest.mark.parametrize("statement", ["import engramdb.client", "from engramdb import connect"])
def test_the_client_loads_no_server_engine_or_integration(statement: str) -> None:
    loaded = _loaded_after(statement)
    heavy = {
        m
        for m in loaded
        if m.startswith(
            (
                "engramdb.serve.server",
                "engramdb.serve.lane",
                "engramdb.serve.http",
                "engramdb.serve.routes",
                "engramdb.serve.context",
                "engramdb.store",
                "engramdb.read",
                "engramdb.database",
                "engramdb.view",
                "engramdb.build",
                "engramdb.integrations",
            )
        )
    }
    assert heavy == set()


def test_every_public_name_resolves() -> None:
    for name in engramdb.__all__:
        assert getattr(engramdb, name) is not None, name
    # functions that share a name with their module stay the functions
    assert callable(engramdb.build) and callable(engramdb.stream) and callable(engramdb.verify)
    import engramdb.build as _b  # noqa: F401  (importing the submodule must not rebind)

    assert engramdb.build.__module__ == "engramdb.build.table"
