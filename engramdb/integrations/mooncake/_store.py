"""The Mooncake store client plumbing every other piece of this package uses.

Client import and set-up (`import_store`, `connect`), the typed errors and `raise_code` (an
ErrorCode to the matching exception), buffer registration, ranged reads (`read_ranges` /
`read_many`: one ``get_into_ranges``, zero-filled on failure), whole-object and bulk reads,
puts and removals, and the `Counters` that prove which path ran. No table or view logic.

Importing this module never imports the ``mooncake`` package; connecting does, and raises
`MissingDependency` naming the extra when it is absent.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

from engramdb.errors import EngramDBError, MissingDependency
from engramdb.integrations.mooncake.layout import RangePlan

#: The optional extra that installs the Mooncake wheel.
EXTRA = "mooncake"
#: Bytes per ``batch_get_into`` when pulling a host copy: each batch must finish inside
#: the master's read lease (10 s by default), whatever the transport's speed.
PULL_BATCH_BYTES = 64 * 1024 * 1024

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
    """``NAME (code)`` of a Mooncake ErrorCode, for messages."""
    return f"{_CODE_NAMES.get(code, 'error')} ({code})"


def raise_code(what: str, code: int, *, hint: str = "") -> NoReturn:
    """Raise the exception for a failed store call: `StoreUnavailable` for RPC and transfer
    failures, `ObjectMissing` for OBJECT_NOT_FOUND, else `MooncakeError`; the message is
    ``what``, the code's name and ``hint`` (a default one for LEASE_EXPIRED)."""
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


#: Seconds `connect` waits for the master (and an HTTP metadata server) to accept a TCP
#: connection before it gives up (the native client alone retries for ~90 s).
DEFAULT_CONNECT_TIMEOUT = 5.0


def quiet_native_logs(verbose: bool = False) -> None:
    """Keep the native client's glog lines (INFO / WARNING, ~120 of them for an unreachable
    master) off stderr unless ``verbose``; errors still print. Must run before the native
    library loads; an explicit ``GLOG_minloglevel`` in the environment wins."""
    if verbose:
        os.environ["GLOG_minloglevel"] = "0"
    else:
        os.environ.setdefault("GLOG_minloglevel", "2")


