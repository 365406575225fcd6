"""A real Store-P view and a RAM-tier budget through `engramdb serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import engramdb
from engramdb.serve import Server


def test_view_records_and_ram_budget_over_uds(
    tmp_path: Path, rng: np.random.Generator, db_factory: Any
) -> None:
    db, written = db_factory({"t": (24, (2000, 3000))})
    table = written["t"]
    rows = np.stack([rng.integers(0, 2000, 300), 2000 + rng.integers(0, 3000, 300)], axis=1)
    engramdb.build_view(db, table="t", name="v", rows=rows)
    srv = Server(db, port=0, unix=str(tmp_path / "s.sock"), ram_budget="1M").start()
    try:
        client = engramdb.connect(f"unix://{tmp_path / 's.sock'}")
        remote = client["t"].view("v")
        ids = rng.integers(0, 300, 50)
        got = remote.read_records(ids)
        want = table[rows[ids]].reshape(50, -1)
        assert np.array_equal(np.asarray(got).reshape(50, -1), want)
        fetched = client["t"].fetch(np.arange(10))
        assert np.array_equal(fetched, table[:10])
        assert "cache" in client.metrics() or "hit" in client.metrics()
        client.close()
    finally:
        srv.stop()
