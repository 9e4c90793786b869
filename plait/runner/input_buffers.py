"""Persistent step-input buffers: pinned host staging and the fixed device buffer graphs read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plait.engine.kv_cache import PAD_BLOCK_ID
from plait.engine.state_slots import PAD_STATE_SLOT
from plait.runner.forward_batch import STEP_FIELDS, StepArrays

# Pinned staging buffers used in turn. A buffer is written only after the copy that last read it
# has completed (its event), so two let the host fill one while the other's copy is in flight
# (FIELD-NOTES hazard 9).
NUM_STAGING_BUFFERS = 2
# What padded rows of a CUDA-graph bucket hold: one token at position 0 of a one-token sequence in
# the pad block (and the pad state slot), so they attend to something finite and write their K/V
# and recurrent state where nothing reads it.
PAD_TOKEN_ID = 0
PAD_SLOT = PAD_BLOCK_ID  # slot 0 of the pad block (block_size * PAD_BLOCK_ID + 0)


# The buffer's sections, block tables last so that a step copies only the prefix it uses.
_FIELDS = tuple(n for n in STEP_FIELDS if n != "block_tables") + ("pending", "block_tables")


@dataclass(frozen=True)
class Layout:
    """Fixed offsets (in int64 elements) of each field in the one flat buffer. Block tables come last
    so a step copies only the prefix it uses."""

    max_tokens: int
    max_rows: int
    block_table_width: int

    def capacity(self, name: str) -> int:
        if name in ("input_ids", "positions", "slot_mapping"):
            return self.max_tokens
        if name == "query_start_loc":
            return self.max_rows + 1
        if name == "block_tables":
            return self.max_rows * self.block_table_width
        if name == "pending":  # destinations then sources of the pending input tokens
            return 2 * self.max_rows
        return self.max_rows

    def offset(self, name: str) -> int:
        return sum(self.capacity(n) for n in _FIELDS[: _FIELDS.index(name)])

    @property
    def size(self) -> int:
        return sum(self.capacity(n) for n in _FIELDS)


class InputBuffers:
    """Stages a step's arrays into pinned memory and copies them to one fixed device buffer with a
    single non-blocking copy. Tensors of every step (and of every captured graph) are views of that
    device buffer at fixed addresses, so a graph replay reads the step that was staged before it."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.device_buffer = torch.zeros(layout.size, dtype=torch.int64, device=device)
        self._pinned = [
            torch.zeros(layout.size, dtype=torch.int64).pin_memory() for _ in range(NUM_STAGING_BUFFERS)
        ]
        self._host = [t.numpy() for t in self._pinned]
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_STAGING_BUFFERS
        self._next = 0

    def views(
        self, num_rows: int, num_tokens: int, num_samples: int, block_table_width: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Device views of the fixed buffer for a step of this shape (graph capture uses these)."""
        width = self.layout.block_table_width
        out = {}
        for name in STEP_FIELDS:
            start = self.layout.offset(name)
            if name == "block_tables":
                table = self.device_buffer[start : start + num_rows * width].view(num_rows, width)
                out[name] = table[:, :block_table_width] if block_table_width else table
                continue
            length = {"query_start_loc": num_rows + 1, "sample_indices": num_samples}.get(
                name, num_tokens if name in ("input_ids", "positions", "slot_mapping") else num_rows
            )
            out[name] = self.device_buffer[start : start + length]
        return out

    def stage(self, arrays: StepArrays, num_rows: int | None = None, pending_src: np.ndarray | None = None
              ) -> dict[str, torch.Tensor]:
        """Copy ``arrays`` to the device buffer, padded to ``num_rows`` one-token rows (a graph bucket)
        when given. Returns the device views of the step, plus ``pending_dst`` / ``pending_src``:
        the input tokens to take from the previous step's sampled ids, and which of them."""
        padded_rows = num_rows or arrays.num_rows
        pad = padded_rows - arrays.num_rows
        num_tokens = arrays.num_tokens + pad
        i = self._next
        self._next = (i + 1) % NUM_STAGING_BUFFERS
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # never overwrite pinned memory a copy may still read
        host = self._host[i]
        used = self._fill(host, arrays, pad)
        num_pending = len(arrays.pending_rows)
        start = self.layout.offset("pending")
        host[start : start + num_pending] = arrays.query_start_loc[1:][arrays.pending_rows] - 1
        host[start + num_pending : start + 2 * num_pending] = pending_src if num_pending else ()
        used = max(used, start + 2 * num_pending)
        self.device_buffer[:used].copy_(self._pinned[i][:used], non_blocking=True)
        event = self._copied[i] = self._copied[i] or torch.cuda.Event()
        event.record()
        # Eager steps read only the columns this step uses; graphs keep the full static width.
        width = None if num_rows else arrays.block_tables.shape[1]
        views = self.views(padded_rows, num_tokens, len(arrays.sample_indices), width)
        views["pending_dst"] = self.device_buffer[start : start + num_pending]
        views["pending_src"] = self.device_buffer[start + num_pending : start + 2 * num_pending]
        return views

    def _fill(self, host: np.ndarray, arrays: StepArrays, pad: int) -> int:
        """Write the arrays (and ``pad`` padded rows) at their offsets; return the elements to copy."""
        layout = self.layout
        rows, tokens = arrays.num_rows, arrays.num_tokens
        if tokens + pad > layout.max_tokens or rows + pad > layout.max_rows:
            raise ValueError(
                f"step of {tokens} tokens / {rows} rows exceeds the input buffers "
                f"({layout.max_tokens} / {layout.max_rows})"
            )
        pad_values = {
            "input_ids": PAD_TOKEN_ID,
            "positions": 0,
            "slot_mapping": PAD_SLOT,
            "context_lens": 0,
            "seq_lens": 1,
            "is_first_chunk": 1,
            "state_slots": PAD_STATE_SLOT,
        }
        for name in STEP_FIELDS:
            if name == "block_tables":
                continue
            src = getattr(arrays, name)
            start = layout.offset(name)
            host[start : start + len(src)] = src
            if name == "query_start_loc":
                # Padded rows are one token each, continuing after the last real token.
                host[start + len(src) : start + len(src) + pad] = src[-1] + np.arange(1, pad + 1)
            elif name in pad_values:
                host[start + len(src) : start + len(src) + pad] = pad_values[name]
        start = layout.offset("block_tables")
        width = layout.block_table_width
        table = host[start : start + (rows + pad) * width].reshape(rows + pad, width)
        used_width = arrays.block_tables.shape[1]
        if used_width > width:
            raise ValueError(f"a row needs {used_width} KV blocks; the block table holds {width}")
        table[:rows, :used_width] = arrays.block_tables
        table[rows:, 0] = PAD_BLOCK_ID
        return start + (rows + pad) * width


def empty_step_arrays() -> StepArrays:
    """A step of no rows: staged with padding, it fills a graph bucket with pad rows only."""
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
