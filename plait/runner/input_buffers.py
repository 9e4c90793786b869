"""Persistent step-input buffers: pinned host staging and the fixed device buffer graphs read."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from plait.kernels.dispatch import triton_enabled, triton_importable
from plait.runner.forward_batch import INT32_FIELDS, STEP_FIELDS, StepArrays

# Pinned staging buffers used in turn. A buffer is written only after the copy that last read it
# has completed (its event), so two let the host fill one while the other's copy is in flight
# (FIELD-NOTES hazard 9).
NUM_STAGING_BUFFERS = 2
# A section only layouts with ``key_limits`` give room (a model whose images attend both ways: Gemma 3).
KEY_LIMITS = "key_limits"
# The buffer's sections, block tables last so that a step copies only the prefix it uses.
_FIELDS = tuple(n for n in STEP_FIELDS if n != "block_tables") + (KEY_LIMITS, "block_tables")
# The fields with one entry per token (the rest have one per row, or per sampling row).
TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "lora_slots")


def pending_marker(source: int | np.ndarray) -> int | np.ndarray:
    """How the host stages an input id still on the device: -(its index in the previous step's
    sampled ids) - 1, so every marker is negative and no real token id (>= 0) is one (elementwise
    for an array of sources)."""
    return -source - 1


def prepare_step_inputs_ref(
    staged: torch.Tensor, num_tokens: int, prev_ids: torch.Tensor | None, out64: torch.Tensor,
    out32: torch.Tensor,
) -> None:
    """Land a staged step (the torch reference of plait.kernels.step_inputs, and the CPU path).

    staged: [used] int64, the input ids first (``num_tokens`` of them, pending ones as markers);
    prev_ids: [S] int64, the previous step's sampled ids, or None; out64, out32: [>= used]."""
    used = staged.shape[0]
    out64[:used].copy_(staged)
    if prev_ids is not None and prev_ids.numel():  # the runner stages markers only beside a prev
        ids = out64[:num_tokens]
        source = (-ids - 1).clamp_(0, prev_ids.numel() - 1)  # no host sync: real ids read a dummy
        ids.copy_(torch.where(ids < 0, prev_ids[source], ids))
    out32[:used].copy_(out64[:used])


@dataclass(frozen=True)
class Layout:
    """Fixed offsets (in int64 elements) of each field in the one flat buffer. Block tables come last
    so a step copies only the prefix it uses."""

    max_tokens: int
    max_rows: int
    block_table_width: int
    # Room for StepArrays.key_limits ([T]); without it the section is empty and the other offsets unchanged.
    key_limits: bool = False

    def capacity(self, name: str) -> int:
        if name == KEY_LIMITS:
            return self.max_tokens if self.key_limits else 0
        # Any token may be sampled (speculative decoding samples every token of a row with drafts).
        if name in TOKEN_FIELDS or name == "sample_indices":
            return self.max_tokens
        if name == "query_start_loc":
            return self.max_rows + 1
        if name == "block_tables":
            return self.max_rows * self.block_table_width
        return self.max_rows

    def offset(self, name: str) -> int:
        return _offsets(self)[name]

    @property
    def size(self) -> int:
        return sum(self.capacity(n) for n in _FIELDS)


@functools.cache
def _offsets(layout: Layout) -> dict[str, int]:
    """Each field's offset in ``layout``: looked up ~20 times a step, so worked out once per layout."""
    ends = itertools.accumulate(layout.capacity(n) for n in _FIELDS)
    return dict(zip(_FIELDS, [0, *ends]))


