"""The Triton backend: one store-KV launch and one paged-attention launch per layer for any batch mix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.attention.base import AttentionBackend, register_backend
from plait.kernels.paged_attention import PagedAttentionPlan, paged_attention, plan_paged_attention
from plait.kernels.store_kv import store_kv

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch


@register_backend
class TritonBackend(AttentionBackend):
    """Reads only query_start_loc, seq_lens, block_tables, slot_mapping, max_query_len and max_seq_len,
    so a batch padded for a CUDA graph (upper-bound maxima, pad rows) works unchanged.

    ``num_kv_splits`` overrides the split-KV choice for decode-only steps (None: heuristic; 1: off); steps
    carrying prefill chunks never split."""

    name = "triton"
    graph_safe = True

    def __init__(self, num_kv_splits: int | None = None) -> None:
        self.num_kv_splits = num_kv_splits

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> None:
        # kv_cache: [2, num_blocks, block_size, Hkv, D]
        store_kv(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping)

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
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
        paged_attention(
            q, kv_cache[0], kv_cache[1], out, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            scale, batch.max_query_len, batch.max_seq_len, sliding_window or 0, lse,
            plan=self._plan(q, kv_cache, batch))
        return (out, lse) if return_lse else out

    def _plan(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> PagedAttentionPlan:
        """Launch config and split-KV scratch, made by the first layer of a step and reused by the rest."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        key = ("triton", num_tokens, num_heads, num_kv_heads, head_dim, q.dtype)
        plan = batch.backend_state.get(key)
        if plan is None:
            splits = self.num_kv_splits if batch.max_query_len <= 1 else None
            plan = batch.backend_state[key] = plan_paged_attention(
                num_tokens, batch.block_tables.shape[0], num_heads, num_kv_heads, head_dim, q.dtype,
                batch.max_query_len, batch.max_seq_len, q.device, splits)
        return plan
