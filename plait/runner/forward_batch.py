"""ForwardBatch: the one description of a step that every layer reads, built once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from plait.attention.base import AttentionBackend, QKNormModules, Rotary
from plait.attention.fp8_kv import UNIT_SCALES, KVScales
from plait.engine.drafter import PENDING_DRAFT_ID
from plait.engine.kv_cache import PAD_BLOCK_ID
from plait.engine.scheduler import StepPlan
from plait.lora.slots import NO_LORA_SLOT

# input_ids value of a token whose id is still on the device (patched before the forward runs).
PENDING_INPUT_ID = 0


@dataclass
class StepArrays:
    """A step's inputs on the host, compact (no padding), all int64. Set by ``build_step_arrays``."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]: position of each token in its request
    slot_mapping: np.ndarray  # [T]: cache slot of each new token's K/V
    query_start_loc: np.ndarray  # [R + 1]: row r's tokens are [qsl[r], qsl[r + 1])
    context_lens: np.ndarray  # [R]: tokens already cached before this step
    seq_lens: np.ndarray  # [R]: context_lens + this step's tokens
    is_first_chunk: np.ndarray  # [R]: 1 iff num_computed_tokens == 0 (never inferred from length)
    state_slots: np.ndarray  # [R]: the request's recurrent-state slot (NO_STATE_SLOT if it has none)
    block_tables: np.ndarray  # [R, max_blocks in this step], padded with PAD_BLOCK_ID
    # [P]: the tokens whose logits are sampled, in row order: each sampling row's last token, or every token
    # of a row with draft tokens (speculative decoding: its 1 + drafts positions).
    sample_indices: np.ndarray
    sample_rows: list[int]  # [S]: the rows that sample (chunks that end the known tokens, decodes)
    # Rows whose input token was sampled by the step still in flight: its id is not on the host, so
    # the runner copies it on the device from that step's sampled ids (hazard 10: the request's own
    # token, never a placeholder). input_ids holds PENDING_INPUT_ID there; the input buffers stage a
    # marker naming the sampled id in its place, which the step's landing launch replaces.
    pending_rows: list[int] = field(default_factory=list)
    # [len(pending_rows)]: the token index of each pending row's input (its first token, or its last draft
    # where that one is PENDING_DRAFT_ID). None: each row's last token.
    pending_tokens: np.ndarray | None = None
    # [S]: how many of sample_indices each sampling row has (1 + its draft tokens); None: one each.
    samples_per_row: list[int] | None = None
    # [T]: each token's LoRA adapter slot (NO_LORA_SLOT: the base weights alone), set by the runner where a
    # row has an adapter (LoRAModel.prepare); None: every token's is NO_LORA_SLOT.
    lora_slots: np.ndarray | None = None
    # [T]: the last key position each token sees (build_step_arrays' ``key_limits``, for a model whose images
    # attend both ways): its own position, or its image's last placeholder's. None for every other model.
    key_limits: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.lora_slots is None:
            self.lora_slots = np.full(len(self.input_ids), NO_LORA_SLOT, dtype=np.int64)
        if self.samples_per_row is None:
            self.samples_per_row = [1] * len(self.sample_rows)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def pending_token_indices(self) -> np.ndarray:
        """The token index of each pending row's input (pending_tokens, or each row's last token)."""
        if self.pending_tokens is not None:
            return self.pending_tokens
        return self.query_start_loc[1:][self.pending_rows] - 1

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_query_len(self) -> int:
        return int((self.seq_lens - self.context_lens).max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))

    @property
    def num_leading_single_token_rows(self) -> int:
        """Rows at the front with exactly one new token (running decodes come first under ``mixed``)."""
        not_one = np.flatnonzero(np.diff(self.query_start_loc) != 1)
        return int(not_one[0]) if len(not_one) else self.num_rows


