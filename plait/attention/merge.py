"""Combine two partial attention results by their log-sum-exp; safe when either side is empty."""

from __future__ import annotations

import torch


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_*: [T, H, D], lse_*: [T, H] (natural log; -inf where a side attended to nothing).

    An empty side contributes nothing, whatever its ``out`` holds (even NaN); two empty sides give
    zeros with lse -inf, so a merge never turns into NaN (-inf - -inf) and poisons a sequence.
    """
    lse_max = torch.maximum(lse_a, lse_b)
    both_empty = torch.isneginf(lse_max)
    safe_max = torch.where(both_empty, torch.zeros_like(lse_max), lse_max)
    w_a = torch.exp(lse_a - safe_max)  # exp(-inf) = 0 for an empty side
    w_b = torch.exp(lse_b - safe_max)
    denom = w_a + w_b
    inv = torch.where(both_empty, torch.zeros_like(denom), 1.0 / torch.where(both_empty, 1.0, denom))
    part_a = torch.where((w_a > 0).unsqueeze(-1), out_a.float() * (w_a * inv).unsqueeze(-1), 0.0)
    part_b = torch.where((w_b > 0).unsqueeze(-1), out_b.float() * (w_b * inv).unsqueeze(-1), 0.0)
    lse = torch.where(both_empty, lse_max, safe_max + torch.log(torch.where(both_empty, 1.0, denom)))
    return (part_a + part_b).to(out_a.dtype), lse
