"""LoRALinear: a Linear layer plus, for each token, the low-rank delta of the adapter in that token's slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.layers.linear import Linear
from plait.lora.adapter import LoRAShard, LoRATarget

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LoRAMapping:
    """Which of a step's tokens run which adapter slot (``ForwardBatch.lora_mapping``, made by the runner):
    for each slot in use, the indices of its tokens, or None where that is every token of the step. Tokens
    in no group run the base weights alone."""

    groups: list[tuple[int, torch.Tensor | None]]  # (slot, [t] int64 token indices on the device)


class LoRAContext:
    """The batch the LoRA layers of one model are running: set by the runner around each forward whose
    step has LoRA rows, None otherwise (base steps, graph capture, the profiling step)."""

    def __init__(self) -> None:
        self.batch: ForwardBatch | None = None

    @property
    def mapping(self) -> LoRAMapping | None:
        return None if self.batch is None else self.batch.lora_mapping


class LoRALinear(nn.Module):
    """Wraps a model's Linear from outside (the model's code is unchanged): ``base(x)`` plus, for the
    tokens of each slot in the running batch's LoRAMapping, ``x @ A.T @ B.T`` of that slot's adapter.

    Each slot holds one adapter's pairs for all of this layer's output slices (q/k/v of a fused qkv, or
    gate/up) as one A of ``slices x max_rank`` rows and one block-diagonal B, its scaling folded in; ranks
    below max_rank and slices the adapter leaves alone are zeros, which add exactly nothing. Tokens are
    grouped by slot, not sorted: per slot one gather, two small matmuls and one scatter-add.
    """

    def __init__(self, base: Linear, target: LoRATarget, num_slots: int, max_rank: int,
                 context: LoRAContext) -> None:
        super().__init__()
        if (base.in_features, base.out_features) != (target.in_features, target.out_features):
            raise ValueError(f"a LoRA target of {target.in_features} -> {target.out_features} features "
                             f"cannot wrap a Linear of {base.in_features} -> {base.out_features}")
        self.base = base
        self.target = target
        self.max_rank = max_rank
        self.context = context
        rank_rows = len(target.shards) * max_rank
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        # Not in the state dict: adapters come and go, the model's weights stay the checkpoint's.
        self.register_buffer("lora_a", torch.zeros(num_slots, rank_rows, target.in_features, **like),
                             persistent=False)  # [slots, slices * R, in]
        self.register_buffer("lora_b", torch.zeros(num_slots, target.out_features, rank_rows, **like),
                             persistent=False)  # [slots, out, slices * R]
        starts = [0]
        for _, rows in target.shards:
            starts.append(starts[-1] + rows)
        self._row_starts = starts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        out = self.base(x)
        mapping = self.context.mapping
        if mapping is not None:
            for slot, index in mapping.groups:
                a, b = self.lora_a[slot], self.lora_b[slot]
                if index is None:
                    out += (x @ a.t()) @ b.t()
                else:
                    out.index_add_(0, index, (x.index_select(0, index) @ a.t()) @ b.t())  # [t, out]
        return out

    @torch.no_grad()
    def load_slot(self, slot: int, shards: list[LoRAShard], scaling: float) -> None:
        """Put one adapter's pairs for this layer into ``slot`` (zeros where it has none: no delta)."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for shard in shards:
            cols = slice(shard.index * self.max_rank, shard.index * self.max_rank + shard.a.shape[0])
            rows = slice(self._row_starts[shard.index], self._row_starts[shard.index + 1])
            a[cols] = shard.a.to(device=a.device, dtype=a.dtype)
            b[rows, cols] = (shard.b.float() * scaling).to(device=b.device, dtype=b.dtype)

    # -- the base layer's interface, as the model calls it --------------------------------------------

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def uses_skinny(self, x: torch.Tensor, gate_up: bool = False) -> bool:
        return self.base.uses_skinny(x, gate_up)

    # The fused kernels below skip forward, so the delta: a step with LoRA rows takes the plain path.
    def adds_residual(self, x: torch.Tensor) -> bool:
        return self.context.mapping is None and self.base.adds_residual(x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.forward_add(x, residual)

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        return self.context.mapping is None and self.base.fuses_gate_up_silu(x)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.gate_up_silu(x)

    def fold_norm_weight(self, norm_weight: torch.Tensor) -> None:
        # The adapters' A read the norm's weighted output; a folded weight would change what they see.
        raise RuntimeError("norm weights are not folded into LoRA-wrapped layers")
