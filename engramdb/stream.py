"""Corpus streaming (workload A): ``(token_ids, e_t)`` batches, read ahead of the consumer.

Background workers (two by default, one per core here) take whole batches of the corpus in
turn, compute every position's row ids (keygen, vectorised) and gather the rows — through the
store's normal read path, so cold batches go to the device sorted and deduplicated (access
order) — into a ring of reused output buffers, up to ``depth`` batches ahead of the consumer,
which receives them in corpus order. With a Store-P
view (``view=``), each position is one record read instead of ``H`` scattered rows. Any
`RowTable` can be the source (a `RemoteStore`, a `MooncakeTable`): a table that is not local
is read through its own `RowTable.gather`.

::

    for tokens, e_t in engramdb.stream(db, "corpus/", preset="qwen3.8-flash-next"):
        ...   # tokens [n] (or [s, T]); e_t uint8 [n, H, row_bytes] (or [s, T, H, row_bytes])

``e_t`` lives in a reused buffer: it is valid until the next batch is requested (pass
``copy=True`` to own it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.corpus import corpus_files, open_tokens
from engramdb.disk.files import mem_available
from engramdb.errors import InvalidArgument, SourceError
from engramdb.io.mapping import prefault, small_pages
from engramdb.keygen.presets import preset_for_table, table_record
from engramdb.read.stream_read import WindowStream
from engramdb.read.stream_warm import Pending, TableWarm
from engramdb.read.table import LocalTable
from engramdb.table_api import RowTable
from engramdb.units import parse_size

_DONE = object()


def _sequences(corpus: Any, bin_dtype: str | None) -> Iterator[np.ndarray]:
    """1-D sequences and 2-D ``[S, T]`` blocks of fresh sequences, in corpus order."""
    if isinstance(corpus, (str, os.PathLike)):
        for path in corpus_files(Path(corpus)):
            arr = open_tokens(path, bin_dtype)
            yield arr[0] if arr.shape[0] == 1 else arr
        return
    if isinstance(corpus, np.ndarray):
        if corpus.ndim not in (1, 2):
            raise SourceError(f"expected [T] or [S, T] token ids, got shape {corpus.shape}")
        yield corpus
        return
    if isinstance(corpus, Iterable):
        for seq in corpus:
            arr = np.asarray(seq)
            if arr.ndim not in (1, 2):
                raise SourceError(f"expected [T] or [S, T] token ids, got shape {arr.shape}")
            yield arr
        return
    raise InvalidArgument(f"corpus must be a path, an array or arrays, got {type(corpus).__name__}")


def _windows(arr: np.ndarray, batch_tokens: int, hist: int) -> Iterator[tuple[Any, int]]:
    """``(tokens, skip)`` work units: 1-D chunks carry ``hist`` tokens of look-back whose
    outputs are dropped (``skip``); 2-D blocks hold whole fresh rows."""
    if arr.ndim == 1:
        n = arr.shape[0]
        for start in range(0, n, batch_tokens):
            lo = max(0, start - hist)
            yield arr[lo : min(n, start + batch_tokens)], start - lo
        return
    s_total, t = arr.shape
    if t == 0:
        return
    if t >= batch_tokens:
        for row in arr:
            yield from _windows(row, batch_tokens, hist)
        return
    per = max(1, batch_tokens // t)
    for i in range(0, s_total, per):
        yield arr[i : i + per], 0


class _Workers:
    """``workers`` threads, each taking the next batch of the corpus and doing its keygen and
    its gather on its own thread (numpy releases the GIL in both; a warm gather is not split
    further), delivered in corpus order. A worker starts batch ``i`` only while
    ``i < next + depth`` (``next``: the batch the consumer asks for next), so the ring of
    ``depth + 2`` output buffers is never overwritten under the consumer. An error (from the
    corpus, keygen or a read) is delivered in its batch's place."""

    def __init__(
        self,
        work: Iterator[tuple[Any, int]],
        produce: Any,
        depth: int,
        workers: int,
        pre: int = 0,
    ):
        self._work = work
        self._produce = produce
        self._depth = depth
        self._pre = pre  # leading batches that may all be in flight (buffers of their own)
        self._cond = threading.Condition()
        self._results: dict[int, Any] = {}
        self._taken = 0  # batches handed to workers
        self._next = 0  # the batch the consumer asks for next
        self._total: int | None = None  # known once the corpus is exhausted
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name="engramdb-stream", daemon=True)
            for _ in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._taken >= max(self._next + self._depth, self._pre):
                    self._cond.wait()
                if self._stop or self._total is not None:
                    return
                i = self._taken
                try:
                    item = next(self._work)  # under the lock: the iterator is not thread-safe
                except StopIteration:
                    self._total = i
                    self._cond.notify_all()
                    return
                except BaseException as e:
                    self._results[i] = e
                    self._total = i + 1
                    self._cond.notify_all()
                    return
                self._taken += 1
            try:
                out: Any = self._produce(i, *item)
            except BaseException as e:
                out = e
            with self._cond:
                self._results[i] = out
                self._cond.notify_all()

    def get(self) -> Any:
        """The next batch in corpus order, an exception, or `_DONE`."""
        with self._cond:
            i = self._next
            while i not in self._results and not (self._total is not None and i >= self._total):
                self._cond.wait()
            if i not in self._results:
                return _DONE
            self._next += 1
            self._cond.notify_all()
            return self._results.pop(i)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


