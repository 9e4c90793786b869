"""A worker extension as RL libraries write them (TRL's, OpenRLHF's), and functions for collective_rpc: the
tests' (test_collective_rpc), importable by name so that tensor-parallel ranks can unpickle them."""

from __future__ import annotations

import time

import torch


class WeightSyncExtension:
    """Mixed into every rank's Worker (worker_extension_cls)."""

    def update_named_param(self, name: str, tensor: torch.Tensor) -> None:
        """vLLM's pattern, one tensor through the model's own load_weights (a model on one GPU)."""
        self.model_runner.model.load_weights(weights=[(name, tensor)])

    def update_whole_param(self, name: str, tensor: torch.Tensor) -> None:
        """A whole tensor that every rank receives, each keeping its slices (plait's Worker.load_weights)."""
        self.load_weights([(name, tensor)])

    def where(self, tag: str = "") -> tuple:
        return self.rank, self.world_size, self.device.type, tag

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model_runner.model.parameters())

    def sleep_on_rank_1(self, seconds: float) -> int:
        if self.rank == 1:
            time.sleep(seconds)
        return self.rank


class ClashingExtension:
    def load_weights(self, weights) -> None:  # hides Worker.load_weights
        raise AssertionError("never called")


def rank_and_world(worker) -> tuple[int, int]:
    return worker.rank, worker.world_size


def fail_on_rank_1(worker) -> int:
    if worker.rank == 1:
        raise RuntimeError("rank 1 says no")
    return worker.rank


def fp8_layers(worker) -> dict:
    """Each FP8 layer's codes (as bytes) and row scales on this rank (test_tensor_parallel_fp8)."""
    from plait.layers.fp8 import Fp8Linear

    return {name: (m.weight.view(torch.uint8).clone(), m.weight_scale.clone())
            for name, m in worker.model_runner.model.named_modules() if isinstance(m, Fp8Linear)}


def fp8_experts(worker) -> dict:
    """Each FP8 FusedMoE's stacks on this rank: name -> (gate_up codes as bytes, gate_up_scale, down codes as
    bytes, down_scale) (test_tensor_parallel_fp8)."""
    from plait.layers.moe import FP8_WEIGHTS, FusedMoE

    return {name: (m.gate_up_proj.view(torch.uint8).clone(), m.gate_up_scale.clone(),
                   m.down_proj.view(torch.uint8).clone(), m.down_scale.clone())
            for name, m in worker.model_runner.model.named_modules()
            if isinstance(m, FusedMoE) and m.weight_format == FP8_WEIGHTS}
