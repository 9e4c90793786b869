"""Persistent step-input buffers: pinned host staging and the fixed device buffer graphs read."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from plait.runner.forward_batch import STEP_FIELDS, StepArrays

# Pinned staging buffers used in turn. A buffer is written only after the copy that last read it
# has completed (its event), so two let the host fill one while the other's copy is in flight
# (FIELD-NOTES hazard 9).
NUM_STAGING_BUFFERS = 2
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
    device buffer at fixed addresses, so a graph replay reads the step that was staged before it.

    Two layouts share the buffer: a compact one, room for ``compact_tokens`` tokens, for the steps
    that fit it (decodes, and every CUDA-graph shape: the runner sizes it so), and the full one for
    larger prompt steps. The copy covers the layout's prefix up to the step's last block-table row,
    so a decode step beside a 16K-token budget copies ~30 KB instead of ~400 KB (a 10 us copy a step
    in an H200 trace of batch-1 decoding, on the token's critical path)."""

    def __init__(self, layout: Layout, device: torch.device, compact_tokens: int | None = None) -> None:
        self.layout = layout
        compact = min(layout.max_tokens, compact_tokens or layout.max_tokens)
        self.compact_layout = replace(layout, max_tokens=compact)
        self.device = device
        self.device_buffer = torch.zeros(layout.size, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._pinned = [
            torch.zeros(layout.size, dtype=torch.int64, pin_memory=pin) for _ in range(NUM_STAGING_BUFFERS)
        ]
        self._host = [t.numpy() for t in self._pinned]
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_STAGING_BUFFERS
        self._next = 0

    def layout_for(self, num_tokens: int) -> Layout:
        """The compact layout where the step's tokens fit it, else the full one."""
        return self.compact_layout if num_tokens <= self.compact_layout.max_tokens else self.layout

    def views(
        self, num_rows: int, num_tokens: int, num_samples: int, block_table_width: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Device views of the fixed buffer for a step of this shape (graph capture uses these)."""
        layout = self.layout_for(num_tokens)
        width = layout.block_table_width
        out = {}
        for name in STEP_FIELDS:
            start = layout.offset(name)
            if name == "block_tables":
                table = self.device_buffer[start : start + num_rows * width].view(num_rows, width)
                out[name] = table[:, :block_table_width] if block_table_width else table
                continue
            length = {"query_start_loc": num_rows + 1, "sample_indices": num_samples}.get(
                name, num_tokens if name in ("input_ids", "positions", "slot_mapping") else num_rows
            )
            out[name] = self.device_buffer[start : start + length]
        return out

    def stage(self, arrays: StepArrays, pending_src: np.ndarray, full_width: bool = False
              ) -> dict[str, torch.Tensor]:
        """Copy ``arrays`` (padded to a graph shape already, if it is one) to the device buffer. Returns
        the device views of the step, plus ``pending_dst`` / ``pending_src``: the input tokens to take
        from the previous step's sampled ids, and which of them. Graphs read the block tables at the
        full static width; eager steps only the columns the step uses."""
        i = self._next
        self._next = (i + 1) % NUM_STAGING_BUFFERS
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # never overwrite pinned memory a copy may still read
        host = self._host[i]
        layout = self.layout_for(arrays.num_tokens)
        used = self._fill(host, arrays, layout)
        num_pending = len(arrays.pending_rows)
        start = layout.offset("pending")
        host[start : start + num_pending] = arrays.query_start_loc[1:][arrays.pending_rows] - 1
        host[start + num_pending : start + 2 * num_pending] = pending_src
        self.device_buffer[:used].copy_(self._pinned[i][:used], non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[i] = self._copied[i] or torch.cuda.Event()
            event.record()
        width = None if full_width else arrays.block_tables.shape[1]
        views = self.views(arrays.num_rows, arrays.num_tokens, len(arrays.sample_indices), width)
        views["pending_dst"] = self.device_buffer[start : start + num_pending]
        views["pending_src"] = self.device_buffer[start + num_pending : start + 2 * num_pending]
        return views

    def _fill(self, host: np.ndarray, arrays: StepArrays, layout: Layout) -> int:
        """Write the arrays at ``layout``'s offsets; return how many leading elements the copy must cover."""
        if arrays.num_tokens > layout.max_tokens or arrays.num_rows > layout.max_rows:
            raise ValueError(
                f"step of {arrays.num_tokens} tokens / {arrays.num_rows} rows exceeds the input buffers "
                f"({layout.max_tokens} / {layout.max_rows})"
            )
        for name in STEP_FIELDS:
            if name != "block_tables":
                src = getattr(arrays, name)
                start = layout.offset(name)
                host[start : start + len(src)] = src
        start = layout.offset("block_tables")
        width = layout.block_table_width
        rows, used_width = arrays.block_tables.shape
        if used_width > width:
            raise ValueError(f"a row needs {used_width} KV blocks; the block table holds {width}")
        host[start : start + rows * width].reshape(rows, width)[:, :used_width] = arrays.block_tables
        return start + rows * width
