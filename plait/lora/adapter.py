"""LoRAAdapter: a PEFT LoRA folder, read and checked against the model's LoRA targets, kept on the host."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.generation_config import read_json_object
from plait.lora.request import LoRARequest
from plait.models.weights import language_model_name

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves every tensor under its wrapper's prefix, then the HF model's own module names.
PEFT_PREFIX = "base_model.model."
LORA_A_SUFFIX = ".lora_A.weight"
LORA_B_SUFFIX = ".lora_B.weight"
# adapter_config.json fields that change what the adapter computes and that plait does not implement;
# each may be absent, null, false or empty.
UNSUPPORTED_FIELDS = (
    "use_dora",  # DoRA rescales each weight column by a learned magnitude
    "fan_in_fan_out",  # Conv1D-style transposed weights (GPT-2), which these models do not have
    "lora_bias",  # a bias on lora_B
    "modules_to_save",  # whole layers saved beside the adapter (often lm_head or the embeddings)
    "rank_pattern",  # per-module ranks
    "alpha_pattern",  # per-module alphas
    "target_parameters",  # LoRA on bare parameters (MoE experts)
)
UNUSED_VALUES = (None, False, {}, [])


@dataclass(frozen=True)
class LoRATarget:
    """A Linear layer adapters may change: its input width and its output's slices, in order, each the
    projection adapters name (HF's module name) and its row count. Llama-family adapters name q/k/v and
    gate/up, slices of plait's fused qkv_proj and gate_up_proj; Phi-3's checkpoints, and so its adapters,
    name the fused layers themselves, one slice each. o_proj and down_proj are one slice everywhere."""

    in_features: int
    shards: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.shards)


@dataclass(frozen=True)
class LoRAShard:
    """One projection's low-rank pair: its slice of the layer's output gets scaling * B @ A @ x."""

    index: int  # the slice of the layer's output (LoRATarget.shards)
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [slice rows, r]


def target_projections(targets: dict[str, LoRATarget]) -> dict[str, tuple[str, int]]:
    """The projections (module names) the model's adapters may change, in layer order, each with the plait
    Linear it is part of (the last part of its name: ``qkv_proj``) and its slice of that Linear's output:
    q_proj -> (qkv_proj, 0) for the Llama family, qkv_proj -> (qkv_proj, 0) for Phi-3."""
    projections: dict[str, tuple[str, int]] = {}
    for name, target in targets.items():
        kind = name.rpartition(".")[2]
        for index, (projection, _) in enumerate(target.shards):
            projections.setdefault(projection, (kind, index))
    return projections


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter ready to load into a slot: its tensors on the host, as the file holds them."""

    request: LoRARequest
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) under use_rslora
    layers: dict[str, list[LoRAShard]]  # plait Linear name -> the slices it changes

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for shards in self.layers.values() for s in shards for t in (s.a, s.b))


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int) -> LoRAAdapter:
    """Read ``request``'s PEFT folder and check it against the model's ``targets`` (plait Linear name ->
    LoRATarget); anything plait cannot apply exactly is a ValueError naming it."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path).expanduser()
    config_file, weights_file = folder / ADAPTER_CONFIG_FILE, folder / ADAPTER_WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"{where}: no {needed.name} there; a PEFT LoRA folder holds "
                             f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}")
    try:
        config = read_json_object(config_file)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    projections = target_projections(targets)
    rank, scaling = _check_config(config, where, max_rank, tuple(projections))
    try:
        from safetensors.torch import load_file

        tensors = load_file(weights_file)
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{where}: cannot read {ADAPTER_WEIGHTS_FILE}: {err}") from err
    return LoRAAdapter(request, rank, scaling, _layers(tensors, targets, projections, rank, where))


def _check_config(config: dict[str, Any], where: str, max_rank: int, supported: tuple[str, ...]
                  ) -> tuple[int, float]:
    """The adapter's rank and scaling, once every field is one plait applies as PEFT does; ``supported``:
    the projections the model's adapters may target."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported; only LORA adapters are")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias {bias!r} is not supported; only adapters with bias 'none' are")
    for name in UNSUPPORTED_FIELDS:
        value = config.get(name)
        if value not in UNUSED_VALUES:
            raise ValueError(f"{where}: {name}={value!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:  # vLLM's words
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex (or "all-linear"): the tensors say what it matched
        unsupported = sorted({str(t) for t in targets if str(t).split(".")[-1] not in supported})
        if unsupported:
            raise ValueError(f"{where}: target_modules {unsupported} are not supported; an adapter of this "
                             f"model may target {', '.join(supported)}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return rank, float(scaling)


def _layers(tensors: dict[str, torch.Tensor], targets: dict[str, LoRATarget],
            projections: dict[str, tuple[str, int]], rank: int, where: str) -> dict[str, list[LoRAShard]]:
    """The file's A/B pairs grouped by plait Linear layer, each checked against its slice's shape
    (``projections``: target_projections(targets))."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        name = language_model_name(name) or name  # an image model's decoder under its own prefix
        for suffix, part in ((LORA_A_SUFFIX, "a"), (LORA_B_SUFFIX, "b")):
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix), {})[part] = tensor
                break
        else:  # lora_embedding_A, lora_magnitude_vector (DoRA), a saved bias or whole layer, ...
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A or B weight plait can apply")
    if not pairs:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS_FILE} holds no LoRA weights")
    layers: dict[str, list[LoRAShard]] = {}
    for module, pair in sorted(pairs.items()):
        parent, _, projection = module.rpartition(".")
        if projection not in projections:
            raise ValueError(f"{where}: it adapts {module!r}; LoRA on {projection} is not supported for this "
                             f"model, only on {', '.join(projections)}")
        kind, index = projections[projection]
        layer = f"{parent}.{kind}" if parent else kind
        target = targets.get(layer)
        if target is None:
            raise ValueError(f"{where}: module {module!r} is not in the model")
        if set(pair) != {"a", "b"}:
            missing = "lora_B" if "a" in pair else "lora_A"
            raise ValueError(f"{where}: module {module!r} has no {missing} weight")
        a, b = pair["a"], pair["b"]
        expected_a = (rank, target.in_features)
        expected_b = (target.shards[index][1], rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise ValueError(f"{where}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"expected {expected_a} and {expected_b} (rank {rank}) for this model")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"{where}: {module!r} has weights of dtype {a.dtype} / {b.dtype}, not floats")
        layers.setdefault(layer, []).append(LoRAShard(index, a, b))
    return layers
