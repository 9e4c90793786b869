"""The Triton backend: store-KV and paged attention over any batch mix, decode rows tiled for bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.attention.base import AttentionBackend, QKNormModules, Rotary, register_backend, rotary_positions
from plait.attention.fp8_kv import UNIT_SCALES, KVScales
from plait.kernels.dispatch import use_triton
from plait.kernels.paged_attention import (
    PagedAttentionPlan,
    mla_cache_views,
    paged_attention,
    plan_paged_attention,
)
from plait.kernels.rope_store import QKNorm, rope_store_kv
from plait.kernels.store_kv import store_kv

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch


@dataclass
class _Part:
    """A run of rows attended by one launch (built once per step, reused by every layer)."""

    tokens: slice  # the query tokens the launch reads: from 0, through the part's last row's tokens
    rows: slice
    query_start_loc: torch.Tensor  # [rows + 1] int32: the rows' token offsets into the step
    max_query_len: int
    plan: PagedAttentionPlan


@register_backend
class TritonBackend(AttentionBackend):
    """Reads only query_start_loc, seq_lens, block_tables, slot_mapping and the host ints max_query_len,
    max_seq_len and num_leading_single_token_rows, so a batch padded for a CUDA graph works unchanged.

    The kernel takes any mix of rows in one launch. A mixed step whose leading rows are one-token rows
    (the ``mixed`` policy schedules running decodes first) is attended in two launches instead:
    decode-shaped tiles for those rows, prefill tiles for the rest. On an H200 that took 0.37 ms a
    Llama-8B layer for 256 decodes beside a 2048-token chunk, against 0.62 ms in one launch with
    prefill tiles and 0.46 ms in one launch with two tile regions
    (benchmarks/results/attention_mixed_step_h200.json).

    Either launch may split its rows' key ranges over more programs (split-KV) when it has too few query
    tiles to fill the GPU: decodes of small batches, or a prompt chunk of a few hundred tokens beside a
    long cached context. The plan holds the split scratch, sized by the launch's token count.
    ``num_kv_splits`` overrides the split count of every launch (None: heuristic; 1: off).

    The row metadata is converted when the step's ForwardBatch is made, kernels before the first
    layer's attention, so the kernel may read it before its PDL wait (``metadata_ready``).
    """

    name = "triton"
    graph_safe = True

    def __init__(self, num_kv_splits: int | None = None) -> None:
        self.num_kv_splits = num_kv_splits

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
                 kv_scales: KVScales = UNIT_SCALES) -> None:
        # kv_cache: [2, num_blocks, block_size, Hkv, D]
        store_kv(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping, kv_scales)

    def rotate_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
        rotary: Rotary, kv_scales: KVScales = UNIT_SCALES, qk_norm: QKNormModules | None = None,
    ) -> torch.Tensor:
        # One launch instead of rotary's and store_kv's (and q/k norms', which Qwen3 has): launches fewer
        # per layer in every step.
        cos_sin = getattr(rotary, "cos_sin", None)
        if (cos_sin is None or not use_triton(q) or cos_sin.device != q.device
                or (qk_norm is not None and cos_sin.shape[1] != q.shape[-1])):
            return super().rotate_and_store(q, k, v, kv_cache, batch, rotary, kv_scales, qk_norm)
        norm = None if qk_norm is None else QKNorm(qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps,
                                                   getattr(qk_norm[0], "unit_offset", False))
        q = rope_store_kv(rotary_positions(rotary, batch), q, k, v, cos_sin, kv_cache[0], kv_cache[1],
                          batch.slot_mapping, kv_scales, norm)
        q_scale = getattr(rotary, "q_scale", None)  # plait.layers.rotary.QueryScaledRotary (Ministral 3)
        return q if q_scale is None else q * q_scale

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        return_lse: bool = False,
        kv_scales: KVScales = UNIT_SCALES,
        logit_softcap: float | None = None,
        causal: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not causal:
            # The kernel masks causally; encoder models attend with torch_ref (ModelRunner._backend_name).
            raise NotImplementedError("the triton attention backend is causal only: an encoder model "
                                      "(bidirectional attention) runs with attention_backend 'torch_ref'")
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
        # Each part's launch writes only its own rows' outputs, so each adds the sinks to those rows once.
        for part in self._parts(q, kv_cache, batch):
            t, r = part.tokens, part.rows
            paged_attention(
                q[t], kv_cache[0], kv_cache[1], out[t], part.query_start_loc, batch.seq_lens[r],
                batch.block_tables[r], scale, part.max_query_len, batch.max_seq_len, sliding_window or 0,
                None if lse is None else lse[t], plan=part.plan, metadata_ready=True, k_scale=kv_scales.k,
                v_scale=kv_scales.v, softcap=logit_softcap or 0.0, sinks=sinks,
                key_limits=batch.key_limits)
        return (out, lse) if return_lse else out

    def attend_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                      value_width: int) -> torch.Tensor:
        # kv_cache: [1, num_blocks, block_size, 1, W] -> K [blocks, bs, Hq / 16, W] and V (its c_kv columns),
        # views of the one latent head (mla_cache_views): the kernel reuses each K tile as V
        num_tokens, num_heads, _ = q.shape
        k, v = mla_cache_views(kv_cache[0], num_heads, value_width)
        out = torch.empty(num_tokens, num_heads, value_width, dtype=q.dtype, device=q.device)
        for part in self._parts(q, k, batch, value_width):
            t, r = part.tokens, part.rows
            paged_attention(
                q[t], k, v, out[t], part.query_start_loc, batch.seq_lens[r], batch.block_tables[r], scale,
                part.max_query_len, batch.max_seq_len, plan=part.plan, metadata_ready=True)
        return out

    def _parts(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
               value_width: int | None = None) -> list[_Part]:
        """The step's launches, made by its first layer and reused by the rest. ``kv_cache``: [2, blocks, bs,
        Hkv, D], or MLA's K view [blocks, bs, Hkv, W] with ``value_width`` (V's, the output's width)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        if value_width is not None:
            head_dim = value_width
        key = ("triton", num_tokens, num_heads, num_kv_heads, head_dim, q.dtype, kv_cache.dtype)
        parts = batch.backend_state.get(key)
        if parts is None:
            parts = batch.backend_state[key] = self._split(batch, num_heads, num_kv_heads, head_dim, q.dtype,
                                                           kv_cache.dtype)
        return parts

    def _split(self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, cache_dtype: torch.dtype) -> list[_Part]:
        # The decode part's rows hold at most one token each, and its tokens come first: its launch reads
        # tokens [0, rows) (a CUDA graph of a mixed step pads it with empty rows, which take none). The
        # prompt part reads its rows' token offsets from query_start_loc as they are, over all the
        # step's tokens, so it needs no host data and no copy of the offsets either.
        short = batch.num_leading_single_token_rows
        if short == 0 or short == batch.num_rows:
            bounds = [(0, batch.num_rows, batch.max_query_len, batch.num_tokens)]
        else:
            bounds = [(0, short, 1, short), (short, batch.num_rows, batch.max_query_len, batch.num_tokens)]
        parts = []
        for first, last, max_query_len, num_tokens in bounds:
            starts = batch.query_start_loc[first : last + 1]
            plan = plan_paged_attention(num_tokens, last - first, num_heads, num_kv_heads, head_dim, dtype,
                                        max_query_len, batch.max_seq_len, starts.device, self.num_kv_splits,
                                        cache_dtype=cache_dtype)
            parts.append(_Part(slice(0, num_tokens), slice(first, last), starts, max_query_len, plan))
        return parts
