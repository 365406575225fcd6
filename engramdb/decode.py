"""Decode-time lookups (workload B): row ids from the keygen stream, prefetched at once.

An engine knows the next token of every sequence as soon as it is sampled, long before the
layer that reads the table runs. `Decoder.push` turns the new tokens into row ids (the keygen
streaming state keeps each sequence's look-back) and starts a background read of them; the
engine computes its earlier layers; `Decoder.fill` then copies the rows into a caller-owned
buffer, waiting only for reads still in flight::

    dec = Decoder(db["ple"], "qwen3.8-flash-next", batch=32)
    out = np.empty((32, dec.n_heads, dec.row_bytes), np.uint8)
    for step in range(n_steps):
        dec.push(next_tokens)        # keygen (~2 us for one sequence) + prefetch submit
        ...                          # layers before the table's layer
        dec.fill(out)                # [B, H, row_bytes]

A prompt goes in at once (`Decoder.prefill`); several layers (a table per layer) use a
`{layer: store}` mapping and fill ``[B, L, H, row_bytes]``; tables that are not local (a
`RemoteStore`, a `MooncakeTable`) are read at `fill` through `RowTable.gather`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, RowIdOutOfRange, ShapeMismatch
from engramdb.io.columns import grid_taker
from engramdb.keygen.presets import preset_for_table, table_record
from engramdb.read.autorule import PrefetchRule
from engramdb.read.decode_fill import LayerReads, fill_slices, mapped_tables
from engramdb.read.prefetch import DONE, QUEUED, Ticket, take_kept
from engramdb.read.step_plan import RUNNING, StepTicket, grid_view
from engramdb.read.steps import StepReader
from engramdb.read.table import LocalTable
from engramdb.table_api import RowTable
from engramdb.validate import check_output, one_token

_INT64 = np.dtype(np.int64)


class Decoder:
    """Row lookups for one sequence or a fixed batch of sequences, one token per step.

    ``stores``: a `Store` (one layer) or ``{layer: Store}`` (several layers, filled in the
    mapping's order); any `RowTable` serves. ``preset``: a keygen preset name or `Hasher`. ``layer``: the layer of a
    single store when the hasher has several. ``batch``: ``None`` for one sequence (push a
    scalar token, fill ``[H, row_bytes]``) or ``B`` (push ``[B]`` tokens, fill
    ``[B, H, row_bytes]``, or ``[B, L, H, row_bytes]`` with several layers). ``prefetch``:
    ``"auto"`` (default) starts background reads at `push` unless the table is resident (a
    thread hand-off would cost more than the gather); ``True`` always, ``False`` never (read
    at `fill`). Tables that are not local are read at `fill` (``prefetch=True`` refuses them).
    ``compressed``: the pushed ids are already tokenizer-compressed (DeepSeek kinds and
    engram-peft without a token map).

    The ``auto`` rule: `engramdb.read.autorule.PrefetchRule` (``rule``, its sample interval
    ``auto_recheck_s``, doubled up to 16x while an off layer stays resident; ``auto_checks``
    / ``auto_switches``). Cold rows of a mapped table are read by a `StepReader` (one
    ``O_DIRECT`` read per row, submitted at `push`), others by the table's prefetcher;
    resident rows are gathered at `fill` (docs/workloads.md).

    Every table must hold the hasher's ``table_rows`` for its layer; that is checked once here,
    so steps skip per-row bounds checks (keygen ids are in range by construction).
    """

    def __init__(
        self,
        stores: RowTable | Mapping[int, RowTable],
        preset: Any,
        *,
        layer: int | None = None,
        batch: int | None = None,
        prefetch: bool | str = "auto",
        compressed: bool = False,
        auto_recheck_s: float = 0.1,
    ):
        first = stores if isinstance(stores, RowTable) else next(iter(stores.values()), None)
        h = preset_for_table(preset, table_record(first)) if isinstance(preset, str) else preset
        if isinstance(stores, RowTable):
            if layer is None:
                if len(h.layers) != 1:
                    raise InvalidArgument(
                        f"the hasher has layers {list(h.layers)}: pass layer= for one store"
                    )
                layer = int(h.layers[0])
            pairs: Sequence[tuple[int, RowTable]] = [(int(layer), stores)]
        else:
            if layer is not None:
                raise InvalidArgument("layer= applies to a single store; the mapping names them")
            pairs = [(int(k), v) for k, v in stores.items()]
        if not pairs:
            raise InvalidArgument("no stores given")
        if batch is not None and (isinstance(batch, bool) or int(batch) < 1):
            raise InvalidArgument(f"batch must be None or >= 1, got {batch!r}")
        self.hasher = h
        self.layers = [p[0] for p in pairs]
        self.stores = [p[1] for p in pairs]
        self.batch = None if batch is None else int(batch)
        if prefetch not in (True, False, "auto"):
            raise InvalidArgument(f"prefetch must be True, False or 'auto', got {prefetch!r}")
        self.prefetch = prefetch
        # Local tables get the trusted read API and a prefetcher; others are read at fill.
        self._local: list[LocalTable | None] = [
            s if isinstance(s, LocalTable) else None for s in self.stores
        ]
        if prefetch is True and None in self._local:
            raise InvalidArgument("prefetch=True needs local tables (a Store): read at fill()")
        self.prefetched = 0  # steps (per layer) that submitted a background read
        row_bytes = {s.row_bytes for s in self.stores}
        if len(row_bytes) != 1:
            raise InvalidArgument(f"the tables' row sizes differ: {sorted(row_bytes)}")
        self.row_bytes = row_bytes.pop()
        for lay, s in pairs:
            if lay not in h.layers:
                raise InvalidArgument(f"layer {lay} is not one of the hasher's {list(h.layers)}")
            need = h.table_rows(lay)
            if s.n_rows < need:
                raise InvalidArgument(
                    f"table {s.name!r} has {s.n_rows:,} rows; layer {lay} of the hasher "
                    f"addresses {need:,}"
                )
        self.compressed = bool(compressed)
        self._streams = [h.stream(layer=lay, compressed=self.compressed) for lay in self.layers]
        #: The ``auto`` rule: per layer, prefetch or not, and from where (`PrefetchRule`).
        self.rule = PrefetchRule(self._local, prefetch, auto_recheck_s)
        self._pending_t: int | None = None  # positions of a pending prefill (None: a step)
        # Per layer: the row ids behind its last fill and the buffer that fill wrote.
        self.filled_rows: list[np.ndarray | None] = [None] * len(self.stores)
        self.filled_out: list[np.ndarray | None] = [None] * len(self.stores)
        heads = [int(st.n_heads) for st in self._streams]
        self.n_heads = heads[0]
        if any(n != self.n_heads for n in heads):
            raise InvalidArgument("the layers have different head counts")
        self._rows: list[np.ndarray] | None = None
        self._tickets: list[Ticket | StepTicket | None] = [None] * len(self.stores)
        #: Reads each step's cold rows of the layers that are one mapped array, from this
        #: thread, without waiting (`StepReader`, made at the first prefetch; None where
        #: io_uring is unavailable); other tables, and steps it refuses, use the table's
        #: `Prefetcher`.
        self._reader: StepReader | None = None
        self._reader_ok = StepReader.available()
        self._step_out: np.ndarray | None = None  # the buffer this step's rows went to
        #: per layer (-1: all): the buffer last filled, as the reader's grid of rows
        self._dest_keys: dict[int, tuple[Any, ...]] = {}
        self.steps = 0
        # One sequence, one table: the decode step engines issue most; see `_push1`/`_fill1`.
        self._single = self.batch is None and len(self.stores) == 1
        self._last_out: np.ndarray | None = None
        self._last_out2d: np.ndarray | None = None
        self._fill_keys: dict[int, tuple[Any, ...]] = {}  # `_key` per buffer (by id)
        self._slot_of = {lay: i for i, lay in enumerate(self.layers)}
        # the resident fast paths of `fill` (`_fill_direct`, its one-layer one)
        self._direct, self._mapped, self._quick = mapped_tables(self._local)
        # per layer, the step buffer its last fill wrote (the one-layer fast path serves the
        # next step's fill of it): (buffer, the layer's slice, its `_take_layer` place)
        self._quick_dst: list[tuple[Any, ...] | None] = [None] * len(self.stores)
        self._grid = grid_taker()
        self._offsets = [np.asarray(h.offsets(lay), np.int64) for lay in self.layers]
        # `local_ids`' buffers; once it is called, each push has the keygen write them too
        # (in its compiled step's own pass) and marks them fresh for that step
        self._local_ids: list[np.ndarray | None] = [None] * len(self.layers)
        self._local_fresh = [False] * len(self.layers)
        self._want_local = False
        reads = (self.stores, self._local, self._tickets, self.filled_rows, self.filled_out)
        self._reads = LayerReads(*reads, self.row_bytes)
        #: Layer fills served by one gather from the mapping into the buffer's slice
        #: (resident rows, not prefetched) / from the rows a prefetch read (kept on its
        #: ticket: no mapping, no page faults) / read here because their prefetch was still
        #: queued (withdrawn: the step came before the worker reached it).
        self.direct_fills = 0
        self.kept_fills = 0
        self.withdrawn_fills = 0

    @property
    def auto_checks(self) -> int:
        """Residency samples the ``auto`` rule took (`PrefetchRule.checks`)."""
        return self.rule.checks

    @property
    def auto_switches(self) -> int:
        """Decisions of the ``auto`` rule that changed (`PrefetchRule.switches`)."""
        return self.rule.switches

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape `fill` writes for a step: ``[H, rb]``, ``[B, H, rb]`` or (several layers)
        ``[B, L, H, rb]`` (``[L, H, rb]`` for one sequence)."""
        lead: tuple[int, ...] = () if self.batch is None else (self.batch,)
        if len(self.stores) > 1:
            lead = (*lead, len(self.stores))
        return (*lead, self.n_heads, self.row_bytes)

    def prefill_shape(self, n_tokens: int) -> tuple[int, ...]:
        """Shape `fill` writes after ``prefill`` of ``n_tokens`` tokens per sequence: the step
        shape with ``T`` after the batch axis (``[T, H, rb]``, ``[B, T, L, H, rb]``)."""
        lead: tuple[int, ...] = (int(n_tokens),)
        if self.batch is not None:
            lead = (self.batch, *lead)
        if len(self.stores) > 1:
            lead = (*lead, len(self.stores))
        return (*lead, self.n_heads, self.row_bytes)

    @property
    def pending_shape(self) -> tuple[int, ...]:
        """Shape the next `fill` takes: `out_shape` after a push, `prefill_shape` after a
        prefill."""
        t = self._pending_t
        return self.out_shape if t is None else self.prefill_shape(t)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's part of `pending_shape` (the layer axis left out): the shape of a
        buffer of one layer's rows, which ``fill(out, layer=)`` also takes."""
        s = self.pending_shape
        return s if len(self.stores) == 1 else s[:-3] + s[-2:]

    # -- steps ---------------------------------------------------------------------------------
    def _submit(self, i: int, flat: np.ndarray, jobs: list[Any]) -> None:
        """Decide layer ``i``'s prefetch of ``flat``: a job for the step reader (appended to
        ``jobs``, submitted once per step by `_flush`), a `Prefetcher` ticket, or none."""
        old = self._tickets[i]
        if old is not None and old.state == QUEUED:
            old.cancel()
        store = self._local[i]
        if self.rule.want(i, store, flat):
            assert store is not None
            if self.rule.cold[i] and self._reader_ok and self._direct[i] is not None:
                t: Ticket | StepTicket = StepTicket(flat)
                jobs.append((store, flat, t))
            else:
                t = store.prefetcher.submit_trusted(flat, keep_rows=True)
            self._tickets[i] = t
            self.prefetched += 1
        else:
            self._tickets[i] = None

    def _flush(self, jobs: list[Any]) -> None:
        """Start one step's reads of every layer at once (`StepReader.submit`); a step it refuses
        (too many rows, a file system without O_DIRECT) goes to the tables' prefetchers."""
        if not jobs:
            return
        reader = self._reader
        if reader is None:
            reader = self._reader = StepReader()
        if not reader.submit(jobs):
            for store, flat, t in jobs:
                i = next(k for k, x in enumerate(self._tickets) if x is t)
                self._tickets[i] = store.prefetcher.submit_trusted(flat, keep_rows=True)

    def __repr__(self) -> str:
        pairs = zip(self.layers, self.stores)
        tables = ", ".join(f"{getattr(t, 'name', '?')}@{i}" for i, t in pairs)
        return (
            f"Decoder(preset={self.hasher.name or self.hasher.kind!r}, tables=[{tables}], "
            f"batch={self.batch}, prefetch={self.prefetch!r}, row_bytes={self.row_bytes})"
        )

    def push(self, token_ids: Any) -> list[np.ndarray]:
        """Take the new token of each sequence (a scalar, or ``[B]``), compute its row ids
        (global, int64 ``[H]`` / ``[B, H]`` per layer) and start prefetching them. Returns the
        row ids per layer. A second push before `fill` replaces the pending step."""
        if self._single:
            return self._push1(token_ids)
        if self.batch is None:
            return self._push_streams(one_token(token_ids), None, None)
        arr = np.asarray(token_ids)
        if arr.shape != (self.batch,):
            raise ShapeMismatch(f"expected {self.batch} tokens, got shape {arr.shape}")
        return self._push_streams(arr.reshape(self.batch, 1), (self.batch, self.n_heads), None)

    def _push1(self, token_ids: Any) -> list[np.ndarray]:
        if type(token_ids) is not int:
            token_ids = one_token(token_ids)
        r = self._push_layer(0, token_ids, self.n_heads)
        jobs: list[Any] = []
        self._submit(0, r, jobs)
        self._flush(jobs)
        return self._stepped([r], None)

    def _push_streams(
        self, tok: Any, shape: tuple[int, int] | None, pending_t: int | None
    ) -> list[np.ndarray]:
        """Push ``tok`` into every layer's key stream, submit each layer's rows for prefetch
        (``shape``: the rows' per-step shape) and record the step."""
        rows = []
        jobs: list[Any] = []
        rule, tickets, now = self.rule, self._tickets, time.monotonic()
        n = self.n_heads * (tok.size if type(tok) is np.ndarray else 1)
        # checked once for every layer's compiled keygen step (`KeyStream.push_native`)
        native = type(tok) is np.ndarray and tok.dtype is _INT64 and tok.flags.c_contiguous
        for i in range(len(self._streams)):
            r = self._push_layer(i, tok, n, native)
            if shape is not None:
                r = r.reshape(shape)
            rows.append(r)
            # in the rule's quiet window `_submit` would leave no ticket: skip its calls
            if tickets[i] is not None or not rule.quiet(i, self._local[i], now):
                self._submit(i, r.reshape(-1), jobs)
        self._flush(jobs)
        return self._stepped(rows, pending_t)

    def _push_layer(self, i: int, tok: Any, n: int, native: bool = False) -> np.ndarray:
        """Layer ``i``'s keygen push of ``tok`` (``n`` row ids; ``native``: int64, C-contiguous),
        writing its local ids into `local_ids`' buffer too once wanted and the buffer holds
        ``n`` (a prefill's, or a step's after a prefill, does not: `local_ids` makes one)."""
        lo = self._local_ids[i] if self._want_local else None
        if lo is not None and lo.size != n:
            lo = None
        st = self._streams[i]
        r = st.push_native(tok, lo) if native else None
        if r is None:
            self._local_fresh[i] = False
            r = st.push(tok, local_out=lo)
        self._local_fresh[i] = lo is not None
        return r

    def local_ids(self, layer: int | None = None) -> np.ndarray:
        """The pending step's (or prefill's) row ids of ``layer`` (None: a single layer) less
        each head's offset: the per-head local ids a model's multi-head embedding takes (as
        `Hasher.local_ids`), e.g. the ids the hook serving this decoder's fills checks. In a
        buffer reused from step to step (valid until the next push): once this has been
        called, each push's keygen writes them there in its own pass (else one subtraction)."""
        rows = self._rows
        j = self._slot_of.get(layer if layer is not None else self.layers[0])  # type: ignore[arg-type]
        if j is None or (layer is None and len(self.layers) > 1):
            raise InvalidArgument(f"layer {layer!r} is not one of the decoder's {self.layers}")
        if rows is None:
            raise InvalidArgument("local_ids() before push(): no pending step")
        buf = self._local_ids[j]
        if self._local_fresh[j] and buf is not None:
            return buf.reshape(rows[j].shape) if buf.shape != rows[j].shape else buf
        if buf is None or buf.shape != rows[j].shape:
            buf = self._local_ids[j] = np.empty(rows[j].shape, np.int64)
        self._want_local = self._local_fresh[j] = True  # the next pushes write them
        return np.subtract(rows[j], self._offsets[j], out=buf)

    def _stepped(self, rows: list[np.ndarray], pending_t: int | None) -> list[np.ndarray]:
        self._rows = rows
        self._pending_t = pending_t
        self._step_out = None
        self.steps += 1
        return rows

    def _fill_step(
        self, out: np.ndarray, rows: list[np.ndarray], which: range | tuple[int, ...], one: bool
    ) -> bool:
        """The step reader's fast path: the layers ``which`` of this step straight from the
        reader into their slices of ``out`` (all layers at once: one gather; ``one``: ``out``
        holds one layer's rows), when it reads each of them. False (nothing written) if not."""
        if self._step_out is out:
            return True  # every layer of this step is in this buffer already
        reader = self._reader
        if reader is None:
            return False
        tickets = self._tickets
        for i in which:
            t = tickets[i]
            if type(t) is not StepTicket or t.state != RUNNING or t.reader is not reader:
                return False
        unit = reader.step_unit
        every = not one and len(which) == len(rows)
        for i in (-1,) if every else which:
            dk = self._dest_keys.get(i)
            if dk is not None and dk[0] is out and dk[1] == self._pending_t and dk[2] == unit:
                dest = dk[3]
            else:
                lead = rows[0].shape[:-1]
                n, at = (1, 0) if one else (len(rows), i)
                dest = grid_view(out, lead, n, self.n_heads, unit, at)
                self._dest_keys[i] = (out, self._pending_t, unit, dest)
            t = None if every else tickets[i]
            if not reader.finish_into(dest, t):  # type: ignore[arg-type]
                return False
        for i in which:
            self.filled_rows[i], self.filled_out[i] = rows[i], out
            tickets[i] = None
        self.kept_fills += len(which)
        if every:
            self._step_out = out
        return True

    def prefill(self, token_ids: Any) -> list[np.ndarray]:
        """Take a prompt (``[T]`` for one sequence, ``[B, T]`` for the batch) at once: one
        batched keygen pass and one prefetch per layer for all ``T`` positions (the look-back
        continues from earlier pushes, so prefill then push equals pushing one by one).
        Returns the row ids per layer (``[T, H]`` / ``[B, T, H]``); the next `fill` takes
        `prefill_shape` (``T``).``"""
        arr = np.asarray(token_ids)
        want = 1 if self.batch is None else 2
        if arr.ndim != want or (self.batch is not None and arr.shape[0] != self.batch):
            lead = "[T]" if self.batch is None else f"[{self.batch}, T]"
            raise ShapeMismatch(f"prefill takes {lead} tokens, got shape {arr.shape}")
        n_tok = int(arr.shape[-1])
        if n_tok == 0:
            raise ShapeMismatch("prefill of zero tokens")
        return self._push_streams(arr, None, n_tok)  # [T, H] or [B, T, H] per layer

    def _fill1(self, out: np.ndarray, r: np.ndarray) -> np.ndarray:
        if out is not self._last_out:  # engines reuse one buffer: validate it once
            check_output(out, self.out_shape)
            self._last_out, self._last_out2d = out, out.reshape(-1, self.row_bytes)
        out2d = self._last_out2d
        assert out2d is not None
        if self._fill_step(out, [r], (0,), False):
            return out
        self.filled_rows[0], self.filled_out[0] = r, out
        store = self._local[0]
        if store is None:
            self.stores[0].gather(r, out2d)
            return out
        t = self._tickets[0]
        if t is None:
            store.gather_small(r, out2d)
            return out
        self._tickets[0] = None
        if t.cancel():  # still queued: read here
            self.withdrawn_fills += 1
            store.gather_small(r, out2d)
        else:
            t.wait()  # raises a failed prefetch's error
            if take_kept(t, r, out2d):
                self.kept_fills += 1
            elif store.prefetcher.target == "page_cache":
                store.gather_resident(r, out2d)
            else:
                store.gather_small(r, out2d)
        return out

    def fill(self, out: np.ndarray, *, layer: int | None = None) -> np.ndarray:
        """Copy the rows of the last `push` (or `prefill`) into ``out`` (writable
        C-contiguous uint8 of `pending_shape`). Waits only for reads still in flight; a
        prefetch still queued is withdrawn and read here. Raises the error of a failed
        prefetch. ``layer`` fills only that layer's slice of ``out`` (an engine fills each
        layer's rows right before the layer runs, so later layers' reads overlap more
        compute), or all of an ``out`` of `layer_shape` (a buffer per layer: a layer's rows
        then lie together, where its slice of a ``[B, L, H, rb]`` buffer is strided)."""
        rows = self._rows
        if type(layer) is int and self._step_out is None and self._pending_t is None:
            # A step's one-layer fill of the buffer the last step filled: a warm decode's
            # (the mapping, no prefetch: one `_take_layer`) or a cold one's (`_fill_stepped`),
            # after a few tests (inside a model step each costs several times its loop cost)
            j = self._slot_of.get(layer)
            if j is not None and rows is not None:
                t = self._tickets[j]
                if t is None:
                    q = self._quick_dst[j]
                    if q is not None and q[0] is out and self._quick[j] is not None:
                        if self._mapped[j]():
                            self._take_layer(j, rows[j], q)
                            return out
                elif type(t) is StepTicket and self._fill_stepped(j, t, rows[j], out):
                    return out
        if rows is None:
            raise InvalidArgument("fill() before push(): no pending step")
        if self._single and self._pending_t is None:
            if layer is not None and layer != self.layers[0]:
                raise InvalidArgument(f"layer {layer!r} is not the decoder's {self.layers}")
            return self._fill1(out, rows[0])
        key = self._fill_keys.get(id(out))
        if key is None or key[0] is not out or key[1] != self._pending_t:
            key = self._key(out)
        if layer is None:
            if key[3]:
                raise InvalidArgument(f"a buffer of {self.layer_shape} is one layer's: pass layer=")
            which: range | tuple[int] = range(len(self.stores))
        else:
            j = self._slot_of.get(layer) if type(layer) is int else None
            if j is None:
                if layer not in self.layers:
                    raise InvalidArgument(
                        f"layer {layer!r} is not one of the decoder's {self.layers}"
                    )
                j = self.layers.index(layer)
            which = (j,)
        if self._pending_t is None:  # a step's buffer: the one-layer fast path may serve it
            for i in which:
                self._quick_dst[i] = key[4][i]
        if self._fill_step(out, rows, which, key[3]) or self._fill_direct(out, rows, which, key):
            return out
        kept, withdrawn = self._reads.read(rows, which, out, key[5], key[2])
        self.kept_fills += kept
        self.withdrawn_fills += withdrawn
        return out

    def _fill_stepped(self, j: int, t: StepTicket, r: np.ndarray, out: np.ndarray) -> bool:
        """Layer ``j``'s rows ``r`` (ticket ``t``) from the step reader into the buffer an
        earlier step's `_fill_step` cut (`StepReader.finish_into`: its compiled steady state
        first); False: nothing written."""
        dk = self._dest_keys.get(j)
        reader = self._reader
        if dk is None or dk[0] is not out or dk[1] is not None or reader is None:
            return False
        if t.reader is not reader or dk[2] != reader.step_unit:
            return False
        if not reader.finish_into(dk[3], t):
            return False
        self._tickets[j] = None
        self.filled_rows[j], self.filled_out[j] = r, out
        self.kept_fills += 1
        return True

    def _key(self, out: Any) -> tuple[Any, ...]:
        """Check ``out`` for the pending fill (`pending_shape`, or `layer_shape`: a buffer of
        one layer's rows) and keep, per layer, its slice shaped like the rows + ``(rb,)``, its
        ``[N, H * rb]`` view, and its destination for `_take_layer` (``out``, the slice, its
        byte offset, the stride between groups of ``H`` rows): ``(out, pending, slices, one
        layer's buffer, destinations, views)``, looked up by ``id(out)`` at the next fill."""
        n = len(self.stores)
        one, shaped, dsts, views = fill_slices(
            out, n, self.n_heads * self.row_bytes, self.layer_shape, self.pending_shape
        )
        if len(self._fill_keys) > 2 * n + 2:  # buffers made anew each step: keep a few
            self._fill_keys.clear()
        key = self._fill_keys[id(out)] = (out, self._pending_t, shaped, one, dsts, views)
        return key

    def _take_layer(self, i: int, r: np.ndarray, dst: tuple[Any, ...]) -> None:
        """Layer ``i``'s rows ``r`` from its mapped table into their slice of a buffer (``dst``:
        the buffer, the slice, its byte offset and group stride): one compiled gather
        (`grid_taker`) that first checks an attached source's size
        (`LocalTable.array_guard`), else the table's own check and ``np.take``. A gather
        slow enough to have faulted is reported to the read rule and the prefetch rule."""
        out, shaped, off, gs = dst
        tbl, fd, size = self._quick[i]  # type: ignore[misc]
        grid = self._grid
        t0 = time.perf_counter()
        bad = -2
        if grid is not None:
            bad = grid(out, off, self.n_heads, gs, tbl, self.row_bytes, r, True, fd, size)
        if bad == -2:  # no compiled loop, or the source failed the check: raises TruncatedFile
            if fd >= 0:
                tbl = self.stores[i].array()  # type: ignore[attr-defined]
            tbl.take(r, 0, shaped, "clip")
        elif bad >= 0:  # never for keygen's ids (the table's rows were checked up front)
            raise RowIdOutOfRange(f"row id {int(r.flat[bad])} out of range [0, {len(tbl)})")
        dt = time.perf_counter() - t0
        self.filled_rows[i], self.filled_out[i] = r, out
        self.direct_fills += 1
        if dt > 10e-6 * r.size:  # faults: a cold table, or a mapping not populated yet
            self.stores[i].note_mapped_gather(r.size, dt)  # type: ignore[attr-defined]
            # prefetch for a while where the rows are cold: the step reader reads them from
            # the device, so this thread takes no major faults
            self.rule.faulted(i)

    def _fill_direct(
        self, out: np.ndarray, rows: list[np.ndarray], which: range | tuple[int], key: Any
    ) -> bool:
        """The resident fast path of `fill`: each layer's rows in one gather (`_take_layer`)
        from the mapping into its (possibly strided) slice of ``out``, when every layer asked
        for is one mapped array without a RAM tier and its rows are resident (a finished
        page-cache prefetch, or no prefetch while its read rule serves it from the mapping).
        False (nothing written) otherwise: the general path reads."""
        tables, shaped = self._direct, key[2]
        for i in which:
            tbl = tables[i]
            t = self._tickets[i]
            if t is None:
                if tbl is None or not self._mapped[i]():
                    return False
                continue
            if t.state != DONE and type(t) is StepTicket:
                try:
                    t.wait()  # collects the reads this step's push started
                except BaseException:
                    self._tickets[i] = None
                    raise
            if t.state != DONE or t.rows is None:
                return False
        for i in which:
            r = rows[i]
            t = self._tickets[i]
            self._tickets[i] = None
            # the rows the prefetch read (kept on the ticket); a step ticket whose ids are not
            # this step's (never expected) falls through to a read from the mapping
            if t is not None and take_kept(t, r, shaped[i]):
                self.filled_rows[i], self.filled_out[i] = r, out
                self.kept_fills += 1
                continue
            self._take_layer(i, r, key[4][i])
        return True

    def step(self, token_ids: Any, out: np.ndarray) -> np.ndarray:
        """`push` then `fill` at once (no overlap: for engines that read right away)."""
        self.push(token_ids)
        return self.fill(out)

    def reset(self) -> None:
        """Forget every sequence (new requests) and cancel pending prefetches."""
        for st in self._streams:
            st.reset()
        for t in self._tickets:
            if t is not None:
                t.cancel()
        self._tickets[:] = [None] * len(self.stores)  # in place: `LayerReads` shares it
        self._local_fresh[:] = [False] * len(self.stores)
        self._rows = None
        self._pending_t = None
