"""The general path of a decode step's fill (`engramdb.decode.Decoder.fill`): each layer's rows
through its table's own read path, when neither of the decoder's fast paths (the step reader's
rows, one gather from a resident mapping) took them."""

from __future__ import annotations

from typing import Any

import numpy as np

from engramdb.errors import EngramDBError
from engramdb.read.prefetch import take_kept
from engramdb.validate import check_output

__all__ = ["LayerReads", "fill_slices", "mapped_tables"]


def mapped_tables(local: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """For a decoder's resident fast paths, per layer (``local``: its `LocalTable` or None):
    the mapped table (None: a RAM tier, rows assembled from several source columns, or not
    local), the read rule's mapped-state test (None where not local), and for the compiled
    gather the table with the attached source's descriptor and size to check (-1 and 0 for
    a built table) or None."""
    direct, mapped, quick = [], [], []
    for st in local:
        tbl = None
        if st is not None and st.cache is None:
            try:
                tbl = st.array()
            except EngramDBError:  # rows assembled from several source columns
                tbl = None
        direct.append(tbl)
        mapped.append(st.mapped_state if st is not None else None)
        fd, size = (st.array_guard() if tbl is not None else None) or (-1, 0)
        quick.append(None if tbl is None else (tbl, fd, size))
    return direct, mapped, quick


def fill_slices(
    out: Any, n: int, hr: int, layer_shape: tuple[int, ...], pending_shape: tuple[int, ...]
) -> tuple[bool, list[Any], list[Any], list[Any]]:
    """A decoder's fill buffer ``out`` checked (`pending_shape`, or `layer_shape`: a buffer
    of one layer's rows, where ``n`` > 1 layers) and cut per layer: whether it is one layer's,
    each layer's slice shaped like its rows + ``(rb,)``, its destination for the compiled
    gather (``out``, the slice, its byte offset, the stride between groups of ``H`` rows of
    ``hr`` bytes) and its ``[N, H * rb]`` view."""
    one = n > 1 and getattr(out, "ndim", 0) == len(layer_shape)
    if one:
        check_output(out, layer_shape)
        return True, [out] * n, [(out, out, 0, hr)] * n, [out.reshape(-1, hr)] * n
    check_output(out, pending_shape)
    # ``out``'s slice of layer i of ``[..., L, H, rb]`` (strided with several layers)
    lead: tuple[Any, ...] = (slice(None),) * (out.ndim - 3)
    shaped = [out] if n == 1 else [out[lead + (i,)] for i in range(n)]
    o = out.reshape(-1, n, hr)
    views = [o[:, i] for i in range(n)]
    return False, shaped, [(out, shaped[i], i * hr, n * hr) for i in range(n)], views


class LayerReads:
    """A decoder's per-layer state, shared with it (the lists are the decoder's own, changed
    in place): its tables (``stores``; ``local``: the `LocalTable` of each, or None), its
    pending prefetch tickets, and per layer the rows and the buffer of its last fill."""

    def __init__(
        self,
        stores: list[Any],
        local: list[Any],
        tickets: list[Any],
        filled_rows: list[np.ndarray | None],
        filled_out: list[np.ndarray | None],
        row_bytes: int,
    ):
        self.stores, self.local, self.tickets = stores, local, tickets
        self.filled_rows, self.filled_out = filled_rows, filled_out
        self.row_bytes = row_bytes

    def read(
        self,
        rows: list[np.ndarray],
        which: Any,
        out: np.ndarray,
        views: list[np.ndarray],
        shaped: list[np.ndarray],
    ) -> tuple[int, int]:
        """Layers ``which`` of a step (its ``rows``) into ``out``: ``views[i]`` is layer
        ``i``'s slice as ``[N, H * rb]`` (strided where ``out`` holds several layers of
        several sequences), ``shaped[i]`` the same slice shaped like the rows + ``(rb,)``.
        A prefetch still queued is withdrawn and read here; one running or done is waited
        for (raising its error) and its kept rows taken, else the rows are gathered from
        the mapping it warmed. Returns the layers served from kept rows and those whose
        prefetch was withdrawn."""
        rb = self.row_bytes
        kept = withdrawn = 0
        for i in which:
            table = self.stores[i]
            self.filled_rows[i], self.filled_out[i] = rows[i], out
            store = self.local[i]
            t = self.tickets[i]
            resident = False
            if t is not None:
                self.tickets[i] = None
                if t.cancel():  # still queued: read here
                    withdrawn += 1
                else:  # running or finished: wait for it (raises its error)
                    t.wait()
                    if take_kept(t, rows[i], shaped[i]):  # the rows it read, no mapping
                        kept += 1
                        continue
                    # Read into the page cache with page-table entries installed: gather
                    # from the mapping (the store's cold rule might re-read them O_DIRECT).
                    assert store is not None
                    resident = store.prefetcher.target == "page_cache"
            v = views[i]
            flat = rows[i].reshape(-1)
            contiguous = v.flags.c_contiguous
            if store is None:  # not a local table: its own read path
                if contiguous:
                    table.gather(flat, v.reshape(-1, rb))
                else:
                    tmp = np.empty((flat.size, rb), dtype=np.uint8)
                    table.gather(flat, tmp)
                    v[...] = tmp.reshape(v.shape)
                continue
            dest = v.reshape(-1, rb) if contiguous else None
            if dest is None:  # several layers and sequences: layer i's rows are strided
                dest = store.scratch("decode", flat.size * rb).reshape(-1, rb)
            if resident:
                # Never through the read rule: its sample would see the rows this decoder
                # just prefetched and call a cold table resident.
                store.gather_resident(flat, dest)
            elif flat.size < 256:
                store.gather_small(flat, dest)
            else:
                store.gather(flat, dest)
            if not contiguous:
                v[...] = dest.reshape(v.shape)
        return kept, withdrawn
