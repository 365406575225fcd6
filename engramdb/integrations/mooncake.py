"""EngramDB tables in a Mooncake distributed store.

Three pieces, all on a ``mooncake.store.MooncakeDistributedStore`` client (the optional extra
``engramdb[mooncake]``):

* `ObjectLayout` — pure geometry: which store object holds a row, and the per-object byte
  ranges of a batch (vectorised with numpy, no I/O), so it can be tested without a store;
* `MooncakeLayers` — the Mooncake backing of `EngramStore` (create-only ``populate``, one
  ``get_into_ranges`` per ``lookup_into``, ``remove_from_store``);
* `publish` / `open_mooncake` — stream a whole EngramDB database into the store under a
  name, with a manifest object that lets any host discover the layout, and open it again
  as a database whose tables have ``fetch`` / ``fetch_into`` / ``lookup_into``; the tables'
  Store-P views go along and serve corpus streams (``use_view``).

Cost model (measured on this project's 2-core test machine, TCP transport over loopback;
see docs/distributed.md): the store client spends ~30-40 us of its own CPU per byte range in
``get_into_ranges`` whatever the range size, so a ranged lookup runs at ~20-35 k rows/s.
That holds wherever the replica lives, even in the reading client's own segment with
``MC_STORE_MEMCPY=1`` (the wheel's local-memcpy path serves whole-object reads only; ranged
reads always take the transfer engine, one request per range), and no TCP knob lowers it
(what an RDMA transport changes is not measured here). So the fast paths cut the number of
ranges: a corpus stream reads a published Store-P view (`engramdb.integrations.mooncake_view`:
the batch's records in a few long runs, ~2 M rows/s measured), and a table whose rows must
be served faster than ranged reads allow from a host that can hold it uses ``host_copy``:
the host pulls each object once (bulk reads) into one tmpfs file that every rank on the
host maps, and lookups become a local gather.

Importing this module never imports the ``mooncake`` package; connecting does, and raises
`MissingDependency` naming the extra when it is absent.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import numpy as np
import xxhash

from engramdb.errors import (
    EngramDBError,
    InvalidArgument,
    LayerExists,
    LayerNotReady,
    StoreClosed,
    TableExists,
    TableNotFound,
)
from engramdb.integrations.mooncake_view import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MERGE_GAP_BYTES,
    ViewReader,
    parse_views,
    publish_view,
)
from engramdb.io.gather import take_rows
from engramdb.validate import (
    as_rowids,
    check_bounds,
    check_head_bounds,
    check_lookup_ids,
    check_output,
)

#: The optional extra that installs the Mooncake wheel.
EXTRA = "mooncake"
#: Default size of one store object when a head is split (``publish``): an object must fit
#: in one storage segment, and smaller objects spread a table over more storage hosts.
DEFAULT_OBJECT_BYTES = 64 * 1024 * 1024
#: Bytes staged per ``batch_put_from`` call while publishing (bounds publish memory).
DEFAULT_STAGING_BYTES = 256 * 1024 * 1024
#: Bytes per ``batch_get_into`` when pulling a host copy: each batch must finish inside
#: the master's read lease (10 s by default), whatever the transport's speed.
PULL_BATCH_BYTES = 64 * 1024 * 1024
MANIFEST_FORMAT = "engramdb-mooncake"
MANIFEST_VERSION = 1

# Mooncake ErrorCode values this module names in messages (mooncake-store types.h).
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
_UNREACHABLE = {-800, -900, -901}


# --- errors ---------------------------------------------------------------------------------
class MooncakeError(EngramDBError, RuntimeError):
    """The Mooncake store refused or failed an operation; ``code`` is its ErrorCode."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class StoreUnavailable(MooncakeError, ConnectionError):
    """The master or a storage host cannot be reached (RPC or transfer failure, setup)."""


class OutputNotRegistered(MooncakeError, ValueError):
    """A ranged read was refused because its destination is not registered with the client."""


class ObjectMissing(MooncakeError, LookupError):
    """A store object the layout names does not exist (removed, evicted, never published)."""


def code_name(code: int) -> str:
    return f"{_CODE_NAMES.get(code, 'error')} ({code})"


def _raise_code(what: str, code: int, *, hint: str = "") -> NoReturn:
    if code == -707 and not hint:
        hint = (
            "the transfer outlasted the master's read lease (--default_kv_lease_ttl); "
            "use smaller batches or a longer lease"
        )
    msg = f"{what}: {code_name(code)}" + (f"; {hint}" if hint else "")
    if code in _UNREACHABLE:
        raise StoreUnavailable(msg + "; is the master / storage host reachable?", code)
    if code == -704:
        raise ObjectMissing(msg, code)
    raise MooncakeError(msg, code)


def import_store() -> ModuleType:
    """``mooncake.store``, or `MissingDependency` naming the extra to install."""
    try:
        import mooncake.store as store_module
    except ImportError as e:
        from engramdb.errors import MissingDependency

        raise MissingDependency(
            f"the Mooncake store client is not installed ({e}); install the extra: "
            f"pip install 'engramdb[{EXTRA}]'"
        ) from None
    module: ModuleType = store_module
    return module


def is_store_client(obj: Any) -> bool:
    """Duck-typed: does ``obj`` look like a ``MooncakeDistributedStore`` client?"""
    return all(
        callable(getattr(obj, m, None))
        for m in ("batch_put_from", "get_into_ranges", "register_buffer", "unregister_buffer")
    )


def _default_hostname() -> str:
    bind = os.environ.get("MC_TCP_BIND_ADDRESS")
    if bind:
        return bind
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def connect(
    master: str,
    metadata: str,
    *,
    local_hostname: str | None = None,
    protocol: str = "tcp",
    device: str = "",
    segment_bytes: int = 0,
    local_buffer_bytes: int = 16 * 1024 * 1024,
) -> Any:
    """A set-up ``MooncakeDistributedStore`` client.

    ``master`` is ``host:port`` of ``mooncake_master``; ``metadata`` the metadata server URL
    (``http://host:8080/metadata`` for the master's built-in one). ``segment_bytes`` is the
    memory this process contributes to the store (0: a pure reader or publisher; the data
    then lives on storage hosts running ``mooncake_client``). ``local_hostname`` defaults to
    ``MC_TCP_BIND_ADDRESS`` or this host's address. Takes ~0.1-1 s (RPC + metadata)."""
    mod = import_store()
    client = mod.MooncakeDistributedStore()
    host = local_hostname or _default_hostname()
    rc = client.setup(
        host, metadata, int(segment_bytes), int(local_buffer_bytes), protocol, device, master
    )
    if rc != 0:
        raise StoreUnavailable(
            f"cannot set up a Mooncake client for master {master!r}, metadata {metadata!r} "
            f"as {host!r}: {code_name(rc)}",
            rc,
        )
    return client


def _replicate_config(client: Any, config: Any) -> Any:
    """The caller's ReplicateConfig, or a hard-pinned one: an Engram table must never be
    evicted under memory pressure (a lookup would then fail with OBJECT_NOT_FOUND)."""
    if config is not None:
        return config
    try:
        mod = import_store()
    except EngramDBError:
        return None
    if not isinstance(client, mod.MooncakeDistributedStore):
        return None
    cfg = mod.ReplicateConfig()
    cfg.with_hard_pin = True
    return cfg


# --- geometry (pure) ------------------------------------------------------------------------
@dataclass(frozen=True)
class RangePlan:
    """The argument lists of one ``get_into_ranges`` call for one destination buffer:
    per object key, the destination offsets, source offsets and sizes (bytes)."""

    keys: list[str]
    dst: list[list[int]]
    src: list[list[int]]
    sizes: list[list[int]]
    n_ranges: int
    #: payload bytes of all ranges
    nbytes: int = 0
    #: every range has the same size (rows), so a result check needs no per-range loop
    uniform: bool = True