def build_step_arrays(plan: StepPlan, block_size: int, key_limits: bool = False) -> StepArrays:
    """Turn a scheduler plan into host arrays: the only place a plan becomes numbers. With ``key_limits`` (a
    model whose images attend both ways), each token's last visible key position too."""
    if plan.is_empty:
        raise ValueError("an empty plan has no forward batch; the engine skips empty steps")
    rows = plan.rows
    num_rows = len(rows)
    query_lens = np.array([r.num_new_tokens for r in rows], dtype=np.int64)
    starts = np.array([r.start for r in rows], dtype=np.int64)
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # Every row's input tokens come from its own request's token list, or (a decode whose last token
    # is still on the device) from the previous step's sampled ids.
    input_ids = np.full(num_tokens, PENDING_INPUT_ID, dtype=np.int64)
    pending_rows, pending_tokens = [], []
    for i, r in enumerate(rows):
        q = query_start_loc[i]
        num_drafts = len(r.draft_token_ids)
        end = r.start + r.num_new_tokens - num_drafts  # the row's drafts follow its own tokens
        known_end = min(end, r.request.num_known_tokens)
        if end - known_end > 1:
            raise ValueError(f"request {r.request.request_id} has {end - known_end} unknown input tokens")
        if known_end > r.start:
            input_ids[q : q + known_end - r.start] = r.request.token_ids(r.start, known_end)
        if known_end < end:
            pending_rows.append(i)
            pending_tokens.append(q + known_end - r.start)
        if num_drafts:
            input_ids[q + end - r.start : q + r.num_new_tokens] = r.draft_token_ids
            if r.draft_token_ids[-1] == PENDING_DRAFT_ID:  # a draft model's last draft, still on the device
                if known_end < end:
                    raise ValueError(f"request {r.request.request_id}: a pending token and a pending draft")
                pending_rows.append(i)
                pending_tokens.append(q + r.num_new_tokens - 1)
    row_of_token = np.repeat(np.arange(num_rows), query_lens)
    positions = starts[row_of_token] + (np.arange(num_tokens) - query_start_loc[row_of_token])

    max_blocks = max(max(len(r.request.block_ids) for r in rows), 1)
    block_tables = np.full((num_rows, max_blocks), PAD_BLOCK_ID, dtype=np.int64)
    for i, r in enumerate(rows):
        block_tables[i, : len(r.request.block_ids)] = r.request.block_ids
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size

    sample_rows = [i for i, r in enumerate(rows) if r.samples]
    samples_per_row = [1 + len(rows[i].draft_token_ids) for i in sample_rows]
    ends = query_start_loc[1:][sample_rows]
    if sum(samples_per_row) == len(sample_rows):
        sample_indices = ends - 1
    else:  # a row with drafts samples at each of its last 1 + drafts tokens
        sample_indices = np.concatenate([np.arange(e - n, e) for e, n in zip(ends, samples_per_row)])
    limits = _key_limits(rows, positions, query_start_loc) if key_limits else None
    return StepArrays(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        context_lens=starts,
        seq_lens=starts + query_lens,
        is_first_chunk=np.array([r.is_first_chunk for r in rows], dtype=np.int64),
        state_slots=np.array([r.request.state_slot for r in rows], dtype=np.int64),
        block_tables=block_tables,
        sample_indices=sample_indices.astype(np.int64),
        sample_rows=sample_rows,
        pending_rows=pending_rows,
        pending_tokens=np.array(pending_tokens, dtype=np.int64),
        samples_per_row=samples_per_row,
        key_limits=limits,
    )


