"""A real Mooncake deployment for tests: master + one storage host, in a private network
namespace with only loopback up.

The test process itself moves its main thread into a fresh network namespace
(``unshare(CLONE_NEWNET)``) for the duration of the module and moves back afterwards
(``setns`` to the namespace it came from). The master binds all interfaces; in the private
namespace "all" is loopback only, so nothing is reachable from, or sends to, any network.
Threads and child processes started while inside (the store client's threads, the master,
the storage host, second clients) inherit the namespace.

Processes are stopped by their PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000


class NamespaceUnavailable(RuntimeError):
    """The private network namespace cannot be created here (no privilege, no ``ip``)."""


def enter_private_netns() -> Callable[[], None]:
    """Move this thread into a new network namespace with loopback up; returns a function
    that moves it back. Raises `NamespaceUnavailable` with the reason."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NamespaceUnavailable(f"cannot open /proc/self/ns/net: {e}") from None
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        os.close(home)
        raise NamespaceUnavailable(
            f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (needs CAP_SYS_ADMIN)"
        )

    def restore() -> None:
        if libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the original network namespace")
        os.close(home)

    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        restore()
        raise NamespaceUnavailable(f"cannot bring loopback up with `ip` (iproute2): {e}") from None
    return restore


def mooncake_binary(name: str) -> str:
    """Path of a binary the Mooncake wheel ships inside its package directory."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the mooncake package is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the mooncake wheel")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening after {timeout} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes] | None, grace: float = 5.0) -> None:
    """Stop one process we started, by its PID."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


class Cluster:
    """``mooncake_master`` (with its HTTP metadata server) plus one storage host
    (``mooncake_client`` with a ``segment`` of memory), on loopback ports from ``base``.

    Each deployment of the suite has ports of its own, below the kernel's ephemeral range
    (32768 and up): a fixed port inside it can be taken by an outgoing connection of an
    earlier deployment's processes, and the storage host then fails to bind and exits."""

    def __init__(self, base: int = 31051, segment: str = "512MB", lease_ms: int = 500):
        self.rpc_port = base
        self.client_port = base + 1
        self.http_port = base + 2
        self.metrics_port = base + 3
        self.segment = segment
        self.lease_ms = lease_ms
        self.logdir = Path(tempfile.mkdtemp(prefix="edb-mooncake-"))
        self.master: subprocess.Popen[bytes] | None = None
        self.storage: subprocess.Popen[bytes] | None = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.logdir / log, "wb") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)

    def start(self) -> Cluster:
        self.master = self._spawn(
            [
                mooncake_binary("mooncake_master"),
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_port={self.metrics_port}",
                f"--default_kv_lease_ttl={self.lease_ms}",
            ],
            "master.log",
        )
        try:
            wait_port(self.rpc_port, self.master, self.logdir / "master.log")
            wait_port(self.http_port, self.master, self.logdir / "master.log")
            self.storage = self._spawn(
                [
                    mooncake_binary("mooncake_client"),
                    f"--global_segment_size={self.segment}",
                    "--host=127.0.0.1",
                    f"--port={self.client_port}",
                    f"--master_server_address={self.master_addr}",
                    f"--metadata_server={self.metadata_url}",
                ],
                "storage.log",
            )
            # the storage host mounts its segment before it opens its service port
            wait_port(self.client_port, self.storage, self.logdir / "storage.log")
        except BaseException:
            self.stop()
            raise
        return self

    def kill_master(self) -> None:
        if self.master is not None:
            self.master.kill()
            self.master.wait(10)

    def stop(self) -> None:
        """Stop both processes by PID and delete their logs (startup failures already
        carried the log tail in their message)."""
        stop(self.storage)
        stop(self.master)
        self.storage = self.master = None
        shutil.rmtree(self.logdir, ignore_errors=True)

    def connect(self) -> object:
        from engramdb.integrations.mooncake import connect

        return connect(self.master_addr, self.metadata_url, local_hostname="127.0.0.1")


def run_python(code: str, *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter (same namespace); returns stdout; raises with the
    output on a non-zero exit, and kills the child past ``timeout`` seconds."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"child exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


# One deployment per test process: the Mooncake client library keeps process-wide state bound
# to the namespace of its first client, so a second private namespace in the same process
# cannot host a client. The first module to ask creates the namespace and the cluster; every
# module moves into that namespace for its duration and back out after; the processes stop
# when the test process exits (by PID).
_shared: tuple[int, Cluster] | None = None


def _setns(fd: int) -> None:
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns to a network namespace")


def module_cluster() -> Iterator[Cluster]:
    """The body of a module-scoped ``cluster`` fixture: the shared deployment, with this
    thread inside its namespace (and ``MC_TCP_BIND_ADDRESS=127.0.0.1``) until the module
    ends. Skips the module where no private namespace can be created."""
    global _shared
    home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    old = os.environ.get("MC_TCP_BIND_ADDRESS")
    try:
        if _shared is None:
            try:
                restore = enter_private_netns()
            except NamespaceUnavailable as e:
                import pytest

                pytest.skip(f"cannot create a private network namespace for Mooncake: {e}")
            ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
            try:
                cluster = Cluster().start()
            except BaseException:
                restore()
                os.close(ns)
                raise
            atexit.register(cluster.stop)
            _shared = (ns, cluster)
        else:
            _setns(_shared[0])
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        yield _shared[1]
    finally:
        _setns(home)
        os.close(home)
        if old is None:
            os.environ.pop("MC_TCP_BIND_ADDRESS", None)
        else:
            os.environ["MC_TCP_BIND_ADDRESS"] = old
