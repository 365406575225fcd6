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

Several layers (DeepSeek Engram: a table per layer) use a `{layer: store}` mapping and fill
``[B, L, H, row_bytes]``. Any `RowTable` works (a `RemoteStore`, a `MooncakeTable`): tables
that are not local (`engramdb.read.table.LocalTable`) have no prefetcher, so their rows are
read at `fill` through `RowTable.gather`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, ShapeMismatch
from engramdb.keygen import preset as keygen_preset
from engramdb.read.prefetch import QUEUED, Ticket
from engramdb.read.table import LocalTable
from engramdb.table_api import RowTable
from engramdb.validate import check_output


class Decoder:
    """Row lookups for one sequence or a fixed batch of sequences, one token per step.

    ``stores``: a `Store` (one layer) or ``{layer: Store}`` (several layers, filled in the
    mapping's order); any `RowTable` serves. ``preset``: a keygen preset name or `Hasher`. ``layer``: the layer of a
    single store when the hasher has several. ``batch``: ``None`` for one sequence (push a
    scalar token, fill ``[H, row_bytes]``) or ``B`` (push ``[B]`` tokens, fill
    ``[B, H, row_bytes]``, or ``[B, L, H, row_bytes]`` with several layers). ``prefetch``:
    ``"auto"`` (default) starts background reads at `push` unless the table is served from
    resident memory (the store's read rule is in its mapped state: a thread hand-off would
    cost more than the gather); ``True`` always, ``False`` never (read at `fill`). Tables
    that are not local are read at `fill` (``prefetch=True`` refuses them).

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
    ):
        h = keygen_preset(preset) if isinstance(preset, str) else preset
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
        self._streams = [h.stream(layer=lay) for lay in self.layers]
        zero = np.zeros(1, np.int64)
        heads = [int(h.row_ids(zero, layer=lay).shape[-1]) for lay in self.layers]
        self.n_heads = heads[0]
        if any(n != self.n_heads for n in heads):
            raise InvalidArgument("the layers have different head counts")
        self._rows: list[np.ndarray] | None = None
        self._tickets: list[Ticket | None] = [None] * len(self.stores)
        self.steps = 0
        # One sequence, one table: the decode step engines issue most; see `_push1`/`_fill1`.
        self._single = self.batch is None and len(self.stores) == 1
        self._last_out: np.ndarray | None = None
        self._last_out2d: np.ndarray | None = None

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape `fill` writes: ``[H, rb]``, ``[B, H, rb]`` or (several layers)
        ``[B, L, H, rb]`` (``[L, H, rb]`` for one sequence)."""
        lead: tuple[int, ...] = () if self.batch is None else (self.batch,)
        if len(self.stores) > 1:
            lead = (*lead, len(self.stores))
        return (*lead, self.n_heads, self.row_bytes)

    def push(self, token_ids: Any) -> list[np.ndarray]:
        """Take the new token of each sequence (a scalar, or ``[B]``), compute its row ids
        (global, int64 ``[H]`` / ``[B, H]`` per layer) and start prefetching them. Returns the
        row ids per layer. A second push before `fill` replaces the pending step."""
        if self._single:
            return self._push1(token_ids)
        if self.batch is None:
            if type(token_ids) is not int:
                if np.ndim(token_ids) != 0:
                    raise ShapeMismatch(
                        "a single-sequence decoder takes one token, got shape "
                        f"{np.shape(token_ids)}"
                    )
                token_ids = int(token_ids)
            tok: Any = token_ids
        else:
            arr = np.asarray(token_ids)
            if arr.shape != (self.batch,):
                raise ShapeMismatch(f"expected {self.batch} tokens, got shape {arr.shape}")
            tok = arr.reshape(self.batch, 1)
        rows = []
        for i, st in enumerate(self._streams):
            r = st.push(tok)
            if self.batch is not None:
                r = r.reshape(self.batch, self.n_heads)
            rows.append(r)
            old = self._tickets[i]
            if old is not None and old.state == QUEUED:
                old.cancel()
            store = self._local[i]
            want = store is not None and (
                self.prefetch is True or (self.prefetch == "auto" and not store.mapped_state())
            )
            if want:
                assert store is not None
                self._tickets[i] = store.prefetcher.submit_trusted(r.reshape(-1))
                self.prefetched += 1
            else:
                self._tickets[i] = None
        self._rows = rows
        self.steps += 1
        return rows

    def _push1(self, token_ids: Any) -> list[np.ndarray]:
        if type(token_ids) is not int:
            if np.ndim(token_ids) != 0:
                raise ShapeMismatch(
                    f"a single-sequence decoder takes one token, got shape {np.shape(token_ids)}"
                )
            token_ids = int(token_ids)
        r = self._streams[0].push(token_ids)
        tickets = self._tickets
        old = tickets[0]
        if old is not None and old.state == QUEUED:
            old.cancel()
        store = self._local[0]
        pf = self.prefetch
        if store is not None and (pf is True or (pf == "auto" and not store.mapped_state())):
            tickets[0] = store.prefetcher.submit_trusted(r)
            self.prefetched += 1
        else:
            tickets[0] = None
        rows = self._rows = [r]
        self.steps += 1
        return rows

    def _fill1(self, out: np.ndarray, r: np.ndarray) -> np.ndarray:
        if out is not self._last_out:  # engines reuse one buffer: validate it once
            check_output(out, self.out_shape)
            self._last_out, self._last_out2d = out, out.reshape(-1, self.row_bytes)
        out2d = self._last_out2d
        assert out2d is not None
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
            store.gather_small(r, out2d)
        else:
            t.wait()  # raises a failed prefetch's error
            if store.prefetcher.target == "page_cache":
                store.gather_resident(r, out2d)
            else:
                store.gather_small(r, out2d)
        return out

    def fill(self, out: np.ndarray) -> np.ndarray:
        """Copy the rows of the last `push` into ``out`` (writable C-contiguous uint8 of
        `out_shape`). Waits only for reads still in flight; a prefetch still queued is
        withdrawn and read here. Raises the error of a failed prefetch."""
        rows = self._rows
        if rows is None:
            raise InvalidArgument("fill() before push(): no pending step")
        if self._single:
            return self._fill1(out, rows[0])
        check_output(out, self.out_shape)
        n_layers = len(self.stores)
        if n_layers == 1:
            views = [out.reshape(-1, self.row_bytes)]
        else:
            o = out.reshape(-1, n_layers, self.n_heads * self.row_bytes)
            views = [o[:, i] for i in range(n_layers)]
        for i, table in enumerate(self.stores):
            store = self._local[i]
            t = self._tickets[i]
            resident = False
            if t is not None:
                self._tickets[i] = None
                if not t.cancel():  # running or finished: wait for it (raises its error)
                    t.wait()
                    # Read into the page cache with page-table entries installed: gather from
                    # the mapping (the store's cold rule might re-read them O_DIRECT).
                    assert store is not None
                    resident = store.prefetcher.target == "page_cache"
            v = views[i]
            flat = rows[i].reshape(-1)
            if store is None:  # not a local table: its own read path
                if v.flags.c_contiguous:
                    table.gather(flat, v.reshape(-1, self.row_bytes))
                else:
                    tmp = np.empty((flat.size, self.row_bytes), dtype=np.uint8)
                    table.gather(flat, tmp)
                    v[...] = tmp.reshape(v.shape)
            elif resident and v.flags.c_contiguous:
                store.gather_resident(flat, v.reshape(-1, self.row_bytes))
            elif v.flags.c_contiguous:
                store.gather_small(flat, v.reshape(-1, self.row_bytes))
            else:  # several layers and sequences: layer i's rows are strided in `out`
                tmp = store.scratch("decode", flat.size * self.row_bytes)
                store.gather(flat, tmp.reshape(-1, self.row_bytes))
                v[...] = tmp.reshape(v.shape)
        return out

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
        self._tickets = [None] * len(self.stores)
        self._rows = None