class ObjectLayout:
    """Where rows live: head ``h`` is split into objects of ``rows_per_object`` whole rows,
    ``keys[h][k]`` holding local rows ``[k * rows_per_object, ...)``. Pure: no I/O."""

    def __init__(
        self, heads: Sequence[int], row_bytes: int, rows_per_object: int, keys: list[list[str]]
    ):
        self.heads = np.asarray([int(n) for n in heads], dtype=np.int64)
        self.row_bytes = int(row_bytes)
        self.rows_per_object = int(rows_per_object)
        if self.rows_per_object <= 0 or self.row_bytes <= 0:
            raise InvalidArgument("rows_per_object and row_bytes must be > 0")
        parts = -(-self.heads // self.rows_per_object)
        if len(keys) != len(self.heads) or any(len(k) != p for k, p in zip(keys, parts)):
            raise InvalidArgument(
                f"layout names {[len(k) for k in keys]} objects per head, geometry needs "
                f"{parts.tolist()}"
            )
        self.keys = [list(k) for k in keys]
        self.flat_keys = [k for ks in keys for k in ks]
        # global object index of each head's part 0
        self.object_base = np.concatenate([[0], np.cumsum(parts)[:-1]]).astype(np.int64)
        self.head_offsets = np.concatenate([[0], np.cumsum(self.heads)[:-1]]).astype(np.int64)

    @classmethod
    def split(
        cls,
        heads: Sequence[int],
        row_bytes: int,
        object_bytes: int | None,
        key_of: Callable[[int, int, int], str],
    ) -> ObjectLayout:
        """Layout with objects of at most ``object_bytes`` (``None``: one object per head).
        ``key_of(head, part, n_parts)`` names each object."""
        if object_bytes is None:
            rpo = max(int(n) for n in heads)
        else:
            if isinstance(object_bytes, bool) or int(object_bytes) < row_bytes:
                raise InvalidArgument(
                    f"object size {object_bytes!r} B is smaller than one {row_bytes} B row"
                )
            rpo = int(object_bytes) // int(row_bytes)
        keys = []
        for h, n in enumerate(heads):
            parts = -(-int(n) // rpo)
            keys.append([key_of(h, k, parts) for k in range(parts)])
        return cls(heads, row_bytes, rpo, keys)

    @property
    def n_objects(self) -> int:
        return len(self.flat_keys)

    def objects(self) -> Iterator[tuple[str, int, int, int]]:
        """``(key, head, first_local_row, rows)`` of every object, in head/part order."""
        rpo = self.rows_per_object
        for h, ks in enumerate(self.keys):
            n = int(self.heads[h])
            for k, key in enumerate(ks):
                yield key, h, k * rpo, min(rpo, n - k * rpo)

    def _plan(
        self, head: np.ndarray, local: np.ndarray, out_rows: np.ndarray | None = None
    ) -> RangePlan:
        """Ranges for rows ``i`` = (``head[i]``, ``local[i]``), written at
        ``out_rows[i] * row_bytes`` (default ``i * row_bytes``). Grouping by object is one
        stable sort (radix for < 65,536 objects) and a bincount; Python only loops over the
        objects touched."""
        rb, rpo = self.row_bytes, self.rows_per_object
        part = local // rpo
        obj = self.object_base[head] + part
        src = (local - part * rpo) * rb
        n_obj = self.n_objects
        small = obj.astype(np.uint16 if n_obj <= 0xFFFF else np.uint32)
        order = np.argsort(small, kind="stable")
        counts = np.bincount(obj, minlength=n_obj)
        used = np.flatnonzero(counts)
        bounds = np.concatenate([[0], np.cumsum(counts[used])]).tolist()
        dst_all = ((order if out_rows is None else out_rows[order]) * rb).tolist()
        src_all = src[order].tolist()
        cuts = list(zip(bounds[:-1], bounds[1:]))
        return RangePlan(
            keys=[self.flat_keys[i] for i in used.tolist()],
            dst=[dst_all[a:b] for a, b in cuts],
            src=[src_all[a:b] for a, b in cuts],
            sizes=[[rb] * (b - a) for a, b in cuts],
            n_ranges=int(local.size),
            nbytes=int(local.size) * rb,
        )

    def plan_local(self, row_ids: np.ndarray) -> RangePlan:
        """Plan for validated per-head local ids ``[..., H]`` (output in C order)."""
        h = len(self.heads)
        flat = row_ids.reshape(-1)
        head = np.tile(np.arange(h, dtype=np.int64), flat.size // h)
        return self._plan(head, flat)

    def plan_positions(self, row_ids: np.ndarray, positions: np.ndarray) -> RangePlan:
        """Plan for the rows of ``positions`` (indices into ``row_ids.reshape(-1, H)``) of
        validated local ids ``[..., H]``: every head's row of each position, written where
        a full-batch plan would write it."""
        h = len(self.heads)
        local = row_ids.reshape(-1, h)[positions].reshape(-1)
        head = np.tile(np.arange(h, dtype=np.int64), positions.size)
        rows = (positions[:, None] * h + np.arange(h, dtype=np.int64)).reshape(-1)
        return self._plan(head, local, rows)

    def plan_global(self, rowids: np.ndarray) -> RangePlan:
        """Plan for validated global ids (any shape; output in C order)."""
        flat = rowids.reshape(-1)
        head = np.searchsorted(self.head_offsets, flat, side="right") - 1
        return self._plan(head, flat - self.head_offsets[head])


# --- reads and writes -----------------------------------------------------------------------
class Counters:
    """What the store served: proves a probe's path ran (calls, ranges, payload bytes)."""

    def __init__(self) -> None:
        self.calls = 0
        self.ranges = 0
        self.bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {"get_into_ranges_calls": self.calls, "ranges": self.ranges, "bytes": self.bytes}


def read_ranges(client: Any, plan: RangePlan, out: np.ndarray, counters: Counters) -> None:
    """One ``get_into_ranges`` call writing ``plan`` into ``out`` (registered by the caller).

    On any failure the output is zero-filled before the error is raised, so it is never
    left half-written (rows of an earlier step are never mistaken for this one's)."""
    read_many(client, [(plan, out)], counters)


def read_many(client: Any, parts: list[tuple[RangePlan, np.ndarray]], counters: Counters) -> None:
    """One ``get_into_ranges`` call for several destination buffers (each registered by the
    caller): ``parts`` pairs a plan with its buffer. On any failure every buffer is
    zero-filled before the error is raised."""
    parts = [(p, b) for p, b in parts if p.n_ranges]
    if not parts:
        return
    ptrs = [b.ctypes.data for _, b in parts]

    def wipe() -> None:
        for _, b in parts:
            b.fill(0)

    try:
        results = client.get_into_ranges(
            ptrs,
            [p.keys for p, _ in parts],
            [p.dst for p, _ in parts],
            [p.src for p, _ in parts],
            [p.sizes for p, _ in parts],
        )
    except Exception as e:
        wipe()
        raise MooncakeError(f"get_into_ranges failed: {type(e).__name__}: {e}") from e
    counters.calls += 1
    failed = None
    if not isinstance(results, list) or len(results) != len(parts):
        failed = (parts[0][0].keys[0], -1, parts[0][1])
    else:
        for (plan, buf), got in zip(parts, results):
            bad = _first_failure(got, plan)
            if bad is not None:
                failed = (bad[0], bad[1], buf)
                break
    if failed is None:
        for plan, _ in parts:
            counters.ranges += plan.n_ranges
            counters.bytes += plan.nbytes
        return
    wipe()
    key, code, buf = failed
    if code == -600:
        raise OutputNotRegistered(
            f"get_into_ranges refused the read of {key!r} ({code_name(code)}): the output "
            f"buffer at {buf.ctypes.data:#x} ({buf.nbytes} bytes) is most likely not "
            "registered with this client; call client.register_buffer(out.ctypes.data, "
            "out.nbytes) before the first non-empty lookup and keep it registered",
            code,
        )
    _raise_code(f"ranged read of {key!r} failed", code)


def _first_failure(got_all: Any, plan: RangePlan) -> tuple[str, int] | None:
    """The first range of one buffer that did not arrive whole, as (key, code)."""
    if not isinstance(got_all, list) or len(got_all) != len(plan.keys):
        return (plan.keys[0], -1)
    for key, got, sizes in zip(plan.keys, got_all, plan.sizes):
        if len(got) != len(sizes):
            return (key, -1)
        if plan.uniform:
            low = min(got)  # builtin min over the list: C speed, not a Python loop per row
            if low < sizes[0]:
                return (key, int(low) if low < 0 else -1)
        else:
            g = np.asarray(got, dtype=np.int64)
            short = np.flatnonzero(g < np.asarray(sizes, dtype=np.int64))
            if short.size:
                low = int(g[short[0]])
                return (key, low if low < 0 else -1)
    return None


@contextmanager
def registered(client: Any, array: np.ndarray) -> Iterator[np.ndarray]:
    """Register ``array``'s memory with ``client`` for the block (no-op when empty)."""
    if array.nbytes == 0:
        yield array
        return
    rc = client.register_buffer(array.ctypes.data, array.nbytes)
    if rc != 0:
        _raise_code(f"register_buffer of {array.nbytes} bytes failed", rc)
    try:
        yield array
    finally:
        # The return code is not checked: raising here would hide the block's own error,
        # and a stale registration costs nothing but bookkeeping in the client.
        client.unregister_buffer(array.ctypes.data)


def _exists(client: Any, keys: list[str]) -> list[int]:
    if not keys:
        return []
    batch = getattr(client, "batch_is_exist", None)
    found = list(batch(keys)) if callable(batch) else [int(client.is_exist(k)) for k in keys]
    for key, rc in zip(keys, found):
        if rc < 0:
            _raise_code(f"cannot check whether {key!r} exists", rc)
    return found


def _remove(client: Any, keys: list[str], force: bool) -> list[str]:
    """Remove those of ``keys`` that exist; returns the removed keys. An object read within
    the master's lease TTL refuses removal unless ``force``. (No existence check first:
    asking the master whether a key exists grants it a fresh lease.)"""
    gone = []
    for key in keys:
        rc = client.remove(key, force) if force else client.remove(key)
        if rc == -704:
            continue
        if rc != 0:
            hint = "pass force=True to skip the lease check" if rc == -706 else ""
            _raise_code(f"cannot remove {key!r}", rc, hint=hint)
        gone.append(key)
    return gone


def _put_batch(
    client: Any, keys: list[str], ptrs: list[int], sizes: list[int], config: Any
) -> list[str]:
    """One ``batch_put_from``; returns the keys written. Raises after removing them if any
    object failed (the caller removes earlier batches)."""
    res = (
        client.batch_put_from(keys, ptrs, sizes, config)
        if config is not None
        else client.batch_put_from(keys, ptrs, sizes)
    )
    written = [k for k, rc in zip(keys, res) if rc == 0]
    bad = [(k, rc) for k, rc in zip(keys, res) if rc != 0]
    if bad or len(res) != len(keys):
        key, rc = bad[0] if bad else (keys[-1], -1)
        hint = (
            "the storage segments are full or smaller than one object: lower the object size"
            if rc == -200
            else ""
        )
        try:
            _remove(client, written, True)
        except EngramDBError:
            pass  # best effort: the original failure is the one to report
        _raise_code(f"batch_put_from of {key!r} failed", rc, hint=hint)
    return written


# --- EngramStore backing ----------------------------------------------------------------------
def layer_layout(
    layer_id: int, heads: Sequence[int], row_bytes: int, object_bytes: int | None
) -> ObjectLayout:
    """`EngramStore` keys: ``engram:l{layer}:h{head}`` holds the whole head (the contract's
    key); a head split into several objects uses ``engram:l{layer}:h{head}:p{part}``."""

    def key_of(h: int, k: int, parts: int) -> str:
        base = f"engram:l{layer_id}:h{h}"
        return base if parts == 1 else f"{base}:p{k}"

    return ObjectLayout.split(heads, row_bytes, object_bytes, key_of)


class MooncakeLayers:
    """The Mooncake side of `EngramStore(layers, store=<MooncakeDistributedStore>)`."""

    def __init__(self, client: Any, object_bytes: int | None = None):
        self.client = client
        self.object_bytes = object_bytes
        self.counters = Counters()
        self._layouts: dict[int, ObjectLayout] = {}

    def layout(self, layer_id: int, heads: Sequence[int], row_bytes: int) -> ObjectLayout:
        lay = self._layouts.get(layer_id)
        if lay is None:
            lay = layer_layout(layer_id, heads, row_bytes, self.object_bytes)
            self._layouts[layer_id] = lay
        return lay

    def populate(self, layout: ObjectLayout, buffers: list[np.ndarray], config: Any) -> None:
        """Create-only upload of validated head tables: existence check, register every
        table, one ``batch_put_from`` for all objects, unregister; a failure removes what
        this call wrote. Cost: one copy of the layer over the transport."""
        keys = layout.flat_keys
        if any(_exists(self.client, keys)):
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
                    _raise_code(f"register_buffer of a {buf.nbytes} B head table failed", rc)
                done.append(buf)
            _put_batch(self.client, keys, ptrs, sizes, _replicate_config(self.client, config))
        finally:
            failed = [b for b in done if self.client.unregister_buffer(b.ctypes.data) != 0]
        if failed:
            try:
                _remove(self.client, keys, True)
            except EngramDBError:
                pass
            raise MooncakeError(f"unregister_buffer failed for {len(failed)} head table(s)")

    def remove(self, layout: ObjectLayout, force: bool) -> int:
        """Remove the layer's objects; returns how many heads had objects removed."""
        gone = set(_remove(self.client, layout.flat_keys, force))
        return sum(1 for ks in layout.keys if any(k in gone for k in ks))

    def lookup_into(self, layout: ObjectLayout, row_ids: np.ndarray, output: np.ndarray) -> None:
        """Validated ids: one ``get_into_ranges`` into the registered ``output``."""
        plan = layout.plan_local(row_ids)
        try:
            read_ranges(self.client, plan, output, self.counters)
        except ObjectMissing as e:
            raise LayerNotReady(f"layer is not populated in the store: {e}") from None


# --- whole databases ----------------------------------------------------------------------------
def manifest_key(name: str) -> str:
    return f"engramdb:{name}:manifest"


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in ": \t\n/"):
        raise InvalidArgument(f"invalid publication name {name!r}: no ':', '/' or spaces")
    return name


def _get_bytes(client: Any, key: str) -> bytes | None:
    size = client.get_size(key)
    if size == -704 or size == 0:
        return None
    if size < 0:
        _raise_code(f"cannot read {key!r}", int(size))
    buf = np.empty(int(size), dtype=np.uint8)
    with registered(client, buf):
        rc = client.get_into(key, buf.ctypes.data, buf.nbytes)
    if rc == -704:
        return None
    if rc != buf.nbytes:
        _raise_code(f"cannot read {key!r}", int(rc) if rc < 0 else -1)
    return buf.tobytes()


def read_object(client: Any, key: str, nbytes: int) -> np.ndarray:
    """The whole object ``key`` (exactly ``nbytes`` long) as a new uint8 array."""
    buf = np.empty(int(nbytes), dtype=np.uint8)
    with registered(client, buf):
        rc = client.get_into(key, buf.ctypes.data, buf.nbytes)
    if rc == -704:
        raise ObjectMissing(f"object {key!r} is not in the store", rc)
    if rc != buf.nbytes:
        _raise_code(f"cannot read {key!r} ({nbytes} bytes expected)", int(rc) if rc < 0 else -1)
    return buf


def _put_bytes(client: Any, key: str, data: bytes, config: Any) -> None:
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    with registered(client, buf):
        _put_batch(client, [key], [buf.ctypes.data], [buf.nbytes], config)


@dataclass(frozen=True)
class PublishSummary:
    name: str
    tables: list[str]
    objects: int
    bytes: int
    seconds: float
    #: published views as ``table/view``; views skipped (stale, or records that are not
    #: one row per head) with the reason
    views: tuple[str, ...] = ()
    skipped_views: tuple[str, ...] = ()

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    def line(self) -> str:
        views = f" and {len(self.views)} view(s)" if self.views else ""
        skipped = f"; skipped views: {', '.join(self.skipped_views)}" if self.skipped_views else ""
        return (
            f"published {len(self.tables)} table(s){views} as {self.name!r}: {self.objects} "
            f"objects, {self.bytes / 1e9:.3f} GB in {self.seconds:.2f} s, "
            f"{self.gb_per_s:.2f} GB/s{skipped}"
        )


def _read_rows(fds: list[int], shards: Sequence[Any], row_bytes: int, first: int, dst: Any) -> None:
    """Rows ``first ...`` of a table into ``dst`` (a writable memoryview) with ``preadv``,
    crossing shard boundaries; a loop over shards, not rows."""
    pos = 0
    row = first
    need = len(dst)
    for fd, s in zip(fds, shards):
        if pos >= need:
            break
        end = s.first_row + s.rows
        if row >= end or row < s.first_row:
            continue
        off = (row - s.first_row) * row_bytes
        take = min(need - pos, (end - row) * row_bytes)
        got = 0
        while got < take:
            n = os.preadv(fd, [dst[pos + got : pos + take]], off + got)
            if n <= 0:
                from engramdb.errors import ReadError

                raise ReadError(f"short read from shard {s.path!r} at offset {off + got}")
            got += n
        pos += take
        row += take // row_bytes


def _stream_table(
    client: Any,
    db_path: Path,
    info: Any,
    layout: ObjectLayout,
    stage: np.ndarray,
    cfg: Any,
    written: list[str],
    progress: Callable[[int], None] | None,
) -> int:
    """Write every object of one table through the registered ``stage`` buffer, several
    objects per ``batch_put_from``; returns payload bytes. ``written`` collects the keys."""
    from engramdb.store import open_shards

    rb = info.row_bytes
    view = memoryview(stage.data)  # .data: a buffer type checkers know
    batch: list[tuple[str, int, int]] = []
    used = 0
    total = 0

    def flush() -> None:
        nonlocal used, total
        if not batch:
            return
        sizes = [n for _, _, n in batch]
        ptrs = [stage.ctypes.data + o for _, o, _ in batch]
        written.extend(_put_batch(client, [k for k, _, _ in batch], ptrs, sizes, cfg))
        total += sum(sizes)
        if progress is not None:
            progress(sum(sizes))
        batch.clear()
        used = 0

    fds = open_shards(db_path, info)
    try:
        for key, h, first, rows in layout.objects():
            nbytes = rows * rb
            if used + nbytes > stage.nbytes:
                flush()
            g = int(info.head_offsets[h]) + first
            _read_rows(fds, info.shards, rb, g, view[used : used + nbytes])
            batch.append((key, used, nbytes))
            used += nbytes
        flush()
    finally:
        for fd in fds:
            os.close(fd)
    return total


def publish(
    db: Any,
    *,
    master: str | None = None,
    metadata: str | None = None,
    name: str | None = None,
    tables: Sequence[str] | None = None,
    object_bytes: int = DEFAULT_OBJECT_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    client: Any = None,
    config: Any = None,
    progress: Callable[[int], None] | None = None,
    local_hostname: str | None = None,
    protocol: str = "tcp",
    views: bool | Sequence[str] = True,
) -> PublishSummary:
    """Stream tables of the EngramDB database ``db`` (path or `Database`) into the store.

    Each head is cut into objects of at most ``object_bytes`` whole rows
    (``engramdb:{name}:{table}:h{h}:p{k}``), staged ``staging_bytes`` at a time through one
    registered buffer (bounded memory) and written with ``batch_put_from``; the manifest
    object ``engramdb:{name}:manifest`` is written last, so a reader sees a publication
    whole or not at all. Create-only: an existing manifest is `TableExists` (remove it
    with `unpublish`). A failure removes the objects this call wrote. ``progress(n)`` is
    called with payload bytes as they are written. Cost: one read of each table from
    disk and one copy over the transport.

    ``views``: also publish the tables' Store-P views (``True``: every view whose records
    hold one row of each head, in head order, skipping stale or other views; a list: those
    names, which must qualify), as record objects plus a row index
    (`engramdb.integrations.mooncake_view`); readers use them with
    ``MooncakeTable.use_view``."""
    import time

    from engramdb.database import Database

    own_db = not isinstance(db, Database)
    database = Database(db) if own_db else db
    own_client = client is None
    try:
        name = _check_name(name or database.path.resolve().name)
        chosen = list(tables) if tables else database.tables
        for t in chosen:
            if t not in database:
                raise TableNotFound(f"no table {t!r} in {str(database.path)!r}")
        if own_client:
            if not master or not metadata:
                raise InvalidArgument("publish needs master= and metadata= (or client=)")
            client = connect(master, metadata, local_hostname=local_hostname, protocol=protocol)
        cfg = _replicate_config(client, config)
        if _get_bytes(client, manifest_key(name)) is not None:
            raise TableExists(f"{name!r} is already published in this store; unpublish it first")
        doc: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "name": name,
            "source": str(database.path),
            "source_generation": database.manifest.generation,
            "tables": {},
        }
        written: list[str] = []
        published_views: list[str] = []
        skipped_views: list[str] = []
        t0 = time.perf_counter()
        total = 0
        stage = np.empty(max(int(staging_bytes), int(object_bytes)), dtype=np.uint8)

        def put(keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
            written.extend(_put_batch(client, keys, ptrs, sizes, cfg))

        try:
            with registered(client, stage):
                for t in chosen:
                    info = database.manifest.tables[t]

                    def key_of(h: int, k: int, _n: int, t: str = t) -> str:
                        return f"engramdb:{name}:{t}:h{h}:p{k}"

                    layout = ObjectLayout.split(info.heads, info.row_bytes, object_bytes, key_of)
                    total += _stream_table(
                        client, database.path, info, layout, stage, cfg, written, progress
                    )
                    entry = info.to_dict()
                    for drop in ("shards", "sources", "layout"):
                        entry.pop(drop, None)
                    entry["rows_per_object"] = layout.rows_per_object
                    entry["objects"] = layout.keys
                    entry["views"] = {}
                    for v, why in _views_to_publish(database, t, views):
                        if why is not None:
                            skipped_views.append(f"{t}/{v} ({why})")
                            continue
                        pv, nbytes = publish_view(
                            client,
                            database,
                            t,
                            v,
                            f"engramdb:{name}:{t}:view:{v}",
                            object_bytes,
                            stage,
                            put,
                            progress,
                        )
                        total += nbytes
                        entry["views"][v] = pv.to_dict()
                        published_views.append(f"{t}/{v}")
                    doc["tables"][t] = entry
            _put_bytes(client, manifest_key(name), json.dumps(doc).encode(), cfg)
        except BaseException:
            try:
                _remove(client, written, True)
            except EngramDBError:
                pass
            raise
        return PublishSummary(
            name,
            chosen,
            len(written),
            total,
            time.perf_counter() - t0,
            tuple(published_views),
            tuple(skipped_views),
        )
    finally:
        if own_db:
            database.close()
        if own_client and client is not None:
            client.close()


def _views_to_publish(
    database: Any, table: str, views: bool | Sequence[str]
) -> list[tuple[str, str | None]]:
    """``(view, reason to skip or None)`` for the views of ``table`` that ``views`` asks for."""
    from engramdb.errors import StaleView
    from engramdb.layouts.view import parse_views as local_views

    info = database.manifest.tables[table]
    have = local_views(info)
    if views is False:
        return []
    if views is True:
        names, strict = sorted(have), False
    else:
        names, strict = [str(v) for v in views], True
        for v in names:
            if v not in have:
                raise TableNotFound(f"table {table!r} has no view {v!r} (views: {sorted(have)})")
    out: list[tuple[str, str | None]] = []
    for v in names:
        e = have[v]
        why = None
        if e.rows_per_record != len(info.heads):
            why = f"records of {e.rows_per_record} rows, {len(info.heads)} heads"
        else:
            from engramdb.layouts.view import source_hash

            if e.source_hash != source_hash(info):
                why = "stale"
        if why is not None and strict:
            err = StaleView if why == "stale" else InvalidArgument
            raise err(f"view {v!r} of {table!r} cannot be published: {why}")
        out.append((v, why))
    return out


def unpublish(name: str, *, client: Any, force: bool = True) -> int:
    """Remove a publication's manifest (first, so no new reader opens it) and objects;
    returns the number of objects removed."""
    raw = _get_bytes(client, manifest_key(name))
    if raw is None:
        return 0
    doc = _parse_manifest(raw, name)
    _remove(client, [manifest_key(name)], force)
    keys = [k for t in doc["tables"].values() for ks in t["objects"] for k in ks]
    for t in doc["tables"].values():
        for v in (t.get("views") or {}).values():
            keys.extend(v.get("objects", []))
            keys.append(v.get("index", ""))
    return len(_remove(client, [k for k in keys if k], force))


def _parse_manifest(raw: bytes, name: str) -> dict[str, Any]:
    from engramdb.errors import CorruptManifest

    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptManifest(f"manifest object of {name!r} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise CorruptManifest(f"object {manifest_key(name)!r} is not an EngramDB publication")
    if doc.get("format_version") != MANIFEST_VERSION:
        raise CorruptManifest(
            f"publication {name!r} has format_version {doc.get('format_version')!r}, this "
            f"reader understands {MANIFEST_VERSION}"
        )
    return doc


class MooncakeTable:
    """One published table: the read surface of `engramdb.Store` over the store.

    Ranged mode (default): every read validates, then issues one ``get_into_ranges`` into
    the destination, which must be registered with the database's client (``fetch``
    registers the array it allocates). Host-copy mode: reads gather from this host's copy.
    Validation and errors are those of `engramdb.Store`; a rejected call leaves the output
    untouched, a failed transfer zero-fills it."""

    def __init__(self, db: MooncakeDatabase, name: str, entry: dict[str, Any]):
        self._db = db
        self.name = name
        self.row_bytes = int(entry["row_bytes"])
        self.heads = np.asarray([int(h["rows"]) for h in entry["heads"]], dtype=np.int64)
        self.n_rows = int(entry["n_rows"])
        self.head_offsets = np.concatenate([[0], np.cumsum(self.heads)[:-1]]).astype(np.int64)
        self.dtype = entry.get("dtype", "u8")
        self.dim = entry.get("dim")
        self.layout = ObjectLayout(
            self.heads.tolist(), self.row_bytes, int(entry["rows_per_object"]), entry["objects"]
        )
        self.counters = Counters()
        self._entry = entry
        self._local: np.ndarray | None = None
        self.views = parse_views(entry, f"publication {db.name!r} table {name!r}")
        self._view: ViewReader | None = None

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def mode(self) -> str:
        if self._local is not None:
            return "host_copy"
        return "ranged" if self._view is None else f"ranged+view:{self._view.view.name}"

    def use_view(
        self,
        name: str | None,
        *,
        merge_gap_bytes: int = DEFAULT_MERGE_GAP_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """Serve ``lookup_into`` through the published view ``name`` (None: stop): its row
        index is read once (one object), then every batch reads the records it needs in
        merged runs and the unmatched positions row by row, in one ``get_into_ranges``.
        ``merge_gap_bytes``: gaps between needed records read through rather than split;
        ``cache_bytes``: a direct-mapped cache of records read earlier (repeated n-grams of
        a stream are not read again; 0 turns it off)."""
        old, self._view = self._view, None
        if old is not None:
            old.close()
        if name is None:
            return
        pv = self.views.get(name)
        if pv is None:
            raise TableNotFound(
                f"table {self.name!r} has no published view {name!r} (views: {sorted(self.views)})"
            )
        self._view = ViewReader(self, pv, merge_gap_bytes=merge_gap_bytes, cache_bytes=cache_bytes)

    def __repr__(self) -> str:
        return (
            f"<MooncakeTable {self.name!r} {self.n_rows:,} rows x {self.row_bytes} B, "
            f"{self.n_heads} heads, {self.mode}>"
        )

    def _client(self) -> Any:
        return self._db._live_client()

    def _read_global(self, flat: np.ndarray, out2d: np.ndarray) -> None:
        if self._local is not None:
            take_rows(self._local, flat, out2d)
            return
        read_ranges(self._client(), self.layout.plan_global(flat), out2d, self.counters)

    def fetch(self, rowids: Any) -> np.ndarray:
        """Rows for global ``rowids``: ``rowids.shape + (row_bytes,)`` uint8, allocated and
        (ranged mode) registered for the call — a register/unregister pair per call."""
        ids = as_rowids(rowids)
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        if flat.size == 0:
            return out
        if self._local is not None:
            self._read_global(flat, out.reshape(-1, self.row_bytes))
            return out
        with registered(self._client(), out):
            self._read_global(flat, out.reshape(-1, self.row_bytes))
        return out

    def fetch_into(self, rowids: Any, out: np.ndarray) -> np.ndarray:
        """Rows of global ``rowids`` into ``out`` (writable C-contiguous uint8, registered
        with the client in ranged mode). No allocation beyond the range lists."""
        ids = as_rowids(rowids)
        check_output(out, ids.shape + (self.row_bytes,))
        flat = ids.reshape(-1)
        check_bounds(flat, self.n_rows, shape=ids.shape)
        if flat.size:
            self._read_global(flat, out.reshape(-1, self.row_bytes))
        return out

    def lookup_into(self, row_ids: np.ndarray, out: np.ndarray) -> None:
        """Per-head local ids, int64 C-contiguous ``[B, L, H]`` -> ``out`` uint8
        ``[B, L, H, row_bytes]``; ranged mode: one ``get_into_ranges`` into the registered
        ``out`` (an empty batch needs no registration)."""
        check_lookup_ids(row_ids, self.n_heads)
        check_output(out, row_ids.shape + (self.row_bytes,))
        if row_ids.size == 0:
            return
        check_head_bounds(row_ids, self.heads)
        if self._local is not None:
            g = (row_ids.reshape(-1, self.n_heads) + self.head_offsets).reshape(-1)
            take_rows(self._local, g, out.reshape(-1, self.row_bytes))
            return
        if self._view is not None:
            self._view.lookup_into(row_ids, out, self.counters)
            return
        read_ranges(self._client(), self.layout.plan_local(row_ids), out, self.counters)

    def stats(self) -> dict[str, Any]:
        doc = {
            "table": self.name,
            "backend": "mooncake",
            "mode": self.mode,
            **self.counters.as_dict(),
        }
        if self._view is not None:
            doc.update({f"view_{k}": v for k, v in self._view.counters.items()})
        return doc

    # -- host copy -----------------------------------------------------------------------------
    def _attach_host_copy(self, directory: Path) -> None:
        """Map this host's copy of the table, pulling it from the store first if no rank on
        the host has (``flock`` serialises the pull; a ``rename`` publishes it whole).
        Cost once per host: one bulk read of the table; afterwards reads are local."""
        # The name carries a digest of what was published (table entry, source database and
        # generation), so a republished table never maps an older host copy.
        ident = {
            "entry": self._entry,
            "source": self._db.manifest.get("source"),
            "generation": self._db.manifest.get("source_generation"),
        }
        digest = xxhash.xxh3_64_hexdigest(json.dumps(ident, sort_keys=True).encode())
        stem = f"{self._db.name}.{self.name}.{digest}"
        path = directory / f"{stem}.rows"
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{stem}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path.exists() and path.stat().st_size == self.nbytes):
                self._pull(path)
        self._local = np.memmap(path, dtype=np.uint8, mode="r", shape=(self.n_rows, self.row_bytes))

    def _pull(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        client = self._client()
        rb = self.row_bytes
        try:
            arr = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(self.nbytes,))
            with registered(client, arr):
                base = arr.ctypes.data
                pending = [
                    (key, base + (int(self.head_offsets[h]) + first) * rb, rows * rb)
                    for key, h, first, rows in self.layout.objects()
                ]
                for batch in _batches(pending, PULL_BATCH_BYTES):
                    _bulk_read(client, batch)
            arr.flush()
            del arr
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _batches(items: list[tuple[str, int, int]], limit: int) -> Iterator[list[tuple[str, int, int]]]:
    """Consecutive groups of at most ``limit`` bytes (at least one object each)."""
    batch: list[tuple[str, int, int]] = []
    used = 0
    for item in items:
        if batch and used + item[2] > limit:
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += item[2]
    if batch:
        yield batch


def _bulk_read(client: Any, batch: list[tuple[str, int, int]], attempts: int = 3) -> None:
    """``batch_get_into`` whole objects; objects whose read lease ran out before their
    transfer finished (LEASE_EXPIRED: the master may have moved them) are read again."""
    for attempt in range(attempts):
        res = client.batch_get_into(
            [k for k, _, _ in batch], [p for _, p, _ in batch], [n for _, _, n in batch]
        )
        retry = []
        for item, rc in zip(batch, res):
            if rc == item[2]:
                continue
            if rc == -707 and attempt + 1 < attempts:
                retry.append(item)
                continue
            _raise_code(f"bulk read of {item[0]!r}", rc if rc < 0 else -1)
        if not retry:
            return
        batch = retry


class MooncakeDatabase:
    """A publication opened from the store: ``db[table]`` is a `MooncakeTable`.

    ``client`` is the store client every ranged read goes through: register output
    buffers with ``db.register(array)`` or ``db.client.register_buffer``."""

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        own_client: bool = False,
        host_copy: str | os.PathLike[str] | None = None,
    ):
        self.client = client
        self.name = _check_name(name)
        self._own_client = own_client
        self._closed = False
        self._lock = threading.Lock()
        raw = _get_bytes(client, manifest_key(name))
        if raw is None:
            raise TableNotFound(f"nothing is published as {name!r} in this store")
        self.manifest = _parse_manifest(raw, name)
        self._tables = {t: MooncakeTable(self, t, e) for t, e in self.manifest["tables"].items()}
        if host_copy is not None:
            for table in self._tables.values():
                table._attach_host_copy(Path(host_copy))

    def _live_client(self) -> Any:
        if self._closed:
            raise StoreClosed(f"publication {self.name!r} is closed")
        return self.client

    @property
    def tables(self) -> list[str]:
        return sorted(self._tables)

    def __contains__(self, name: object) -> bool:
        return name in self._tables

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, name: str) -> MooncakeTable:
        self._live_client()
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFound(
                f"no table {name!r} in publication {self.name!r} (tables: {self.tables})"
            ) from None

    def register(self, array: np.ndarray) -> Any:
        """Context manager: ``array`` registered with the client for the block."""
        return registered(self._live_client(), array)

    def info(self) -> dict[str, Any]:
        return dict(self.manifest)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for t in self._tables.values():
                t._local = None
                if t._view is not None:
                    t._view.close()
                    t._view = None
            self._closed = True
            if self._own_client:
                self.client.close()

    def __enter__(self) -> MooncakeDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MooncakeDatabase {self.name!r} tables={self.tables}>"


def open_mooncake(
    *,
    master: str | None = None,
    metadata: str | None = None,
    name: str,
    client: Any = None,
    host_copy: str | os.PathLike[str] | None = None,
    local_hostname: str | None = None,
    protocol: str = "tcp",
    view: str | None = None,
) -> MooncakeDatabase:
    """Open the publication ``name`` (see `publish`) from the store at ``master`` /
    ``metadata``, or through an existing ``client`` (one client per rank can serve every
    table). ``host_copy`` (a tmpfs directory such as ``/dev/shm/engramdb``): pull each
    table once per host into a file that all ranks on the host map, and serve reads
    locally. Cost: client setup (~0.1-1 s) and one manifest read; ``host_copy`` adds one
    bulk read of every table the first time on a host. ``view``: every table that has a
    published view of that name serves ``lookup_into`` through it (`MooncakeTable.use_view`).
    """
    own = client is None
    if own:
        if not master or not metadata:
            raise InvalidArgument("open_mooncake needs master= and metadata= (or client=)")
        client = connect(master, metadata, local_hostname=local_hostname, protocol=protocol)
    try:
        db = MooncakeDatabase(client, name, own_client=own, host_copy=host_copy)
        if view is not None:
            try:
                tables = [t for t in db._tables.values() if view in t.views]
                if not tables:
                    raise TableNotFound(f"no table of {name!r} has a published view {view!r}")
                for t in tables:
                    t.use_view(view)
            except BaseException:
                db._own_client = False  # the handler below closes the client
                db.close()
                raise
        return db
    except BaseException:
        if own:
            client.close()
        raise


__all__ = [
    "DEFAULT_OBJECT_BYTES",
    "EXTRA",
    "MooncakeDatabase",
    "MooncakeError",
    "MooncakeLayers",
    "MooncakeTable",
    "ObjectLayout",
    "ObjectMissing",
    "OutputNotRegistered",
    "PublishSummary",
    "RangePlan",
    "StoreUnavailable",
    "connect",
    "import_store",
    "is_store_client",
    "open_mooncake",
    "publish",
    "unpublish",
]
