"""Padding a step to a CUDA-graph shape: decode rows, then prompt rows, each part padded to its bucket."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.engine.kv_cache import PAD_BLOCK_ID
from plait.engine.state_slots import PAD_STATE_SLOT
from plait.runner.forward_batch import StepArrays

# What pad rows hold: tokens at positions 0.. of a sequence in the pad block (and the pad state
# slot), so they attend to something finite and write their K/V and state where nothing reads it.
PAD_TOKEN_ID = 0
PAD_SLOT = PAD_BLOCK_ID  # slot 0 of the pad block (block_size * PAD_BLOCK_ID + 0)


@dataclass(frozen=True, order=True)
class GraphShape:
    """A captured step shape: ``decode_rows`` one-token rows, then prompt rows holding ``prompt_tokens``
    tokens in all, ``num_rows`` rows in all (prompt rows past the real ones are empty, but the last,
    which takes the prompt part's pad tokens)."""

    decode_rows: int
    prompt_tokens: int
    num_rows: int

    @property
    def num_tokens(self) -> int:
        return self.decode_rows + self.prompt_tokens


def fits(arrays: StepArrays, shape: GraphShape) -> bool:
    """Whether the step can be padded to ``shape``: its leading one-token rows fit the decode part and
    the rest (prompt chunks) the prompt part, with a row to spare for the pad tokens."""
    d = arrays.num_leading_single_token_rows
    prompt_rows = arrays.num_rows - d
    prompt_tokens = arrays.num_tokens - d
    if shape.prompt_tokens == 0:
        return prompt_rows == 0 and d <= shape.decode_rows == shape.num_rows
    return (d <= shape.decode_rows and prompt_tokens <= shape.prompt_tokens
            and shape.decode_rows + prompt_rows + 1 <= shape.num_rows)


def pad_to_shape(arrays: StepArrays, shape: GraphShape, block_size: int) -> StepArrays:
    """The step laid out as ``shape``: [real decode rows | one-token pad rows | real prompt rows | empty
    pad rows, the last holding the prompt part's pad tokens]. Real rows keep their data; their tokens
    move by the decode pad, which sample_indices follow (sample_rows still name plan rows)."""
    if not fits(arrays, shape):
        raise ValueError(f"a step of {arrays.num_rows} rows / {arrays.num_tokens} tokens does not fit "
                         f"{shape}")
    d = arrays.num_leading_single_token_rows
    qsl = arrays.query_start_loc
    decode_pad = shape.decode_rows - d
    prompt_rows = arrays.num_rows - d
    prompt_pad_rows = shape.num_rows - shape.decode_rows - prompt_rows
    prompt_pad_tokens = shape.prompt_tokens - (arrays.num_tokens - d)
    pad_row_lens = [0] * (prompt_pad_rows - 1) + [prompt_pad_tokens] if prompt_pad_rows else []

    def tokens(name: str, pad_value: int, pad_positions: bool = False) -> np.ndarray:
        real = getattr(arrays, name)
        decode_fill = np.zeros(decode_pad, np.int64) if pad_positions else np.full(decode_pad, pad_value)
        prompt_fill = (np.arange(prompt_pad_tokens) if pad_positions
                       else np.full(prompt_pad_tokens, pad_value))
        return np.concatenate([real[:d], decode_fill, real[d:], prompt_fill]).astype(np.int64)

    def rows(name: str, decode_value: int, prompt_values: list[int] | int) -> np.ndarray:
        real = getattr(arrays, name)
        fill = np.broadcast_to(np.asarray(prompt_values, np.int64), (prompt_pad_rows,))
        return np.concatenate([real[:d], np.full(decode_pad, decode_value), real[d:], fill]).astype(np.int64)

    lens = np.concatenate([np.diff(qsl[: d + 1]), np.ones(decode_pad, np.int64), np.diff(qsl[d:]),
                           np.asarray(pad_row_lens, np.int64)])
    query_start_loc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    # Every column a pad row's keys reach points at the pad block (staging writes only these columns).
    pad_cols = -(-max(pad_row_lens, default=1) // block_size)
    width = max(arrays.block_tables.shape[1], pad_cols, 1)
    tables = np.full((shape.num_rows, width), PAD_BLOCK_ID, np.int64)
    tables[:d, : arrays.block_tables.shape[1]] = arrays.block_tables[:d]
    real_prompt = slice(shape.decode_rows, shape.decode_rows + prompt_rows)
    tables[real_prompt, : arrays.block_tables.shape[1]] = arrays.block_tables[d:]
    shift = np.where(arrays.sample_indices >= d, decode_pad, 0)
    return StepArrays(
        input_ids=tokens("input_ids", PAD_TOKEN_ID),
        positions=tokens("positions", 0, pad_positions=True),
        slot_mapping=tokens("slot_mapping", PAD_SLOT),
        query_start_loc=query_start_loc,
        context_lens=rows("context_lens", 0, 0),
        seq_lens=rows("seq_lens", 1, pad_row_lens),
        is_first_chunk=rows("is_first_chunk", 1, 1),
        state_slots=rows("state_slots", PAD_STATE_SLOT, PAD_STATE_SLOT),
        block_tables=tables,
        sample_indices=arrays.sample_indices + shift,
        sample_rows=arrays.sample_rows,
        pending_rows=arrays.pending_rows,  # decode rows only: they keep their place
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
