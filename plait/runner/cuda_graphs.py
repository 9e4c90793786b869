"""CUDA graphs of one-token-per-row steps (every decode step), one graph per batch-size bucket."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from plait.runner.forward_batch import ForwardBatch
from plait.runner.input_buffers import InputBuffers, empty_step_arrays

logger = logging.getLogger(__name__)

# Buckets: 1, 2, 4, 8, then every 8 up to 64, then every 16: a step pads to the next bucket, so the
# padding never wastes more than 16 rows where batches are large and little where they are small.
SMALL_BUCKETS = (1, 2, 4, 8)
MID_STEP, MID_LIMIT, LARGE_STEP = 8, 64, 16
WARMUP_RUNS = 2  # eager runs before a capture: compile kernels, settle library workspaces


def bucket_sizes(max_rows: int) -> list[int]:
    sizes = [b for b in SMALL_BUCKETS if b < max_rows]
    size = SMALL_BUCKETS[-1]
    while size < max_rows:
        size += MID_STEP if size < MID_LIMIT else LARGE_STEP
        sizes.append(min(size, max_rows))
    sizes.append(max_rows)
    return sorted(set(sizes))


# The model under a graph: a ForwardBatch in, hidden states [T, hidden] out.
RunModel = Callable[[ForwardBatch], torch.Tensor]
MakeBatch = Callable[[dict[str, torch.Tensor], int], ForwardBatch]


class DecodeGraphs:
    """Captures the model forward for steps where every row has exactly one new token.

    Such a step is the same computation whether its rows are decodes or one-token prompt chunks
    (the attention kernel reads each row's context from its block table), so the choice is about
    shapes, never about what a row is. The graph reads the runner's fixed input buffers and writes
    hidden states to a static buffer; the lm_head and sampling run after it on the real rows only.
    """

    def __init__(
        self,
        buffers: InputBuffers,
        make_batch: MakeBatch,
        run_model: RunModel,
        max_rows: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.buffers = buffers
        self.make_batch = make_batch
        self.run_model = run_model
        self.buckets = bucket_sizes(max_rows)
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=buffers.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    def bucket_for(self, num_rows: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_rows)
        return self.buckets[i] if i < len(self.buckets) else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, so the smaller ones reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):
                self._graphs[size] = self._capture_one(size, pool)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for %d batch sizes up to %d", len(self.buckets), self.buckets[-1])

    def _capture_one(self, size: int, pool: object) -> torch.cuda.CUDAGraph:
        views = self.buffers.stage(empty_step_arrays(), num_rows=size)  # all pad rows: valid inputs
        for _ in range(WARMUP_RUNS):
            self._forward(views, size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream()):
            self._forward(views, size)
        return graph

    def _forward(self, views: dict[str, torch.Tensor], size: int) -> None:
        batch = self.make_batch(views, size)
        self.hidden[:size].copy_(self.run_model(batch))

    def input_ids(self, size: int) -> torch.Tensor:
        """The static input ids the bucket's graph reads (patched for pending tokens before replay)."""
        return self.buffers.views(size, size, 0)["input_ids"]

    def replay(self, size: int) -> torch.Tensor:
        """Run the bucket's graph on what was staged last; returns hidden [size, hidden]."""
        self._graphs[size].replay()
        self.num_replays += 1
        return self.hidden[:size]