def _key_limits(rows: list, positions: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
    """[T]: each token's own position, but a token inside one of its request's attention spans sees up to
    the span's last token, which the scheduler puts in the same chunk (ValueError where it did not)."""
    limits = positions.copy()
    for i, r in enumerate(rows):
        spans = r.request.attention_spans
        if not spans:
            continue
        lo, hi, q = r.start, r.start + r.num_new_tokens, int(query_start_loc[i])
        for start, end in spans:
            if start < hi and lo < end:
                if end > hi:
                    raise ValueError(f"request {r.request.request_id}: a chunk ends at {hi}, inside the "
                                     f"bidirectional span [{start}, {end})")
                first = max(start, lo)
                limits[q + first - lo : q + end - lo] = end - 1
    return limits


@dataclass
class ForwardBatch:
    """Flattened tokens of every row, in plan order. Made by ``ForwardBatch.from_views`` from device
    views of one host-to-device copy (or, on CPU, of the host arrays themselves).

    Under a CUDA graph the tensors are views of the runner's static buffers and the host-side
    numbers are the graph's bucket bounds; ``*_cpu`` lists are then None (no backend that needs
    them is ever captured).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its request
    query_start_loc: torch.Tensor  # [R + 1] int32
    context_lens: torch.Tensor  # [R] int32: tokens already cached before this step
    seq_lens: torch.Tensor  # [R] int32: context_lens + this step's tokens
    is_first_chunk: torch.Tensor  # [R] int32: 1 iff num_computed_tokens == 0 (never inferred from length)
    state_slots: torch.Tensor  # [R] int64: the request's recurrent-state slot (NO_STATE_SLOT if none)
    block_tables: torch.Tensor  # [R, W] int32, padded with PAD_BLOCK_ID
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    sample_indices: torch.Tensor  # [P] int64: the tokens sampled (StepArrays.sample_indices), in row order
    sample_rows: list[int]  # [S] the rows that sample
    num_rows: int
    num_tokens: int
    max_query_len: int  # an upper bound under graphs
    max_seq_len: int  # an upper bound under graphs
    # Rows at the front with exactly one token (decodes first, under ``mixed``); a backend may give them
    # decode-shaped work. Under a graph: the shape's decode part.
    num_leading_single_token_rows: int = 0
    # [T] int64: each token's LoRA slot (NO_LORA_SLOT: base weights alone), read by the LoRA layers while
    # the runner has them on; None in batches built outside the runner (kernel references, tests).
    lora_slots: torch.Tensor | None = None
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    attn_backend: AttentionBackend | None = None  # set by the runner
    # set by the runner: one [2, blocks, bs, Hkv, D] per layer (MLA's: [1, blocks, bs, 1, W], KVCacheSpec)
    kv_caches: list[torch.Tensor] | None = None
    kv_scales: list[KVScales] | None = None  # set by the runner for an FP8 cache: one per layer (None: 1.0)
    # Set by the runner for models with recurrent layers: one MambaLayerState per Mamba layer.
    recurrent_states: list | None = None
    # Set by the runner for an image model (ImageEmbeddings.views): (mask [T] bool, values [T, hidden]); a
    # token whose mask is set takes its value in place of its own embedding (an image's placeholder).
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # Set by the runner for an M-RoPE model (Qwen2-VL; MRopePositions.views): [3, T] int64, each token's
    # (temporal, height, width) positions. A text token's three are equal (its position plus its request's
    # delta); an image placeholder's are its grid cell's. None for every other model, which pays nothing.
    mrope_positions: torch.Tensor | None = None
    # [T] int64: the last key position each token sees, for a model whose images attend both ways (Gemma 3):
    # an image placeholder's is its image's last placeholder, every other token's its own position. Staged
    # with the step's arrays (StepArrays.key_limits); None for every other model, which pays nothing.
    key_limits: torch.Tensor | None = None
    # Set by the attention backend: metadata it derives from this batch once and reuses in every layer.
    backend_state: dict = field(default_factory=dict)

    @classmethod
    def from_views(
        cls,
        views: dict[str, torch.Tensor],
        sample_rows: list[int],
        max_query_len: int,
        max_seq_len: int,
        host: StepArrays | None = None,
        num_leading_single_token_rows: int = 0,
    ) -> ForwardBatch:
        """Build from device tensors named like StepArrays' fields, already in the dtypes the fields
        hold (INT32_FIELDS int32, the rest int64): views of the runner's fixed buffers, so a CUDA
        graph that builds its batch inside the capture launches nothing for it."""
        return cls(
            input_ids=views["input_ids"],
            positions=views["positions"],
            query_start_loc=views["query_start_loc"],
            context_lens=views["context_lens"],
            seq_lens=views["seq_lens"],
            is_first_chunk=views["is_first_chunk"],
            state_slots=views["state_slots"],
            block_tables=views["block_tables"],
            slot_mapping=views["slot_mapping"],
            sample_indices=views["sample_indices"],
            lora_slots=views["lora_slots"],
            key_limits=views.get("key_limits"),
            sample_rows=sample_rows,
            num_rows=views["seq_lens"].shape[0],
            num_tokens=views["input_ids"].shape[0],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_leading_single_token_rows=num_leading_single_token_rows,
            query_start_loc_cpu=None if host is None else host.query_start_loc.tolist(),
            seq_lens_cpu=None if host is None else host.seq_lens.tolist(),
        )

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        rotary: Rotary | None = None,
        qk_norm: QKNormModules | None = None,
        logit_softcap: float | None = None,
        causal: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's k, v for layer ``layer_idx`` and attend with q over the paged cache. With
        ``rotary``, q and k are rotated at ``self.positions`` first, by the backend (which may fuse the
        rotation with the store); with ``qk_norm`` (q_norm, k_norm), their head rows are normalised before
        that (fused too); ``logit_softcap``: Gemma 2's cap on the scores; ``causal`` False: each token sees
        its row's whole sequence, an encoder's; ``sinks`` ([Hq]): gpt-oss's per-head sink logits
        (AttentionBackend.attend)."""
        cache = self.kv_caches[layer_idx]
        scales = UNIT_SCALES if self.kv_scales is None else self.kv_scales[layer_idx]
        if rotary is None:
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            self.attn_backend.store_kv(k, v, cache, self, scales)
        else:
            q = self.attn_backend.rotate_and_store(q, k, v, cache, self, rotary, scales, qk_norm)
        return self.attn_backend.attend(q, cache, self, scale, sliding_window, kv_scales=scales,
                                        logit_softcap=logit_softcap, causal=causal, sinks=sinks)

    def latent_attention(self, layer_idx: int, q: torch.Tensor, row: torch.Tensor, scale: float,
                         value_width: int) -> torch.Tensor:
        """MLA (DeepSeek-V2 / V3): store this step's latent rows ([T, W]: c_kv, then the rotated k_pe) for
        layer ``layer_idx`` and attend with the absorbed queries q ([T, Hq, W]) over the one-plane cache;
        returns [T, Hq, value_width] (AttentionBackend.attend_latent)."""
        cache = self.kv_caches[layer_idx]
        self.attn_backend.store_latent(row, cache, self)
        return self.attn_backend.attend_latent(q, cache, self, scale, value_width)


STEP_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "lora_slots",
    "query_start_loc",
    "context_lens",
    "seq_lens",
    "is_first_chunk",
    "state_slots",
    "block_tables",
    "sample_indices",
)
# The fields kernels read as int32 (the input buffers keep an int32 mirror for them); the rest are int64.
INT32_FIELDS = ("query_start_loc", "context_lens", "seq_lens", "is_first_chunk", "block_tables")


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device) -> ForwardBatch:
    """A plan's ForwardBatch without persistent buffers (CPU runs and tests): on CPU the tensors
    are the host arrays themselves; elsewhere one copy of one concatenated buffer."""
    arrays = build_step_arrays(plan, block_size)
    return forward_batch_from_arrays(arrays, device)


def forward_batch_from_arrays(arrays: StepArrays, device: torch.device) -> ForwardBatch:
    names = STEP_FIELDS if arrays.key_limits is None else (*STEP_FIELDS, "key_limits")
    parts = [getattr(arrays, name) for name in names]
    host = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]))
    dev = host.to(device)  # a plain (synchronous) copy: this path keeps no staging buffer alive
    flat = torch.split(dev, [p.size for p in parts])
    views = {name: t.view(p.shape) for name, t, p in zip(names, flat, parts)}
    views.update({name: views[name].int() for name in INT32_FIELDS})
    return ForwardBatch.from_views(
        views, arrays.sample_rows, arrays.max_query_len, arrays.max_seq_len, host=arrays,
        num_leading_single_token_rows=arrays.num_leading_single_token_rows,
    )
