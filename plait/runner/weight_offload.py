"""WeightOffload: vLLM's cpu_offload_gb: the first decoder layers' weights kept in (pinned) host memory, each
copied into one device buffer just before its layer runs, in eager steps and CUDA graphs alike."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Each parameter starts at a multiple of this many bytes in the buffers (the kernels' vector loads).
OFFLOAD_ALIGNMENT = 256
GIB = 2**30


def _aligned(n: int) -> int:
    return -(-n // OFFLOAD_ALIGNMENT) * OFFLOAD_ALIGNMENT


def _span(param: torch.Tensor) -> int:
    """The elements a tensor's strides reach: its numel where contiguous (a transposed view keeps its
    layout)."""
    if not param.numel():
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(param.shape, param.stride()))


def _param_offsets(layer: nn.Module) -> tuple[list[tuple[nn.Parameter, int, int]], int]:
    """(parameter, byte offset, bytes) for each of the layer's parameters, and the bytes they take."""
    placed, at = [], 0
    for param in layer.parameters():
        size = _span(param) * param.element_size()
        placed.append((param, at, size))
        at = _aligned(at + size)
    return placed, at


def _place(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s shape and strides over the bytes ``flat`` (uint8), so kernels read it as they read it."""
    return flat.view(param.dtype).as_strided(param.shape, param.stride())


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's decoder layers in the order its forward runs them (``model.model.layers``), if any."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


class WeightOffload:
    """Layers are taken from the first until ``num_bytes`` of weights are offloaded. Each offloaded layer's
    parameters become views of one device buffer, the size of the largest such layer, at the same offsets for
    every layer; a forward pre-hook copies the layer's own bytes from its host copy into that buffer. Steps
    are stream-ordered, so a layer's kernels finish reading the buffer before the next layer's copy
    overwrites it, and a graph captured with the hooks replays the copies too. Every forward so reads the
    offloaded weights over the host link (PCIe): memory for speed, as in vLLM."""

    def __init__(self, model: nn.Module, num_bytes: int, device: torch.device) -> None:
        layers = decoder_layers(model)
        if layers is None:
            raise ValueError(f"cpu_offload_gb: {type(model).__name__} has no decoder layers to offload")
        chosen, offloaded = [], 0
        for layer in layers:
            if offloaded >= num_bytes:
                break
            placed, size = _param_offsets(layer)
            chosen.append((layer, placed, size))
            offloaded += sum(n for _, _, n in placed)
        pin = device.type == "cuda"
        # [largest layer's bytes] uint8: where the running offloaded layer's weights are read from
        self.buffer = torch.empty(max(size for _, _, size in chosen), dtype=torch.uint8, device=device)
        self.host: list[torch.Tensor] = []  # per offloaded layer: [its bytes] uint8, pinned on CUDA
        self._hooks = []
        for layer, placed, size in chosen:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            for param, at, n in placed:
                _place(host[at: at + n], param).copy_(param.data)
                param.data = _place(self.buffer[at: at + n], param)
            self.host.append(host)
            self._hooks.append(layer.register_forward_pre_hook(self._loader(host)))
        self.num_layers = len(chosen)
        self.num_bytes = offloaded  # weight bytes now in host memory
        if pin:
            torch.cuda.empty_cache()  # the layers' device memory, back for the KV cache
        logger.info("cpu_offload_gb: %d of %d layers' weights (%.2f GiB) in host memory, read through a %.2f "
                    "GiB device buffer", self.num_layers, len(layers), offloaded / GIB,
                    self.buffer.numel() / GIB)

    def _loader(self, host: torch.Tensor):
        def load(module: nn.Module, args: tuple) -> None:
            self.buffer[: host.numel()].copy_(host, non_blocking=True)
        return load

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
