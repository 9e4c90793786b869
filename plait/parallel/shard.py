"""How a model is cut across tensor-parallel ranks, applied from outside it: each rank builds the model of
a narrower config (its share of the heads and of the MLP), takes its slice of every checkpoint tensor, and
sums the outputs of o_proj and down_proj over the ranks (Megatron's column / row split)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plait.config import ModelConfig
from plait.parallel.group import DRIVER_RANK, TPGroup

# The dense decoders whose layers are the Llama family's attention and MLP: those a rank can build from a
# narrower config alone.
SHARDABLE_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "GraniteForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
})
# Row-parallel layers: each rank holds some of their input columns, so their outputs are partial sums.
ROW_PARALLEL = ("o_proj", "down_proj")
# A checkpoint tensor of one decoder layer: (projection, "weight" | "bias").
LAYER_TENSOR = re.compile(r"\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's share of a model: which heads, which MLP columns (made by shard_for)."""

    rank: int
    world_size: int
    full: ModelConfig  # the checkpoint's
    local: ModelConfig  # this rank's: what its model is built from

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    @property
    def kv_heads_replicated(self) -> bool:
        """Fewer KV heads than ranks: each rank keeps the one its query heads read (vLLM does the same)."""
        return self.full.num_key_value_heads < self.world_size

    def kv_head_range(self) -> tuple[int, int]:
        n = self.local.num_key_value_heads
        if self.kv_heads_replicated:
            first = self.rank * self.full.num_key_value_heads // self.world_size
            return first, first + 1
        return self.rank * n, (self.rank + 1) * n

    def _row_range(self, name: str) -> tuple[int, int] | None:
        """The rows of a column-parallel projection's full tensor this rank keeps."""
        d, r = self.full.head_dim, self.rank
        if name == "q_proj":
            n = self.local.num_attention_heads * d
            return r * n, (r + 1) * n
        if name in ("k_proj", "v_proj"):
            lo, hi = self.kv_head_range()
            return lo * d, hi * d
        if name in ("gate_proj", "up_proj"):
            n = self.local.intermediate_size
            return r * n, (r + 1) * n
        return None

    def _slice(self, name: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        rows = self._row_range(name)
        if rows is not None:
            return t[rows[0]: rows[1]]
        if name in ROW_PARALLEL:
            if kind == "bias":  # added once, after the sum: the driver's alone
                return t if self.rank == DRIVER_RANK else torch.zeros_like(t)
            n = t.shape[1] // self.world_size
            return t[:, self.rank * n: (self.rank + 1) * n]
        if name == "qkv_proj":  # Phi-3's fused q, k, v rows
            c = self.full
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            parts = zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]))
            return torch.cat([self._slice(part, kind, piece) for part, piece in parts])
        if name == "gate_up_proj":  # Phi-3's fused gate, up rows
            gate, up = t.chunk(2)
            return torch.cat([self._slice("gate_proj", kind, gate), self._slice("up_proj", kind, up)])
        return t  # q/k norms (per head), anything replicated

    def checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of each checkpoint tensor (HF names); the LM head only on the driver, the one
        rank that samples."""
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.rank != DRIVER_RANK:
                continue
            match = LAYER_TENSOR.search(name)
            yield name, (self._slice(match[1], match[2], tensor) if match else tensor)


def shard_for(config: ModelConfig, rank: int, world_size: int) -> Shard:
    """Rank ``rank``'s share of ``config``'s model, or a ValueError saying why it cannot be split so."""
    if config.architecture not in SHARDABLE_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {world_size}: {config.architecture} cannot be split across "
                         f"devices yet; the dense decoders that can: {sorted(SHARDABLE_ARCHITECTURES)}")
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    for what, n in (("attention heads", heads), ("intermediate size", inter)):
        if n % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {what} ({n})")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} and the model's {kv_heads} KV heads: one must "
                         "divide the other")
    local = dataclasses.replace(config, num_attention_heads=heads // world_size,
                                num_key_value_heads=max(1, kv_heads // world_size),
                                intermediate_size=inter // world_size)
    return Shard(rank, world_size, config, local)


def sum_row_parallel_outputs(model: nn.Module, group: TPGroup) -> None:
    """Make a rank's model (built from Shard.local, loaded from Shard.checkpoint) one slice of the whole:
    o_proj's and down_proj's outputs are summed over the ranks after each call, so every rank's residual
    stream is the whole model's."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ROW_PARALLEL:
            module.register_forward_hook(lambda _m, _x, out: group.all_reduce_(out))
