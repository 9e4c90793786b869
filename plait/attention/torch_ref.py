"""The reference backend: per-request attention over gathered paged K/V. Any device; the truth."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.attention.base import AttentionBackend, register_backend
from plait.attention.fp8_kv import UNIT_SCALES, KVScales, from_cache, to_cache

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch


# Largest padded score tensor (elements) for which all rows are attended in one batched call;
# above it (long chunks beside long contexts) rows go one at a time to bound memory.
MAX_PADDED_SCORES = 1 << 24


@register_backend
class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    max_padded_scores = MAX_PADDED_SCORES

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
                 kv_scales: KVScales = UNIT_SCALES) -> None:
        # kv_cache: [2, num_blocks, block_size, Hkv, D] (any strides); a slot is block * block_size + offset
        block_size = kv_cache.shape[2]
        block, pos = batch.slot_mapping // block_size, batch.slot_mapping % block_size
        inv_k, inv_v = kv_scales.inverse
        kv_cache[0, block, pos] = to_cache(k, kv_cache.dtype, inv_k)
        kv_cache[1, block, pos] = to_cache(v, kv_cache.dtype, inv_v)

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
        out, lse = self._attend(q, kv_cache[0], kv_cache[1], batch, scale, sliding_window, kv_scales,
                                logit_softcap, causal, sinks)
        return (out, lse) if return_lse else out

    def attend_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                      value_width: int) -> torch.Tensor:
        # kv_cache: [1, num_blocks, block_size, 1, W]: K is the row, V its leading c_kv columns (a view)
        latent = kv_cache[0]
        out, _ = self._attend(q, latent, latent[..., :value_width], batch, scale, None, UNIT_SCALES)
        return out

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        scale: float,
        sliding_window: int | None, kv_scales: KVScales, logit_softcap: float | None = None,
        causal: bool = True, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k_cache [num_blocks, block_size, Hkv, Dk] (Dk = q's width), v_cache [..., Dv] -> (out [T, Hq, Dv],
        lse [T, Hq])."""
        num_heads = q.shape[1]
        block_size = k_cache.shape[1]
        max_keys = _num_key_blocks(batch, block_size) * block_size
        if batch.num_rows * num_heads * batch.max_query_len * max_keys <= self.max_padded_scores:
            attend = self._attend_padded
        else:
            attend = self._attend_per_row
        return attend(q, k_cache, v_cache, batch, scale, sliding_window, kv_scales, logit_softcap, causal,
                      sinks)

    def _attend_padded(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        scale: float,
        sliding_window: int | None, kv_scales: KVScales, logit_softcap: float | None = None,
        causal: bool = True, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row at once, queries and keys padded to the batch maximum and masked."""
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads, value_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
        group = num_heads // num_kv_heads
        key = ("torch_ref", sliding_window, causal)
        meta = batch.backend_state.get(key)
        if meta is None:
            meta = batch.backend_state[key] = _padded_metadata(batch, block_size, sliding_window, causal)
        token_index, valid, visible = meta
        num_rows, max_q = token_index.shape
        # q: [T, Hq, D] -> [R, Hkv, group * maxq, D]: a kv head's group of query heads share one matmul,
        # so K and V are laid out once per kv head, never copied per query head.
        qp = q.float()[token_index].view(num_rows, max_q, num_kv_heads, group, head_dim)
        qp = qp.permute(0, 2, 3, 1, 4).reshape(num_rows, num_kv_heads, group * max_q, head_dim)
        # k, v: [R, L, Hkv, D] -> [R, Hkv, L, D], L = max_blocks * block_size
        tables = batch.block_tables[:, : _num_key_blocks(batch, block_size)].long()
        k = from_cache(k_cache[tables].flatten(1, 2), kv_scales.k).permute(0, 2, 1, 3)
        v = from_cache(v_cache[tables].flatten(1, 2), kv_scales.v).permute(0, 2, 1, 3)
        # scores: [R, Hkv, group * maxq, L]
        scores = _softcap(torch.matmul(qp, k.transpose(-1, -2)) * scale, logit_softcap)
        scores = scores.view(num_rows, num_kv_heads, group, max_q, -1)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [R, Hkv, group, maxq]
        if sinks is not None:  # sinks: [Hq] = [Hkv * group], as the query heads are grouped here
            row_lse = _with_sinks(row_lse, sinks.reshape(1, num_kv_heads, group, 1))
        probs = torch.exp(scores - row_lse.unsqueeze(-1))
        out = torch.matmul(probs.view(num_rows, num_kv_heads, group * max_q, -1), v)  # [R, Hkv, G * maxq, Dv]
        out = out.view(num_rows, num_kv_heads, group, max_q, value_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(num_rows * max_q, num_heads, value_dim)[valid]
        lse = row_lse.permute(0, 3, 1, 2).reshape(num_rows * max_q, num_heads)[valid]
        return out.to(q.dtype), lse

    def _attend_per_row(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        scale: float,
        sliding_window: int | None, kv_scales: KVScales, logit_softcap: float | None = None,
        causal: bool = True, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, _ = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        out = q.new_empty(num_tokens, num_heads, v_cache.shape[3])
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
        for i in range(batch.num_rows):
            q_start, q_end = batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
            seq_len = batch.seq_lens_cpu[i]
            if q_end == q_start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = batch.block_tables[i, :num_blocks].long()
            # k, v: [seq_len, Hkv, D] -> [Hq, seq_len, D] (GQA: each kv head serves `group` q heads)
            k = from_cache(k_cache[blocks].flatten(0, 1)[:seq_len], kv_scales.k).transpose(0, 1)
            v = from_cache(v_cache[blocks].flatten(0, 1)[:seq_len], kv_scales.v).transpose(0, 1)
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
            qi = q[q_start:q_end].float().transpose(0, 1)  # [Hq, n, D]
            scores = _softcap(torch.matmul(qi, k.transpose(1, 2)) * scale, logit_softcap)  # [Hq, n, seq_len]
            limits = None if batch.key_limits is None else batch.key_limits[q_start:q_end]
            visible = _visible(q_end - q_start, seq_len, sliding_window, q.device, causal, limits)
            scores = scores.masked_fill(~visible, float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
            if sinks is not None:
                row_lse = _with_sinks(row_lse, sinks.reshape(num_heads, 1))
            probs = torch.exp(scores - row_lse.unsqueeze(-1))
            out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
            lse[q_start:q_end] = row_lse.transpose(0, 1)
        return out, lse


def _with_sinks(row_lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The LSE over a row's keys and its head's sink (a key of score ``sinks`` and value zero, broadcast
    against ``row_lse``). The probabilities exp(score - lse) then leave the sink its share of the mass,
    and a row that saw no key (lse -inf) gets probabilities 0 and lse = sink rather than 0/0."""
    return torch.logaddexp(row_lse, sinks.float())


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capped scores: cap * tanh(scores / cap) (None: as they are)."""
    return scores if not cap else torch.tanh(scores / cap) * cap


def _num_key_blocks(batch: ForwardBatch, block_size: int) -> int:
    """Block-table columns any row of this step can use (the runner's tables may be wider)."""
    return max(1, -(-batch.max_seq_len // block_size))


def _padded_metadata(
    batch: ForwardBatch, block_size: int, sliding_window: int | None, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_index [R, maxq]: flat token of each padded query slot, clamped for padding;
    valid [R * maxq]: which slots are real; visible [R, maxq, L]: causal (+window) key mask, or, not
    ``causal``, every key of the row's sequence). Under ``batch.key_limits`` a query sees keys up to its
    limit rather than its own position (Gemma 3's images); the window counts back from its position."""
    device = batch.input_ids.device
    qsl = batch.query_start_loc.long()
    starts, query_lens = qsl[:-1], qsl[1:] - qsl[:-1]
    offsets = torch.arange(batch.max_query_len, device=device)
    valid = offsets.unsqueeze(0) < query_lens.unsqueeze(1)  # [R, maxq]
    token_index = (starts.unsqueeze(1) + offsets).clamp(max=max(batch.num_tokens - 1, 0))
    q_pos = batch.context_lens.long().unsqueeze(1) + offsets  # [R, maxq]
    k_pos = torch.arange(_num_key_blocks(batch, block_size) * block_size, device=device)
    if causal:
        last = q_pos if batch.key_limits is None else batch.key_limits.long()[token_index]  # [R, maxq]
        visible = k_pos.view(1, 1, -1) <= last.unsqueeze(-1)
    else:
        visible = (k_pos.view(1, 1, -1) < batch.seq_lens.long().view(-1, 1, 1)) & (q_pos.unsqueeze(-1) >= 0)
    if sliding_window is not None:
        visible &= k_pos.view(1, 1, -1) > q_pos.unsqueeze(-1) - sliding_window
    return token_index, valid.flatten(), visible


def _visible(
    num_queries: int, seq_len: int, sliding_window: int | None, device: torch.device, causal: bool = True,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n, seq_len] bool: query j (at position seq_len - n + j) sees keys at positions <= its own, or <=
    ``key_limits[j]`` where given (every key, not ``causal``; and, with a sliding window, within the last
    ``sliding_window`` positions before its own)."""
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    last = q_pos if key_limits is None else key_limits.long().unsqueeze(1)
    visible = k_pos <= last if causal else torch.ones(num_queries, seq_len, dtype=torch.bool, device=device)
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible
