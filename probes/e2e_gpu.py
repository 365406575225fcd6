"""The CUDA engine path of probes/e2e_decode.py (issue 18 item 6): the model on the GPU, the
Engram rows staged through pinned host memory.

Every table arm other than ``gpu:ram`` hands the layer its rows the way an engine's offload
path does: the rows land in a **pinned host buffer** (the decoder's `fill` writes them there
directly; a module's CPU output is copied into it), an **H2D copy on a side stream**
(``non_blocking``, issued by the host outside any captured region) moves them to a device
buffer, and the compute stream waits on that stream before the layer reads them. The pinned
buffer is reused on the next step only after the step's sampled token came back to the host
(the compute stream, which waited on the copy, has drained).

Baselines: ``gpu:ram`` keeps engram-peft's own `MultiHeadEmbedding` with its table in GPU
memory (the limit: no host copy at all); ``gpu:host`` keeps it in host RAM (anonymous memory)
and stages its rows like the EngramDB arms (the table "pinned in RAM" of an offloading engine).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

#: ``E2E_GPU_DRYRUN=1`` runs the GPU arms' code on the CPU (plain copies, no stream, no pinned
#: memory): a check of the arms' plumbing on a machine without CUDA, not a measurement.
DRYRUN = os.environ.get("E2E_GPU_DRYRUN") == "1"


def cuda_note() -> str | None:
    """None when a CUDA device is usable here, else why not (the message for skipped arms)."""
    if DRYRUN:
        return None
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the probe needs torch anyway
        return f"torch does not import ({e})"
    if not torch.cuda.is_available():
        build = torch.version.cuda
        return (
            f"no CUDA device (torch {torch.__version__}, "
            f"{'CUDA ' + build if build else 'a CPU-only build'}, torch.cuda.is_available() "
            "is False)"
        )
    return None


def device() -> Any:
    import torch

    return torch.device("cpu" if DRYRUN else "cuda")


def device_name() -> str:
    import torch

    return (
        "the CPU (E2E_GPU_DRYRUN=1: plumbing check only)"
        if DRYRUN
        else str(torch.cuda.get_device_name(0))
    )


class Stager:
    """Pinned host buffers and their device copies, moved by one side stream."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._pinned: dict[tuple[Any, ...], Any] = {}
        self._dev: dict[tuple[Any, ...], Any] = {}
        #: The decoder arm's last staged device copy per layer slot (`decoder_before_layer`).
        self.last: dict[int, Any] = {}

    def pinned(self, key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """A pinned host tensor for ``key`` (allocated once per shape)."""
        k = (key, tuple(shape), dtype)
        t = self._pinned.get(k)
        if t is None:
            t = self._pinned[k] = self.torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        return t

    def pinned_numpy(self, key: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A pinned uint8 host buffer as a numpy array (what `Decoder.fill` writes into)."""
        return self.pinned(key, shape, self.torch.uint8).numpy()  # type: ignore[no-any-return]

    def to_device(self, key: Any, host: Any) -> Any:
        """``host`` (pinned, contiguous) copied into ``key``'s device buffer on the side
        stream; the compute stream waits for the copy. Returns the device buffer. Each key's
        device buffer is read only within one step, and a step ends with the sampled token
        back on the host, so the copy need not wait for earlier compute: it overlaps the
        kernels already queued."""
        torch = self.torch
        k = (key, tuple(host.shape), host.dtype)
        dev = self._dev.get(k)
        if dev is None:
            dev = self._dev[k] = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if self.stream is None:  # the dry run
            dev.copy_(host)
            return dev
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
        main.wait_stream(self.stream)
        return dev


def staged_module(inner: Any, stager: Stager, key: Any) -> Any:
    """A layer's table module whose CPU output reaches the GPU through ``stager``: ``inner``
    (a CPU module: engram-peft's in-RAM `MultiHeadEmbedding` or EngramDB's
    `DiskMultiHeadEmbedding`) gathers the rows, they are copied into the pinned buffer and
    moved by the side stream."""
    from torch import nn

    class Staged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: Any) -> Any:
            rows = self.inner(ids)
            host = stager.pinned(key, tuple(rows.shape), rows.dtype)
            host.copy_(rows)
            return stager.to_device(key, host)

    return Staged()


def gpu_table_module(inner: Any, device: Any) -> Any:
    """engram-peft's `MultiHeadEmbedding` with its table in GPU memory, called with the
    model's host ids (moved with the step's other inputs)."""
    from torch import nn

    inner = inner.to(device)

    class OnDevice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: Any) -> Any:
            return self.inner(ids.to(device, non_blocking=True))

    return OnDevice()


def decoder_rows_module(hook: Any, stager: Stager, slot: int) -> Any:
    """The pre-fetched-rows hook on the GPU: ``hook`` (`prefetched_multi_head_embedding`)
    verifies the model's ids against the decoder's fill; when it serves the fill, the layer
    gets the device copy that `before_layer` staged right after the fill (no host copy);
    otherwise (ids the decoder did not fill) its synchronous read is copied over."""
    from torch import nn

    class DecoderRows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hook = hook

        def forward(self, ids: Any) -> Any:
            before = hook.served_prefetched
            rows = hook(ids)
            if hook.served_prefetched == before:
                return rows.to(stager.device)
            dev = stager.last[slot]  # the layer's rows [..., H, rb] on the device
            return dev.view(rows.dtype).reshape(rows.shape)

    return DecoderRows()


def decoder_before_layer(dec: Any, stager: Stager, bufs: dict[str, np.ndarray]) -> Any:
    """``before_layer`` of the GPU decoder arm: fill the layer's rows into a pinned buffer of
    the layer's own (``bufs[layer]``'s shape, `Decoder.layer_shape`: that layer's rows
    alone), then stage it to a device buffer of the layer's own, so the next layer's fill
    and copy never touch memory a queued copy or kernel still reads, and each copy moves
    one layer's bytes."""
    torch = stager.torch
    slot_of = {lay: i for i, lay in enumerate(dec.layers)}

    def before(lay: int) -> None:
        i = slot_of[lay]
        out = stager.pinned_numpy(("out", i), bufs[lay].shape)
        dec.fill(out, layer=lay)
        stager.last[i] = stager.to_device(("dec", i), torch.from_numpy(out))

    return before
