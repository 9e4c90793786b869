"""MXFP4 checkpoint weights (OCP microscaling FP4, as GPT-OSS ships its experts), kept packed by the experts
(plait.layers.moe.FusedMoE.use_mxfp4) and decoded as the fused MoE kernels multiply."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

MXFP4_METHOD = "mxfp4"
# The models whose loaders know MXFP4 tensors' names (their experts').
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
# FP4 (E2M1) codes 0..15 -> values: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# A block's scale is an E8M0 byte: 2 ** (byte - 127).
E8M0_BIAS = 127
# Values per block (one scale each): 16 bytes of two codes, the low nibble first.
BLOCK_VALUES = 32
CODES_PER_BYTE = 2
MXFP4_DTYPE = torch.uint8  # the packed codes' and the scales' storage
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
MXFP4_SUFFIXES = (BLOCKS_SUFFIX, SCALES_SUFFIX)
# Rows dequantised at a time: bounds the int and 16-bit temporaries of a 120B checkpoint's largest tensors.
DEQUANT_ROWS = 1 << 16


def is_mxfp4_checkpoint(hf_config: dict) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == MXFP4_METHOD


def experts_config(hf_config: dict, quantization: str | None) -> dict:
    """An MXFP4 checkpoint's config without its quantization_config: the model is built as an unquantised
    one, and the loader then makes its experts MXFP4 (FusedMoE.use_mxfp4) before any weight arrives; the
    other layers are 16-bit in these checkpoints (modules_to_not_convert)."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in MXFP4_ARCHITECTURES:
        raise ValueError(f"MXFP4 checkpoints of {arch} are not supported (those of "
                         f"{list(MXFP4_ARCHITECTURES)} are)")
    if quantization not in (None, MXFP4_METHOD):
        raise ValueError(f"--quantization {quantization}: this checkpoint's experts are MXFP4, served "
                         "as they are")
    config = dict(hf_config)
    config.pop("quantization_config")
    logger.info("MXFP4 checkpoint: its experts stay MXFP4 (4.25 bits a weight), decoded in the MoE kernels")
    return config


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 E8M0 scales -> [..., G * 32] values in ``dtype``. Every
    FP4 value times a power of two is exact in bf16, fp16 (within its range) and fp32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != BLOCK_VALUES:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"({BLOCK_VALUES // 2} bytes a block)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    rows = blocks.reshape(-1, BLOCK_VALUES // 2)
    exps = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    out = torch.empty(rows.shape[0], BLOCK_VALUES, dtype=dtype, device=blocks.device)
    for start in range(0, rows.shape[0], DEQUANT_ROWS):
        part, exp = rows[start:start + DEQUANT_ROWS], exps[start:start + DEQUANT_ROWS]
        values = torch.empty(part.shape[0], BLOCK_VALUES, dtype=torch.float32, device=blocks.device)
        values[:, 0::2] = lut[(part & 0x0F).long()]
        values[:, 1::2] = lut[(part >> 4).long()]
        out[start:start + DEQUANT_ROWS] = torch.ldexp(values, exp.float()).to(dtype)
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK_VALUES)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] values (K a multiple of 32) -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8),
    each block scaled so its largest magnitude fits FP4's 6 and every value rounded to the nearest code: the
    inverse of dequantize_mxfp4 for tests and for writing checkpoints."""
    *lead, k = weight.shape
    if k % BLOCK_VALUES:
        raise ValueError(f"MXFP4 rows of {k} values: not a multiple of {BLOCK_VALUES}")
    blocks = weight.float().reshape(*lead, k // BLOCK_VALUES, BLOCK_VALUES)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    exp = torch.ceil(torch.log2(amax / FP4_VALUES[7])).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks / torch.exp2(exp)
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)  # nearest magnitude
    codes = codes + 8 * (scaled < 0)  # the sign bit
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


class MxFp4Pairs:
    """Collects each MXFP4 tensor's ``<name>_blocks`` and ``<name>_scales`` (in any order, with other tensors
    between them) and hands back ``(<name>, blocks, scales)`` once both are in."""

    def __init__(self) -> None:
        self._waiting: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        for suffix in MXFP4_SUFFIXES:
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                parts = self._waiting.setdefault(base, {})
                parts[suffix] = tensor
                if len(parts) < 2:
                    return None
                del self._waiting[base]
                return base, parts[BLOCKS_SUFFIX], parts[SCALES_SUFFIX]
        raise ValueError(f"checkpoint tensor {name!r} is neither an MXFP4 blocks nor scales tensor")

    def check_empty(self) -> None:
        if self._waiting:
            name, parts = next(iter(self._waiting.items()))
            raise ValueError(f"MXFP4 tensor {name!r} came with only its {list(parts)[0].lstrip('_')}")
