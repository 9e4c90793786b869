"""CUDA graphs of small steps: decode steps, and decodes with a few hundred prompt tokens beside them."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import numpy as np
import torch

from plait.runner.forward_batch import ForwardBatch, StepArrays
from plait.runner.input_buffers import InputBuffers
from plait.runner.padding import GraphShape, empty_step_arrays, fits, pad_to_shape

logger = logging.getLogger(__name__)

# Decode-row buckets: 1, 2, 4, 8, then every 8 up to 64, then every 16: a step pads to the next bucket,
# so the padding never wastes more than 16 rows where batches are large and little where they are small.
SMALL_BUCKETS = (1, 2, 4, 8)
MID_STEP, MID_LIMIT, LARGE_STEP = 8, 64, 16
# Prompt-token buckets of mixed-step graphs, up to max_prefill_tokens_beside_decodes (which is a bucket
# too). Eager, such a step costs ~15 ms of Python kernel launches on a Llama-8B (measured on an H200),
# three times its GPU time. Past MAX_GRAPH_PROMPT_TOKENS a step's GPU time hides its launches.
PROMPT_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024)
MAX_GRAPH_PROMPT_TOKENS = PROMPT_BUCKETS[-1]
WARMUP_RUNS = 2  # eager runs before a capture: compile kernels, settle library workspaces


def decode_buckets(max_rows: int) -> list[int]:
    sizes = [b for b in SMALL_BUCKETS if b < max_rows]
    size = SMALL_BUCKETS[-1]
    while size < max_rows:
        size += MID_STEP if size < MID_LIMIT else LARGE_STEP
        sizes.append(min(size, max_rows))
    sizes.append(max_rows)
    return sorted(set(sizes))


def prompt_buckets(max_prompt_tokens: int) -> list[int]:
    """The prompt parts of mixed-step graphs: the buckets below ``max_prompt_tokens`` (at most
    MAX_GRAPH_PROMPT_TOKENS), and that cap itself, so a step that uses its whole cap pads nothing."""
    cap = min(max_prompt_tokens, MAX_GRAPH_PROMPT_TOKENS)
    return [p for p in PROMPT_BUCKETS if p < cap] + ([cap] if cap > 0 else [])


def graph_shapes(max_rows: int, max_prompt_tokens: int) -> list[GraphShape]:
    """Decode-only shapes (one row per bucket), and mixed shapes: decode buckets (or none) beside each
    prompt bucket up to ``max_prompt_tokens``, over max_rows + 1 rows (one row takes pad tokens)."""
    decodes = decode_buckets(max_rows)
    shapes = [GraphShape(b, 0, b) for b in decodes]
    prompts = prompt_buckets(max_prompt_tokens)
    shapes += [GraphShape(d, p, max_rows + 1) for d in [0, *decodes] for p in prompts]
    return shapes


# The model under a graph: a ForwardBatch in, hidden states [T, hidden] out.
RunModel = Callable[[ForwardBatch], torch.Tensor]
MakeBatch = Callable[[dict[str, torch.Tensor], GraphShape], ForwardBatch]


class StepGraphs:
    """One CUDA graph per step shape. A step is padded to the smallest shape it fits: its leading
    one-token rows (decodes, or one-token prompt chunks: the same computation) to a decode bucket, the
    rest (prompt chunks) to a prompt-token bucket. The graph reads the runner's fixed input buffers and
    writes hidden states to a static buffer; the lm_head and sampling run after it on the real rows."""

    def __init__(self, buffers: InputBuffers, make_batch: MakeBatch, run_model: RunModel,
                 shapes: list[GraphShape], block_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.buffers, self.make_batch, self.run_model = buffers, make_batch, run_model
        self.shapes = sorted(shapes, key=lambda s: (s.num_tokens, s.num_rows))
        self.block_size = block_size
        max_tokens = max(s.num_tokens for s in shapes)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=buffers.device)
        self._graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self._sizes = [s.num_tokens for s in self.shapes]

    def shape_for(self, arrays: StepArrays) -> GraphShape | None:
        """The smallest captured shape the step fits, or None (it runs eager)."""
        start = bisect.bisect_left(self._sizes, arrays.num_tokens)
        return next((s for s in self.shapes[start:] if fits(arrays, s)), None)

    def pad(self, arrays: StepArrays, shape: GraphShape) -> StepArrays:
        return pad_to_shape(arrays, shape, self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape, largest first, so the smaller ones reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for shape in reversed(self.shapes):
                self._graphs[shape] = self._capture_one(shape, pool)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # Replays need neither: letting go of them (closures over the runner, which holds these graphs)
        # leaves no reference cycle, so a dropped engine is freed at once, frozen heap or not.
        self.make_batch = self.run_model = None
        logger.info("captured CUDA graphs for %d step shapes", len(self.shapes))

    def _capture_one(self, shape: GraphShape, pool: object) -> torch.cuda.CUDAGraph:
        no_pending = np.zeros(0, dtype=np.int64)
        views = self.buffers.stage(self.pad(empty_step_arrays(), shape), no_pending, full_width=True)
        for _ in range(WARMUP_RUNS):
            self._forward(views, shape)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream()):
            self._forward(views, shape)
        return graph

    def _forward(self, views: dict[str, torch.Tensor], shape: GraphShape) -> None:
        batch = self.make_batch(views, shape)
        self.hidden[: shape.num_tokens].copy_(self.run_model(batch))

    def replay(self, shape: GraphShape) -> torch.Tensor:
        """Run the shape's graph on what was staged last; returns hidden [num_tokens, hidden]."""
        self._graphs[shape].replay()
        return self.hidden[: shape.num_tokens]