def _probe(what: str, address: str, timeout: float) -> None:
    """`StoreUnavailable` unless ``address`` (``host:port``) accepts a TCP connection within
    ``timeout`` seconds."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise StoreUnavailable(f"{what} address {address!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise StoreUnavailable(
            f"{what} {address!r} is not reachable within {timeout:g} s "
            f"({e.strerror or e}); is it running? (connect_timeout / --connect-timeout)"
        ) from None


def import_store() -> ModuleType:
    """``mooncake.store``, or `MissingDependency` naming the extra to install."""
    quiet_native_logs(verbose=os.environ.get("GLOG_minloglevel") == "0")
    try:
        import mooncake.store as store_module
    except ImportError as e:
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
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> Any:
    """A set-up ``MooncakeDistributedStore`` client.

    ``master`` is ``host:port`` of ``mooncake_master``; ``metadata`` the metadata server URL
    (``http://host:8080/metadata`` for the master's built-in one). ``segment_bytes`` is the
    memory this process contributes to the store (0: a pure reader or publisher; the data
    then lives on storage hosts running ``mooncake_client``). ``local_hostname`` defaults to
    ``MC_TCP_BIND_ADDRESS`` or this host's address. Takes ~0.1-1 s (RPC + metadata).
    The master (and an ``http://`` metadata server) must accept a TCP connection within
    ``connect_timeout`` seconds, else `StoreUnavailable` at once (the native client alone
    keeps retrying for ~90 s)."""
    _probe("Mooncake master", master, connect_timeout)
    if metadata.startswith(("http://", "https://")):
        netloc = metadata.split("://", 1)[1].split("/", 1)[0]
        if ":" not in netloc.rsplit("]", 1)[-1]:
            netloc += ":443" if metadata.startswith("https") else ":80"
        _probe("metadata server", netloc, connect_timeout)
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


def replicate_config(client: Any, config: Any) -> Any:
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
    raise_code(f"ranged read of {key!r} failed", code)


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
        raise_code(f"register_buffer of {array.nbytes} bytes failed", rc)
    try:
        yield array
    finally:
        # The return code is not checked: raising here would hide the block's own error,
        # and a stale registration costs nothing but bookkeeping in the client.
        client.unregister_buffer(array.ctypes.data)


def exists(client: Any, keys: list[str]) -> list[int]:
    """Per key, 1 if the store holds it, else 0 (one ``batch_is_exist`` where the client has
    it). Note that asking grants the object a fresh read lease."""
    if not keys:
        return []
    batch = getattr(client, "batch_is_exist", None)
    found = list(batch(keys)) if callable(batch) else [int(client.is_exist(k)) for k in keys]
    for key, rc in zip(keys, found):
        if rc < 0:
            raise_code(f"cannot check whether {key!r} exists", rc)
    return found


def remove(client: Any, keys: list[str], force: bool) -> list[str]:
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
            raise_code(f"cannot remove {key!r}", rc, hint=hint)
        gone.append(key)
    return gone


def put_batch(
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
            remove(client, written, True)
        except EngramDBError:
            pass  # best effort: the original failure is the one to report
        raise_code(f"batch_put_from of {key!r} failed", rc, hint=hint)
    return written


def get_bytes(client: Any, key: str) -> bytes | None:
    """The whole small object ``key`` as bytes (a manifest), or None if it does not exist."""
    size = client.get_size(key)
    if size == -704 or size == 0:
        return None
    if size < 0:
        raise_code(f"cannot read {key!r}", int(size))
    buf = np.empty(int(size), dtype=np.uint8)
    with registered(client, buf):
        rc = client.get_into(key, buf.ctypes.data, buf.nbytes)
    if rc == -704:
        return None
    if rc != buf.nbytes:
        raise_code(f"cannot read {key!r}", int(rc) if rc < 0 else -1)
    return buf.tobytes()


def read_object(client: Any, key: str, nbytes: int) -> np.ndarray:
    """The whole object ``key`` (exactly ``nbytes`` long) as a new uint8 array."""
    buf = np.empty(int(nbytes), dtype=np.uint8)
    with registered(client, buf):
        rc = client.get_into(key, buf.ctypes.data, buf.nbytes)
    if rc == -704:
        raise ObjectMissing(f"object {key!r} is not in the store", rc)
    if rc != buf.nbytes:
        raise_code(f"cannot read {key!r} ({nbytes} bytes expected)", int(rc) if rc < 0 else -1)
    return buf


def put_bytes(client: Any, key: str, data: bytes, config: Any) -> None:
    """Write ``data`` as the object ``key`` (create-only, through a registered copy)."""
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    with registered(client, buf):
        put_batch(client, [key], [buf.ctypes.data], [buf.nbytes], config)


def object_batches(
    items: list[tuple[str, int, int]], limit: int
) -> Iterator[list[tuple[str, int, int]]]:
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


def bulk_read(client: Any, batch: list[tuple[str, int, int]], attempts: int = 3) -> None:
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
            raise_code(f"bulk read of {item[0]!r}", rc if rc < 0 else -1)
        if not retry:
            return
        batch = retry


__all__ = [
    "EXTRA",
    "PULL_BATCH_BYTES",
    "Counters",
    "MooncakeError",
    "ObjectMissing",
    "OutputNotRegistered",
    "StoreUnavailable",
    "bulk_read",
    "code_name",
    "connect",
    "exists",
    "get_bytes",
    "import_store",
    "is_store_client",
    "object_batches",
    "put_batch",
    "put_bytes",
    "raise_code",
    "read_many",
    "read_object",
    "read_ranges",
    "registered",
    "remove",
    "replicate_config",
]
