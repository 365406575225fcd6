"""``verify``: recompute checksums and compare them with the manifest, for tables and views.

`verify` recomputes every shard's xxh3-64 (whole file and each 64 MiB block) and checks the
table's ``engramdb index`` output (`verify_index`: types, sizes, xxh3-64, decoding). `verify_views`
checks each Store-P view's files the same way, then opens the view (headers, staleness) and
compares its key index (sorted hashes, slot permutation, stored hashes) and sampled slots
(equal to the concatenation of their Store-I rows, zero padding) through the public `View`
API. Every finding is one `Problem`; `total_bytes` / `views_bytes` size a progress bar.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from engramdb.disk.checksum import Problem, check_file
from engramdb.disk.files import check_source
from engramdb.disk.publish import read_manifest
from engramdb.errors import EngramDBError, IndexNotFound, TableNotFound
from engramdb.keygen import Hasher
from engramdb.layouts.manifest import FileEntry, SourceFile
from engramdb.layouts.view import (
    HEADER_BYTES,
    key_index_sections,
    parse_views,
    source_hash,
)
from engramdb.read.index import load_index
from engramdb.store import Store
from engramdb.view import View

__all__ = [
    "Problem",
    "ViewProblem",
    "total_bytes",
    "verify",
    "verify_index",
    "verify_views",
    "views_bytes",
]


def verify(
    db_path: str | os.PathLike[str],
    *,
    tables: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Recompute the xxh3-64 of every shard (and of each 64 MiB block). Returns the problems
    found (empty list = intact). Reads every byte once: cost is one sequential pass."""
    db = Path(db_path)
    manifest = read_manifest(db)
    names = tables if tables else sorted(manifest.tables)
    problems: list[Problem] = []
    for name in names:
        info = manifest.tables.get(name)
        if info is None:
            raise TableNotFound(f"no table {name!r} in {str(db)!r}")
        for s in info.shards:
            problems.extend(check_file(db, s, "shard file", table=name, progress=progress))
        for sf in info.attached.files if info.attached is not None else ():
            problems.extend(_check_source(sf, name, progress))
        problems.extend(verify_index(db, name))
    return problems


def _check_source(
    sf: SourceFile, table: str, progress: Callable[[int], None] | None
) -> list[Problem]:
    """An attached table's source file: its identity (stat, header, sampled blocks), then,
    when ``attach --checksum`` recorded them, every block."""
    try:
        fd = os.open(sf.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return [Problem(table, sf.path, 0, sf.size, "source file is missing")]
    try:
        check_source(fd, sf, table)
        if not sf.blocks:
            return []
        entry = FileEntry(path=sf.path, bytes=sf.size, xxh3_64=sf.xxh3_64, blocks=sf.blocks)
        return check_file(Path("/"), entry, "source file", table=table, progress=progress, fd=fd)
    except EngramDBError as e:
        return [Problem(table, sf.path, 0, sf.size, str(e))]
    finally:
        os.close(fd)


def verify_index(db_path: str | os.PathLike[str], table: str) -> list[Problem]:
    """Check the ``engramdb index`` output of ``table`` if it has one: ``index.json`` (a
    regular file inside the database, every field typed), then each file's size and xxh3-64
    and that it inflates to exactly its rows (`load_index`). One problem per index at most
    (the first thing wrong)."""
    db = Path(db_path)
    index_dir = db / table / "index"
    if not os.path.lexists(index_dir):
        return []
    try:
        load_index(db, table)
    except (TableNotFound, IndexNotFound):
        return [Problem(table, f"{table}/index/index.json", 0, 0, "index: index.json is missing")]
    except EngramDBError as e:
        return [Problem(table, f"{table}/index", 0, 0, f"index: {e}")]
    return []


def total_bytes(db_path: str | os.PathLike[str], tables: list[str] | None = None) -> int:
    """Bytes `verify` reads (for a progress bar)."""
    manifest = read_manifest(db_path)
    names = tables if tables else list(manifest.tables)
    return sum(
        manifest.tables[n].n_rows * manifest.tables[n].row_bytes
        for n in names
        if n in manifest.tables
    )


#: View problems are `Problem`s with ``view=`` set (the name stays for callers of the old type).
ViewProblem = Problem


def _check_slots(view: View, store: Store, slots: np.ndarray, batch: int = 4096) -> list[Problem]:
    """Compare slots with the concatenation of their Store-I rows (vectorised per batch)."""
    found: list[Problem] = []
    pad = view.slot_bytes - view.record_bytes
    keys = view.slot_keys() if view.source == "keys" else None
    path = view.entry.data.path
    for lo in range(0, slots.shape[0], batch):
        s = slots[lo : lo + batch]
        if keys is not None:
            rows = view.hasher().hash_keys(keys[s], layer=view.layer)
        else:
            rows = view.record_rows(s)
        want = store.fetch(rows).reshape(s.shape[0], view.record_bytes)
        got = view.read_records(s)
        bad = np.flatnonzero((got != want).any(axis=1))
        if pad:
            tail = view.read_slots(s)[:, view.record_bytes :]
            bad = np.union1d(bad, np.flatnonzero(tail.any(axis=1)))
        for b in bad[:16].tolist():  # name the first few; the count says the rest
            sl = int(s[b])
            start = HEADER_BYTES + sl * view.slot_bytes
            found.append(
                Problem(
                    view.table,
                    path,
                    start,
                    start + view.slot_bytes,
                    f"slot {sl} differs from its Store-I rows {rows[b].tolist()}",
                    view=view.name,
                )
            )
        if bad.shape[0] > 16:
            found.append(
                Problem(
                    view.table,
                    path,
                    0,
                    0,
                    f"{bad.shape[0] - 16} more bad slots in this batch",
                    view=view.name,
                )
            )
    return found


def _check_index(view: View, full: bool, sample: np.ndarray) -> list[Problem]:
    index = view.key_index()
    vf = view.entry.index
    assert vf is not None
    path = vf.path
    found: list[Problem] = []
    n = view.n_records
    h_off, k_off, s_off = key_index_sections(n, view.key_width)
    hashes = np.asarray(index.hashes)
    if n > 1 and bool((hashes[1:] < hashes[:-1]).any()):
        i = int(np.argmax(hashes[1:] < hashes[:-1]))
        found.append(
            Problem(
                view.table,
                path,
                h_off + 8 * i,
                h_off + 8 * i + 16,
                "key hashes are not sorted",
                view=view.name,
            )
        )
    slot_of = np.asarray(index.slot_of).astype(np.int64)
    if n and (int(slot_of.max()) >= n or bool((np.bincount(slot_of, minlength=n) != 1).any())):
        found.append(
            Problem(
                view.table,
                path,
                s_off,
                s_off + 4 * n,
                "slots are not a permutation of the view's slots",
                view=view.name,
            )
        )
    entries = np.arange(n) if full else sample[sample < n]
    if entries.size:
        keys = np.asarray(index.keys)[entries]
        recomputed = view.key_hashes(keys)
        bad = np.flatnonzero(recomputed != hashes[entries])
        for b in bad[:16].tolist():
            e = int(entries[b])
            found.append(
                Problem(
                    view.table,
                    path,
                    k_off + 8 * view.key_width * e,
                    k_off + 8 * view.key_width * (e + 1),
                    f"key {keys[b].tolist()} does not hash to its stored hash",
                    view=view.name,
                )
            )
    return found


def verify_views(
    db_path: str | os.PathLike[str],
    *,
    tables: Sequence[str] | None = None,
    full: bool = False,
    sample: int = 1024,
    hashers: dict[str, Hasher] | None = None,
    progress: Callable[[int], None] | None = None,
    notes: Callable[[str], None] | None = None,
) -> list[Problem]:
    """Check every view of ``tables`` (default all): file sizes and xxh3-64 (whole and per
    64 MiB block) against the manifest, headers, staleness, the key index (sorted hashes,
    slot permutation, stored hashes of ``sample`` keys or all with ``full``), and that
    ``sample`` slots (every slot with ``full``, plus the first and last) equal the
    concatenation of their Store-I rows. Returns the problems (empty: intact).

    ``hashers`` maps ``"table/view"`` to the `Hasher` of views built with a non-preset
    hasher; without one their slots are not compared and ``notes`` is told so. Cost: one
    sequential pass over every view file, plus the sampled (or full) gathers from Store-I.
    """
    db = Path(db_path)
    manifest = read_manifest(db)
    names = list(tables) if tables else sorted(manifest.tables)
    found: list[Problem] = []
    rng = np.random.default_rng(0)
    for tname in names:
        info = manifest.tables.get(tname)
        if info is None:
            raise TableNotFound(f"no table {tname!r} in {str(db)!r}")
        entries = parse_views(info)
        if not entries:
            continue
        store = Store(db, info)
        try:
            for vname, entry in sorted(entries.items()):
                bad_files = False
                for vf in entry.files:
                    probs = check_file(db, vf, "file", table=tname, view=vname, progress=progress)
                    found.extend(probs)
                    bad_files = bad_files or bool(probs)
                if entry.source_hash != source_hash(info):
                    found.append(
                        Problem(
                            tname,
                            entry.data.path,
                            0,
                            HEADER_BYTES,
                            "stale: built from another version of the table",
                            view=vname,
                        )
                    )
                    continue
                if bad_files:
                    continue
                hasher = (hashers or {}).get(f"{tname}/{vname}")
                try:
                    view = View(
                        db, table=tname, name=vname, store=store, hasher=hasher, backend="mmap"
                    )
                except EngramDBError as e:
                    found.append(
                        Problem(
                            tname,
                            entry.data.path,
                            0,
                            HEADER_BYTES,
                            f"cannot open: {type(e).__name__}: {e}",
                            view=vname,
                        )
                    )
                    continue
                with view:
                    n = view.n_records
                    if full or n <= sample:
                        slots = np.arange(n, dtype=np.int64)
                    else:
                        pick = rng.choice(n, size=sample, replace=False)
                        slots = np.unique(np.concatenate([pick, [0, n - 1]])).astype(np.int64)
                    if view.source == "keys":
                        found.extend(_check_index(view, full, slots))
                        try:
                            view.hasher()
                        except EngramDBError as e:
                            if notes is not None:
                                notes(f"view {tname}/{vname}: slots not compared with Store-I: {e}")
                            continue
                    found.extend(_check_slots(view, store, slots))
        finally:
            store.close()
    return found


def views_bytes(db_path: str | os.PathLike[str], tables: Sequence[str] | None = None) -> int:
    """Bytes `verify_views` hashes (for a progress bar)."""
    manifest = read_manifest(db_path)
    names = list(tables) if tables else list(manifest.tables)
    total = 0
    for n in names:
        if n in manifest.tables:
            total += sum(f.bytes for e in parse_views(manifest.tables[n]).values() for f in e.files)
    return total
