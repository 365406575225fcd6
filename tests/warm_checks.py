"""A check shared by the memory-tier tests: a background warm pass ran to its end."""

from __future__ import annotations

from typing import Any


def warmed_memory(store: Any, nbytes: int) -> dict[str, Any]:
    """Wait for ``store``'s background warm pass, check it finished with ``nbytes`` of the
    table in the page cache and mapped in this process's page tables (to the last page),
    and return `Store.memory()`."""
    assert store.tiers.warm.wait(60)
    m: dict[str, Any] = store.memory()
    assert m["warm"]["state"] == "done"
    assert m["page_cache_resident_bytes"] >= nbytes - 4096
    assert m["rss_file_bytes"] >= nbytes - 4096
    return m


def warm_pass(store: Any, **options: Any) -> Any:
    """A `BackgroundWarm` over ``store``'s shards (its mapping, its descriptors), not
    started; ``options`` as `BackgroundWarm` takes them (``rate=`` and ``budget=`` at
    least)."""
    from engramdb.io.tiers import BackgroundWarm

    shards = [(fd, int(sh.bytes)) for fd, sh in zip(store.fd_array.tolist(), store.info.shards)]
    return BackgroundWarm(int(store.array().ctypes.data), shards, **options)


def fetch_into_fast_when_mapped(store: Any, batches: list[tuple[Any, Any]]) -> None:
    """``store.fetch_into(ids, out)`` for each ``(ids, out)``; every call made while the
    table's read rule is in its mapped state must take the mapped fast path (a slow gather
    on a busy machine may move the ``auto`` rule out of it, and the next call takes the
    general path, right rows either way). Skips where no call was made in that state."""
    import pytest

    fast = 0
    for ids, out in batches:
        mapped, calls = store.mapped_state(), store._fast_counts["calls"]
        assert store.fetch_into(ids, out) is out
        if mapped:
            assert store._fast_counts["calls"] == calls + 1
            fast += 1
    if not fast:
        pytest.skip("the read rule never stayed in its mapped state (a busy machine)")
