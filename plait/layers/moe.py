"""FusedMoE: the routed experts of a sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE), run in one call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.dispatch import use_triton
from plait.layers.linear import deferred_device

# A checkpoint's per-expert projections -> (stacked parameter, shard of its rows: gate first, then up).
EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts and their weights, as HF's routers compute them: a softmax over every
    expert in fp32, the top_k probabilities, renormalised to sum to one where the model says so
    (Mixtral always; Qwen-MoE by norm_topk_prob)."""
    # router_logits: [T, E] -> (weights [T, k] fp32, ids [T, k] int64)
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """Every expert's SiLU-gated MLP as two stacked weights, named as transformers 5 names them:
    gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I].

    Hub checkpoints hold one tensor per expert and projection (``experts.{e}.gate_proj.weight`` ...):
    load_expert puts each in place, and check_loaded refuses a checkpoint that leaves one out. On CUDA the
    experts run as two grouped Triton GEMMs over the tokens sorted by expert (plait.kernels.fused_moe,
    CUDA-graph safe); on CPU through its torch reference, which loops over the experts as HF does."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        device = deferred_device()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, device=device),
                                      requires_grad=False)
        self._pieces_loaded: set[tuple[int, str]] = set()  # (expert, projection) the checkpoint filled

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # x: [T, H], router_logits: [T, E] -> [T, H]
        if use_triton(x):
            from plait.kernels.fused_moe import fused_moe, moe_route

            weights, ids = moe_route(router_logits, self.top_k, self.renormalize)
            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)
        from plait.kernels.fused_moe import fused_moe_ref

        weights, ids = route(router_logits, self.top_k, self.renormalize)

        return fused_moe_ref(x, self.gate_up_proj, self.down_proj, weights, ids)

    @torch.no_grad()
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """Copy one expert's gate_proj / up_proj / down_proj weight (HF layout: [out, in]) into place."""
        if not 0 <= expert < self.num_experts or projection not in EXPERT_PROJECTIONS:
            raise ValueError(f"no expert tensor {expert}.{projection} among {self.num_experts} experts")
        stacked, shard = EXPERT_PROJECTIONS[projection]
        rows = self.intermediate_size if stacked == "gate_up_proj" else self.down_proj.shape[1]
        dst = getattr(self, stacked)[expert, shard * rows:(shard + 1) * rows]
        if dst.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {projection} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self._pieces_loaded.add((expert, projection))

    def check_loaded(self) -> None:
        """After loading per-expert tensors: every expert got all three (a stacked checkpoint skips this)."""
        if not self._pieces_loaded:
            return
        missing = [(e, p) for e in range(self.num_experts) for p in EXPERT_PROJECTIONS
                   if (e, p) not in self._pieces_loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} expert tensors, e.g. {missing[:4]}")
