"""LoRAModel: a model's LoRA-wrapped layers, the adapters in their slots, and each step's tokens by slot."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from torch import nn

from plait.layers.fp8 import Fp8Linear
from plait.layers.linear import Linear
from plait.layers.wna16 import WNA16Linear
from plait.lora.adapter import LoRAAdapter, LoRAShard, LoRATarget
from plait.lora.layer import LoRAContext, LoRALinear
from plait.lora.slots import NO_LORA_SLOT
from plait.models.llama import Phi3ForCausalLM

if TYPE_CHECKING:
    from plait.config import ModelConfig
    from plait.engine.request import Request
    from plait.parallel.shard import Shard
    from plait.runner.forward_batch import ForwardBatch


# Where a model's decoder layers live (LlamaForCausalLM.model.layers, an image model's too).
DECODER_PREFIX = "model.layers."


def lora_targets(model: nn.Module, full: ModelConfig | None = None) -> dict[str, LoRATarget]:
    """The Linear layers of a Llama-family model adapters may change, by plait name, with their output
    slices as the loader fuses them (plait.models.weights.load_decoder_weights) and as the model's adapters
    name them (vLLM's packed_modules_mapping): q/k/v and gate/up for most, the fused layers whole for
    Phi-3 (fused_projection_names). ``full``: the sizes of the whole model, of which ``model`` is a tensor-
    parallel rank's share (an adapter's tensors are the whole model's)."""
    if not getattr(model, "supports_lora", False):
        raise ValueError(f"LoRA is not supported for {type(model).__name__}; it serves the Llama family "
                         f"(Llama, Mistral, Qwen2, Qwen3), Granite, OLMo 2 / OLMo 3, Gemma 1 / 2 / 3 text, "
                         f"Phi-3 / Phi-3.5 / Phi-4, and LLaVA's, Gemma 3's and Qwen2-VL's decoders")
    cfg = full or model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    in_features = {"qkv_proj": cfg.hidden_size, "o_proj": q, "gate_up_proj": cfg.hidden_size,
                   "down_proj": cfg.intermediate_size}
    if fused_projection_names(model):
        qkv: tuple[tuple[str, int], ...] = (("qkv_proj", q + 2 * kv),)
        gate_up: tuple[tuple[str, int], ...] = (("gate_up_proj", 2 * cfg.intermediate_size),)
    else:
        qkv = (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        gate_up = (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))
    slices = {
        "qkv_proj": qkv,
        "o_proj": (("o_proj", cfg.hidden_size),),
        "gate_up_proj": gate_up,
        "down_proj": (("down_proj", cfg.hidden_size),),
    }
    targets = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        # The decoder's alone: an image model's vision side (vision_tower, visual) is never adapted.
        decoder = name.startswith(DECODER_PREFIX)
        if decoder and kind in slices and isinstance(module, (Linear, Fp8Linear, WNA16Linear)):
            targets[name] = LoRATarget(in_features[kind] if full else module.in_features, slices[kind])
    return targets


def fused_projection_names(model: nn.Module) -> bool:
    """Whether the model's checkpoints, and so the PEFT adapters trained on them, name the fused
    ``qkv_proj`` and ``gate_up_proj`` themselves (Phi-3, Phi-3.5, Phi-4): such an adapter has one A
    ([r, in]) and one B ([q + 2 kv or 2 x intermediate, r]) for the whole fused layer, as vLLM's Phi-3
    packs them, and q_proj .. up_proj name nothing in these models."""
    return isinstance(model, Phi3ForCausalLM)


# Sends rank r a slot's adapter slices: (rank, (slot, adapter id, scaling, {layer: [LoRAShard]})).
SendSlices = Callable[[int, tuple[int, int, float, dict[str, list[LoRAShard]]]], None]


class LoRAModel:
    """Wraps every LoRA target of ``model`` in a LoRALinear with ``num_slots`` slots of rank up to
    ``max_rank`` (before any CUDA graph is captured: graphs capture the deltas too, reading the slots'
    weights in place), and loads adapters into slots.

    Under tensor parallelism (``shard``: the driver's share) ``targets`` are the whole model's (adapters are
    read and checked whole), and loading a slot gives each rank its slices (Shard.projection): B's rows of a
    column-parallel layer (A whole), A's columns of a row-parallel one (B whole, the ranks' partial deltas
    summed with the layer's output); ``send`` carries the other ranks' to them."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, shard: Shard | None = None,
                 send: SendSlices | None = None) -> None:
        self.targets = lora_targets(model, shard.full if shard is not None else None)
        self.shard, self.send = shard, send
        self.context = LoRAContext()
        self.layers: dict[str, LoRALinear] = {}
        for name, target in lora_targets(model).items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = LoRALinear(getattr(parent, child), target, num_slots, max_rank, self.context)
            setattr(parent, child, layer)
            self.layers[name] = layer
        self._loaded: list[int | None] = [None] * num_slots  # the adapter id each slot's weights hold
        self.num_loads = 0

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` of every layer (this rank's slices; the other ranks' sent them). On
        a GPU the copies queue behind the steps launched before, so a step still running reads the adapter
        it was launched with."""
        layers, lora_id = adapter.layers, adapter.request.lora_int_id
        if self.shard is not None:
            for rank in range(1, self.shard.world_size):
                theirs = self._slices(layers, self.shard.of_rank(rank))
                self.send(rank, (slot, lora_id, adapter.scaling, theirs))
            layers = self._slices(layers, self.shard)
        self.load_slices(slot, lora_id, adapter.scaling, layers)

    def load_slices(self, slot: int, lora_id: int, scaling: float, layers: dict[str, list[LoRAShard]]
                    ) -> None:
        """Copy an adapter's pairs, already this rank's, into ``slot`` of every layer."""
        for name, layer in self.layers.items():
            layer.load_slot(slot, layers.get(name, []), scaling)
        self._loaded[slot] = lora_id
        self.num_loads += 1

    def _slices(self, layers: dict[str, list[LoRAShard]], shard: Shard) -> dict[str, list[LoRAShard]]:
        """An adapter's pairs as ``shard``'s rank holds them (the class docstring says how)."""
        out = {}
        for name, shards in layers.items():
            row_parallel = name.endswith(("o_proj", "down_proj"))
            out[name] = []
            for s in shards:
                proj = self.targets[name].shards[s.index][0]
                if row_parallel:
                    out[name].append(LoRAShard(s.index, shard.projection(proj, s.a), s.b))
                else:
                    out[name].append(LoRAShard(s.index, s.a, shard.projection(proj, s.b)))
        return out

    def prepare(self, requests: Sequence[Request], query_start_loc: np.ndarray) -> np.ndarray | None:
        """Load any adapter a row of the step needs that its slot does not hold yet; return each token's
        slot ([T], the step input StepArrays.lora_slots), or None where no row has an adapter.
        ``requests`` are the step's rows, ``query_start_loc`` their tokens'."""
        row_slots = np.array([r.lora_slot for r in requests], dtype=np.int64)  # [R]
        if not (row_slots != NO_LORA_SLOT).any():
            return None
        for request in requests:
            slot = request.lora_slot
            if slot != NO_LORA_SLOT and self._loaded[slot] != request.lora.request.lora_int_id:
                self.load(slot, request.lora)
        return np.repeat(row_slots, np.diff(query_start_loc))

    @contextlib.contextmanager
    def running(self, batch: ForwardBatch) -> Iterator[None]:
        """The LoRA layers add the deltas of ``batch.lora_slots`` inside this block, and nothing after it."""
        self.context.batch = batch
        try:
            yield
        finally:
            self.context.batch = None

