"""The reference backend: per-request attention over gathered paged K/V. Any device; the truth."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.attention.base import AttentionBackend, register_backend

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch


@register_backend
class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> None:
        # kv_cache: [2, num_blocks, block_size, Hkv, D] viewed as [2, slots, Hkv, D]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0].index_copy_(0, batch.slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, batch.slot_mapping, v.to(kv_cache.dtype))

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
        for i in range(batch.num_rows):
            q_start, q_end = batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
            seq_len = batch.seq_lens_cpu[i]
            if q_end == q_start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = batch.block_tables[i, :num_blocks].long()
            # k, v: [seq_len, Hkv, D] -> [Hq, seq_len, D] (GQA: each kv head serves `group` q heads)
            k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)
            v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
            qi = q[q_start:q_end].float().transpose(0, 1)  # [Hq, n, D]
            scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [Hq, n, seq_len]
            visible = _visible(q_end - q_start, seq_len, sliding_window, q.device)
            scores = scores.masked_fill(~visible, float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
            probs = torch.exp(scores - row_lse.unsqueeze(-1))
            out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
            lse[q_start:q_end] = row_lse.transpose(0, 1)
        return (out, lse) if return_lse else out


def _visible(
    num_queries: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[n, seq_len] bool: query j (at position seq_len - n + j) sees keys at positions <= its own
    (and, with a sliding window, within the last ``sliding_window`` positions)."""
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible
