"""FP8 quantisation (W8A8): Fp8Linear, and the pass that swaps it in for a model's Linear layers."""

# vLLM's `--quantization fp8` on an unquantised checkpoint: every linear layer but the lm_head keeps its
# weight as float8_e4m3fn codes with one fp32 scale per output row (amax / 448), half the bytes of bf16,
# and each matmul quantises its input the same way per token (dynamic per-token scales, as vLLM's
# fp8 on Hopper), so the product runs on FP8 tensor cores: x @ W^T = sx[m] * sw[n] * (codes_x @ codes_w^T),
# the code products summed in fp32. A token's scale depends on that token alone, so every row of a batch
# computes the same function whatever else is in the step. The kernels are plait.kernels.fp8_gemm; off
# CUDA the same arithmetic runs in torch (fp32 on the dequantised codes).

from __future__ import annotations

import json
import re

import torch
from torch import nn

from plait.config import QUANTIZATION_METHODS
from plait.kernels.dispatch import use_triton
from plait.layers.linear import linear
from plait.layers.moe import FusedMoE, default_fp8_block

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INV_FP8_MAX = 1.0 / FP8_MAX  # (rounded to fp32 where it multiplies an fp32 tensor)
# A row of zeros still gets a positive scale, so that dequantising never divides by zero.
MIN_SCALE = 1e-12
# Layers left in 16 bits: the lm_head (the logits' precision; tied to the embedding in some models) and a MoE
# block's routers (tiny; their logits pick the experts), as vLLM and the FP8 MoE checkpoints keep them.
SKIPPED_LAYERS = ("lm_head", "gate", "shared_expert_gate")
# Dtypes whose matmuls take the CUDA kernels (cuBLASLt's FP8 GEMM writes bf16; fp16 is rounded from it).
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


# Checkpoint tensors FP8 checkpoints carry beside their weights that no layer takes: static input scales
# (plait quantises every input per token, at least as fine as one scale per tensor) and FP8 KV-cache scales
# (k_scale / v_scale, or the older k_proj / v_proj output_scale), which the loader hands to an FP8 KV cache
# (plait.loader.model_loader) and which are unused by a cache in the model's dtype.
UNUSED_CHECKPOINT_SCALES = ("input_scale", "k_scale", "v_scale", "output_scale")
# Checkpoint layers left unquantised that plait can honour: those it leaves in 16 bits anyway.
IGNORABLE = {"lm_head", "re:.*lm_head"}
# ... and the MoE routers it keeps in 16 bits (Qwen's FP8 MoE checkpoints list every layer's mlp.gate).
IGNORABLE_ROUTER = re.compile(r"(^|\.)(mlp|block_sparse_moe)\.gate$|(^|\.)shared_expert_gate$")


