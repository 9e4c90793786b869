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
# An FP8 expert's tile scales, as block-wise checkpoints name them (DeepSeek / Qwen; compressed-tensors).
SCALE_NAMES = ("weight_scale_inv", "weight_scale")
# The tiles of experts quantised here (--quantization fp8 on a 16-bit checkpoint), as block-wise checkpoints
# keep theirs: per-tile scales follow an expert's weights more closely than one per row or per tensor. Narrow
# experts take fewer rows a tile, so that the up rows start on a tile row (fp8_block.MIN_BLOCK at least).
DEFAULT_FP8_BLOCK = (128, 128)
# The experts' activations (here, not in plait.kernels.fused_moe, so that they import without triton).
SILU = "silu"  # silu(gate) * up: Mixtral, Qwen-MoE
SWIGLU_OAI = "swiglu_oai"  # OpenAI's gpt-oss: plait.kernels.fused_moe.swiglu_oai_ref
ACTIVATIONS = (SILU, SWIGLU_OAI)
# gpt-oss's swiglu_alpha and swiglu_limit: transformers' GptOssConfig defaults, as its checkpoints set them.
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0


def default_fp8_block(intermediate_size: int) -> tuple[int, int]:
    """DEFAULT_FP8_BLOCK, its rows halved until they divide the expert width."""
    bn, bk = DEFAULT_FP8_BLOCK
    while intermediate_size % bn and bn > 32:
        bn //= 2
    return bn, bk


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
    """Every expert's gated MLP as two stacked weights, named as transformers 5 names them:
    gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I].

    activation: "silu" (silu(gate) * up: Mixtral, Qwen-MoE) or "swiglu_oai" (OpenAI's gpt-oss, with
    swiglu_alpha and swiglu_limit: plait.kernels.fused_moe.swiglu_oai_ref). bias=True (gpt-oss) adds
    gate_up_bias [E, 2I] (gate, then up, as gate_up_proj's rows) and down_bias [E, H] after each projection.

    Hub checkpoints hold one tensor per expert and projection (``experts.{e}.gate_proj.weight`` ...):
    load_expert puts each in place, and check_loaded refuses a checkpoint that leaves one out. On CUDA the
    experts run in Triton (plait.kernels.fused_moe, CUDA-graph safe); on CPU through its torch reference,
    which loops over the experts as HF does.

    quantize_fp8 (from outside, by plait.layers.fp8.quantize_model) makes the weights FP8 codes with one fp32
    scale per [bn, bk] tile (gate_up_scale [E, 2I / bn, cdiv(H, bk)], down_scale [E, cdiv(H, bn),
    cdiv(I, bk)]), as block-wise FP8 checkpoints (Qwen3-30B-A3B-FP8) hold them; the experts' inputs are then
    quantised per token and bk-wide group (W8A8, as plait.layers.fp8_block.Fp8BlockLinear)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, *, activation: str = SILU, bias: bool = False,
                 swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA, swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT
                 ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        device = deferred_device()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, device=device),
                                      requires_grad=False)
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, device=device),
                                             requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size, device=device),
                                          requires_grad=False)
        else:
            self.register_parameter("gate_up_bias", None)
            self.register_parameter("down_bias", None)
        self.block: tuple[int, int] | None = None  # FP8 tiles (bn, bk); None: 16/32-bit weights
        self.compute_dtype: torch.dtype | None = None  # FP8: the model's dtype (x and the output)
        self.register_buffer("gate_up_scale", None)  # FP8: [E, 2I / bn, cdiv(H, bk)] fp32
        self.register_buffer("down_scale", None)  # FP8: [E, cdiv(H, bn), cdiv(I, bk)] fp32
        self._pieces_loaded: set[tuple[int, str]] = set()  # (expert, projection) the checkpoint filled

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # x: [T, H], router_logits: [T, E] -> [T, H]
        kwargs = self._expert_kwargs()
        if use_triton(x) and (self.block is None or x.dtype in (torch.bfloat16, torch.float16)):
            from plait.kernels.fused_moe import fused_moe, moe_route

            weights, ids = moe_route(router_logits, self.top_k, self.renormalize)
            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, **kwargs)
        from plait.kernels.fused_moe import fused_moe_ref

        weights, ids = route(router_logits, self.top_k, self.renormalize)
        return fused_moe_ref(x, self.gate_up_proj, self.down_proj, weights, ids, **kwargs)

    def _expert_kwargs(self) -> dict:
        """fused_moe's (and fused_moe_ref's) keywords beyond the weights: biases, activation, FP8 scales."""
        kwargs = dict(w13_bias=self.gate_up_bias, w2_bias=self.down_bias, activation=self.activation,
                      swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        if self.block is not None:
            kwargs.update(w13_scale=self.gate_up_scale, w2_scale=self.down_scale, block=self.block)
        return kwargs

    @torch.no_grad()
    def quantize_fp8(self, block: tuple[int, int], device: torch.device | None = None) -> None:
        """Make the experts FP8 with per-tile scales. Weights still on the meta device (deferred_weights)
        become empty codes with NaN scales on ``device``, for the checkpoint or random weights to fill."""
        from plait.layers.fp8 import FP8_DTYPE
        from plait.layers.fp8_block import check_block, quantize_blocks

        bn, bk = check_block(block)
        if self.gate_up_bias is not None or self.activation != SILU:
            # The FP8 kernels' epilogues have neither (fused_moe refuses them too).
            raise ValueError(f"FP8 experts with biases or the {self.activation!r} activation are not "
                             "implemented")
        if self.intermediate_size % bn:
            raise ValueError(f"expert width {self.intermediate_size} is not a multiple of the {bn}-row FP8 "
                             "blocks: the up projection would not start on a tile row")
        self.block, self.compute_dtype = (bn, bk), self.gate_up_proj.dtype
        for name in ("gate_up_proj", "down_proj"):
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
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, kind: str = "weight") -> None:
        """One expert's gate_proj / up_proj / down_proj tensor (HF layout: [out, in]): its weight (``kind``
        "weight"; 16-bit weights of an FP8 block are quantised here, FP8 codes kept) or, for FP8 codes, its
        tile scales (``kind`` one of SCALE_NAMES: [rows / bn, cdiv(in, bk)])."""
        if not 0 <= expert < self.num_experts or projection not in EXPERT_PROJECTIONS:
            raise ValueError(f"no expert tensor {expert}.{projection} among {self.num_experts} experts")
        stacked, shard = EXPERT_PROJECTIONS[projection]
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

    def load_stacked(self, stacked: str, expert: int, tensor: torch.Tensor) -> None:
        """One expert's whole gate_up_proj ([2I, H]: gate rows, then up) or down_proj ([H, I]), as
        transformers 5 stacks them (and random weights are drawn), through load_expert."""
        for projection, (target, shard) in EXPERT_PROJECTIONS.items():
            if target == stacked:
                rows = tensor.shape[0] // (2 if stacked == "gate_up_proj" else 1)
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
        and FP8 codes their scales."""
        if self._pieces_loaded:
            missing = [(e, p) for e in range(self.num_experts) for p in EXPERT_PROJECTIONS
                       if (e, p) not in self._pieces_loaded]
            if missing:
                raise ValueError(f"checkpoint is missing {len(missing)} expert tensors, e.g. {missing[:4]}")
        scales = (self.gate_up_scale, self.down_scale)
        if self.block is not None and any(torch.isnan(s).any() for s in scales):
            raise ValueError("FP8 expert weights came without their block scales (weight_scale_inv)")

    def extra_repr(self) -> str:
        kind = f", fp8 scales per {self.block[0]}x{self.block[1]} block" if self.block else ""
        act = self.activation
        if act == SWIGLU_OAI:
            act += f"(alpha={self.swiglu_alpha}, limit={self.swiglu_limit})"
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, activation={act}, "
                f"bias={self.gate_up_bias is not None}{kind}")
