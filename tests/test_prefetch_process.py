"""`PrefetchProcess`: a module's prefetches read in a companion process. Rows equal
engram-peft's own multi-head embedding (cold rows read there, resident ones gathered from its
mapping), replaced and mismatched prefetches stay right, a failed read raises its own error
from the forward, a dead companion raises `ProcessExited`, bad arguments raise typed errors."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from peft_tables import peft_tables  # noqa: E402

import engramdb  # noqa: E402
from engramdb.errors import (  # noqa: E402
    InvalidArgument,
    ProcessExited,
    RowIdOutOfRange,
    TableNotFound,
    TruncatedFile,
)
from engramdb.prefetch_process import PrefetchProcess  # noqa: E402
from engramdb.testing.pages import evict  # noqa: E402
from engramdb.torch import DiskMultiHeadEmbedding  # noqa: E402

NO_WARM = {"background_warm": False}


def _evict_all(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            evict(f)


def _ids(h: Any, toks: np.ndarray, t: int, lay: int) -> Any:
    return torch.from_numpy(h.local_ids(toks[:, : t + 1], layer=lay)[:, -1:].copy())


def test_prefetched_rows_equal_the_model_cold_and_resident(tmp_path: Path, mode: str) -> None:
    h, mods = peft_tables(tmp_path)
    toks = np.random.default_rng(3).integers(0, 100, (3, 14))
    _evict_all(tmp_path)
    with (
        engramdb.open(tmp_path, **NO_WARM) as db,
        PrefetchProcess(db, ["l1", "l3"], open_options=NO_WARM) as proc,
    ):
        emb = {lay: DiskMultiHeadEmbedding(db[f"l{lay}"], process=proc) for lay in (1, 3)}
        for t in range(1, 7):  # cold: every request read by the companion's step reader
            ids = {lay: _ids(h, toks, t, lay) for lay in emb}
            for lay, m in emb.items():
                assert m.prefetch(ids[lay])
            for lay, m in emb.items():
                got = m(ids[lay])
                assert torch.equal(got, mods[lay].multi_head_embedding(ids[lay]))
        st = proc.stats()
        assert st["requests"] == 12 and st["read"] == 12 and st["gathered"] == 0
        # both tables' cold rows taken at one hand-over: the first table's reads went alone
        assert st["held_submits"] == st["joint_reads"]
        # nothing was read in this process: its tables' counters stay at zero
        assert all(db[f"l{lay}"].counters()["rows_fetched"] == 0 for lay in emb)
        for f in tmp_path.rglob("*"):  # resident now: gathered from the companion's mapping
            if f.is_file():
                f.read_bytes()
        time.sleep(0.15)  # past the rule's recheck interval (0.1 s): it samples them again
        for t in range(7, 14):
            ids = {lay: _ids(h, toks, t, lay) for lay in emb}
            for lay, m in emb.items():
                assert m.prefetch(ids[lay])
                got = m(ids[lay])
                assert torch.equal(got, mods[lay].multi_head_embedding(ids[lay]))
        st = proc.stats()
        assert st["requests"] == 26 and st["gathered"] >= 1
        assert all(m.served_from_prefetch == 13 and m.prefetches == 13 for m in emb.values())


def test_replaced_mismatched_and_oversized_prefetches(tmp_path: Path) -> None:
    h, mods = peft_tables(tmp_path, layers=(1,))
    toks = np.random.default_rng(4).integers(0, 100, (2, 40))
    with engramdb.open(tmp_path) as db, PrefetchProcess(db, ["l1"], max_rows=64) as proc:
        m = DiskMultiHeadEmbedding(db["l1"], process=proc)
        want = mods[1].multi_head_embedding
        a, b = _ids(h, toks, 5, 1), _ids(h, toks, 6, 1)
        assert m.prefetch(a) and m.prefetch(b)  # the second replaces the first
        assert torch.equal(m(b), want(b)) and m.served_from_prefetch == 1
        assert m.prefetch(a)  # other ids in the forward: read here, right
        assert torch.equal(m(b), want(b)) and m.served_from_prefetch == 1
        assert torch.equal(m(a), want(a))  # no prefetch pending: read here
        bad = a.clone()
        bad[0, 0, 1] = -1
        assert not m.prefetch(bad)  # out of range: nothing handed over, the forward raises
        with pytest.raises(RowIdOutOfRange):
            m(bad)
        # a strided tensor of ids: checked and handed over by the general path
        wide = torch.cat([a, a], dim=2)[:, :, : a.shape[2]]
        assert not wide.is_contiguous() and m.prefetch(wide)
        assert torch.equal(m(wide), want(a)) and m.served_from_prefetch == 2
        # a prefill's 2 x 39 x H ids are more than max_rows: this process's own prefetch (or
        # none: its table is resident by now)
        big = torch.from_numpy(h.local_ids(toks[:, :39], layer=1).copy())
        assert big.numel() > proc.max_rows
        m.prefetch(big)
        assert torch.equal(m(big), want(big)) and proc.stats()["requests"] == 4


def test_a_failed_read_raises_its_error_from_the_forward(tmp_path: Path) -> None:
    h, _ = peft_tables(tmp_path, layers=(1,))
    toks = np.random.default_rng(5).integers(0, 100, (2, 8))
    with (
        engramdb.open(tmp_path, **NO_WARM) as db,
        PrefetchProcess(db, ["l1"], open_options=NO_WARM) as proc,
    ):
        m = DiskMultiHeadEmbedding(db["l1"], process=proc)
        ids = _ids(h, toks, 4, 1)
        assert m.prefetch(ids)
        m(ids)
        (rows,) = tmp_path.glob("l1/*/shard-*.edb")
        os.truncate(rows, 4096)  # the rows' file cut short under both processes
        _evict_all(tmp_path)
        assert m.prefetch(_ids(h, toks, 5, 1))
        with pytest.raises(TruncatedFile, match="past the end"):
            m(_ids(h, toks, 5, 1))
        assert proc.stats()["requests"] == 2  # the companion goes on


def test_bad_arguments_and_a_dead_companion(tmp_path: Path) -> None:
    h, _ = peft_tables(tmp_path)
    with engramdb.open(tmp_path) as db:
        with pytest.raises(TableNotFound):
            PrefetchProcess(db, ["l1", "nope"])
        with pytest.raises(InvalidArgument, match="named twice"):
            PrefetchProcess(db, ["l1", "l1"])
        with pytest.raises(InvalidArgument, match="max_rows"):
            PrefetchProcess(db, ["l1"], max_rows=0)
        with pytest.raises(InvalidArgument, match="cpus"):
            PrefetchProcess(db, ["l1"], cpus={10_000})
        with pytest.raises(InvalidArgument):
            PrefetchProcess(db, [])
        proc = PrefetchProcess(db, ["l1"])
        with pytest.raises(InvalidArgument, match="not one of"):
            DiskMultiHeadEmbedding(db["l3"], process=proc)
        m = DiskMultiHeadEmbedding(db["l1"], process=proc)
        ids = _ids(h, np.arange(8).reshape(2, 4), 3, 1)
        os.kill(proc._proc.pid, signal.SIGKILL)
        proc._proc.wait()
        assert m.prefetch(ids)
        with pytest.raises(ProcessExited, match="exited"):
            m(ids)
        with pytest.raises(ProcessExited):
            proc.stats()
        proc.close()
        with pytest.raises(InvalidArgument, match="closed"):
            proc.request(0, np.zeros(4, np.int64))
        # dropped without a close, the companion exits with code 0
        proc = PrefetchProcess(db, ["l1"])
        child = proc._proc
        del proc
        gc.collect()
        assert child.poll() == 0
