"""torch modules over EngramDB tables (optional extra ``torch``).

`DiskEmbedding` has ``nn.Embedding``'s forward contract (ids ``[...]`` → ``[..., dim]``) but
its weight stays in an EngramDB table; `DiskMultiHeadEmbedding` maps per-head local ids
``[B, L, H]`` to ``[B, L, H, dim]``. Rows are decoded from the table's dtype hint
(`engramdb.rowcodec`): raw dtypes are reinterpreted without a copy, FP8 is widened, FP8 with
E8M0 block scales is dequantised. No gradients: the table is read-only.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

from engramdb.errors import InvalidArgument, MissingDependency
from engramdb.io.columns import globalizer, heads_checker, rows_matcher
from engramdb.read.prefetch import take_kept
from engramdb.read.step_plan import StepTicket
from engramdb.read.steps import StepReader
from engramdb.table_api import RowTable
from engramdb.torch_rows import DiskEmbedding, DiskTable, Hot, hand_over, ids_to_numpy
from engramdb.validate import SmallBounds, unsigned_max

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise MissingDependency("engramdb.torch needs PyTorch: pip install 'engramdb[torch]'") from e


#: Ids up to this many (a decode step's, B <= 16 at 16 heads) are bounds-checked as integer
#: lanes (`SmallBounds`), more by numpy reductions (the lanes cost grows with the count; a
#: reduction's barely does).
_LANE_IDS = 256


class DiskMultiHeadEmbedding(DiskTable):
    """Per-head lookup: int64 local ids ``[B, L, H]`` → ``[B, L, H, dim]``.

    Keeps an ``offsets`` buffer (the global id of each head's row 0) like the in-memory
    multi-head embeddings it replaces. A local table (`Store`) is read with its trusted
    small-gather path (one ``np.take`` from the mapping while resident, the read rule
    otherwise) after one bounds check; other tables with `RowTable.lookup_into`.

    **Pre-fetched rows** (``decoder=``, a `engramdb.decode.Decoder` over this table, and
    ``layer=`` when it serves several): when the ids equal the rows the decoder's last
    `Decoder.fill` wrote (the same step, ``[B, 1, H]``, or a prefill, ``[B, T, H]``), the
    output is a view of that fill buffer (no copy, no read); otherwise it falls back to a
    synchronous read. ``served_prefetched`` / ``served_read`` count the two. The view is valid
    until the next `fill` overwrites the buffer (the layer consumes it within the step).

    ``process=``: a `engramdb.prefetch_process.PrefetchProcess` serving this table: every
    `prefetch` of up to its ``max_rows`` rows is read there (the forward copies them out).
    """

    offsets: torch.Tensor

    def __init__(
        self,
        store: RowTable | None = None,
        *,
        out_dtype: torch.dtype | None = None,
        scale: float | None = None,
        dim: int | None = None,
        decoder: Any = None,
        layer: int | None = None,
        process: Any = None,
    ):
        self._slot = 0
        if decoder is not None:
            layers = list(decoder.layers)
            if layer is None:
                if len(layers) != 1:
                    raise InvalidArgument(f"the decoder serves layers {layers}: pass layer=")
                layer = layers[0]
            if layer not in layers:
                raise InvalidArgument(f"layer {layer!r} is not one of the decoder's {layers}")
            slot = layers.index(layer)
            if store is None:
                store = decoder.stores[slot]
            elif store is not decoder.stores[slot]:
                raise InvalidArgument("store= differs from the decoder's table of that layer")
            self._slot = slot
        if store is None:
            raise InvalidArgument("DiskMultiHeadEmbedding needs a store (or a decoder=)")
        super().__init__(store, out_dtype=out_dtype, scale=scale, dim=dim)
        self.decoder = decoder
        self.layer = layer
        self.register_buffer(
            "offsets", torch.from_numpy(self.store.head_offsets.copy()), persistent=False
        )
        self._offsets_np = store.head_offsets.copy()
        self._heads_u64 = np.asarray(store.heads, dtype=np.uint64)
        self._min_head = int(self._heads_u64.min()) if self._heads_u64.size else 0
        self._head_bounds = SmallBounds(store.heads) if self._heads_u64.size else None
        self._n_heads = store.n_heads
        self._rb = self.codec.row_bytes
        # The trusted small gather of a local table (duck-typed: any table offering it).
        small = getattr(store, "gather_small", None)
        self._small = small if callable(small) and store.n_heads == len(store.heads) else None
        # The resident fast path: a local table without a RAM tier whose rows are one mapped
        # array (built, or attached from one source run): one ``np.take`` from the mapping
        # while the table's read rule serves it from there (`mapped_state`).
        self._mapped_ok: Any = getattr(store, "mapped_state", None)
        warming = getattr(store, "warming", None)
        self._warming: Any = warming if callable(warming) else (lambda: False)
        self._table_np: np.ndarray | None = None
        self._guarded = bool(getattr(store, "attached", False))
        if (
            self._small is not None
            and callable(self._mapped_ok)
            and getattr(store, "cache", None) is None
        ):
            try:
                self._table_np = store.array()  # type: ignore[attr-defined]
            except Exception:  # several source columns: not one array
                self._table_np = None
        # per row: a slower mapped gather (a major fault, not the minor faults of a mapping
        # that is not populated yet) is reported to the read rule
        self._slow_s = 10e-6
        self._fast = self._table_np is not None and decoder is None
        # The same mapping as a torch tensor of values ``[n_rows, dim]`` where a row's bytes
        # are its values (no decoding): the resident forward is then one ``torch.add`` and one
        # ``torch.embedding``, the ops an in-memory multi-head embedding runs. Inside a model
        # step the model's own torch code keeps those ops in the CPU caches while numpy's sit
        # cold: the numpy gather cost 1.5-1.8x engram-peft's in-memory module there, this
        # path 1.1-1.2x (probes/e2e_decode.py, docs/probes.md, 16th stop).
        self._table_t: torch.Tensor | None = None
        self._offsets_t = torch.from_numpy(self._offsets_np)  # a plain attribute: no lookup
        # the heads' bounds for the compiled check of a contiguous id tensor (`heads_checker`)
        self._check_at = heads_checker()
        self._bounds_bytes = self._heads_u64.tobytes()
        self._global_at = globalizer()  # the check and the global ids in one call
        # the hook's check that a layer's ids are the decoder's filled rows (`rows_matcher`)
        self._match_at = rows_matcher() if decoder is not None else None
        self._offsets_bytes = self._offsets_np.tobytes()
        if self._fast and self._decode.is_view and self._table_np is not None:
            with warnings.catch_warnings():
                # the mapping is read-only: torch warns that writing to it is undefined (the
                # tensor is only ever read, by the gather, and never handed out)
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(self._table_np)
            self._table_t = raw.view(self._decode.value_dtype)  # [n_rows, dim]
        # Per-call state in a plain object: ``nn.Module.__setattr__`` costs microseconds.
        self._hot = Hot()
        # Cold rows of a table that is one mapped array are prefetched by a step reader
        # (O_DIRECT through the process's io_uring polling thread: nothing for this thread
        # to wait for); others by the table's prefetcher.
        self._reader: StepReader | None = None
        self._reader_ok = self._fast and StepReader.available()
        #: How often (seconds) `prefetch` looks whether a table not served from its mapping
        #: has become resident (then the forward reads it, and prefetches stop).
        self.resident_recheck_s = 0.1
        self._checked_at = -float("inf")
        self._proc = process
        self._proc_slot = process.slot(store) if process is not None else -1
        self._keys = (self._n_heads, self._bounds_bytes, self._offsets_bytes, self._rb)

    @property
    def served_mapped(self) -> int:
        """Forwards served by the resident fast path (one gather from the mapping)."""
        return self._hot.mapped

    @property
    def served_prefetched(self) -> int:
        """Forwards served from the decoder's fill buffer (no copy)."""
        return self._hot.prefetched

    @property
    def served_read(self) -> int:
        """Forwards with a decoder whose ids did not match its fill (read synchronously)."""
        return self._hot.read

    @property
    def served_from_prefetch(self) -> int:
        """Forwards served from the rows a `prefetch` read (no mapping, no read)."""
        return self._hot.from_prefetch

    @property
    def prefetches(self) -> int:
        """`prefetch` calls that started a background read."""
        return self._hot.prefetches

    @property
    def prefetch_skips(self) -> int:
        """`prefetch` calls that started nothing because the table was served from its
        mapping (resident, page tables filled: the forward's gather costs less than a
        background read)."""
        return self._hot.resident_skips

    def _global(self, local_ids: Any) -> tuple[np.ndarray | None, tuple[int, ...] | None]:
        """Validated global ids ``[N * H]`` of local ids ``[..., H]`` (None: out of range or
        not ``[..., H]``), and ``(B, L, H, row bytes)`` where they are a CPU int64 ``[B, L, H]``
        tensor (else None); such a tensor in one compiled call on its numpy view
        (`globalizer`: numpy's check and add cost ~50 us a step, torch's attributes ~6 us)."""
        to_global = self._global_at
        if to_global is not None and type(local_ids) is torch.Tensor:
            try:
                arr = local_ids.numpy()  # a view; a device tensor raises
            except (TypeError, RuntimeError, ValueError):
                arr = None
            if arr is not None:
                flat = np.empty(arr.size, np.int64)
                ok = to_global(arr, self._bounds_bytes, self._offsets_bytes, flat)
                if ok >= 0:  # else not contiguous int64 [..., H]: the general path
                    shape = (*arr.shape, self._rb) if arr.ndim == 3 else None
                    return (flat if ok else None), shape
        ids = self._as_ids(local_ids)
        if ids.ndim < 1 or ids.shape[-1] != self._n_heads:
            return None, None
        if not self._in_heads(ids):  # negative ids: huge
            return None, None
        return np.add(ids, self._offsets_np).reshape(-1), None

    def prefetch(self, local_ids: Any) -> bool:
        """Start a background read of the rows of ``local_ids`` ``[B, L, H]`` (a later
        forward of the same ids waits only for reads still in flight, then gathers them from
        the mapping). Call it as soon as the ids are known (right after sampling and hashing)
        so the read overlaps the layers before this one. Returns False (nothing started) for
        a table without a prefetcher, ids that are out of range (the forward then raises),
        or a table the forward will gather from the mapping (its read rule in the mapped
        state: resident, and no slow gather since; a thread hand-off would cost more than
        the gather, counted in `prefetch_skips`) — never while the table's background warm
        reads it. A second call replaces a pending one. With ``process=``, the rows are read in
        that process (always: it decides resident or cold)."""
        proc = self._proc
        if proc is not None and proc.hands_over:
            done = hand_over(self._hot, local_ids, proc, self._proc_slot, self._keys)
            if done is not None:
                return done
        pf = getattr(self.store, "prefetcher", None)
        flat, shape = self._global(local_ids)
        if pf is None or flat is None:
            return False
        hot = self._hot
        old = hot.ticket
        if old is not None:
            old.cancel()
            hot.ticket = hot.ticket_ids = hot.ticket_src = None
        if proc is not None and flat.size <= proc.max_rows:
            ticket: Any = proc.request(self._proc_slot, flat)
        elif self._fast and self._resident_skip(flat):
            return False
        if proc is None or flat.size > proc.max_rows:
            ticket = self._submit(flat, pf)
        hot.ticket = ticket
        hot.ticket_ids = flat
        if shape is None:  # not a CPU int64 [B, L, H] tensor
            hot.ticket_src = None
        else:  # with torch's counter of in-place changes to it (what autograd checks)
            hot.ticket_src = (local_ids, local_ids._version, shape)  # noqa: SLF001
        hot.prefetches += 1
        return True

    def _resident_skip(self, flat: np.ndarray) -> bool:
        """Whether a prefetch of global ids ``flat`` of a table that is one mapped array starts
        nothing (counted in `prefetch_skips`): the forward gathers from the mapping."""
        # (while the table's background warm reads it, a sample of resident rows says little
        # and the forward's gather from the mapping faults on the rest: at B=8 6 major
        # faults a step, the forward 1 ms; the rows come from the device instead)
        if self._warming():
            return False
        if self._mapped_ok():
            self._hot.resident_skips += 1
            return True
        # The forwards are served from the prefetches, so the read rule sees no batch that
        # would move it to its mapped state: look at the rows every `resident_recheck_s` (a
        # few mincore calls) and, resident, read them in the forward (the rule then samples
        # them and moves to the mapping).
        now = time.monotonic()
        if now - self._checked_at >= self.resident_recheck_s:
            self._checked_at = now
            if self.store.rows_resident(flat):  # type: ignore[attr-defined]
                self._hot.resident_skips += 1
                return True
        return False

    def _submit(self, flat: np.ndarray, pf: Any) -> Any:
        """Start reading rows ``flat`` here: the step reader's ticket (a step of the last
        one's shape in a few statements, `StepReader.submit_fast`), else the prefetcher's."""
        if self._reader_ok:
            reader = self._reader
            if reader is None:
                reader = self._reader = StepReader()
            ticket = StepTicket(flat)
            store: Any = self.store  # a local table: `_fast` holds
            if reader.submit_fast(store, flat, ticket) or reader.submit(
                [(store, flat, ticket)], ordered=True
            ):
                return ticket
        return pf.submit_trusted(flat, keep_rows=True)

    def _take_ticket(self, flat: np.ndarray, dest: np.ndarray, same: bool = False) -> bool:
        """Serve ``flat`` from the pending `prefetch` when it asked for exactly these rows
        (``same``: they are its own, known unchanged)."""
        hot = self._hot
        t, want = hot.ticket, hot.ticket_ids
        hot.ticket = hot.ticket_ids = hot.ticket_src = None
        if want is None or (
            not same and (want.size != flat.size or not np.array_equal(want, flat))
        ):
            if t is not None:
                t.cancel()
            return False
        if t.cancel():  # still queued: read here
            return False
        if self._proc is not None and type(t) is not StepTicket and hasattr(t, "finish_into"):
            t.finish_into(dest)  # read by the process (raises a failed read's error)
            hot.from_prefetch += 1
            return True
        reader = self._reader
        if type(t) is StepTicket and reader is not None and t.reader is reader:
            # straight from the step reader's staging buffer into ``dest`` (one copy a row;
            # raises a failed read's error)
            if reader.finish_into(dest.reshape(dest.shape[0], -1, reader.step_unit), t):
                hot.from_prefetch += 1
                return True
        t.wait()  # raises a failed prefetch's error
        if take_kept(t, flat, dest):  # the rows the prefetch read: no mapping faults
            hot.from_prefetch += 1
            return True
        store: Any = self.store
        if store.prefetcher.target != "page_cache":
            return False  # rows went to the RAM tier: the normal path finds them there
        store.gather_resident(flat, dest)
        return True

    @staticmethod
    def _as_ids(local_ids: Any) -> np.ndarray:
        if type(local_ids) is torch.Tensor and local_ids.dtype is torch.int64:
            t = local_ids if local_ids.device.type == "cpu" else local_ids.cpu()
            return t.numpy() if t.is_contiguous() else t.contiguous().numpy()
        ids = ids_to_numpy(local_ids)
        if ids.dtype != np.int64:
            ids = ids.astype(np.int64)
        return np.ascontiguousarray(ids)

    def _prefetched(self, ids: np.ndarray) -> torch.Tensor | None:
        """A view of the decoder's last fill if it holds exactly the rows of ``ids``."""
        dec = self.decoder
        want = dec.filled_rows[self._slot]
        out = dec.filled_out[self._slot]
        if want is None or out is None or want.size != ids.size:
            return None
        # ids verified: every one equals the row the decoder filled (their global ids'
        # bytes against the fill's: one add and a memcmp, no numpy compare + reduction)
        glob = ids.reshape(want.shape) + self._offsets_np
        if glob.tobytes() != want.tobytes():
            return None
        cached = self._hot.view_cache
        if cached is not None and cached[0] is out:
            view = cached[1]
            if cached[2] == ids.shape:
                return cached[3]
        else:
            lay, n = (0, 1) if out.size == want.size * self._rb else (self._slot, len(dec.layers))
            # layer ``lay`` of ``[..., n, H, rb]`` (n = 1: a buffer of this layer's rows alone)
            raw = torch.from_numpy(out).view(-1, n, self._n_heads, self._rb)[:, lay]
            if not self._decode.is_view:  # decoding makes a new tensor (FP8, scaled rows)
                with torch.no_grad():
                    vals = self._decode(raw.reshape(-1, self._rb))
                return vals.view(*ids.shape, self.codec.dim)
            view = raw.view(self._decode.value_dtype)  # [N, H, dim], no copy
        shaped = view.view(*ids.shape, self.codec.dim)
        self._hot.view_cache = (out, view, ids.shape, shaped)
        return shaped

    def _in_heads(self, ids: np.ndarray) -> bool:
        """Whether every id of int64 ``ids`` (``[..., H]``, read as unsigned: a negative id
        is huge, so one comparison checks both ends) is below its head's size: one max
        (`unsigned_max`) when they are all below the smallest head, else the per-head
        compare. A decode step's few ids are checked against their own heads' sizes as
        integer lanes instead (`SmallBounds`: exact, no numpy call)."""
        hb = self._head_bounds
        if hb is not None and ids.size <= _LANE_IDS:
            return hb.ok(ids)
        if unsigned_max(ids) < self._min_head:
            return True
        return bool((ids.view(np.uint64) < self._heads_u64).all())

    def _take_resident(self, ids: np.ndarray) -> torch.Tensor:
        """Validated local ids ``[B, L, H]`` of a resident table whose rows are decoded (FP8,
        scaled; rows that are their values take `_take_resident_torch`): one gather from the
        mapping (a slow one, which may have faulted, is reported to the read rule), decoded."""
        tbl = self._table_np
        hot = self._hot
        hot.mapped += 1
        if self._guarded:  # attached sources: an fstat of the mapped files before each gather
            tbl = self.store.array()  # type: ignore[attr-defined]  # (TruncatedFile, not SIGBUS)
        assert tbl is not None
        flat = ids + self._offsets_np
        pc = time.perf_counter
        t0 = pc()
        raw_np = tbl.take(flat, 0)  # [B, L, H, rb], a fresh array (one call, not two)
        dt = pc() - t0
        if dt > self._slow_s * flat.size:
            self.store.note_mapped_gather(flat.size, dt)  # type: ignore[attr-defined]
        return self._values(raw_np)

    def _take_resident_torch(self, local_ids: torch.Tensor, n: int) -> torch.Tensor:
        """`_take_resident` for validated CPU int64 ids ``[B, L, H]`` of a table whose rows
        are their values: ``torch.embedding`` of the mapped table (`_table_t`)."""
        self._hot.mapped += 1
        if self._guarded:  # attached sources: an fstat of the mapped files before the gather
            self.store.array()  # type: ignore[attr-defined]  # (TruncatedFile, not SIGBUS)
        assert self._table_t is not None
        pc = time.perf_counter
        t0 = pc()
        out = torch.embedding(self._table_t, local_ids + self._offsets_t)
        dt = pc() - t0
        if dt > self._slow_s * n:
            self.store.note_mapped_gather(n, dt)  # type: ignore[attr-defined]
        return out

    def _from_prefetch(self, local_ids: torch.Tensor) -> torch.Tensor | None:
        """The forward of the very ids tensor the pending `prefetch` was given, unchanged
        since (its version): validated then, so its rows go straight from the prefetch into
        a fresh output; None where the prefetch did not keep them (read as usual)."""
        hot = self._hot
        want, src = hot.ticket_ids, hot.ticket_src
        assert want is not None and src is not None  # (set together by `prefetch`)
        raw_np = np.empty(src[2], np.uint8)  # [B, L, H, row bytes]
        if not self._take_ticket(want, raw_np.reshape(-1, self._rb), same=True):
            return None
        return self._values(raw_np)

    def _values(self, raw_np: np.ndarray) -> torch.Tensor:
        """Fetched rows ``uint8 [..., rb]`` (a fresh array) as values ``[..., dim]``: a view
        where the rows are their values, else decoded."""
        raw = torch.from_numpy(raw_np)
        if self._decode.is_view:
            return raw.view(self._decode.value_dtype)  # no copy
        with torch.no_grad():
            return self._decode(raw.view(-1, self._rb)).view(*raw_np.shape[:-1], self.codec.dim)

    def forward(self, local_ids: Any) -> torch.Tensor:
        src = self._hot.ticket_src
        if (
            src is not None
            and src[0] is local_ids
            and src[1] == local_ids._version  # noqa: SLF001
            and self.decoder is None
            and self._small is not None
        ):
            out = self._from_prefetch(local_ids)
            if out is not None:
                return out
        plain = (
            type(local_ids) is torch.Tensor and local_ids.dtype is torch.int64 and local_ids.is_cpu
        )
        if plain and local_ids.is_contiguous():
            # Checked in place by one compiled call each (no numpy array): with a decoder,
            # the hook's steady state (the ids equal its filled rows: the view of its fill
            # buffer made for the first step of this shape, again); without, a resident table
            # whose rows are their values (the ids' bounds, then one ``torch.embedding``).
            # Anything else (ids out of range included, which raise below) goes on below.
            match = self._match_at
            if match is not None:
                cached = self._hot.view_cache
                dec = self.decoder
                slot = self._slot
                if (
                    cached is not None
                    and cached[0] is dec.filled_out[slot]
                    and cached[2] == local_ids.shape
                    and match(
                        local_ids.data_ptr(),
                        local_ids.numel(),
                        dec.filled_rows[slot],
                        self._offsets_bytes,
                    )
                ):
                    self._hot.prefetched += 1
                    return cached[3]  # type: ignore[no-any-return]
            elif (
                self._table_t is not None
                and (check := self._check_at) is not None
                and local_ids.dim() == 3
                and local_ids.shape[2] == self._n_heads
                and self._hot.ticket_ids is None
                and self._mapped_ok()
            ):
                n = local_ids.numel()
                if check(local_ids.data_ptr(), n, self._bounds_bytes):
                    return self._take_resident_torch(local_ids, n)
        if self._fast and plain and local_ids.dim() == 3:
            ids = local_ids.numpy()
            if (
                ids.shape[2] == self._n_heads
                and self._hot.ticket_ids is None
                and self._mapped_ok()
                and self._in_heads(ids)  # negative ids: huge
            ):
                if self._table_t is not None:
                    return self._take_resident_torch(local_ids, ids.size)
                return self._take_resident(ids)
        else:
            ids = self._as_ids(local_ids)
        ids = np.ascontiguousarray(ids)
        if self.decoder is not None and ids.ndim >= 1 and ids.shape[-1] == self._n_heads:
            hit = self._prefetched(ids)
            if hit is not None:
                self._hot.prefetched += 1
                return hit
            self._hot.read += 1
        small = self._small
        h = self._n_heads
        if small is not None and ids.ndim == 3 and ids.shape[-1] == h:
            if self._in_heads(ids):  # negative ids: huge
                # Validated in one pass: straight to the table's trusted small gather (the
                # mapping while resident, the read rule otherwise), into the output's bytes.
                flat = np.add(ids, self._offsets_np).reshape(-1)
                raw_np = np.empty((*ids.shape, self._rb), dtype=np.uint8)
                dest = raw_np.reshape(-1, self._rb)
                if self._hot.ticket_ids is None or not self._take_ticket(flat, dest):
                    small(flat, dest)
                return self._values(raw_np)
        raw = torch.empty(ids.shape + (self._rb,), dtype=torch.uint8)
        self.store.lookup_into(ids, raw.numpy())
        with torch.no_grad():
            out = self._decode(raw.view(-1, self._rb))
        return out.view(*ids.shape, self.codec.dim)


def prefetched_multi_head_embedding(
    decoder: Any, layer: int | None = None, **options: Any
) -> DiskMultiHeadEmbedding:
    """The pre-fetched-rows hook: a `DiskMultiHeadEmbedding` over ``decoder``'s table of
    ``layer`` that serves the decoder's filled rows without a copy (see the class). Put it
    where the model calls its multi-head embedding, e.g. engram-peft's
    ``engram_layer.multi_head_embedding = prefetched_multi_head_embedding(dec, layer_id)``."""
    return DiskMultiHeadEmbedding(decoder=decoder, layer=layer, **options)


__all__ = ["DiskEmbedding", "DiskMultiHeadEmbedding", "prefetched_multi_head_embedding"]
