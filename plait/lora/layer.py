"""LoRALinear: a Linear layer plus, for each token, the low-rank delta of the adapter in that token's slot."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.layers.fp8 import Fp8Linear
from plait.layers.linear import Linear
from plait.lora.adapter import LoRAShard, LoRATarget

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch


class LoRAContext:
    """The batch the LoRA layers of one model are running: set by the runner around each forward that may
    have LoRA tokens (eager steps with an adapter's rows, every CUDA-graph capture, the profiling step),
    None otherwise. The layers read each token's slot from ``batch.lora_slots``."""

    def __init__(self) -> None:
        self._batch: ForwardBatch | None = None
        self._own: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def batch(self) -> ForwardBatch | None:
        return self._batch

    @batch.setter
    def batch(self, batch: ForwardBatch | None) -> None:
        self._batch, self._own = batch, {}

    def own_columns(self, column_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, columns] 1 where a column's slot is the token's own, else 0: made once a forward per column
        layout (the layers of one kind share it), not once a layer."""
        key = (column_slot.shape[0], dtype)
        own = self._own.get(key)
        if own is None:
            own = self._own[key] = (self._batch.lora_slots[:, None] == column_slot).to(dtype)
        return own


class LoRALinear(nn.Module):
    """Wraps a model's Linear from outside (the model's code is unchanged): ``base(x)`` plus, for each token
    of the running batch, ``x @ A.T @ B.T`` of the adapter in the token's slot (``batch.lora_slots``).

    Each slot holds one adapter's pairs for all of this layer's output slices (q/k/v of a fused qkv, or
    gate/up; one slice spanning the layer where adapters name the fused layer itself: Phi-3) as one A of
    ``slices x max_rank`` rows and one block-diagonal B, its scaling folded in; ranks below max_rank and
    slices the adapter leaves alone are zeros, which add exactly nothing. Every token
    goes through every slot's A at once, the columns of slots other than its own are zeroed, and one
    matmul with every slot's B side by side adds its own adapter's delta: shapes depend on the token
    count alone, so the step can be captured in a CUDA graph, and a token's delta is the same whatever
    slots its neighbours use (a base token's is exactly zero). The cost, slots x rank extra columns, is
    small beside the layer's own matmul at the slot counts served (vLLM's default max_loras is 1).
    """

    def __init__(self, base: Linear | Fp8Linear, target: LoRATarget, num_slots: int, max_rank: int,
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
        # An FP8 base (--quantization fp8) keeps 16-bit adapters: they read x unquantised, as in vLLM.
        like = {"dtype": getattr(base, "compute_dtype", base.weight.dtype), "device": base.weight.device}
        # Not in the state dict: adapters come and go, the model's weights stay the checkpoint's.
        self.register_buffer("lora_a", torch.zeros(num_slots, rank_rows, target.in_features, **like),
                             persistent=False)  # [slots, slices * R, in]
        # B with the slots side by side along its columns, so that one matmul takes every slot's.
        self.register_buffer("lora_b", torch.zeros(target.out_features, num_slots, rank_rows, **like),
                             persistent=False)  # [out, slots, slices * R]
        # The slot each column of the concatenated A's output belongs to.
        self.register_buffer("column_slot", torch.arange(num_slots * rank_rows, device=base.weight.device)
                             // rank_rows, persistent=False)  # [slots * slices * R] int64
        starts = [0]
        for _, rows in target.shards:
            starts.append(starts[-1] + rows)
        self._row_starts = starts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        out = self.base(x)
        if self.context.batch is not None:
            slots, rank_rows = self.lora_a.shape[:2]
            h = x @ self.lora_a.view(slots * rank_rows, -1).t()  # [T, slots * slices * R]
            h.mul_(self.context.own_columns(self.column_slot, h.dtype))  # other slots' columns -> 0
            out.addmm_(h, self.lora_b.view(self.out_features, -1).t())  # [T, out]
        return out

    @torch.no_grad()
    def load_slot(self, slot: int, shards: list[LoRAShard], scaling: float) -> None:
        """Put one adapter's pairs for this layer into ``slot`` (zeros where it has none: no delta)."""
        a, b = self.lora_a[slot], self.lora_b[:, slot]  # [slices * R, in], [out, slices * R]
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

    # The fused kernels below skip forward, so the delta: a step with LoRA rows takes the plain path.
    def adds_residual(self, x: torch.Tensor) -> bool:
        return self.context.batch is None and self.base.adds_residual(x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.forward_add(x, residual)

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        return self.context.batch is None and self.base.fuses_gate_up_silu(x)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.gate_up_silu(x)

    def fold_norm_weight(self, norm_weight: torch.Tensor) -> None:
        # The adapters' A read the norm's weighted output; a folded weight would change what they see.
        raise RuntimeError("norm weights are not folded into LoRA-wrapped layers")
