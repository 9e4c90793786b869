"""FusedMoE: the routed experts of a sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5,
DeepSeek, NemotronH), run in one call, and the routers that pick them: softmax top-k (route), DeepSeek-V2's
group-limited greedy (route_group_limited) and DeepSeek-V3's noaux_tc (route_noaux_tc)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import NOAUX_TC_ROUTER, ModelConfig
from plait.kernels.dispatch import use_triton
from plait.layers.linear import deferred_device
from plait.layers.mxfp4 import BLOCK_VALUES, CODES_PER_BYTE, E8M0_BIAS, MXFP4_DTYPE
from plait.layers.wna16 import (
    DUMMY_SCALE_DTYPE,
    WNA16Spec,
    in_group_order,
    pack_rows,
    projection_tensor,
    quantize_rtn,
)

# A checkpoint's per-expert projections -> (stacked parameter, shard of its rows: gate first, then up).
EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
# The same for ungated experts (RELU2_NO_MUL): gate_up_proj holds the up rows alone.
UNGATED_EXPERT_PROJECTIONS = {"up_proj": ("gate_up_proj", 0), "down_proj": ("down_proj", 0)}
# An FP8 expert's tile scales, as block-wise checkpoints name them (DeepSeek / Qwen; compressed-tensors).
SCALE_NAMES = ("weight_scale_inv", "weight_scale")
# The tiles of experts quantised here (--quantization fp8 on a 16-bit checkpoint), as block-wise checkpoints
# keep theirs: per-tile scales follow an expert's weights more closely than one per row or per tensor. Narrow
# experts take fewer rows a tile, so that the up rows start on a tile row (fp8_block.MIN_BLOCK at least).
DEFAULT_FP8_BLOCK = (128, 128)
# The experts' activations (here, not in plait.kernels.fused_moe, so that they import without triton).
SILU = "silu"  # silu(gate) * up: Mixtral, Qwen-MoE
SWIGLU_OAI = "swiglu_oai"  # OpenAI's gpt-oss: plait.kernels.fused_moe.swiglu_oai_ref
# NemotronH's ungated experts, relu(up)^2 (vLLM's name): w13 / gate_up_proj holds the up rows alone.
RELU2_NO_MUL = "relu2_no_mul"
ACTIVATIONS = (SILU, SWIGLU_OAI, RELU2_NO_MUL)
GATED_ACTIVATIONS = (SILU, SWIGLU_OAI)
# gpt-oss's swiglu_alpha and swiglu_limit: transformers' GptOssConfig defaults, as its checkpoints set them.
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0
# FusedMoE.weight_format: how the experts' weights are held.
FLOAT_WEIGHTS = "float"  # the model's dtype
FP8_WEIGHTS = "fp8"  # block-wise FP8 codes with fp32 tile scales (quantize_fp8)
MXFP4_WEIGHTS = "mxfp4"  # packed E2M1 codes with E8M0 scales (use_mxfp4)
INT_WEIGHTS = "int"  # GPTQ / AWQ / compressed-tensors integer codes, group scales and zeros (use_integer)
STACKS = ("gate_up_proj", "down_proj")  # the stacked expert weights, each with its scales (FP8, MXFP4, int)
# fill_random_mxfp4's scale exponents (-8 and -7), drawn uniformly. Uniform code bytes have an RMS of 2.93
# (the root of the mean square of FP4's magnitudes, 8.5625), times an RMS scale of 2^-8 * sqrt((1 + 4) / 2):
# a std of 0.018, about the 0.02 of the random-weights loader's 16-bit draws, so that a random MXFP4 model's
# activations have the random 16-bit model's sizes.
RANDOM_MXFP4_SCALE_EXPONENTS = range(-8, -6)


def up_halves(activation: str) -> int:
    """How many row blocks of the expert width w13 / gate_up_proj stacks: gate and up (2), or up alone (1)."""
    return 2 if activation in GATED_ACTIVATIONS else 1


def default_fp8_block(intermediate_size: int) -> tuple[int, int]:
    """DEFAULT_FP8_BLOCK, its rows halved until they divide the expert width."""
    bn, bk = DEFAULT_FP8_BLOCK
    while intermediate_size % bn and bn > 32:
        bn //= 2
    return bn, bk


@dataclass(frozen=True)
class LocalExperts:
    """Expert parallelism: the routed experts one rank holds, global ids [first, first + count) of the
    ``total`` its router picks among. Entries routed to the others are computed by their ranks (the block's
    output is summed over the ranks afterwards), so here they contribute nothing."""

    first: int
    count: int
    total: int

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed (global) ids as indices into the held experts; an entry routed to an expert held
        elsewhere gets ``count``, one past the held experts (the kernels' dropped id). Elementwise ops only:
        no host sync, CUDA-graph capturable."""
        # topk_ids: [T, k] global ids -> [T, k] local ids, same dtype
        local = topk_ids - self.first
        held = (local >= 0) & (local < self.count)
        return torch.where(held, local, self.count)


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