def stream(
    source: Any,
    corpus: Any,
    *,
    preset: Any,
    layer: int | None = None,
    table: str | None = None,
    batch_tokens: int = 8192,
    depth: int = 2,
    copy: bool = False,
    view: Any = None,
    bin_dtype: str | None = None,
    workers: int = 2,
    page_cache_budget: int | str | None = None,
    mode: str = "auto",
) -> Stream:
    """Yield ``(token_ids, e_t)`` for every position of ``corpus``, read ``depth`` batches
    ahead by a background thread.

    ``source``: a `Database` (``table=`` names the table; optional with one table), a
    `Store`, or any other `RowTable`. ``corpus``: a token file / directory (as ``engramdb index`` reads), a ``[T]``
    array (one sequence), ``[S, T]`` (S fresh sequences) or an iterable of such arrays.
    ``preset``: keygen preset name or `Hasher`; ``layer`` when it has several. A sequence
    longer than ``batch_tokens`` comes in chunks (ids exactly as one pass over it);
    ``[S, T]`` blocks come ``batch_tokens // T`` rows at a time. ``view``: a Store-P view of
    the table (its name, or a `View`) to serve keys from; misses fall back to Store-I. Memory: ``depth + 2`` buffers of ``batch_tokens`` x
    ``H`` x ``row_bytes``. ``workers`` threads each take whole batches (keygen and gather);
    errors are raised here, at the batch they hit.

    ``mode`` (a local table without a view): ``"warm"`` reads the table sequentially once
    in the background (`engramdb.read.stream_warm.TableWarm`) and serves every batch from
    the mapping, each as soon as the rows it needs are read; ``"windows"`` reads look-ahead
    windows of distinct rows (as large as the budget allows) in file order into a bounded
    row store (`engramdb.read.stream_plan`), never holding more than the budget;
    ``"batch"`` reads each batch through the store's read path; ``"auto"`` (default) picks
    ``"warm"`` when the table fits ``page_cache_budget`` (bytes or ``"8G"``; default
    ``MemAvailable`` minus a margin), else ``"windows"``. The returned `Stream` is an
    iterator; its `Stream.stats` reports the mode, the calibration and what was read.
    """
    if mode not in _MODES:
        raise InvalidArgument(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    if batch_tokens < 1 or depth < 1 or workers < 1:
        raise InvalidArgument(
            f"batch_tokens, depth and workers must be >= 1: {batch_tokens}, {depth}, {workers}"
        )
    store = _resolve_store(source, table)
    h = preset_for_table(preset, table_record(store)) if isinstance(preset, str) else preset
    if layer is None:
        if len(h.layers) != 1:
            raise InvalidArgument(f"the hasher has layers {list(h.layers)}: pass layer=")
        layer = int(h.layers[0])
    need = h.table_rows(layer)
    if store.n_rows < need:
        raise InvalidArgument(
            f"table {store.name!r} has {store.n_rows:,} rows; layer {layer} addresses {need:,}"
        )
    n_heads = int(h.row_ids(np.zeros(1, np.int64), layer=layer).shape[-1])
    rb = store.row_bytes
    hist = h.max_ngram - 1
    slot_bytes = (batch_tokens + hist) * n_heads * rb
    # committed up front: faulting a fresh buffer in page by page costs ~10x more here
    # output buffers, written in order: small pages (huge ones sometimes took ~0.2 s each
    # to commit here)
    ring = [prefault(small_pages(np.empty(slot_bytes, np.uint8))) for _ in range(depth + 2)]
    serial = workers > 1  # the workers are the parallelism: don't split a gather further
    if isinstance(view, str):
        open_view = getattr(store, "view", None)
        if open_view is None:
            raise InvalidArgument(f"table {store.name!r} has no views: pass a View object")
        view = open_view(view, hasher=h)
    if view is not None and getattr(view, "record_bytes", n_heads * rb) != n_heads * rb:
        raise InvalidArgument(f"view records are {view.record_bytes} B, not {n_heads} x {rb} B")

    local = store if isinstance(store, LocalTable) else None
    budget = _budget(page_cache_budget)
    if mode == "auto":
        if local is None or view is not None:
            mode = "batch"
        else:
            mode = "warm" if local.nbytes <= budget else "windows"
    elif mode != "batch" and (local is None or view is not None):
        raise InvalidArgument(f"mode={mode!r} needs a local table and no view")
    stats: dict[str, Any] = {
        "mode": mode,
        "page_cache_budget": budget,
        "table_bytes": store.nbytes,
        "batches": 0,
        "tokens": 0,
    }
    work = (w for arr in _sequences(corpus, bin_dtype) for w in _windows(arr, batch_tokens, hist))
    if mode == "windows":
        assert local is not None
        ws = WindowStream(
            local.fd_array,
            [sh.bytes for sh in local.info.shards],
            local.geometry,
            n_heads=n_heads,
            budget=budget,
            slot_bytes=slot_bytes,
            stats=stats,
        )
        return Stream(ws.run(work, lambda t: h.row_ids(t, layer=layer), copy), stats, ws.close)
    warm: TableWarm | None = None
    pre = 0
    if mode == "warm":
        assert local is not None
        table_arr = local.array()
        resident = local.residency()
        stats.update(resident_before=resident, warm_seconds=None, warm_bytes_per_s=None)
        nbytes = local.nbytes

        def warm_done(dt: float, err: BaseException | None) -> None:
            stats["warm_seconds"] = dt
            stats["warm_bytes_per_s"] = nbytes / dt if dt > 0 else 0.0

        # A resident table is served at once (its page tables fill behind the gathers).
        warm = TableWarm(table_arr, threads=2, on_done=warm_done, serve_now=resident >= 0.99)
        if resident < 0.5:
            # Cold: the leading batches are gathered by the warm's filler thread while the
            # device reads, in buffers of their own, bounded in memory.
            pre_bytes = min(_PRE_MAX, max(0, budget - nbytes) // 4)
            pre = min(_PRE_BATCHES, pre_bytes // slot_bytes)
        stats["warm_lookahead_batches"] = pre

    def produce(i: int, tokens: np.ndarray, skip: int) -> tuple[np.ndarray, np.ndarray] | _Later:
        if i < pre:
            buf = prefault(small_pages(np.empty(slot_bytes, np.uint8)))
        else:
            buf = ring[(i - pre) % len(ring)]
        shape = tokens.shape + (n_heads, rb)
        e = buf[: int(np.prod(shape))].reshape(shape)
        if view is not None:
            view.lookup(h.keys(tokens), e.reshape(tokens.shape + (n_heads * rb,)))
        else:
            rows = h.row_ids(tokens, layer=layer)  # in range: the table fits (checked above)
            if warm is not None and i < pre and not warm.done:
                # gathered by the warm's filler as the rows land; the consumer waits for it
                pend = warm.submit(rows.reshape(-1), e.reshape(-1, rb))
                return _Later(pend, (tokens[skip:], e[skip:]) if skip else (tokens, e))
            if warm is not None:
                warm.gather(rows.reshape(-1), e.reshape(-1, rb))
            elif local is not None:
                local.gather(rows.reshape(-1), e.reshape(-1, rb), serial=serial)
            else:
                store.gather(rows.reshape(-1), e.reshape(-1, rb))
        if skip:
            return tokens[skip:], e[skip:]
        return tokens, e

    pool = _Workers(work, produce, depth, workers, pre)

    def close() -> None:
        if warm is not None:
            warm.stop()  # an abandoned stream does not read the rest of the table
        pool.close()
        if warm is not None:
            warm.join()

    return Stream(_consume(pool, copy, stats), stats, close)


def _consume(
    pool: _Workers, copy: bool, stats: dict[str, Any]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    while True:
        item = pool.get()
        if item is _DONE:
            return
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _Later):
            item.pending.wait()
            item = item.result
        tokens, e = item
        stats["batches"] += 1
        stats["tokens"] += int(tokens.size)
        yield (tokens, e.copy()) if copy else (tokens, e)


class _Later:
    """A batch whose rows the table's warm is still gathering (`Pending`)."""

    def __init__(self, pending: Pending, result: tuple[np.ndarray, np.ndarray]):
        self.pending = pending
        self.result = result


_MODES = {"auto", "warm", "windows", "batch"}
_MARGIN_MIN = 1 << 30  # the default budget leaves MemAvailable minus max(1 GiB, 10 %)
# Batches gathered while a cold table warms: at most this many, in at most this many bytes
# (and a quarter of what the budget leaves beside the table).
_PRE_BATCHES = 8
_PRE_MAX = 256 << 20


def _budget(page_cache_budget: int | str | None) -> int:
    if page_cache_budget is not None:
        b = parse_size(page_cache_budget)
        if b <= 0:
            raise InvalidArgument(f"page_cache_budget must be > 0, got {page_cache_budget!r}")
        return b
    avail = mem_available()
    return max(0, avail - max(_MARGIN_MIN, avail // 10))


class Stream:
    """The iterator `stream` returns: ``(token_ids, e_t)`` batches in corpus order.
    `stats` reports the read mode, the budget and (windowed reads) the device calibration
    and what was read; `close` (also on abandonment) stops the background threads."""

    def __init__(
        self, gen: Iterator[tuple[np.ndarray, np.ndarray]], stats: dict[str, Any], close: Any
    ):
        self._gen = gen
        self._stats = stats
        self._close = close
        self._closed = False

    def __repr__(self) -> str:
        mode = self._stats.get("mode", "?") if isinstance(self._stats, dict) else "?"
        return f"Stream(mode={mode!r}, closed={self._closed})"

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        try:
            return next(self._gen)
        except BaseException:
            self.close()
            raise

    def stats(self) -> dict[str, Any]:
        """A copy of the counters: ``mode``, ``page_cache_budget``, ``table_bytes``,
        ``batches``, ``tokens``; warm mode: ``warm_seconds``, ``warm_bytes_per_s``,
        ``resident_before``, ``warm_lookahead_batches``; windows mode: ``device`` (the
        calibration and the chosen ``merge_gap``, ``max_read``, ``depth``),
        ``window_cap_bytes``, ``window_small_pages`` (its window fell back to 4 KiB pages:
        huge ones committed too slowly), ``windows``, ``runs``, ``bytes_read`` (device bytes),
        ``payload_bytes``, ``rows_read``, ``memory_bytes`` (peak the stream holds),
        ``within_budget``."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            close_gen = getattr(self._gen, "close", None)
            if close_gen is not None:
                close_gen()
            self._close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _resolve_store(source: Any, table: str | None) -> RowTable:
    if isinstance(source, RowTable):
        if table is not None and table != source.name:
            raise InvalidArgument(f"table={table!r} but the store is {source.name!r}")
        return source
    tables = getattr(source, "tables", None)
    if tables is None:
        raise InvalidArgument(f"source must be a Database or a Store, got {type(source).__name__}")
    if table is None:
        if len(tables) != 1:
            raise InvalidArgument(f"the database has tables {tables}: pass table=")
        table = tables[0]
    return source[table]
