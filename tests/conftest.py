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


def pytest_configure(config: pytest.Config) -> None:
    """torchvision / torchaudio / torchcodec wheels that fail to import against the pinned
    torch are marked absent once, for every test file (transformers, vLLM and engram-peft
    then take their text-only paths whichever test file runs first, or alone)."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        from engramdb.integrations.engines._env import hide_broken_torch_extensions

        hide_broken_torch_extensions()


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


@pytest.fixture(params=["compiled", "eventfds"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A companion process's two hand-overs (`DecoderProcess`, `PrefetchProcess`): the
    compiled words (where built) and the eventfds both ways."""
    if request.param == "compiled":
        from engramdb.io.sqpoll import step_compiled

        if step_compiled("wait_word") is None:
            pytest.skip("engramdb.io._submitter is not built")
    else:
        from engramdb import companion_client

        monkeypatch.setattr(companion_client, "step_compiled", lambda name: None)
    return str(request.param)