def route_noaux_tc(router_logits: torch.Tensor, top_k: int, renormalize: bool, correction_bias: torch.Tensor,
                   n_group: int, topk_group: int, routed_scaling_factor: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's "noaux_tc" routing, as GLM-4.5 / GLM-4.6 use it (transformers' Glm4MoeTopkRouter, op for
    op, so that ties break alike): sigmoid scores in fp32; ``correction_bias`` (the checkpoint's
    e_score_correction_bias, learned for load balance) added for choosing experts only; the experts split
    into n_group groups, each scored by the sum of its two best biased scores, the topk_group best groups
    kept; then the top_k experts among theirs. The weights are the chosen experts' unbiased scores,
    renormalised to sum to one where the model says so, times routed_scaling_factor."""
    # router_logits: [T, E]; correction_bias: [E] -> (weights [T, k] fp32, ids [T, k] int64)
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()  # [T, E]
    biased = scores + correction_bias.float()  # [T, E]
    per_group = num_experts // n_group
    group_scores = biased.view(num_tokens, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(num_tokens, num_experts)
    choice = biased.masked_fill(~expert_mask.bool(), float("-inf"))  # [T, E]: other groups' experts out
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]: unbiased
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' guard against 0 / 0
    return weights * routed_scaling_factor, ids


def route_group_limited(router_logits: torch.Tensor, top_k: int, renormalize: bool, n_group: int,
                        topk_group: int, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's "group_limited_greedy" routing (transformers' DeepseekV2TopkRouter, op for op): softmax
    scores in fp32; the experts split into n_group groups, each scored by its best expert, the topk_group best
    groups kept (the others' scores zeroed); the top_k experts of what is left. The weights are their scores,
    renormalised where the model says so (DeepSeek's norm_topk_prob), times routed_scaling_factor."""
    # router_logits: [T, E] -> (weights [T, k] fp32, ids [T, k] int64)
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().softmax(dim=-1)  # [T, E]
    per_group = num_experts // n_group
    group_scores = scores.view(num_tokens, n_group, per_group).max(dim=-1).values  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(num_tokens, num_experts)
    weights, ids = torch.topk(scores.masked_fill(~expert_mask.bool(), 0.0), k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """A ValueError where group-limited routing cannot run on these numbers (the kept groups must hold
    top_k experts)."""
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"group-limited routing: n_group {n_group} must split the {num_experts} routed "
                         "experts into equal groups")
    if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"group-limited routing: topk_group {topk_group} of {n_group} groups cannot hold "
                         f"num_experts_per_tok {top_k} experts")


class GroupRouter(nn.Module):
    """What DeepSeek's routers share (SoftmaxGroupRouter, NoAuxTcRouter): weight [E, H] fp32 whatever the
    model's dtype (model.to(dtype) moves it between devices, never casts it), so that the logits are one fp32
    GEMV with no per-step copy to widen the weight. The loader rounds a checkpoint's router weight to the
    model's dtype, as transformers' 16-bit model holds it, and copies it in: a 16-bit value widened to fp32
    is exact, so the logits are transformers' F.linear(x.float(), weight.float()) to the bit. Then top_k of
    E experts from the topk_group best of n_group groups, the weights times routed_scaling_factor."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, n_group: int,
                 topk_group: int, routed_scaling_factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32,
                                               device=deferred_device()), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        def device_only(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return t.to(device=moved.device) if moved.dtype != t.dtype else moved

        return super()._apply(device_only, recurse)

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, top_k={self.top_k}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}, renormalize={self.renormalize}, "
                f"routed_scaling_factor={self.routed_scaling_factor}")


class SoftmaxGroupRouter(GroupRouter):
    """DeepSeek-V2's router (``mlp.gate``; GroupRouter): "greedy" (a softmax top-k: n_group 1) or
    "group_limited_greedy" (route_group_limited). On the kernels' devices the routing is one Triton launch
    (plait.kernels.fused_moe.moe_route_group_limited: int32 ids), route_group_limited elsewhere."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, n_group: int,
                 topk_group: int, routed_scaling_factor: float) -> None:
        check_groups(num_experts, top_k, n_group, topk_group)
        super().__init__(hidden_size, num_experts, top_k, renormalize, n_group, topk_group,
                         routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> (weights [T, k] fp32, ids [T, k] int32 (kernel) / int64 (torch))
        logits = F.linear(x.float(), self.weight)  # [T, E] fp32
        args = (self.top_k, self.renormalize, self.n_group, self.topk_group, self.routed_scaling_factor)
        if use_triton(x):
            from plait.kernels.fused_moe import moe_route_group_limited

            return moe_route_group_limited(logits, *args)
        return route_group_limited(logits, *args)


def check_noaux_tc(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """A ValueError where noaux_tc routing cannot run on these numbers (each group is scored by its two best
    experts, and the kept groups must hold top_k experts)."""
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"noaux_tc routing: n_group {n_group} must split the {num_experts} routed experts "
                         "into equal groups of at least 2")
    if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"noaux_tc routing: topk_group {topk_group} of {n_group} groups cannot hold "
                         f"num_experts_per_tok {top_k} experts")


