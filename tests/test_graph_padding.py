"""Steps padded to CUDA-graph shapes compute what the eager step computes (CPU: the Triton kernels in
the interpreter, the same padded batch a graph replays; the capture itself is tested on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_prompts

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.runner.cuda_graphs import StepGraphs, graph_shapes
from plait.runner.forward_batch import ForwardBatch, StepArrays, build_step_arrays
from plait.runner.padding import GraphShape, fits, pad_to_shape
from plait.sampling_params import SamplingParams

pytest.importorskip("triton")

BLOCK = 4
MAX_SEQS = 8
PROMPT_CAP = 32


def _graph_batch(engine: LLMEngine, views: dict, shape: GraphShape) -> ForwardBatch:
    runner = engine.runner
    batch = ForwardBatch.from_views(views, [], shape.max_query_len, runner.max_model_len,
                                    num_leading_single_token_rows=shape.decode_rows)
    runner._attach(batch)
    return batch


def test_padded_steps_match_eager_steps(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), attention_backend="triton", block_size=BLOCK,
                                    max_num_seqs=MAX_SEQS, max_num_batched_tokens=48,
                                    max_prefill_tokens_beside_decodes=PROMPT_CAP, async_scheduling=False))
    runner = engine.runner
    shapes = graph_shapes(MAX_SEQS, PROMPT_CAP, runner.max_model_len)
    graphs = StepGraphs(runner.buffers, lambda v, s: _graph_batch(engine, v, s), runner._run_model,
                        shapes, BLOCK, runner.model_config.hidden_size, runner.dtype)
    launch = runner.launch
    seen: set[str] = set()

    def checking_launch(plan, prev):
        arrays = build_step_arrays(plan, BLOCK)
        shape = graphs.shape_for(arrays)
        if shape is not None:
            no_pending = np.zeros(0, dtype=np.int64)
            with torch.inference_mode():
                staged = runner.buffers.stage(arrays, no_pending)
                eager = runner._run_model(runner._eager_batch(arrays, staged))
                want = eager[torch.from_numpy(arrays.sample_indices)].clone()
                padded = graphs.pad(arrays, shape)
                views = runner.buffers.stage(padded, no_pending, full_width=True)
                got = runner._run_model(graphs.make_batch(views, shape))[views["sample_indices"]]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            seen.add("mixed" if shape.is_mixed else "decode")
        return launch(plan, prev)

    runner.launch = checking_launch
    # 4 tokens each: the steps take every shape that 6 took ({36, 32} prompt tokens beside decodes, 3 and 6
    # decodes), only fewer repeats of the decode shapes (each step is 3 forwards in Triton's interpreter).
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(6, 1, 20, seed=5)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(p, params, request_id=f"a-{i}")
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:  # new prompts arrive beside running decodes: mixed steps
            for i, p in enumerate(prompts[3:]):
                engine.add_request(p, params, request_id=f"b-{i}")
        engine.step()
        step += 1
    assert seen == {"mixed", "decode"}
    assert engine.is_idle_and_clean()


def _two_decodes_and_a_chunk() -> StepArrays:
    return StepArrays(
        input_ids=np.array([11, 12, 13, 14, 15]), positions=np.array([7, 4, 0, 1, 2]),
        slot_mapping=np.array([27, 40, 48, 49, 50]), query_start_loc=np.array([0, 1, 2, 5]),
        context_lens=np.array([7, 4, 0]), seq_lens=np.array([8, 5, 3]), is_first_chunk=np.array([0, 0, 1]),
        state_slots=np.array([-1, -1, -1]), block_tables=np.array([[3, 6], [10, 0], [12, 0]]),
        sample_indices=np.array([0, 1, 4]), sample_rows=[0, 1, 2], pending_rows=[0, 1])


def test_mixed_pad_layout():
    """[2 decodes | 2 empty decode rows | a 3-token chunk | empty rows, the last with the pad tokens]:
    real tokens keep their indices, and the shape's tokens are all the step's to use."""
    arrays = _two_decodes_and_a_chunk()
    shape = GraphShape(decode_rows=4, num_tokens=8, num_rows=7)
    assert fits(arrays, shape)
    assert not fits(arrays, GraphShape(1, 8, 7)) and not fits(arrays, GraphShape(4, 4, 7))
    assert not fits(arrays, GraphShape(4, 8, 5))  # no row left for the pad tokens
    p = pad_to_shape(arrays, shape, block_size=4)
    assert p.input_ids.tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert p.query_start_loc.tolist() == [0, 1, 2, 2, 2, 5, 5, 8]
    assert p.seq_lens.tolist() == [8, 5, 0, 0, 3, 0, 3]
    assert p.positions.tolist() == [7, 4, 0, 1, 2, 0, 1, 2]
    assert p.slot_mapping.tolist()[5:] == [0, 0, 0]  # pad K/V go to the pad block
    assert p.sample_indices.tolist() == [0, 1, 4] and p.pending_rows == [0, 1]
    assert p.block_tables[:2, :2].tolist() == [[3, 6], [10, 0]] and p.block_tables[4, 0] == 12
    assert (p.block_tables[[2, 3, 5, 6]] == 0).all()  # pad rows see only the pad block


def test_decode_pad_layout():
    """A decode-only shape pads with one-token rows: [2 decodes | 2 pad decodes]."""
    arrays = _two_decodes_and_a_chunk()
    two = StepArrays(
        input_ids=arrays.input_ids[:2], positions=arrays.positions[:2], slot_mapping=arrays.slot_mapping[:2],
        query_start_loc=arrays.query_start_loc[:3], context_lens=arrays.context_lens[:2],
        seq_lens=arrays.seq_lens[:2], is_first_chunk=arrays.is_first_chunk[:2],
        state_slots=arrays.state_slots[:2], block_tables=arrays.block_tables[:2],
        sample_indices=arrays.sample_indices[:2], sample_rows=[0, 1], pending_rows=[0, 1])
    shape = GraphShape(4, 4, 4)
    assert fits(two, shape) and not fits(arrays, shape)
    p = pad_to_shape(two, shape, block_size=4)
    assert p.input_ids.tolist() == [11, 12, 0, 0] and p.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert p.seq_lens.tolist() == [8, 5, 1, 1] and p.sample_indices.tolist() == [0, 1]
    # A decode step of the shape's own size is staged as it is; padded to the next size, its real rows keep
    # their data.
    assert pad_to_shape(two, GraphShape(2, 2, 2), block_size=4) is two
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "seq_lens", "state_slots"):
        assert getattr(p, name)[:2].tolist() == getattr(two, name).tolist(), name
