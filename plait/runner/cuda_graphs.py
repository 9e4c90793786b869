"""CUDA graphs of small steps: decode steps, and decodes with a few hundred prompt tokens beside them."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import numpy as np
import torch

from plait.engine.scheduler import STEP_TOKEN_ALIGNMENT
from plait.runner.forward_batch import ForwardBatch, StepArrays
from plait.runner.input_buffers import InputBuffers
from plait.runner.padding import GraphShape, empty_step_arrays, fits, pad_to_shape

logger = logging.getLogger(__name__)

# Decode-row buckets: 1, 2, 4, 8, then every 8 up to 64, then every 16: a step pads to the next bucket,
# so the padding never wastes more than 16 rows where batches are large and little where they are small.
SMALL_BUCKETS = (1, 2, 4, 8)
MID_STEP, MID_LIMIT, LARGE_STEP = 8, 64, 16
# Token counts of mixed-step graphs: small ones, then whole GEMM row tiles (STEP_TOKEN_ALIGNMENT, which
# the scheduler aligns mixed steps to), up to a decode part plus MAX_GRAPH_PROMPT_TOKENS. Eager, such a
# step costs ~15 ms of Python kernel launches on a Llama-8B (measured on an H200), three times its GPU
# time; past MAX_GRAPH_PROMPT_TOKENS prompt tokens a step's GPU time hides its launches.
SMALL_TOKEN_BUCKETS = (32, 64)
# Under speculative decoding, also shapes of 8 and 16 tokens with no decode part: a few rows of 1 + drafts
# tokens (batch 1-3 at 4 drafts) then take the skinny GEMMs that decode rows take, not 32-row matmuls.
SPEC_TOKEN_BUCKETS = (8, 16)
MAX_GRAPH_PROMPT_TOKENS = 1024
WARMUP_RUNS = 2  # eager runs before a capture: compile kernels, settle library workspaces
# Prompt rows of the first mixed shape of each size. Every row owns at least one query tile of the
# prompt part's attention launch, empty or not; with room for max_num_seqs rows W4's 256-token chunk
# launched ~250 tiles of empty rows per kv head and split, and its attention took 4.84 ms a step
# instead of 3.03 (H200, 32 layers; benchmarks/results/attention_steps_h200.json). A step with more
# prompt rows takes the shape with room for all.
FEW_PROMPT_ROWS = 8


def decode_buckets(max_rows: int, chosen: list[int] | None = None) -> list[int]:
    """The decode batch sizes captured: SMALL_BUCKETS then every MID_STEP / LARGE_STEP up to ``max_rows``;
    or ``chosen`` (vLLM's --cuda-graph-sizes: one size N means 1, 2, 4 and every 8 up to N), the sizes over
    ``max_rows`` left out. A decode step with more rows than the largest runs eager."""
    if chosen:
        if len(chosen) == 1:
            chosen = [*SMALL_BUCKETS[:-1], *range(SMALL_BUCKETS[-1], chosen[0] + 1, MID_STEP)]
        return sorted({size for size in chosen if size <= max_rows})
    sizes = [b for b in SMALL_BUCKETS if b < max_rows]
    size = SMALL_BUCKETS[-1]
    while size < max_rows:
        size += MID_STEP if size < MID_LIMIT else LARGE_STEP
        sizes.append(min(size, max_rows))
    sizes.append(max_rows)
    return sorted(set(sizes))


def token_buckets(decode_rows: int, max_prompt_tokens: int, max_tokens: int,
                  small: tuple[int, ...] = SMALL_TOKEN_BUCKETS) -> list[int]:
    """Token counts of the mixed shapes over a decode part of ``decode_rows`` rows: every bucket with
    room for a prompt token (``small`` ones, then whole tiles), up to the first with room for
    ``max_prompt_tokens`` (at most MAX_GRAPH_PROMPT_TOKENS) beside a full decode part, and none over
    ``max_tokens`` (a shape's pad tokens are one sequence, which must fit max_model_len)."""
    cap = min(max_prompt_tokens, MAX_GRAPH_PROMPT_TOKENS)
    need = decode_rows + cap
    tiles = -(-need // STEP_TOKEN_ALIGNMENT)
    last = need if need <= small[-1] else tiles * STEP_TOKEN_ALIGNMENT
    last = min(last, max_tokens)
    if cap <= 0 or last <= decode_rows:
        return []
    sizes = [*small, *range(STEP_TOKEN_ALIGNMENT, last, STEP_TOKEN_ALIGNMENT)]
    return sorted({s for s in sizes if decode_rows < s < last} | {last})


def graph_shapes(max_rows: int, max_prompt_tokens: int, max_tokens: int,
                 max_prompt_only_tokens: int = 0, speculative: bool = False,
                 decodes: bool = True, decode_sizes: list[int] | None = None) -> list[GraphShape]:
    """Decode-only shapes (one row per bucket), and mixed shapes: decode parts of each bucket beside
    token buckets for up to ``max_prompt_tokens`` prompt tokens, or no decode part and up to
    ``max(max_prompt_tokens, max_prompt_only_tokens)`` of them (at most ``max_tokens`` in all), with room
    for FEW_PROMPT_ROWS prompt rows or for max_rows rows in all (and one for the pad tokens). With
    ``speculative``, the shapes without a decode part start at SPEC_TOKEN_BUCKETS. Without ``decodes`` (a
    pooling model's steps are prompt chunks alone) only the shapes without a decode part. ``decode_sizes``:
    decode_buckets' ``chosen``."""
    buckets = decode_buckets(max_rows, decode_sizes) if decodes else []
    shapes = [GraphShape(b, b, b) for b in buckets]
    for d in [0, *buckets]:
        row_counts = sorted({min(d + FEW_PROMPT_ROWS, max_rows) + 1, max_rows + 1})
        cap = max(max_prompt_tokens, max_prompt_only_tokens) if d == 0 else max_prompt_tokens
        small = SMALL_TOKEN_BUCKETS
        if speculative and d == 0:
            small = (*SPEC_TOKEN_BUCKETS, *small)
        shapes += [GraphShape(d, t, r) for t in token_buckets(d, cap, max_tokens, small) for r in row_counts]
    return shapes


# The model under a graph: a ForwardBatch in, hidden states [T, hidden] out.
RunModel = Callable[[ForwardBatch, bool], torch.Tensor]  # (batch, with the LoRA deltas) -> hidden
MakeBatch = Callable[[dict[str, torch.Tensor], GraphShape], ForwardBatch]


class StepGraphs:
    """One CUDA graph per step shape. A step is padded to the smallest shape it fits: its leading
    one-token rows (decodes, or one-token prompt chunks: the same computation) to a decode bucket, the
    rest (prompt chunks) to a prompt-token bucket. The graph reads the runner's fixed input buffers and
    writes hidden states to a static buffer; the lm_head and sampling run after it on the real rows.

    With ``lora`` each shape is captured twice, sharing one memory pool: as the base model, and with the
    LoRA layers adding the deltas of the tokens' slots (a step input). Steps without an adapter's row
    replay the first, so serving adapters costs base requests nothing."""

    def __init__(self, buffers: InputBuffers, make_batch: MakeBatch, run_model: RunModel,
                 shapes: list[GraphShape], block_size: int, hidden_size: int, dtype: torch.dtype,
                 lora: bool = False) -> None:
        self.buffers, self.make_batch, self.run_model = buffers, make_batch, run_model
        self.variants = (False, True) if lora else (False,)  # captured with the LoRA deltas or not
        self.shapes = sorted(shapes, key=lambda s: (s.num_tokens, s.num_rows))
        self.block_size = block_size
        max_tokens = max(s.num_tokens for s in shapes)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=buffers.device)
        self._graphs: dict[tuple[GraphShape, bool], torch.cuda.CUDAGraph] = {}
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
                for lora in self.variants:
                    self._graphs[shape, lora] = self._capture_one(shape, pool, lora)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # Replays need neither: letting go of them (closures over the runner, which holds these graphs)
        # leaves no reference cycle, so a dropped engine is freed at once, frozen heap or not.
        self.make_batch = self.run_model = None
        logger.info("captured CUDA graphs for %d step shapes (x%d)", len(self.shapes), len(self.variants))

    def _capture_one(self, shape: GraphShape, pool: object, lora: bool) -> torch.cuda.CUDAGraph:
        no_pending = np.zeros(0, dtype=np.int64)
        views = self.buffers.stage(self.pad(empty_step_arrays(), shape), no_pending, full_width=True)
        for _ in range(WARMUP_RUNS):
            self._forward(views, shape, lora)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream()):
            self._forward(views, shape, lora)
        return graph

    def _forward(self, views: dict[str, torch.Tensor], shape: GraphShape, lora: bool) -> None:
        batch = self.make_batch(views, shape)
        self.hidden[: shape.num_tokens].copy_(self.run_model(batch, lora))

    def replay(self, shape: GraphShape, lora: bool = False) -> torch.Tensor:
        """Run the shape's graph (with the LoRA deltas, if ``lora``) on what was staged last; returns hidden
        [num_tokens, hidden]."""
        self._graphs[shape, lora].replay()
        return self.hidden[: shape.num_tokens]
