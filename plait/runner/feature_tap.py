"""FeatureTap: the hidden states of each step's tokens that an EAGLE or MTP head drafts from, kept by the
target's runner (its final hidden states for EAGLE-1 and MTP, three layers' residual streams for EAGLE-3)."""

from __future__ import annotations

import torch
from torch import nn


class FeatureTap:
    """EAGLE-1 reads the step's output (the hidden states after the final norm); EAGLE-3 reads the residual
    stream entering each of ``layer_ids``, which forward pre-hooks on those layers write into one static
    buffer [max_tokens, 3 x hidden], so that CUDA graphs captured with the hooks replay the writes too."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = (), max_tokens: int = 0) -> None:
        self.buffer: torch.Tensor | None = None
        self._hooks = []
        if not layer_ids:
            return
        layers = model.model.layers
        hidden = model.config.hidden_size
        weight = model.model.norm.weight
        # [max_tokens, len(layer_ids) x hidden]: each tapped layer's input stream, side by side
        self.buffer = torch.zeros(max_tokens, len(layer_ids) * hidden, dtype=weight.dtype,
                                  device=weight.device)
        for j, index in enumerate(layer_ids):
            columns = slice(j * hidden, (j + 1) * hidden)
            self._hooks.append(layers[index].register_forward_pre_hook(self._writer(columns)))

    def _writer(self, columns: slice):
        def write(module: nn.Module, args: tuple) -> None:
            # args: (x [T, hidden], residual [T, hidden] or None at the first layer, ...)
            x, residual = args[0], args[1]
            stream = x if residual is None else x + residual
            self.buffer[: stream.shape[0], columns].copy_(stream)
        return write

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's features [T, F] (hidden: the step's output [T, hidden]): valid until the runner's next
        forward, and in stream order after this one."""
        if self.buffer is None:
            return hidden
        return self.buffer[: hidden.shape[0]]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
