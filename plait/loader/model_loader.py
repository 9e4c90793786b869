"""Builds a model from a GGUF file, an HF folder, or random weights, on the chosen device/dtype."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.config import (
    CHECKPOINT_QUANTIZATION_METHODS,
    LAZY_LOAD,
    EngineConfig,
    ModelConfig,
    load_threads,
    merge_objects,
    with_rope_overrides,
)
from plait.layers import mxfp4, wna16
from plait.layers.fp8 import FP8_DTYPE, checkpoint_quantization, checkpoint_weight_block, quantize_model
from plait.layers.fp8_block import MIN_BLOCK
from plait.layers.linear import deferred_weights, materialize_deferred
from plait.layers.moe import FP32_ROUTER_TENSORS, INT_WEIGHTS, FusedMoE
from plait.layers.mxfp4 import MXFP4_DTYPE
from plait.models.base import checkpoint_layout
from plait.models.registry import BASE_MODEL_ARCHITECTURES, get_model_class, resolve_runner
from plait.models.weights import IMAGE_SIDE_MODULES, weight_row_loader
from plait.parallel.group import ParallelRank
from plait.parallel.shard import Shard, shard_for

if TYPE_CHECKING:
    from plait.loader.hf import ModelSource

logger = logging.getLogger(__name__)

# Standard deviation of random (dummy) weights: HF's initializer_range default, which keeps
# activations of a random model in a sane range so benchmarks exercise ordinary numbers.
DUMMY_INIT_STD = 0.02


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None (random-weight configs have none)
    source: Path
    quantization: str | None = None  # config.quantization, or what the checkpoint itself holds ("fp8")
    # Per attention layer (in KV-cache order), the checkpoint's FP8 KV-cache scales (k_scale, v_scale), where
    # it has them and kv_cache_dtype is "fp8"; None otherwise (an FP8 cache then takes 1.0, as vLLM).
    kv_scales: list[tuple[float, float]] | None = None
    runner: str = "generate"  # EngineConfig.runner resolved for this model (resolve_runner)
    # Under tensor parallelism, this rank's share: the model is built from shard.local (config stays whole).
    shard: Shard | None = None


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if config.dtype in (None, "auto"):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = names[config.dtype]
    return device, dtype


def load_model(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
    parallel: ParallelRank | None = None, source: ModelSource | None = None,
) -> LoadedModel:
    """The model ``config`` names (``source``: where it is, as the engine resolved it; None: resolved here),
    built, sharded for ``parallel`` and loaded."""
    from plait.loader.hf import config_folder, resolve_model

    if source is None:
        source = resolve_model(config.model, config.revision, config.download_dir)
    # One bar, the driver's: the other tensor-parallel ranks read the same shards beside it.
    progress = config.use_tqdm_on_load and (parallel is None or parallel.is_driver)
    # The checkpoint tensors the model's class reads, where it says (an MTP head: its one layer's), known once
    # the config names the class; the reader below runs only after that, so it leaves the others unread.
    wanted: list[Callable[[str], bool]] = []
    hf_config, weights = read_source(source, config.load_format, progress, config_folder(config),
                                     config.safetensors_load_strategy, load_threads(config),
                                     wanted=lambda name: all(keep(name) for keep in wanted))
    plan = _plan(config, hf_config)
    hf_config, model_config, cls = plan.hf_config, plan.model_config, plan.cls
    runner, quantization, int_spec, block = plan.runner, plan.quantization, plan.int_spec, plan.block
    # A model that reads a few of the checkpoint's tensors (an MTP head: its one layer) names them, so that
    # the loader leaves the rest unread.
    wanted_tensors = getattr(cls, "wanted_tensors", None)
    if wanted_tensors is not None:
        wanted.append(wanted_tensors(model_config))
    positions = max_positions or model_config.max_position_embeddings
    # Split across devices, quantised too (each rank takes its slice of the codes and of their scales, in
    # whole tiles, words and groups: Shard.checkpoint; a 16-bit checkpoint's slices are quantised to FP8
    # where they land).
    shard = None if parallel is None else plan.shard(config, parallel.rank, parallel.world_size)
    # Linear layers are made without memory (every weight is written below: drawing random ones that
    # loading overwrites would only cost start-up time). Quantised, they are replaced before any weight
    # arrives, so each checkpoint tensor is quantised (or, already FP8, kept) as it is read and no 16-bit
    # copy of the model ever exists.
    with torch.device(device), deferred_weights():
        model = cls(model_config if shard is None else shard.local, positions)
        if runner == "pooling" or (shard is not None and not shard.is_driver):
            # Embeddings come from the trunk's hidden states, and only the driver rank samples: no logits.
            model.lm_head = None
    model.to(dtype)  # rotary tables are plain attributes, so they stay fp32
    if plan.mxfp4_experts:  # before any 16-bit expert memory exists
        for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
            moe.use_mxfp4(device)
    left_16_bit = tuple(f"{name}." for name in plan.image_side)
    if int_spec is not None:
        wna16.quantize_model(model, int_spec, device, wna16.unquantized_modules(hf_config), left_16_bit)
    elif quantization is not None:
        quantize_model(model, quantization, device, block, left_16_bit)
    materialize_deferred(model, device)  # what no quantiser replaced (16-bit models: everything)
    kv_scales: dict[int, dict[str, float]] = {}
    tokenizer = _load_tokenizer(source, config)
    if weights is None:
        # Under tensor parallelism every rank draws the same numbers: replicated tensors agree, and each
        # rank's slice is as random as the whole.
        _init_dummy(model, config.seed)
    else:
        weights = checkpoint_layout(model, weights)
        # A pooling model's names and score head come first: a rank's slices are cut by the trunk's names.
        from_tokens = hf_config.get("classifier_from_token")
        if from_tokens and hasattr(model, "classify"):
            weights = _score_from_token_rows(weights, _token_ids(tokenizer, from_tokens, source.path))
        if runner == "pooling":
            weights = _trunk_weights(weights, model_config.architecture in BASE_MODEL_ARCHITECTURES)
        if shard is not None:
            weights = shard.checkpoint(weights)
        weights = _tap_kv_scales(weights, kv_scales)
        model.load_weights((name, to_model_dtype(name, t, device, dtype)) for name, t in weights)
    model.eval()
    fp8_cache = config.kv_cache_dtype == "fp8"
    cache_scales = _kv_cache_scales(kv_scales, model) if fp8_cache and kv_scales else None
    return LoadedModel(model, model_config, tokenizer, source.path, quantization, cache_scales, runner, shard)


def _expert_tile(config: ModelConfig, quantization: str | None, block: tuple[int, int] | None,
                 int_spec: wna16.WNA16Spec | None) -> tuple[int, str] | None:
    """(how many columns, what) a rank's share of a quantised MoE model's routed expert width must be whole
    pieces of (shard_for): FP8 experts' tiles (a block-wise checkpoint's, gate and up split by block_n rows,
    down by block_k columns: whole in both; with --quantization fp8, MIN_BLOCK, the fewest rows
    default_fp8_block tiles a rank's own experts in); integer experts' scale groups and packed words (down's
    inputs a rank keeps, gate's and up's columns packed along N). None where the experts are 16-bit."""
    if config.moe is None:
        return None
    if int_spec is not None:
        return max(int_spec.group_size, int_spec.pack), f"{int_spec.method.upper()} groups and packed words"
    if quantization != "fp8":
        return None
    return (max(block) if block is not None else MIN_BLOCK), "FP8 tiles"


def _token_ids(tokenizer: Any, tokens: list[str], path: Path) -> list[int]:
    """The vocabulary ids of ``tokens`` (classifier_from_token's), each a single token of the tokenizer."""
    if tokenizer is None:
        raise ValueError(f"classifier_from_token needs the model's tokenizer, and {str(path)!r} has none")
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's vocabulary")
        ids.append(token_id)
    return ids


def _score_from_token_rows(weights: Iterable[tuple[str, torch.Tensor]], token_ids: list[int]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """A causal LM's checkpoint as a classifier's (vLLM's classifier_from_token): the LM head's rows of
    ``token_ids`` (the embeddings' where the head is tied to them) become the score head, and a pair of
    tokens one label, the second's row minus the first's: its sigmoid is the softmax of the pair's logits
    at the second token (Qwen3-Reranker's P("yes") of "no" / "yes")."""
    head = embedded = None
    index = torch.tensor(token_ids)
    for name, tensor in weights:
        if name == "lm_head.weight":
            head = tensor[index.to(tensor.device)].clone()
            continue  # the classifier has no LM head
        if name == "model.embed_tokens.weight":
            embedded = tensor[index.to(tensor.device)].clone()
        yield name, tensor
    rows = head if head is not None else embedded
    if rows is None:
        raise ValueError("classifier_from_token: the checkpoint has neither lm_head.weight nor "
                         "model.embed_tokens.weight to read the tokens' rows from")
    rows = rows.float()  # a 16-bit checkpoint's rows differ exactly in fp32; the loader casts after
    yield "score.weight", rows[1:] - rows[:1] if len(token_ids) == 2 else rows


def _trunk_weights(weights: Iterable[tuple[str, torch.Tensor]], base_model: bool
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors for a pooling model: the LM head's left out (the model has none), and a base
    model's names (``layers.0...``, saved from an HF ``...Model``) under the ``model.`` trunk of plait's."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (f"model.{name}" if base_model and not name.startswith("model.") else name), tensor


# An FP8 checkpoint's KV-cache scales: compressed-tensors' self_attn.k_scale / v_scale, or the older
# k_proj / v_proj output_scale.
KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def _tap_kv_scales(weights: Iterable[tuple[str, torch.Tensor]], found: dict[int, dict[str, float]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, passed on; the KV-cache scales among them are also kept in ``found``
    (decoder layer -> {"k": scale, "v": scale}; the largest element, where a scale has several)."""
    for name, tensor in weights:
        match = KV_SCALE_NAME.search(name)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2) or match.group(3)] = float(tensor.max())
        yield name, tensor


def _kv_cache_scales(found: dict[int, dict[str, float]], model: nn.Module) -> list[tuple[float, float]]:
    """The checkpoint's (k_scale, v_scale) per KV-cache layer: its attention layers in order."""
    num_kv_layers = getattr(model, "num_kv_cache_layers", model.config.num_hidden_layers)
    complete = [layer for layer, pair in sorted(found.items()) if set(pair) == {"k", "v"}]
    if len(complete) != len(found) or len(found) != num_kv_layers:
        raise ValueError(f"the checkpoint has KV-cache scales for {len(complete)} of {num_kv_layers} "
                         "attention layers: serve it without --kv-cache-dtype fp8, or one that has them all")
    bad = [layer for layer in complete if not all(math.isfinite(v) and v > 0 for v in found[layer].values())]
    if bad:
        raise ValueError(f"KV-cache scales of layers {bad} are not positive finite numbers")
    return [(found[layer]["k"], found[layer]["v"]) for layer in complete]


def to_model_dtype(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor on the device, in the model's dtype unless it is codes (FP8, or a GPTQ / AWQ
    checkpoint's packed integers) or a quantised checkpoint's scales (kept as they are: the codes are what is
    served, the scales multiply fp32 values), or a noaux_tc router's fp32 correction bias (NoAuxTcRouter keeps
    it fp32)."""
    if (t.dtype == torch.float8_e4m3fn or not t.is_floating_point()
            or name.endswith(("_scale", "_scale_inv", ".scales", *FP32_ROUTER_TENSORS))):
        return t.to(device=device)
    return t.to(device=device, dtype=dtype)


@dataclass(frozen=True)
class _Plan:
    """What a checkpoint's config says of the model load_model builds: its configs and class, the runner it
    serves, and how its weights are quantised."""
    hf_config: dict  # with the engine's overrides
    model_config: ModelConfig
    cls: type
    runner: str  # EngineConfig.runner resolved for this model
    mxfp4_experts: bool
    int_spec: wna16.WNA16Spec | None  # GPTQ / AWQ / compressed-tensors integer weights
    quantization: str | None  # config.quantization, or what the checkpoint itself holds
    block: tuple[int, int] | None  # a block-wise FP8 checkpoint's weight blocks
    image_side: tuple[str, ...]  # an image model's vision modules, which stay 16-bit

    def shard(self, config: EngineConfig, rank: int, world_size: int) -> Shard:
        """Rank ``rank``'s share of the model split over ``world_size`` ranks, or shard_for's ValueError
        saying why it cannot be split so. MXFP4 experts split in whole 32-value blocks: a width that does not
        (gpt-oss's 2,880 over 4 ranks) is padded with zero weights; FP8 and integer experts in whole tiles,
        groups and words, never padded."""
        expert_block = mxfp4.BLOCK_VALUES if self.mxfp4_experts else 1
        shard = shard_for(self.model_config, rank, world_size, expert_block, config.enable_expert_parallel,
                          _expert_tile(self.model_config, self.quantization, self.block, self.int_spec))
        return dataclasses.replace(shard, weight_block=self.block, integer=self.int_spec)


def _plan(config: EngineConfig, hf_config: dict) -> _Plan:
    """The _Plan of a checkpoint whose config.json (or GGUF header) says ``hf_config``, or the ValueError
    that refuses to serve it so."""
    hf_config = with_rope_overrides(merge_objects(hf_config, config.hf_overrides), config.rope_scaling,
                                    config.rope_theta)
    mxfp4_experts = mxfp4.is_mxfp4_checkpoint(hf_config)
    if mxfp4_experts:
        hf_config = mxfp4.experts_config(hf_config, config.quantization)
    model_config = ModelConfig.from_hf(hf_config)
    runner = resolve_runner(config.runner, model_config.architecture)
    cls = get_model_class(model_config.architecture)
    # A quantised checkpoint is served as it is without --quantization, as vLLM reads its quantization_config:
    # GPTQ / AWQ integer weights (the flag may only repeat the method), or FP8, whose scheme (per-row or
    # block-wise scales) is the checkpoint's whether or not the flag is given.
    int_spec = wna16.checkpoint_spec(hf_config)
    # An image model's vision side stays 16-bit, quantised or not (as GPTQ / AWQ / FP8 releases leave it).
    image_side = IMAGE_SIDE_MODULES if getattr(cls, "supports_images", False) else ()
    block = None
    if int_spec is not None:
        wna16.check_method(int_spec, config.quantization, model_config.architecture)
        quantization = int_spec.method
    elif (config.quantization in CHECKPOINT_QUANTIZATION_METHODS
          and config.quantization != (hf_config.get("quantization_config") or {}).get("quant_method")):
        raise ValueError(f"--quantization {config.quantization} serves a checkpoint quantised so (its "
                         "config.json's quantization_config says so); this one is not")
    else:
        checkpoint_fp8 = checkpoint_quantization(hf_config, image_side)
        quantization = checkpoint_fp8 or config.quantization
        block = checkpoint_weight_block(hf_config)
        if model_config.moe is not None and checkpoint_fp8 and block is None:
            raise ValueError(f"{model_config.architecture}: FP8 MoE checkpoints with per-tensor or "
                             "per-channel scales are not supported (block-wise ones, e.g. Qwen3-30B-A3B-FP8, "
                             "are)")
    return _Plan(hf_config, model_config, cls, runner, mxfp4_experts, int_spec, quantization, block,
                 image_side)


def check_split(config: EngineConfig, source: ModelSource | None = None) -> None:
    """Raise the ValueError that every rank's load_model would raise for a split of ``config``'s model over
    config.tensor_parallel_size ranks that cannot be made (shard_for's: heads, widths, experts, quantised
    tiles; or the checkpoint's own refusals), from its config alone (a GGUF file's header): the driver calls
    it before starting any worker, so a refused split costs no worker's start-up and says why at once."""
    from plait.loader.hf import config_folder, resolve_model

    if source is None:
        source = resolve_model(config.model, config.revision, config.download_dir)
    hf_config, _ = read_source(source, "dummy", hf_config_folder=config_folder(config))
    _plan(config, hf_config).shard(config, 0, config.tensor_parallel_size)


def read_source(source: Any, load_format: str, progress: bool = False, hf_config_folder: Path | None = None,
                strategy: str = LAZY_LOAD, threads: int = 1, wanted: Callable[[str], bool] | None = None
                ) -> tuple[dict, Iterable[tuple[str, torch.Tensor]] | None]:
    """(config, the checkpoint's (name, tensor) pairs, or None for random weights); an HF folder's are
    read lazily, shard by shard, with a progress bar over its shards where ``progress``, as ``strategy`` and
    ``threads`` say (iter_hf_weights). ``hf_config_folder`` (vLLM's --hf-config-path): the config.json is
    that folder's instead of the model's (a GGUF file's header's). ``wanted``: the tensor names an HF
    folder's reader hands out (None: all)."""
    from plait.loader.hf import iter_hf_weights, read_hf_config

    hf_config = read_hf_config(hf_config_folder) if hf_config_folder is not None else None
    if source.kind == "gguf":
        from plait.loader.gguf import load_gguf, read_gguf_config

        if threads > 1:
            raise ValueError("model_loader_extra_config enable_multithread_load reads safetensors shards; "
                             f"{str(source.path)!r} is a GGUF file (leave it out)")
        if load_format == "dummy":
            return hf_config or read_gguf_config(source.path), None
        config, tensors = load_gguf(source.path)
        return hf_config or config, tensors.items()
    if hf_config is None:
        hf_config = read_hf_config(source.path)
    if load_format == "dummy":
        return hf_config, None
    return hf_config, iter_hf_weights(source.path, progress, strategy, threads, wanted)


def _load_tokenizer(source: Any, config: EngineConfig) -> Any | None:
    """The model's tokenizer, or the one config.tokenizer names (vLLM's --tokenizer), which must hold one;
    None under skip_tokenizer_init."""
    from plait.loader.hf import resolve_model
    from plait.loader.tokenizer import HF_TOKENIZER_FILES, load_tokenizer

    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is None and config.tokenizer_revision is None:
        return load_tokenizer(source.path)
    # As vLLM's: the tokenizer defaults to the model, and its revision applies to whichever it is.
    named = config.tokenizer if config.tokenizer is not None else config.model
    tokenizer = load_tokenizer(resolve_model(named, config.tokenizer_revision, config.download_dir).path)
    if tokenizer is None:
        raise ValueError(f"tokenizer {named!r} holds no tokenizer (none of {', '.join(HF_TOKENIZER_FILES)})")
    return tokenizer


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        load_rows = weight_row_loader(modules, name)
        owner_name, _, leaf = name.rpartition(".")
        owner = modules[owner_name]
        if name.endswith(".bias"):  # a LayerNorm's too (BERT)
            param.zero_()
        elif "norm" in name.lower():  # RMSNorm / LayerNorm weights (BERT's "LayerNorm")
            param.fill_(1.0)
        elif isinstance(owner, FusedMoE) and param.dtype == MXFP4_DTYPE:
            if leaf == "gate_up_proj":  # one call draws both stacks' codes and scales
                owner.fill_random_mxfp4(gen)
        elif isinstance(owner, FusedMoE) and owner.weight_format == INT_WEIGHTS:
            # Integer experts: the unquantised model's draws ([E, out, in]), each expert's quantised
            # round-to-nearest as the checkpoint's scheme would (scales and zeros come with the codes).
            experts, words, out = param.shape
            weights = torch.empty((experts, out, words * owner.int_spec.pack), dtype=owner.compute_dtype,
                                  device=param.device)
            weights.normal_(0.0, DUMMY_INIT_STD, generator=gen)
            for expert, weight in enumerate(weights):
                owner.quantize_expert(leaf, expert, weight)
        elif isinstance(owner, FusedMoE) and param.dtype == FP8_DTYPE:
            # FP8 experts: the unquantised model's draws, each expert's quantised tile by tile.
            weights = torch.empty(param.shape, dtype=owner.compute_dtype, device=param.device)
            weights.normal_(0.0, DUMMY_INIT_STD, generator=gen)
            for expert, weight in enumerate(weights):
                owner.load_stacked(leaf, expert, weight)
        elif isinstance(owner, wna16.WNA16Linear):
            # Integer codes: the unquantised model's draws, quantised round-to-nearest (scales and zeros
            # come with the codes).
            if leaf == "codes":
                weight = torch.empty((owner.out_features, owner.in_features), dtype=owner.compute_dtype,
                                     device=param.device)
                owner.load_weight_rows(0, weight.normal_(0.0, DUMMY_INIT_STD, generator=gen))
        elif load_rows is not None:
            # A quantised layer: the same draws as the unquantised model's weight, then quantised, so
            # both random models are one model up to the rounding.
            weight = torch.empty(param.shape, dtype=owner.compute_dtype, device=param.device)
            load_rows(0, weight.normal_(0.0, DUMMY_INIT_STD, generator=gen))
        else:
            param.normal_(0.0, DUMMY_INIT_STD, generator=gen)
