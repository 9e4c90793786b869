"""ModelRunner: owns the device, weights and KV tensors; turns a StepPlan into sampled tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from plait.attention.base import get_backend
from plait.config import CPU_KV_CACHE_BYTES, EngineConfig
from plait.engine.kv_cache import cdiv
from plait.engine.request import Request
from plait.engine.scheduler import StepPlan
from plait.layers.mamba import allocate_mamba_states
from plait.loader.model_loader import load_model, resolve_device_dtype
from plait.runner.forward_batch import ForwardBatch, build_forward_batch
from plait.runner.sampler import Logprobs, Sampler, SamplingRow

logger = logging.getLogger(__name__)

# Share of the device memory left after the weights that is held back for activations and the
# allocator's slack when the KV cache is sized on a GPU.
GPU_ACTIVATION_RESERVE = 0.1


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprobs: Logprobs | None


@dataclass
class StepOutput:
    sampled: list[SampledToken]  # one per sampling row, in row order
    logits: torch.Tensor | None  # [S, vocab] fp32: the rows that were sampled (for tests/tools)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        loaded = load_model(config, self.device, self.dtype)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_path = loaded.source
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.model_config.max_position_embeddings}"
            )
        # Recurrent (Mamba) state first, so that on a GPU the KV cache is sized from what is left.
        specs_of = getattr(self.model, "recurrent_state_specs", None)
        state_specs = specs_of() if specs_of is not None else []
        self.num_state_slots = (config.max_num_state_slots or config.max_num_seqs) if state_specs else 0
        # One extra row per tensor: the pad slot (plait.engine.state_slots.PAD_STATE_SLOT).
        self.recurrent_states = allocate_mamba_states(state_specs, self.num_state_slots + 1, self.dtype,
                                                      self.device) if state_specs else None
        self.num_kv_blocks = self._choose_num_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        self.attn_backend = get_backend("torch_ref")
        self.sampler = Sampler()

    # -- memory -----------------------------------------------------------------------------

    def _bytes_per_block(self) -> int:
        c = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self._num_kv_layers() * self.config.block_size * c.num_key_value_heads * c.head_dim * elem

    def _num_kv_layers(self) -> int:
        # Hybrid models keep KV only for their attention layers (each knows its cache index).
        return getattr(self.model, "num_kv_cache_layers", self.model_config.num_hidden_layers)

    def _choose_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.config.kv_cache_memory_fraction) - free * GPU_ACTIVATION_RESERVE
        else:
            budget = CPU_KV_CACHE_BYTES
        # Never more blocks than every sequence at full length could use: saves host memory on CPU.
        needed = self.config.max_num_seqs * cdiv(self.max_model_len, self.config.block_size) + 1
        if self._bytes_per_block() == 0:  # attention-free: blocks are bookkeeping only
            return needed
        return max(2, min(int(budget // self._bytes_per_block()), needed))

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        c = self.model_config
        shape = (2, num_blocks, self.config.block_size, c.num_key_value_heads, c.head_dim)
        num_layers = self._num_kv_layers()
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    # -- one step ---------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        batch = build_forward_batch(plan, self.config.block_size, self.device)
        batch.attn_backend, batch.kv_caches = self.attn_backend, self.kv_caches
        batch.recurrent_states = self.recurrent_states
        return batch

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        batch = self.prepare(plan)
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, hidden]
        if not batch.sample_rows:
            return StepOutput([], None)
        # lm_head only where a token is sampled: one logits row per sampling request.
        logits = self.model.compute_logits(hidden[batch.sample_indices])  # [S, vocab]
        requests = [plan.rows[i].request for i in batch.sample_rows]
        rows = [
            SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids)
            for r in requests
        ]
        out = self.sampler(logits, rows)
        sampled = [SampledToken(r, t, lp) for r, t, lp in zip(requests, out.token_ids, out.logprobs)]
        return StepOutput(sampled, logits)
