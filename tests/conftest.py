from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True)
def _no_stray_threads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGRAMDB_GATHER_THREADS", raising=False)


def pytest_report_header() -> str:
    return f"engramdb tests, {os.cpu_count()} cpus"


@pytest.fixture
def db_factory(tmp_path: os.PathLike[str]):  # type: ignore[no-untyped-def]
    """``db_factory(tables=None, **options)`` builds a small database under ``tmp_path`` with
    `engramdb.testing.dbs.make_db` and returns ``(db_path, rows_by_table)``."""
    from engramdb.testing.dbs import make_db

    count = iter(range(1_000_000))

    def factory(tables=None, **options):  # type: ignore[no-untyped-def]
        options.setdefault("name", f"db{next(count)}")
        return make_db(tmp_path, tables, **options)

    return factory
