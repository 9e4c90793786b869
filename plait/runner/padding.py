"""Padding a step to a CUDA-graph shape: a decode part of rows, then prompt rows, in whole token buckets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.engine.kv_cache import PAD_BLOCK_ID
from plait.engine.state_slots import PAD_STATE_SLOT
from plait.lora.slots import NO_LORA_SLOT
from plait.runner.forward_batch import StepArrays

# What pad rows hold: tokens at positions 0.. of a sequence in the pad block (and the pad state
# slot), so they attend to something finite and write their K/V and state where nothing reads it.
PAD_TOKEN_ID = 0
PAD_SLOT = PAD_BLOCK_ID  # slot 0 of the pad block (block_size * PAD_BLOCK_ID + 0)


@dataclass(frozen=True, order=True)
class GraphShape:
    """A captured step shape of ``num_tokens`` tokens over ``num_rows`` rows, whose first ``decode_rows``
    rows hold at most one token each (the decode part, attended with decode-shaped work).

    A decode-only shape (``num_tokens == decode_rows == num_rows``) pads with one-token rows. A mixed
    shape pads its decode part with empty rows, so prompt tokens follow the real decodes directly and
    every token the shape has is the step's to use: ``num_tokens`` is the matmuls' row count, chosen
    in whole GEMM tiles (plait.engine.scheduler.STEP_TOKEN_ALIGNMENT). Rows past the real prompt rows
    are empty but the last, which takes the pad tokens."""

    decode_rows: int
    num_tokens: int
    num_rows: int

    @property
    def is_mixed(self) -> bool:
        return self.num_tokens > self.decode_rows

    @property
    def max_query_len(self) -> int:
        """An upper bound on a row's tokens in a step of this shape (the kernels size tiles by it)."""
        return self.num_tokens if self.is_mixed else 1


def fits(arrays: StepArrays, shape: GraphShape) -> bool:
    """Whether the step can be padded to ``shape``: its leading one-token rows fit the decode part, its
    tokens the shape's tokens, and its prompt rows the rows left, with one to spare for the pad tokens."""
    d = arrays.num_leading_single_token_rows
    prompt_rows = arrays.num_rows - d
    if not shape.is_mixed:
        return prompt_rows == 0 and d <= shape.decode_rows
    return (d <= shape.decode_rows and arrays.num_tokens <= shape.num_tokens
            and shape.decode_rows + prompt_rows + 1 <= shape.num_rows)


def pad_to_shape(arrays: StepArrays, shape: GraphShape, block_size: int) -> StepArrays:
    """The step laid out as ``shape``. Decode-only: [real decode rows | one-token pad rows]. Mixed:
    [real decode rows | empty rows | real prompt rows | empty rows, the last holding the pad tokens],
    tokens [real tokens | pad tokens]. Real rows and tokens keep their data and, in mixed shapes, their
    token indices (sample_indices follow the decode-only shapes' pad rows; sample_rows name plan rows)."""
    if not fits(arrays, shape):
        raise ValueError(f"a step of {arrays.num_rows} rows / {arrays.num_tokens} tokens does not fit "
                         f"{shape}")
    if not shape.is_mixed and arrays.num_rows == shape.decode_rows:
        return arrays  # a decode step of the shape's own size: nothing to pad, so no numpy pass to make
    d = arrays.num_leading_single_token_rows
    prompt_rows = arrays.num_rows - d
    decode_pad_rows = shape.decode_rows - d
    prompt_pad_rows = shape.num_rows - shape.decode_rows - prompt_rows
    pad_tokens = shape.num_tokens - arrays.num_tokens
    if shape.is_mixed:
        # Empty decode pad rows; every pad token in the last row, a sequence at positions 0.. of the pad
        # block (empty rows take no tokens, so a mixed step's tokens need not move).
        decode_pad_lens = [0] * decode_pad_rows
        prompt_pad_lens = [0] * (prompt_pad_rows - 1) + [pad_tokens]
        token_pad_at = arrays.num_tokens
    else:
        decode_pad_lens, prompt_pad_lens, token_pad_at = [1] * decode_pad_rows, [], d

    def tokens(name: str, fill: np.ndarray) -> np.ndarray:
        real = getattr(arrays, name)
        return np.concatenate([real[:token_pad_at], fill, real[token_pad_at:]]).astype(np.int64)

    def rows(name: str, decode_fill: list[int] | int, prompt_fill: list[int] | int) -> np.ndarray:
        real = getattr(arrays, name)
        dfill = np.broadcast_to(np.asarray(decode_fill, np.int64), (decode_pad_rows,))
        pfill = np.broadcast_to(np.asarray(prompt_fill, np.int64), (prompt_pad_rows,))
        return np.concatenate([real[:d], dfill, real[d:], pfill]).astype(np.int64)

    qsl = arrays.query_start_loc
    lens = np.concatenate([np.diff(qsl[: d + 1]), np.asarray(decode_pad_lens, np.int64), np.diff(qsl[d:]),
                           np.asarray(prompt_pad_lens, np.int64)])
    query_start_loc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    # Every column a pad row's keys reach points at the pad block (staging writes only these columns).
    pad_cols = -(-max(decode_pad_lens + prompt_pad_lens, default=1) // block_size)
    width = max(arrays.block_tables.shape[1], pad_cols, 1)
    tables = np.full((shape.num_rows, width), PAD_BLOCK_ID, np.int64)
    tables[:d, : arrays.block_tables.shape[1]] = arrays.block_tables[:d]
    real_prompt = slice(shape.decode_rows, shape.decode_rows + prompt_rows)
    tables[real_prompt, : arrays.block_tables.shape[1]] = arrays.block_tables[d:]
    shift = np.where(arrays.sample_indices >= token_pad_at, pad_tokens, 0)
    pad_positions = np.zeros(pad_tokens) if not shape.is_mixed else np.arange(pad_tokens)
    return StepArrays(
        input_ids=tokens("input_ids", np.full(pad_tokens, PAD_TOKEN_ID)),
        positions=tokens("positions", pad_positions),
        slot_mapping=tokens("slot_mapping", np.full(pad_tokens, PAD_SLOT)),
        lora_slots=tokens("lora_slots", np.full(pad_tokens, NO_LORA_SLOT)),
        query_start_loc=query_start_loc,
        context_lens=rows("context_lens", 0, 0),
        seq_lens=rows("seq_lens", decode_pad_lens, prompt_pad_lens),
        is_first_chunk=rows("is_first_chunk", 1, 1),
        state_slots=rows("state_slots", PAD_STATE_SLOT, PAD_STATE_SLOT),
        block_tables=tables,
        sample_indices=arrays.sample_indices + shift,
        sample_rows=arrays.sample_rows,
        pending_rows=arrays.pending_rows,  # decode rows only: they keep their place
        pending_tokens=arrays.pending_tokens,  # so do their tokens (decode-only shapes pad after them)
        samples_per_row=arrays.samples_per_row,
        # pad tokens see keys up to their own positions, as causal ones
        key_limits=None if arrays.key_limits is None else tokens("key_limits", pad_positions),
    )


def empty_step_arrays() -> StepArrays:
    """A step of no rows: padded to a shape, it fills a graph with pad rows only (graph capture)."""
    none = np.zeros(0, dtype=np.int64)
    return StepArrays(
        input_ids=none,
        positions=none,
        slot_mapping=none,
        query_start_loc=np.zeros(1, dtype=np.int64),
        context_lens=none,
        seq_lens=none,
        is_first_chunk=none,
        state_slots=none,
        block_tables=np.zeros((0, 1), dtype=np.int64),
        sample_indices=none,
        sample_rows=[],
    )
