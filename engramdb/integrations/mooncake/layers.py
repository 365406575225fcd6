"""`MooncakeLayers`: the Mooncake backing of `EngramStore` (``EngramStore(layers, store=client)``).

One store object per head (``engram:l{layer}:h{head}``, or ``...:p{part}`` when
``object_bytes`` splits large heads; `layer_layout`), a create-only ``populate`` with one
``batch_put_from``, one ``get_into_ranges`` per ``lookup_into``, ``remove_from_store``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engramdb.errors import EngramDBError, LayerExists, LayerNotReady
from engramdb.integrations.mooncake._store import (
    Counters,
    MooncakeError,
    ObjectMissing,
    exists,
    put_batch,
    raise_code,
    read_ranges,
    remove,
    replicate_config,
)
from engramdb.integrations.mooncake.layout import ObjectLayout, layer_layout


class MooncakeLayers:
    """The Mooncake side of `EngramStore(layers, store=<MooncakeDistributedStore>)`."""

    def __init__(self, client: Any, object_bytes: int | None = None):
        self.client = client
        self.object_bytes = object_bytes
        self.counters = Counters()
        #: layer id -> the `ObjectLayout` of its store objects (filled by `layout`)
        self.layouts: dict[int, ObjectLayout] = {}

    def layout(self, layer_id: int, heads: Sequence[int], row_bytes: int) -> ObjectLayout:
        """The layer's object layout, made on first use (`layer_layout`) and kept."""
        lay = self.layouts.get(layer_id)
        if lay is None:
            lay = layer_layout(layer_id, heads, row_bytes, self.object_bytes)
            self.layouts[layer_id] = lay
        return lay

    def populate(self, layout: ObjectLayout, buffers: list[np.ndarray], config: Any) -> None:
        """Create-only upload of validated head tables: existence check, register every
        table, one ``batch_put_from`` for all objects, unregister; a failure removes what
        this call wrote. Cost: one copy of the layer over the transport."""
        keys = layout.flat_keys
        if any(exists(self.client, keys)):
            raise LayerExists(
                f"store objects {keys[:3]}{'...' if len(keys) > 3 else ''} already exist; "
                "call remove_from_store first"
            )
        ptrs: list[int] = []
        sizes: list[int] = []
        rb = layout.row_bytes
        for _key, h, first, rows in layout.objects():
            ptrs.append(buffers[h].ctypes.data + first * rb)
            sizes.append(rows * rb)
        done: list[np.ndarray] = []
        try:
            for buf in buffers:
                rc = self.client.register_buffer(buf.ctypes.data, buf.nbytes)
                if rc != 0:
                    raise_code(f"register_buffer of a {buf.nbytes} B head table failed", rc)
                done.append(buf)
            put_batch(self.client, keys, ptrs, sizes, replicate_config(self.client, config))
        finally:
            failed = [b for b in done if self.client.unregister_buffer(b.ctypes.data) != 0]
        if failed:
            try:
                remove(self.client, keys, True)
            except EngramDBError:
                pass
            raise MooncakeError(f"unregister_buffer failed for {len(failed)} head table(s)")

    def remove(self, layout: ObjectLayout, force: bool) -> int:
        """Remove the layer's objects; returns how many heads had objects removed."""
        gone = set(remove(self.client, layout.flat_keys, force))
        return sum(1 for ks in layout.keys if any(k in gone for k in ks))

    def lookup_into(self, layout: ObjectLayout, row_ids: np.ndarray, output: np.ndarray) -> None:
        """Validated ids: one ``get_into_ranges`` into the registered ``output``."""
        plan = layout.plan_local(row_ids)
        try:
            read_ranges(self.client, plan, output, self.counters)
        except ObjectMissing as e:
            raise LayerNotReady(f"layer is not populated in the store: {e}") from None


__all__ = ["MooncakeLayers"]