# Checkpoint tensors the loader hands over in their own dtype (fp32), not the model's: NoAuxTcRouter's bias.
FP32_ROUTER_TENSORS = ("e_score_correction_bias",)


class NoAuxTcRouter(GroupRouter):
    """A "noaux_tc" MoE block's router (``mlp.gate`` in GLM-4.5's checkpoints): weight [E, H] and
    e_score_correction_bias [E], both fp32 whatever the model's dtype, as transformers keeps the bias
    (_keep_in_fp32_modules_strict) and vLLM both: the biased scores of 128 experts differ in the third
    decimal, and a 16-bit bias would move expert choices (GroupRouter keeps its tensors fp32). On the
    kernels' devices the routing is one Triton launch (plait.kernels.fused_moe.moe_route_noaux_tc: int32
    ids), route_noaux_tc elsewhere."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> NoAuxTcRouter:
        """The router of ``cfg``'s MoE blocks (GLM-4.5's, DeepSeek-V3's, NemotronH's); a ValueError where
        the config names another router."""
        moe = cfg.moe
        if moe.router != NOAUX_TC_ROUTER:
            raise ValueError(f"{cfg.architecture}: router {moe.router!r}, expected {NOAUX_TC_ROUTER!r}")
        return cls(cfg.hidden_size, moe.num_experts, moe.top_k, moe.renormalize, moe.n_group, moe.topk_group,
                   moe.routed_scaling_factor)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, n_group: int,
                 topk_group: int, routed_scaling_factor: float) -> None:
        check_noaux_tc(num_experts, top_k, n_group, topk_group)
        super().__init__(hidden_size, num_experts, top_k, renormalize, n_group, topk_group,
                         routed_scaling_factor)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32, device=deferred_device()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> (weights [T, k] fp32, ids [T, k] int32 (kernel) / int64 (torch))
        logits = F.linear(x.float(), self.weight)  # [T, E] fp32
        args = (self.top_k, self.renormalize, self.e_score_correction_bias, self.n_group, self.topk_group,
                self.routed_scaling_factor)
        if use_triton(x):
            from plait.kernels.fused_moe import moe_route_noaux_tc

            return moe_route_noaux_tc(logits, *args)
        return route_noaux_tc(logits, *args)


def _local_experts(expert_range: tuple[int, int] | None, num_experts: int) -> LocalExperts | None:
    if expert_range is None:
        return None
    first, end = expert_range
    if not 0 <= first < end <= num_experts:
        raise ValueError(f"expert_range {expert_range} is not a range of whole experts among {num_experts}")
    return LocalExperts(first, end - first, num_experts)


class FusedMoE(nn.Module):
    """Every expert's gated MLP as two stacked weights, named as transformers 5 names them:
    gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I].

    activation: "silu" (silu(gate) * up: Mixtral, Qwen-MoE), "swiglu_oai" (OpenAI's gpt-oss, with
    swiglu_alpha and swiglu_limit: plait.kernels.fused_moe.swiglu_oai_ref) or "relu2_no_mul" (NemotronH's
    ungated relu(up)^2: gate_up_proj is then [E, I, H], the up rows alone, as transformers 5's
    ``experts.up_proj``; 16/32-bit weights only). bias=True (gpt-oss) adds
    gate_up_bias [E, 2I] (gate, then up, as gate_up_proj's rows) and down_bias [E, H] after each projection.

    Hub checkpoints hold one tensor per expert and projection (``experts.{e}.gate_proj.weight`` ...):
    load_expert puts each in place, and check_loaded refuses a checkpoint that leaves one out. On CUDA the
    experts run in Triton (plait.kernels.fused_moe, CUDA-graph safe); on CPU through its torch reference,
    which loops over the experts as HF does.

    quantize_fp8 (from outside, by plait.layers.fp8.quantize_model) makes the weights FP8 codes with one fp32
    scale per [bn, bk] tile (gate_up_scale [E, 2I / bn, cdiv(H, bk)], down_scale [E, cdiv(H, bn),
    cdiv(I, bk)]), as block-wise FP8 checkpoints (Qwen3-30B-A3B-FP8) hold them; the experts' inputs are then
    quantised per token and bk-wide group (W8A8, as plait.layers.fp8_block.Fp8BlockLinear).

    use_mxfp4 (from outside, before any weight is loaded) makes them MXFP4 as gpt-oss's checkpoints hold them
    (W4A16): two E2M1 codes a byte along the input dimension (gate_up_proj uint8 [E, 2I, H / 2], down_proj
    [E, H, I / 2]) and an E8M0 scale byte per 32 inputs (gate_up_scale [E, 2I, H / 32], down_scale
    [E, H, I / 32]), decoded inside the kernels' K loops; load_mxfp4 takes each stack whole (or
    fill_random_mxfp4 draws them).

    expert_range (first, end): expert parallelism (plait.parallel.shard). The router still picks among all
    ``num_experts``, but the stacks hold experts [first, end) alone (E above is their count, and
    num_experts then is too), whole; entries routed to the others contribute nothing here (LocalExperts).

    use_integer (from outside, by plait.layers.wna16.quantize_model, before any weight is loaded) makes them
    integer codes as GPTQ / AWQ / compressed-tensors checkpoints hold them (W4A16, W8A16), each expert in
    WNA16Linear's layout (plait.layers.wna16), stacked: gate_up_proj int32 [E, H / pack, 2I] (gate columns,
    then up), down_proj [E, I / pack, H]; gate_up_scale [E, G_H, 2I] and down_scale [E, G_I, H] in the
    checkpoint's dtype; gate_up_zeros / down_zeros the same shapes, zero points. load_expert takes each
    expert's checkpoint tensors (or float weights, quantised round-to-nearest)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, *, activation: str = SILU, bias: bool = False,
                 swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA, swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT,
                 expert_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.local_experts = _local_experts(expert_range, num_experts)
        # The stacks' experts: every one, or under expert parallelism this rank's (checkpoint tensors and
        # load_expert index them from 0 all the same).
        num_held = num_experts if self.local_experts is None else self.local_experts.count
        self.num_experts, self.top_k, self.renormalize = num_held, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        # checkpoint projection -> (stack, row block): gate and up, or up alone (ungated experts)
        gated = activation in GATED_ACTIVATIONS
        self.projections = EXPERT_PROJECTIONS if gated else UNGATED_EXPERT_PROJECTIONS
        up_rows = up_halves(activation) * intermediate_size
        device = deferred_device()
        self.gate_up_proj = nn.Parameter(torch.empty(num_held, up_rows, hidden_size, device=device),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_held, hidden_size, intermediate_size, device=device),
                                      requires_grad=False)
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_held, up_rows, device=device),
                                             requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(num_held, hidden_size, device=device),
                                          requires_grad=False)
        else:
            self.register_parameter("gate_up_bias", None)
            self.register_parameter("down_bias", None)
        self.weight_format = FLOAT_WEIGHTS  # FP8_WEIGHTS: quantize_fp8; MXFP4_WEIGHTS: use_mxfp4; INT_WEIGHTS
        self.int_spec: WNA16Spec | None = None  # integer experts: the checkpoint's scheme (use_integer)
        self.block: tuple[int, int] | None = None  # FP8 tiles (bn, bk); None: 16/32-bit or MXFP4 weights
        self.compute_dtype: torch.dtype | None = None  # FP8, MXFP4: the model's dtype (x and the output)
        # FP8: [E, 2I / bn, cdiv(H, bk)] fp32; MXFP4: [E, 2I, H / 32] uint8 (E8M0)
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)  # FP8: [E, cdiv(H, bn), cdiv(I, bk)]; MXFP4: [E, H, I / 32]
        # int: scales [E, G_H, 2I] and [E, G_I, H], and as shaped the zero points (use_integer)
        self.register_buffer("gate_up_zeros", None)
        self.register_buffer("down_zeros", None)
        self._pieces_loaded: set[tuple[int, str]] = set()  # (expert, projection) the checkpoint filled
        self._stacks_loaded: set[str] = set()  # MXFP4: the STACKS load_mxfp4 (or fill_random_mxfp4) filled

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The experts on route's softmax top-k routing of ``router_logits`` (Mixtral, Qwen-MoE, gpt-oss)."""
        # x: [T, H], router_logits: [T, E] -> [T, H]
        if self._uses_kernels(x):
            from plait.kernels.fused_moe import moe_route

            weights, ids = moe_route(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = route(router_logits, self.top_k, self.renormalize)
        return self.run_routed(x, weights, ids)

    def run_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts on a routing made elsewhere (another router kind: NoAuxTcRouter's)."""
        # x: [T, H], weights: [T, k] fp32, ids: [T, k] int32 / int64 global ids -> [T, H]
        kwargs = self._expert_kwargs()
        if self._uses_kernels(x):
            from plait.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, **kwargs)
        from plait.kernels.fused_moe import fused_moe_ref

        return fused_moe_ref(x, self.gate_up_proj, self.down_proj, weights, ids, **kwargs)

    def _uses_kernels(self, x: torch.Tensor) -> bool:
        fp8_fp32 = self.weight_format == FP8_WEIGHTS and x.dtype == torch.float32  # FP8's kernels: 16-bit x
        return use_triton(x) and not fp8_fp32

    def _expert_kwargs(self) -> dict:
        """fused_moe's (and fused_moe_ref's) keywords beyond the weights: biases, activation, FP8 or MXFP4
        scales."""
        kwargs = dict(w13_bias=self.gate_up_bias, w2_bias=self.down_bias, activation=self.activation,
                      swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit,
                      local_experts=self.local_experts)
        if self.weight_format != FLOAT_WEIGHTS:
            kwargs.update(w13_scale=self.gate_up_scale, w2_scale=self.down_scale, block=self.block)
        if self.weight_format == INT_WEIGHTS:
            kwargs.update(w13_zeros=self.gate_up_zeros, w2_zeros=self.down_zeros, bits=self.int_spec.bits)
        return kwargs

    def _refuse_requantizing(self, to: str) -> None:
        if self.weight_format != FLOAT_WEIGHTS:
            raise ValueError(f"experts already held as {self.weight_format}: they cannot become {to} as well")

    @torch.no_grad()
    def quantize_fp8(self, block: tuple[int, int], device: torch.device | None = None) -> None:
        """Make the experts FP8 with per-tile scales. Weights still on the meta device (deferred_weights)
        become empty codes with NaN scales on ``device``, for the checkpoint or random weights to fill."""
        from plait.layers.fp8 import FP8_DTYPE
        from plait.layers.fp8_block import check_block, quantize_blocks

        bn, bk = check_block(block)
        self._refuse_requantizing(FP8_WEIGHTS)
        if self.gate_up_bias is not None or self.activation != SILU:
            # The FP8 kernels' epilogues have neither (fused_moe refuses them too).
            raise ValueError(f"FP8 experts with biases or the {self.activation!r} activation are not "
                             "implemented")
        if self.intermediate_size % bn:
            raise ValueError(f"expert width {self.intermediate_size} is not a multiple of the {bn}-row FP8 "
                             "blocks: the up projection would not start on a tile row")
        self.weight_format, self.block, self.compute_dtype = FP8_WEIGHTS, (bn, bk), self.gate_up_proj.dtype
        for name in STACKS:
            weight = getattr(self, name)
            e, n, k = weight.shape
            scale = torch.full((e, -(-n // bn), -(-k // bk)), float("nan"), dtype=torch.float32,
                               device=device if weight.is_meta else weight.device)
            codes = torch.zeros((e, n, k), dtype=FP8_DTYPE, device=scale.device)
            if not weight.is_meta:
                for expert in range(e):
                    codes[expert], scale[expert] = quantize_blocks(weight[expert], (bn, bk))
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            self.register_buffer(name.replace("_proj", "_scale"), scale)

    @torch.no_grad()
    def use_mxfp4(self, device: torch.device | None = None) -> None:
        """Hold the experts in MXFP4 (see the class docstring): zero codes and scale bytes, on ``device``
        where the weights are still on the meta device (deferred_weights), for load_mxfp4 or
        fill_random_mxfp4 to fill; check_loaded refuses the experts until both stacks are."""
        self._refuse_requantizing(MXFP4_WEIGHTS)
        if self.activation not in GATED_ACTIVATIONS:
            raise ValueError(f"MXFP4 experts with the {self.activation!r} activation are not implemented")
        if self.hidden_size % BLOCK_VALUES or self.intermediate_size % BLOCK_VALUES:
            raise ValueError(f"MXFP4 experts need the hidden size ({self.hidden_size}) and the expert width "
                             f"({self.intermediate_size}) to be multiples of {BLOCK_VALUES}, the inputs a "
                             "scale covers")
        if self._pieces_loaded:
            raise ValueError("use_mxfp4 comes before any expert weight is loaded")
        self.weight_format, self.compute_dtype = MXFP4_WEIGHTS, self.gate_up_proj.dtype
        for name in STACKS:
            weight = getattr(self, name)
            e, rows, k = weight.shape
            where = device if weight.is_meta else weight.device
            codes = torch.zeros((e, rows, k // CODES_PER_BYTE), dtype=MXFP4_DTYPE, device=where)
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            scale = torch.zeros((e, rows, k // BLOCK_VALUES), dtype=MXFP4_DTYPE, device=where)
            self.register_buffer(name.replace("_proj", "_scale"), scale)

    @torch.no_grad()
    def use_integer(self, spec: WNA16Spec, device: torch.device | None = None,
                    scale_dtype: torch.dtype = DUMMY_SCALE_DTYPE) -> None:
        """Hold the experts as integer codes (see the class docstring): zero codes, NaN scales (check_loaded
        refuses any left so) and the implied zero points, on ``device`` where the weights are still on the
        meta device (deferred_weights), for load_expert to fill. The scales take the checkpoint's dtype when
        its first arrive (``scale_dtype`` until then: random weights')."""
        self._refuse_requantizing(INT_WEIGHTS)
        if self.gate_up_bias is not None or self.activation != SILU:
            raise ValueError(f"integer experts with biases or the {self.activation!r} activation are not "
                             "implemented")
        if self._pieces_loaded:
            raise ValueError("use_integer comes before any expert weight is loaded")
        for k in (self.hidden_size, self.intermediate_size):
            rows = spec.group_rows(k)
            if k % rows or rows % spec.pack:
                raise ValueError(f"integer experts: {k} inputs do not split into {rows}-row groups of "
                                 f"{spec.pack} codes a word")
        self.weight_format, self.int_spec, self.compute_dtype = INT_WEIGHTS, spec, self.gate_up_proj.dtype
        for name in STACKS:
            weight = getattr(self, name)
            e, n, k = weight.shape
            where = device if weight.is_meta else weight.device
            codes = torch.zeros((e, k // spec.pack, n), dtype=torch.int32, device=where)
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            groups = spec.groups(k)
            scale = torch.full((e, groups, n), float("nan"), dtype=scale_dtype, device=where)
            self.register_buffer(name.replace("_proj", "_scale"), scale)
            zeros = torch.full((e, groups, n), 1 << (spec.bits - 1), dtype=spec.zero_dtype(), device=where)
            self.register_buffer(name.replace("_proj", "_zeros"), zeros)

    @torch.no_grad()
    def load_mxfp4(self, stacked: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """A whole stack of MXFP4 experts, rows in this module's order (gate_up_proj: each expert's gate
        rows, then its up rows): blocks uint8 [E, rows, K / 32, 16] (a checkpoint's ``_blocks``), scales
        uint8 [E, rows, K / 32] (its ``_scales``)."""
        if self.weight_format != MXFP4_WEIGHTS:
            raise ValueError(f"MXFP4 tensors for experts held as {self.weight_format} (use_mxfp4 first)")
        if stacked not in STACKS:
            raise ValueError(f"no stacked expert weight {stacked!r}: one of {STACKS}")
        codes, scale = getattr(self, stacked), getattr(self, stacked.replace("_proj", "_scale"))
        want_blocks = (*scale.shape, BLOCK_VALUES // CODES_PER_BYTE)
        for name, got, want in (("blocks", blocks, want_blocks), ("scales", scales, tuple(scale.shape))):
            if got.dtype != MXFP4_DTYPE or tuple(got.shape) != want:
                raise ValueError(f"MXFP4 {stacked} {name}: expected {MXFP4_DTYPE} {list(want)}, got "
                                 f"{got.dtype} {list(got.shape)}")
        codes.copy_(blocks.reshape(codes.shape))
        scale.copy_(scales)
        self._stacks_loaded.add(stacked)

    @torch.no_grad()
    def fill_random_mxfp4(self, generator: torch.Generator | None = None) -> None:
        """Random MXFP4 experts (the random-weights loader's): uniform code bytes, and scale exponents drawn
        from RANDOM_MXFP4_SCALE_EXPONENTS, so that the weights' std is about 0.02."""
        if self.weight_format != MXFP4_WEIGHTS:
            raise ValueError(f"random MXFP4 weights for experts held as {self.weight_format} "
                             "(use_mxfp4 first)")
        exps = RANDOM_MXFP4_SCALE_EXPONENTS
        for stacked in STACKS:
            getattr(self, stacked).random_(0, 1 << 8, generator=generator)  # every byte: two uniform codes
            scale = getattr(self, stacked.replace("_proj", "_scale"))
            scale.random_(E8M0_BIAS + exps.start, E8M0_BIAS + exps.stop, generator=generator)
            self._stacks_loaded.add(stacked)

    @torch.no_grad()
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, kind: str = "weight") -> None:
        """One expert's gate_proj / up_proj / down_proj tensor (HF layout: [out, in]): its weight (``kind``
        "weight"; 16-bit weights of an FP8 block are quantised here, FP8 codes kept) or, for FP8 codes, its
        tile scales (``kind`` one of SCALE_NAMES: [rows / bn, cdiv(in, bk)])."""
        if not 0 <= expert < self.num_experts or projection not in self.projections:
            raise ValueError(f"no expert tensor {expert}.{projection} among {self.num_experts} experts")
        if self.weight_format == MXFP4_WEIGHTS:
            raise ValueError("MXFP4 experts load each stack whole, as packed codes (load_mxfp4)")
        if self.weight_format == INT_WEIGHTS:
            self._load_int(expert, projection, tensor, kind)
            return
        stacked, shard = self.projections[projection]
        rows = self.intermediate_size if stacked == "gate_up_proj" else self.hidden_size
        dst = getattr(self, stacked)[expert, shard * rows:(shard + 1) * rows]
        if kind in SCALE_NAMES:
            self._load_scale(expert, stacked, shard, rows, tensor)
            return
        if dst.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {projection} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        if self.block is not None and tensor.dtype != dst.dtype:
            from plait.layers.fp8_block import quantize_blocks

            codes, scale = quantize_blocks(tensor, self.block)
            dst.copy_(codes)
            self._load_scale(expert, stacked, shard, rows, scale)
        else:
            dst.copy_(tensor)
        self._pieces_loaded.add((expert, projection))

    def _int_columns(self, projection: str) -> tuple[str, int, int, slice]:
        """An integer expert projection's stack, its input count, its output count and its columns there."""
        stacked, shard = EXPERT_PROJECTIONS[projection]
        gate_up = stacked == "gate_up_proj"
        in_features = self.hidden_size if gate_up else self.intermediate_size
        n = self.intermediate_size if gate_up else self.hidden_size
        return stacked, in_features, n, slice(shard * n, (shard + 1) * n)

    def _load_int(self, expert: int, projection: str, tensor: torch.Tensor, kind: str) -> None:
        """One expert projection's checkpoint tensor (plait.layers.wna16.projection_tensor's names) into its
        columns of the integer stacks."""
        stacked, in_features, n, cols = self._int_columns(projection)
        if kind == "weight":  # as WNA16Linear refuses one: a checkpoint's 16-bit weight is no integer layer's
            raise ValueError(f"a 16-bit weight for expert {expert}'s {projection} in a "
                             f"{self.int_spec.method.upper()} checkpoint: experts left unquantised are not "
                             "supported")
        part, value = projection_tensor(self.int_spec, kind, tensor, in_features, n,
                                        groups=self.int_spec.groups(in_features))
        scale = getattr(self, stacked.replace("_proj", "_scale"))  # [E, G, N]
        if part == "codes":
            getattr(self, stacked)[expert, :, cols] = value
            self._pieces_loaded.add((expert, projection))
        elif part == "scales":
            if value.dtype != scale.dtype and torch.isnan(scale).all():
                scale = scale.to(value.dtype)  # keep the checkpoint's precision
                self.register_buffer(stacked.replace("_proj", "_scale"), scale)
            scale[expert, :, cols] = value.to(scale.dtype)
        elif part == "zeros":
            zeros = getattr(self, stacked.replace("_proj", "_zeros"))
            zeros[expert, :, cols] = value.to(zeros.dtype)
        elif part == "g_idx" and not in_group_order(value, self.int_spec):
            raise ValueError(f"GPTQ act-order (desc_act) MoE experts are not supported: expert {expert}'s "
                             f"{projection} has its input rows out of group order (g_idx); serve a "
                             "checkpoint quantised without desc_act")

    @torch.no_grad()
    def quantize_expert(self, stacked: str, expert: int, weight: torch.Tensor) -> None:
        """Integer experts: one expert's whole float gate_up_proj ([2I, H]: gate rows, then up) or down_proj
        ([H, I]), quantised round-to-nearest as the checkpoint's scheme would (random weights)."""
        if self.weight_format != INT_WEIGHTS:
            raise ValueError(f"quantize_expert is for integer experts, not {self.weight_format} ones")
        for projection, (target, shard) in EXPERT_PROJECTIONS.items():
            if target != stacked:
                continue
            _, in_features, n, cols = self._int_columns(projection)
            rows = weight[shard * n:(shard + 1) * n]  # [n, in]
            if tuple(rows.shape) != (n, in_features):
                raise ValueError(f"expert {expert}'s {projection} of shape {tuple(rows.shape)}, expected "
                                 f"{(n, in_features)}")
            scale = getattr(self, stacked.replace("_proj", "_scale"))
            zeros = getattr(self, stacked.replace("_proj", "_zeros"))
            codes, scale[expert, :, cols], z = quantize_rtn(rows, self.int_spec, scale.dtype)
            getattr(self, stacked)[expert, :, cols] = pack_rows(codes, self.int_spec.bits)
            zeros[expert, :, cols] = z.to(zeros.dtype)
            self._pieces_loaded.add((expert, projection))

    def load_stacked(self, stacked: str, expert: int, tensor: torch.Tensor) -> None:
        """One expert's whole gate_up_proj ([2I, H]: gate rows, then up; ungated: [I, H]) or down_proj
        ([H, I]), as transformers 5 stacks them (and random weights are drawn), through load_expert."""
        for projection, (target, shard) in self.projections.items():
            if target == stacked:
                rows = tensor.shape[0] // (up_halves(self.activation) if stacked == "gate_up_proj" else 1)
                self.load_expert(expert, projection, tensor[shard * rows:(shard + 1) * rows])

    def _load_scale(self, expert: int, stacked: str, shard: int, rows: int, scale: torch.Tensor) -> None:
        if self.block is None:
            raise ValueError("FP8 scales for experts that are not FP8")
        bn = self.block[0]
        tiles = slice(shard * rows // bn, -(-(shard + 1) * rows // bn))
        dst = getattr(self, stacked.replace("_proj", "_scale"))[expert, tiles]
        if tuple(scale.shape) != tuple(dst.shape):
            raise ValueError(f"expert block scales of shape {tuple(scale.shape)}: expected "
                             f"{tuple(dst.shape)} (blocks {list(self.block)})")
        dst.copy_(scale.float())

    def check_loaded(self) -> None:
        """After loading per-expert tensors: every expert got all three (a stacked checkpoint skips this),
        FP8 codes their scales, and MXFP4 experts both stacks."""
        if self._pieces_loaded:
            missing = [(e, p) for e in range(self.num_experts) for p in self.projections
                       if (e, p) not in self._pieces_loaded]
            if missing:
                raise ValueError(f"checkpoint is missing {len(missing)} expert tensors, e.g. {missing[:4]}")
        scales = (self.gate_up_scale, self.down_scale)
        if self.block is not None and any(torch.isnan(s).any() for s in scales):
            raise ValueError("FP8 expert weights came without their block scales (weight_scale_inv)")
        if self.weight_format == INT_WEIGHTS and any(torch.isnan(s.float()).any() for s in scales):
            raise ValueError(f"{self.int_spec.method.upper()} experts came without the scales of some "
                             "columns")
        missing_stacks = [name for name in STACKS if name not in self._stacks_loaded]
        if self.weight_format == MXFP4_WEIGHTS and missing_stacks:
            raise ValueError(f"MXFP4 experts without their {' and '.join(missing_stacks)} (load_mxfp4)")

    def extra_repr(self) -> str:
        kind = ""
        if self.weight_format == FP8_WEIGHTS:
            kind = f", fp8 scales per {self.block[0]}x{self.block[1]} block"
        elif self.weight_format == MXFP4_WEIGHTS:
            kind = f", mxfp4 (e8m0 scales per {BLOCK_VALUES} inputs)"
        elif self.weight_format == INT_WEIGHTS:
            spec = self.int_spec
            group = f"groups of {spec.group_size}" if spec.group_size else "one group a column"
            kind = f", {spec.method} {spec.bits}-bit ({group})"
        act = self.activation
        if act == SWIGLU_OAI:
            act += f"(alpha={self.swiglu_alpha}, limit={self.swiglu_limit})"
        held, experts = self.local_experts, f"{self.num_experts}"
        if held is not None:
            experts = f"{held.first}..{held.first + held.count - 1} of {held.total}"
        return (f"experts={experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, activation={act}, "
                f"bias={self.gate_up_bias is not None}{kind}")
