"""A decoder whose keygen and reads run in a process of their own (`DecoderProcess`).

A `Decoder` does its keygen and starts its reads on the engine's thread, right after the
sampling: inside a model step that Python costs several times its cost in a loop, because
the model's compute has just evicted the interpreter's code and data from the CPU caches
(~140 us a step for two layers at B=8 cold, against ~45 us for the model's own keygen). A
thread of the same process would need the GIL, and hands it back and forth in the middle of
the model's ops. `DecoderProcess` runs the same `Decoder` in a companion process: the
engine's thread writes the step's tokens into shared memory and bumps a word (no system
call when the companion is watching for it, which it does at the engine's learnt pace);
the companion hashes, reads and copies each layer's rows into shared memory and publishes a
word per layer; `fill` waits for that word and copies the rows into the engine's buffer::

    with DecoderProcess("db/", {1: "l1", 3: "l3"}, hasher, batch=8) as dec:
        bufs = {lay: np.empty(dec.layer_shape, np.uint8) for lay in dec.layers}
        for step in range(n_steps):
            dec.push(next_tokens)            # a copy and an atomic add
            ids = dec.local_ids(1)           # the model's ids (written by the companion)
            ...
            dec.fill(bufs[1], layer=1)       # waits for the word, copies [B, H, rb]

Its surface is the `Decoder`'s (``push``, ``prefill``, ``fill``, ``local_ids``, ``reset``,
``filled_rows`` / ``filled_out`` for the pre-fetched-rows hook), except that `push`
returns nothing (`row_ids` waits for them) and that an error of a step (a token outside the
vocabulary, a failed read) is raised by the next `local_ids` / `row_ids` / `fill` of that
step. The companion exiting raises `ProcessExited`. ``ENGRAMDB_NATIVE=0`` or no compiled
``engramdb.io._submitter``: the hand-overs go through eventfds both ways (correct, slower).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

from engramdb.companion_client import CompanionClient, checked_cpus
from engramdb.database import Database
from engramdb.database import open as open_db
from engramdb.decode import Decoder
from engramdb.decode_companion import DONE, KEYED, STEP, Layout
from engramdb.errors import InvalidArgument, InvalidDtype, ShapeMismatch
from engramdb.read.decode_fill import fill_slices
from engramdb.validate import one_token


class DecoderProcess(CompanionClient):
    """`Decoder` over ``tables`` (``{layer: table name}``) of the database at ``path`` (or an
    open `Database`), its keygen and reads in a companion process (see the module).
    ``preset``, ``batch``, ``prefetch``, ``compressed``: as `Decoder`'s (a `Hasher` must
    pickle). ``open_options``: `engramdb.open` keywords for the companion's database
    (``background_warm=``, ``backend=``...). ``cpus``: the CPUs the companion may run on."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Database,
        tables: Mapping[int, str],
        preset: Any,
        *,
        batch: int | None = None,
        prefetch: bool | str = "auto",
        compressed: bool = False,
        open_options: Mapping[str, Any] | None = None,
        cpus: set[int] | None = None,
    ):
        if not tables:
            raise InvalidArgument("no tables given")
        checked_cpus(cpus)
        try:
            pickle.dumps(preset)
        except Exception as e:  # the companion builds its own decoder from it
            raise InvalidArgument(f"the preset {preset!r} does not pickle: {e}") from e
        self._own_db = not isinstance(path, Database)
        if isinstance(path, Database):
            self._db, path = path, path.path
        else:  # this process's handles: the hook's tables and shapes (they never read here)
            self._db = open_db(path, **dict(open_options or {}))
        names = {int(lay): str(name) for lay, name in tables.items()}
        try:  # the same decoder here checks the arguments and gives the shapes (it never reads)
            ref = Decoder(
                {lay: self._db[n] for lay, n in names.items()},
                preset, batch=batch, prefetch=prefetch, compressed=compressed,
            )  # fmt: skip
        except BaseException:
            if self._own_db:
                self._db.close()
            raise
        self.layers, self.stores, self.batch = ref.layers, ref.stores, ref.batch
        self.n_heads, self.row_bytes, self.hasher = ref.n_heads, ref.row_bytes, ref.hasher
        self.out_shape, self._step_layer_shape = ref.out_shape, ref.layer_shape
        self._ref = ref
        n = len(self.layers)
        ids = (1 if batch is None else int(batch)) * self.n_heads
        lay = Layout(n, 1 if batch is None else int(batch), ids, self.row_bytes)
        self._launch(lay.size, lay.words)
        _, self._tok, self._local, self._rows, data = lay.views(self._mm)
        shape = ref.layer_shape
        self._local = [a.reshape(shape[:-1]) for a in self._local]
        self._data = [d.reshape(shape) for d in data]
        self.filled_rows: list[np.ndarray | None] = [None] * n
        self.filled_out: list[np.ndarray | None] = [None] * n
        self._row_copy = [np.empty(shape[:-1], np.int64) for _ in range(n)]
        self._slot_of = {lay: i for i, lay in enumerate(self.layers)}
        self._fills: dict[tuple[int, Any], tuple[Any, ...]] = {}
        self._step = 0  # the hand-over of the pending step (0: none)
        self._pre: tuple[Any, ...] | None = None  # a pending prefill's rows, ids and data
        job = {
            "kind": "decode", "path": str(path), "tables": names, "preset": preset, "batch": batch,
            "prefetch": prefetch, "compressed": compressed,
            "layout": (n, lay.tokens, ids, self.row_bytes),
        }  # fmt: skip
        self._start_job(job, cpus, open_options)

    _what = "decode process"

    def _await_step(self, index: int) -> None:
        """Wait until word ``index`` reaches the pending step (raising the step's error)."""
        if self._step == 0:
            raise InvalidArgument("no pending step: push() first")
        self._await(index, self._step)

    # -- the decoder's surface -------------------------------------------------------------------
    @property
    def layer_shape(self) -> tuple[int, ...]:
        """A buffer of one layer's rows for the pending step (or prefill)."""
        pre = self._pre
        return pre[3] if pre is not None else self._step_layer_shape

    @property
    def pending_shape(self) -> tuple[int, ...]:
        """The buffer `fill` without ``layer=`` takes for the pending step (or prefill)."""
        pre = self._pre
        return pre[4] if pre is not None else self._ref.pending_shape

    def prefill_shape(self, n_tokens: int) -> tuple[int, ...]:
        """The buffer `fill` takes after a prefill of ``n_tokens`` (`Decoder.prefill_shape`)."""
        return self._ref.prefill_shape(n_tokens)

    def stats(self) -> dict[str, Any]:
        """The companion's counters: its decoder's (``steps``, ``prefetched``,
        ``auto_switches``), the steps it read the first layer of before the rest
        (``held_submits``) and, per table, ``counters()`` and the background warm's
        ``memory()["warm"]``."""
        return self._control(("stats",))  # type: ignore[no-any-return]

    def push(self, token_ids: Any) -> None:
        """Hand the companion each sequence's new token (a scalar, or ``[B]``); it computes
        the row ids and starts their reads. Returns at once (`row_ids` / `local_ids` wait)."""
        self._check()
        self._taken()
        if self.batch is None:
            self._tok[0] = one_token(token_ids)
        else:
            arr = token_ids if type(token_ids) is np.ndarray else np.asarray(token_ids)
            if arr.dtype.kind not in "iu":
                raise InvalidDtype(f"token ids must be integers, got {arr.dtype}")
            if arr.shape != (self.batch,):
                raise ShapeMismatch(f"expected {self.batch} tokens, got shape {arr.shape}")
            np.copyto(self._tok, arr, casting="unsafe")
        self._pre = None
        for i in range(len(self.filled_rows)):  # no layer's rows are this step's yet
            self.filled_rows[i] = None
        self._ring(STEP)
        self._step = self._seq

    def prefill(self, token_ids: Any) -> list[np.ndarray]:
        """`Decoder.prefill` in the companion: its row ids per layer (it waits for the rows,
        which the next `fill` copies)."""
        arr = np.asarray(token_ids)
        rows, local, data, layer_shape, pending = self._control(("prefill", arr))
        self._pre = (rows, local, data, layer_shape, pending)
        self._step = self._seq
        return list(rows)

    def reset(self) -> None:
        """Forget every sequence (new requests): `Decoder.reset` in the companion."""
        self._control(("reset",))
        self._pre, self._step = None, 0
        self.filled_rows[:] = [None] * len(self.layers)
        self.filled_out[:] = [None] * len(self.layers)

    def _slot(self, layer: int | None) -> int:
        j = self._slot_of.get(layer if layer is not None else self.layers[0])  # type: ignore[arg-type]
        if j is None or (layer is None and len(self.layers) > 1):
            raise InvalidArgument(f"layer {layer!r} is not one of the decoder's {self.layers}")
        return j

    def local_ids(self, layer: int | None = None, *, wait: bool = True) -> np.ndarray:
        """The pending step's row ids of ``layer`` less each head's offset (`Decoder.local_ids`),
        in a buffer the companion rewrites at each step. ``wait=False`` returns that buffer at
        once: a model that reads it only at the layer (after its `fill`) never waits for the
        companion's keygen."""
        j = self._slot(layer)
        if self._pre is not None:
            return self._pre[1][j]  # type: ignore[no-any-return]
        if wait:
            self._await_step(KEYED)
        return self._local[j]

    def row_ids(self, layer: int | None = None) -> np.ndarray:
        """The pending step's global row ids of ``layer`` (what `Decoder.push` returns)."""
        j = self._slot(layer)
        if self._pre is not None:
            return self._pre[0][j]  # type: ignore[no-any-return]
        self._await_step(KEYED)
        return self._rows[j].reshape(self._local[j].shape).copy()

    def fill(self, out: np.ndarray, *, layer: int | None = None) -> np.ndarray:
        """Copy the pending step's rows into ``out`` (`Decoder.fill`: `pending_shape`, or one
        layer's `layer_shape` with ``layer=``), waiting for the companion's reads."""
        key = (id(out), layer)
        cut = self._fills.get(key)
        if cut is None or cut[0] is not out or self._pre is not None:
            cut = self._cut(out, layer)
        for j, dest in cut[1]:
            if self._pre is not None:
                np.copyto(dest, self._pre[2][j].reshape(dest.shape))
                self.filled_rows[j] = self._pre[0][j]
            else:
                self._await_step(DONE + j)
                np.copyto(dest, self._data[j].reshape(dest.shape))
                np.copyto(self._row_copy[j], self._rows[j].reshape(self._row_copy[j].shape))
                self.filled_rows[j] = self._row_copy[j]
            self.filled_out[j] = out
        return out

    def _cut(self, out: np.ndarray, layer: int | None) -> tuple[Any, ...]:
        """``out`` checked and cut into the destinations of the layers it takes."""
        n = len(self.layers)
        one, shaped, _, _ = fill_slices(
            out, n, self.n_heads * self.row_bytes, self.layer_shape, self.pending_shape
        )
        if layer is None:
            if one:
                raise InvalidArgument(f"a buffer of {self.layer_shape} is one layer's: pass layer=")
            which = list(range(n))
        else:
            which = [self._slot(layer)]
        cut = (out, [(j, shaped[j]) for j in which])
        if self._pre is None:
            if len(self._fills) > 4 * n + 4:
                self._fills.clear()
            self._fills[(id(out), layer)] = cut
        return cut

    def _release_views(self) -> None:
        self._fills.clear()
        self._local = self._rows = self._data = []
        self._tok = np.empty(0, np.int64)

    def _describe(self) -> str:
        return f"layers={self.layers}, batch={self.batch}"