class InputBuffers:
    """Stages a step's arrays into pinned memory, copies them to the device with a single non-blocking
    copy, and lands them in one fixed device buffer (and its int32 mirror) with one launch that also
    patches the input ids still on the device. Tensors of every step (and of every captured graph)
    are views of those fixed buffers, so a graph replay reads the step that was staged before it.

    On CUDA the copy runs on its own stream into one of two device staging buffers, so it overlaps
    the step still running (which reads the fixed buffers); only the landing launch waits for that
    step, on the compute stream.

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
        # The fields the kernels read as int32 are views of this mirror, at the same offsets.
        self.device_buffer32 = torch.zeros(layout.size, dtype=torch.int32, device=device)
        on_cuda = device.type == "cuda"
        self._pinned = [torch.zeros(layout.size, dtype=torch.int64, pin_memory=on_cuda)
                        for _ in range(NUM_STAGING_BUFFERS)]
        self._host = [t.numpy() for t in self._pinned]
        # CUDA only: where each copy lands, the stream that copies, and per buffer the events that
        # order it: its copy is done (pinned memory free, staging readable), its landing launch is done
        # (staging free).
        self._staging = [torch.zeros_like(self.device_buffer) for _ in self._pinned] if on_cuda else []
        self._copy_stream = torch.cuda.Stream(device) if on_cuda else None
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_STAGING_BUFFERS
        self._landed: list[torch.cuda.Event | None] = [None] * NUM_STAGING_BUFFERS
        self._next = 0

    def layout_for(self, num_tokens: int) -> Layout:
        """The compact layout where the step's tokens fit it, else the full one."""
        return self.compact_layout if num_tokens <= self.compact_layout.max_tokens else self.layout

    def views(
        self, num_rows: int, num_tokens: int, num_samples: int, block_table_width: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Device views of the fixed buffers for a step of this shape (graph capture uses these): int32
        for INT32_FIELDS, int64 for the rest."""
        layout = self.layout_for(num_tokens)
        width = layout.block_table_width
        out = {}
        for name in STEP_FIELDS:
            start = layout.offset(name)
            buffer = self.device_buffer32 if name in INT32_FIELDS else self.device_buffer
            if name == "block_tables":
                table = buffer[start : start + num_rows * width].view(num_rows, width)
                out[name] = table[:, :block_table_width] if block_table_width else table
                continue
            length = {"query_start_loc": num_rows + 1, "sample_indices": num_samples}.get(
                name, num_tokens if name in TOKEN_FIELDS else num_rows
            )
            out[name] = buffer[start : start + length]
        if layout.key_limits:
            start = layout.offset(KEY_LIMITS)
            out[KEY_LIMITS] = self.device_buffer[start : start + num_tokens]
        return out

    def stage(self, arrays: StepArrays, pending_src: np.ndarray, prev_ids: torch.Tensor | None = None,
              full_width: bool = False) -> dict[str, torch.Tensor]:
        """Copy ``arrays`` (padded to a graph shape already, if it is one) to the fixed buffers, in stream
        order before whatever is launched next. Row ``pending_rows[j]``'s input id is
        ``prev_ids[pending_src[j]]``: the previous step's sampled id, still on the device. Returns the
        device views of the step. Graphs read the block tables at the full static width; eager steps
        only the columns the step uses."""
        i = self._next
        self._next = (i + 1) % NUM_STAGING_BUFFERS
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # never overwrite pinned memory a copy may still read
        host = self._host[i]
        layout = self.layout_for(arrays.num_tokens)
        used = self._fill(host, arrays, layout)
        host[arrays.pending_token_indices] = pending_marker(pending_src)  # one numpy op, no loop a row
        if self._copy_stream is None:
            prepare_step_inputs_ref(self._pinned[i][:used], arrays.num_tokens, prev_ids,
                                    self.device_buffer, self.device_buffer32)
        else:
            self._copy_and_land(i, used, arrays.num_tokens, prev_ids)
        width = None if full_width else arrays.block_tables.shape[1]
        return self.views(arrays.num_rows, arrays.num_tokens, len(arrays.sample_indices), width)

    def _copy_and_land(self, i: int, used: int, num_tokens: int, prev_ids: torch.Tensor | None) -> None:
        land = prepare_step_inputs_ref
        if triton_enabled() and triton_importable():
            from plait.kernels.step_inputs import prepare_step_inputs as land

        compute = torch.cuda.current_stream(self.device)
        staging = self._staging[i][:used]
        copied = self._copied[i] = self._copied[i] or torch.cuda.Event()
        landed = self._landed[i] = self._landed[i] or torch.cuda.Event()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(landed)  # the landing launch two steps back read this staging
            staging.copy_(self._pinned[i][:used], non_blocking=True)
            copied.record()
        compute.wait_event(copied)
        land(staging, num_tokens, prev_ids, self.device_buffer, self.device_buffer32)
        landed.record(compute)

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
        if arrays.key_limits is not None:
            if not layout.key_limits:
                raise ValueError("the step has key limits; these input buffers have no room for them")
            start = layout.offset(KEY_LIMITS)
            host[start : start + arrays.num_tokens] = arrays.key_limits
        start = layout.offset("block_tables")
        width = layout.block_table_width
        rows, used_width = arrays.block_tables.shape
        if used_width > width:
            raise ValueError(f"a row needs {used_width} KV blocks; the block table holds {width}")
        host[start : start + rows * width].reshape(rows, width)[:, :used_width] = arrays.block_tables
        return start + rows * width