def checkpoint_quantization(hf_config: dict, image_side: tuple[str, ...] = ()) -> str | None:
    """What config.json's quantization_config asks for: "fp8" for FP8 weights plait loads as they are (one
    scale per tensor, per output channel or per block: llm-compressor's compressed-tensors
    "float-quantized", and the "fp8" method of AutoFP8 / vLLM / DeepSeek / Qwen), None where there is none;
    anything else is a ValueError naming what plait does not load. checkpoint_weight_block says whether the
    scales are block-wise. ``image_side``: an image model's vision-side module names, which its checkpoint
    may leave unquantised (plait keeps them 16-bit whatever it says)."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size") and q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("block-wise FP8 checkpoints with static activation scales are not supported "
                             "(dynamic per-token-group scales are)")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
    elif method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        for group in groups:
            w = group.get("weights") or {}
            if not (w.get("type") == "float" and w.get("num_bits") == 8
                    and w.get("strategy") in ("tensor", "channel", "block")):
                raise ValueError(f"compressed-tensors weights {w} are not supported: plait loads 8-bit float "
                                 "weights with per-tensor, per-channel or block scales")
            a = group.get("input_activations")
            if a and not (a.get("type") == "float" and a.get("num_bits") == 8):
                raise ValueError(f"compressed-tensors input activations {a} are not supported (FP8 only)")
            if w.get("strategy") == "block" and a and not a.get("dynamic", False):
                raise ValueError("compressed-tensors block weights with static input scales are not "
                                 "supported")
        if not groups:
            raise ValueError("compressed-tensors quantization_config without config_groups")
        if len({json.dumps((g.get("weights") or {}).get("block_structure")) for g in groups}) > 1:
            raise ValueError("compressed-tensors groups with different weight blocks are not supported")
        ignored = q.get("ignore") or []
    else:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported: plait loads FP8 "
                         "checkpoints ('fp8', 'compressed-tensors' float-quantized), GPTQ and AWQ ones "
                         "(plait.layers.wna16), or quantises an unquantised one with --quantization fp8")
    extra = sorted(name for name in set(ignored) - IGNORABLE
                   if not IGNORABLE_ROUTER.search(name) and not any(side in name for side in image_side))
    if extra:
        raise ValueError(f"FP8 checkpoints leaving layers other than the lm_head unquantised ({extra[:4]}) "
                         "are not supported")
    checkpoint_weight_block(hf_config)  # refuses blocks the kernels do not take
    return "fp8"


def checkpoint_weight_block(hf_config: dict) -> tuple[int, int] | None:
    """(block_n, block_k) of a checkpoint with block-wise FP8 scales (quant_method "fp8" with
    weight_block_size, or compressed-tensors weights of strategy "block"); None for any other."""
    q = hf_config.get("quantization_config") or {}
    block = q.get("weight_block_size")
    if q.get("quant_method") == "compressed-tensors":
        weights = [(g.get("weights") or {}) for g in (q.get("config_groups") or {}).values()]
        block = next((w.get("block_structure") for w in weights if w.get("strategy") == "block"), None)
    if not block:
        return None
    from plait.layers.fp8_block import check_block

    return check_block(tuple(block))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): each row scaled so its largest magnitude lands on FP8_MAX, rounded to FP8."""
    # weight: [N, K] -> codes: [N, K] float8_e4m3fn; scales: [N] fp32
    w = weight.float()
    # amax times fp32(1 / FP8_MAX), not amax / FP8_MAX: torch divides by a scalar that way on CUDA and
    # truly on CPU, and the kernels must give the same scale on every device.
    scale = (w.abs().amax(dim=1) * INV_FP8_MAX).clamp_min(MIN_SCALE)
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_rows(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """code * scale per row in fp32, rounded to dtype: the weight that codes and scales stand for."""
    # weight: [N, K] 8-bit; weight_scale: [N] fp32 -> [N, K] dtype
    return (weight.float() * weight_scale[:, None]).to(dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, dequantized: torch.Tensor | None = None) -> torch.Tensor:
    """x's rows quantised to FP8 on their own scales, times the FP8 weight, in fp32; rounded to x's dtype.
    ``dequantized``: weight * weight_scale in fp32, where the caller keeps it."""
    # x: [..., K]; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32; bias: [N] -> [..., N]
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_rows(x2)
    xd = codes.float() * scale[:, None]
    wd = dequantized if dequantized is not None else dequantize_rows(weight, weight_scale, torch.float32)
    out = linear(xd, wd, bias.float() if bias is not None else None)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """A Linear whose weight is FP8 codes with per-row scales, with plait.layers.linear.Linear's interface
    (forward, and the fused decode paths the models ask for)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.weight = nn.Parameter(codes, requires_grad=False)  # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", scale.contiguous())  # [N] fp32
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.compute_dtype = compute_dtype  # the model's dtype: what x and the output are
        # Off CUDA: code * scale in fp32, made at the first forward and kept (the torch path would
        # otherwise widen the whole weight at every call; there FP8 buys numerics, not memory).
        self._reference_weight: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: torch.device | None = None) -> Fp8Linear:
        """The layer's weight quantised; a layer on the meta device (deferred_weights) gives an empty
        one on ``device``, for load_weight_rows to fill."""
        w = linear.weight
        if w.is_meta:
            n, k = w.shape
            bias = torch.zeros(n, dtype=w.dtype, device=device) if linear.bias is not None else None
            return cls(torch.zeros((n, k), dtype=FP8_DTYPE, device=device),
                       torch.full((n,), float("nan"), dtype=torch.float32, device=device), bias, w.dtype)
        codes, scale = quantize_rows(w.detach())
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(codes, scale, bias, w.dtype)

    @torch.no_grad()
    def load_weight_rows(self, start: int, rows: torch.Tensor) -> None:
        """Checkpoint rows ``start:start + len(rows)`` of the weight: 16/32-bit rows are quantised here (each
        row has its own scale, so a fused layer's shards quantise alone as they would together); FP8 rows
        (an FP8 checkpoint) are kept as they are, their scale coming as "weight_scale" (load_scale_rows)."""
        # rows: [n, in_features] in the checkpoint's (or the model's) dtype
        end = start + rows.shape[0]
        if rows.dtype == FP8_DTYPE:
            self.weight[start:end].copy_(rows)
            return
        codes, scale = quantize_rows(rows)
        self.weight[start:end].copy_(codes)
        self.weight_scale[start:end].copy_(scale)

    @torch.no_grad()
    def load_scale_rows(self, start: int, num_rows: int, scale: torch.Tensor) -> None:
        """An FP8 checkpoint's weight_scale for rows ``start:start + num_rows``: one per tensor (a single
        value, spread over the rows) or one per output channel."""
        # scale: [], [1], [num_rows] or [num_rows, 1]
        if scale.numel() not in (1, num_rows):
            raise ValueError(f"weight_scale of {tuple(scale.shape)} for {num_rows} rows: per-tensor or "
                             "per-channel scales only")
        self.weight_scale[start:start + num_rows].copy_(scale.float().reshape(-1).expand(num_rows))

    def check_loaded(self) -> None:
        """Every row has its scale (an FP8 checkpoint without weight_scale would leave a NaN)."""
        if torch.isnan(self.weight_scale).any():
            raise ValueError("an FP8 checkpoint tensor came without its weight_scale")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.dtype in KERNEL_DTYPES and use_triton(x):
            from plait.kernels.fp8_gemm import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if self._reference_weight is None:
            self._reference_weight = self.dequantized(torch.float32)
        return fp8_linear_ref(x, self.weight, self.weight_scale, self.bias, self._reference_weight)

    # The fused decode paths of plait.layers.linear.Linear are 16-bit-weight kernels: the model takes its
    # plain path (a norm launch of its own, gate/up then silu-and-mul).
    def adds_residual(self, x: torch.Tensor) -> bool:
        return False

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        return False

    def fold_norm_weight(self, norm_weight: torch.Tensor) -> None:
        raise RuntimeError("fold norm weights into a layer before quantising it, not after")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per-row scales"


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, device: torch.device | None = None,
                   block: tuple[int, int] | None = None, left_16_bit: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear of ``model`` but SKIPPED_LAYERS and those under ``left_16_bit`` (module name
    prefixes: an image model's vision side) with its quantised form, from outside the model (its code is
    unchanged); returns how many layers were replaced. Layers built on the meta device
    (plait.layers.linear.deferred_weights) become empty FP8 layers on ``device``, and skipped ones empty
    16-bit layers there, for the checkpoint to fill. ``block``: block-wise scales of that (block_n,
    block_k) (plait.layers.fp8_block.Fp8BlockLinear), as a block-wise checkpoint holds them. A MoE block's
    experts (FusedMoE) take block-wise scales either way (``block``, else moe.default_fp8_block)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    kept = [(name, m) for name, m in linears
            if name.rsplit(".", 1)[-1] in SKIPPED_LAYERS or name.startswith(left_16_bit)]
    targets = [(name, m) for name, m in linears if (name, m) not in kept]
    for _, module in kept:
        if module.weight.is_meta:
            module.to_empty(device=device)
    count = len(targets)
    for moe in [m for m in model.modules() if isinstance(m, FusedMoE)]:
        moe.quantize_fp8(block or default_fp8_block(moe.intermediate_size), device)
        count += 1
    while targets:  # popped one by one, so each 16-bit weight is freed once its layer is replaced
        name, module = targets.pop()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if block is None:
            setattr(parent, child, Fp8Linear.from_linear(module, device))
        else:
            from plait.layers.fp8_block import Fp8BlockLinear

            setattr(parent, child, Fp8BlockLinear.from_linear(module, device, block))
    return count
