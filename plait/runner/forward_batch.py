"""ForwardBatch: the one description of a step that every layer reads, built once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from plait.attention.base import AttentionBackend
from plait.engine.kv_cache import PAD_BLOCK_ID
from plait.engine.scheduler import StepPlan


@dataclass
class ForwardBatch:
    """Flattened tokens of every row, in plan order. All fields set by ``build_forward_batch``.

    Device tensors come from a single host-to-device copy; the ``*_cpu`` twins are the same
    numbers on the host, so Python loops never synchronise with the device.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its request
    query_start_loc: torch.Tensor  # [R + 1] int32: row r's tokens are [qsl[r], qsl[r + 1])
    context_lens: torch.Tensor  # [R] int32: tokens already cached before this step
    seq_lens: torch.Tensor  # [R] int32: context_lens + this step's tokens
    is_first_chunk: torch.Tensor  # [R] bool: num_computed_tokens == 0 (never inferred from length)
    state_slots: torch.Tensor  # [R] int64: the request's recurrent-state slot (NO_STATE_SLOT if none)
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with PAD_BLOCK_ID
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    sample_indices: torch.Tensor  # [S] int64: last token of each sampling row, in row order
    sample_rows: list[int]  # [S] the rows that sample (chunks that end the known tokens, decodes)
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    attn_backend: AttentionBackend | None = None  # set by the runner
    kv_caches: list[torch.Tensor] | None = None  # set by the runner: one [2, blocks, bs, Hkv, D] per layer
    # Set by the runner for models with recurrent layers: one MambaLayerState per Mamba layer.
    recurrent_states: list | None = None
    # Set by the attention backend: metadata it derives from this batch once and reuses in every layer.
    backend_state: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def attention(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store this step's k, v for layer ``layer_idx`` and attend with q over the paged cache."""
        cache = self.kv_caches[layer_idx]
        self.attn_backend.store_kv(k, v, cache, self)
        return self.attn_backend.attend(q, cache, self, scale, sliding_window)


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device) -> ForwardBatch:
    """Turn a scheduler plan into tensors: numpy on the host, then one copy to ``device``."""
    if plan.is_empty:
        raise ValueError("an empty plan has no forward batch; the engine skips empty steps")
    rows = plan.rows
    num_rows = len(rows)
    query_lens = np.array([r.num_new_tokens for r in rows], dtype=np.int64)
    starts = np.array([r.start for r in rows], dtype=np.int64)
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = starts + query_lens

    input_ids = np.fromiter(
        (t for r in rows for t in r.request.token_ids(r.start, r.start + r.num_new_tokens)),
        dtype=np.int64,
        count=num_tokens,
    )
    # positions: for each token, its row's start plus its offset within the row
    row_of_token = np.repeat(np.arange(num_rows), query_lens)
    positions = starts[row_of_token] + (np.arange(num_tokens) - query_start_loc[row_of_token])

    max_blocks = max((len(r.request.block_ids) for r in rows), default=1)
    block_tables = np.full((num_rows, max(max_blocks, 1)), PAD_BLOCK_ID, dtype=np.int64)
    for i, r in enumerate(rows):
        block_tables[i, : len(r.request.block_ids)] = r.request.block_ids
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size

    sample_rows = [i for i, r in enumerate(rows) if r.samples]
    sample_indices = query_start_loc[1:][sample_rows] - 1
    is_first = np.array([r.is_first_chunk for r in rows], dtype=np.int64)
    state_slots = np.array([r.request.state_slot for r in rows], dtype=np.int64)

    # One contiguous int64 buffer, one copy; the device tensors are views into it.
    parts = [input_ids, positions, query_start_loc, starts, seq_lens, is_first,
             block_tables.reshape(-1), slot_mapping, np.asarray(sample_indices, dtype=np.int64), state_slots]
    host = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    views = torch.split(dev, [len(p) for p in parts])
    return ForwardBatch(
        input_ids=views[0],
        positions=views[1],
        query_start_loc=views[2].int(),
        context_lens=views[3].int(),
        seq_lens=views[4].int(),
        is_first_chunk=views[5].bool(),
        block_tables=views[6].view(num_rows, -1).int(),
        slot_mapping=views[7],
        sample_indices=views[8],
        state_slots=views[9],
        sample_rows=sample_rows,
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )
