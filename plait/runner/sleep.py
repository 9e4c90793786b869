"""Sleep mode's storage: device tensors whose memory is handed back and taken again (vLLM's LLM.sleep)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# vLLM's sleep levels: 1 parks the weights in host memory, 2 drops them (load_weights brings new ones); both
# drop the KV cache, whose contents are forgotten.
SLEEP_OFFLOAD_WEIGHTS = 1
SLEEP_DISCARD_WEIGHTS = 2
SLEEP_LEVELS = (SLEEP_OFFLOAD_WEIGHTS, SLEEP_DISCARD_WEIGHTS)
# What wake_up(tags=...) may bring back, as vLLM names it.
WAKE_TAGS = ("weights", "kv_cache")

# Builds a dropped tensor again (its shape, dtype, device): zeros.
Allocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class ReleasableTensors:
    """Tensors whose storage can be let go and taken back while each tensor object stays the same: every
    module, list and closure that holds one sees its new storage (``tensor.data`` is swapped). A tensor is
    parked (copied to host memory, pinned on a GPU, and copied back) or dropped (zeros when taken back).
    CUDA graphs hold the old addresses: their owner captures them again after ``take_back``."""

    def __init__(self, tensors: Iterable[torch.Tensor], allocate: Allocate = _zeros) -> None:
        unique = {id(t): t for t in tensors}  # tied weights: one tensor, reached twice
        self.tensors = list(unique.values())
        self._allocate = allocate
        # Per tensor while released: its host copy (parked) or None (dropped), and its shape.
        self._held: list[tuple[torch.Tensor | None, tuple[int, ...]]] | None = None

    @property
    def released(self) -> bool:
        return self._held is not None

    @property
    def parked(self) -> bool:
        """Released with host copies (take_back restores the values)."""
        return self._held is not None and any(host is not None for host, _ in self._held)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def release(self, keep: Callable[[torch.Tensor], bool]) -> None:
        """Let go of every tensor's storage, parking a copy of those ``keep`` accepts in host memory. Already
        released: forget the copies of those it refuses (a deeper sleep after a lighter one)."""
        if self._held is not None:
            self._held = [(host if keep(t) else None, shape)
                          for t, (host, shape) in zip(self.tensors, self._held)]
            return
        held = []
        for t in self.tensors:
            host = None
            if keep(t):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                host.copy_(t, non_blocking=t.is_cuda)
            held.append((host, tuple(t.shape)))
        if any(t.is_cuda for t in self.tensors):
            torch.cuda.synchronize()  # the copies land before their sources go
        for t in self.tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._held = held

    def take_back(self) -> None:
        """Storage again for every tensor: its parked values, or zeros."""
        if self._held is None:
            return
        for t, (host, shape) in zip(self.tensors, self._held):
            if host is None:
                t.data = self._allocate(shape, t.dtype, t.device)
            else:
                t.data = host.to(t.device, non_blocking=True)
        if any(t.is_cuda for t in self.tensors):
            torch.cuda.synchronize()  # the pinned copies are freed below, so they must have landed
        self._held = None


def module_tensors(model: torch.nn.Module, device: torch.device) -> tuple[list[torch.Tensor], set[int]]:
    """Every tensor on ``device`` that the model's modules hold: parameters, buffers and plain tensor
    attributes (rotary tables); and the ids of those that are parameters (the checkpoint's weights)."""
    tensors, params = [], set()
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                tensors.append(p)
                params.add(id(p))
        tensors += [b for b in module._buffers.values() if b is not None]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return [t for t in tensors if t.device.type == device.type], params
