"""Checked copying of HF-named checkpoint tensors into a plait model, with fused projections."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.config import ModelConfig
from plait.layers.fp8 import UNUSED_CHECKPOINT_SCALES

# HF projection name -> (plait fused parameter, shard index): q/k/v and gate/up are concatenated
# at load so each layer runs one projection GEMM instead of three (or two).
STACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}

# The tensors of a GPTQ / AWQ / compressed-tensors integer layer (plait.layers.wna16.WNA16Linear.load_shard).
INTEGER_WEIGHT_TENSORS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_zero_point",
                          "weight_scale", "weight_g_idx", "weight_shape")

# One routed expert's projection (HF's ``...mlp.experts.{e}.gate_proj.weight``, an FP8 one's tile scales, or
# an integer one's INTEGER_WEIGHT_TENSORS): its FusedMoE stacks it.
EXPERT_TENSOR = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    rf"(weight|weight_scale_inv|{'|'.join(INTEGER_WEIGHT_TENSORS)})$")
# Mixtral's names for the same (block_sparse_moe.experts.{e}.w1 / w3 / w2): gate, up, down.
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(gate|experts\.(\d+)\.(w[123]))\.")


@dataclass
class LoadRecord:
    """What one load into a live model wrote (plait.runner.model_runner.ModelRunner.load_weights reads it to
    fold norms again where tensors came)."""

    # parameter name -> the (first row, row count) spans written: a fused projection's shards, or the whole
    rows: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def add(self, name: str, start: int, count: int) -> None:
        self.rows.setdefault(name, []).append((start, count))

    def covers(self, name: str, total_rows: int) -> bool:
        """Whether every one of the parameter's ``total_rows`` rows was written."""
        written = set()
        for start, count in self.rows.get(name, ()):
            written.update(range(start, start + count))
        return len(written) == total_rows


# Set inside live_load(): the load is into a model that already holds weights, so any subset of its tensors
# may come (vLLM's load_weights: the rest keep theirs); None at start-up, where every tensor must come.
_LIVE_LOAD: ContextVar[LoadRecord | None] = ContextVar("plait_live_load", default=None)


@contextmanager
def live_load() -> Iterator[LoadRecord]:
    """Scope a load into a model that already holds weights (LLM.load_weights, a worker extension's): the
    checkpoint's tensors may be any subset, and the record says what each wrote (the innermost open one's:
    a collective_rpc's method may load through the runner, which opens its own)."""
    record = LoadRecord()
    token = _LIVE_LOAD.set(record)
    try:
        yield record
    finally:
        _LIVE_LOAD.reset(token)


def in_live_load() -> bool:
    """Whether a load is a live_load() (any subset of the tensors may come)."""
    return _LIVE_LOAD.get() is not None


def mixtral_name(name: str) -> str:
    """A Mixtral checkpoint name in the Qwen-MoE / transformers 5 layout plait's MoE blocks use."""
    def rename(match: re.Match) -> str:
        if match[1] == "gate":
            return ".mlp.gate."
        return f".mlp.experts.{match[2]}.{MIXTRAL_EXPERT_NAMES[match[3]]}."

    return MIXTRAL_EXPERT.sub(rename, name)


def fused_target(name: str, stacked: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """The plait parameter a checkpoint tensor goes to, and its shard index (None: the whole)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in stacked:
            fused, shard = stacked[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


def weight_row_loader(modules: dict[str, nn.Module], name: str) -> Callable[[int, torch.Tensor], None] | None:
    """For the weight of a quantised layer (plait.layers.fp8.Fp8Linear), the method that takes its rows
    through the layer's own quantiser; None for any other parameter (copied as it is)."""
    owner_name, _, param_name = name.rpartition(".")
    return getattr(modules[owner_name], "load_weight_rows", None) if param_name == "weight" else None


def _shard_sizes(shard_sizes: dict[str, list[int]], target: str) -> list[int]:
    """The shard rows of a fused parameter: keyed by its module and parent ("shared_expert.gate_up_proj"),
    else by its module alone ("qkv_proj")."""
    parts = target.split(".")
    return shard_sizes.get(".".join(parts[-3:-1])) or shard_sizes[parts[-2]]


@torch.no_grad()
def load_checked(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: dict[str, tuple[str, int]],
    shard_sizes: dict[str, list[int]],
    rename: Callable[[str], str | None] = lambda name: name,
    not_in_checkpoint: frozenset[str] = frozenset(),
) -> None:
    """Copy every tensor into its parameter, shape-checked; every parameter must be covered, except in a
    live_load() (which records what came).

    ``rename`` maps a checkpoint name to the model's (None: skip the tensor); ``stacked`` says which
    projections are fused (e.g. STACKED_PROJECTIONS) and ``shard_sizes`` maps a fused parameter's
    module name (e.g. ``qkv_proj``, or with its parent: ``shared_expert.gate_up_proj``) to its shards'
    row counts; a routed expert's tensors go to their FusedMoE (EXPERT_TENSOR);
    ``not_in_checkpoint`` names parameters the checkpoint may omit (a tied lm_head).
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    live = _LIVE_LOAD.get()
    for raw_name, tensor in weights:
        name = rename(raw_name)
        if name is None or name.rpartition(".")[2] in UNUSED_CHECKPOINT_SCALES:
            continue
        expert = EXPERT_TENSOR.match(name)
        if expert and hasattr(modules.get(expert[1]), "load_expert"):
            moe = modules[expert[1]]
            moe.load_expert(int(expert[2]), expert[3], tensor, expert[4])  # check_loaded: every piece came
            loaded.update(f"{expert[1]}.{param}" for param, _ in moe.named_parameters())
            continue
        target, shard = fused_target(name, stacked)
        owner_name, _, param_name = target.rpartition(".")
        owner = modules.get(owner_name)
        if hasattr(owner, "load_stacked") and param_name in ("gate_up_proj", "down_proj"):
            # transformers 5's stacked experts ([E, rows, in]): one expert at a time, so FP8 experts quantise
            for expert, rows in enumerate(tensor):
                owner.load_stacked(param_name, expert, rows)
            loaded.add(target)
            continue
        sizes = _shard_sizes(shard_sizes, target) if shard is not None else None
        # An FP8 checkpoint's weight scales (weight_scale_inv: DeepSeek / Qwen block-wise checkpoints).
        if param_name in ("weight_scale", "weight_scale_inv") and hasattr(owner, "load_scale_rows"):
            start, rows = (sum(sizes[:shard]), sizes[shard]) if sizes else (0, owner.out_features)
            owner.load_scale_rows(start, rows, tensor)
            continue
        # A GPTQ / AWQ checkpoint's packed codes, zeros, scales and g_idx: the layer unpacks its columns.
        if param_name in INTEGER_WEIGHT_TENSORS and hasattr(owner, "load_shard"):
            start, rows = (sum(sizes[:shard]), sizes[shard]) if sizes else (0, owner.out_features)
            loaded.add(f"{owner_name}.{owner.load_shard(param_name, start, rows, tensor)}")
            continue
        if param_name in INTEGER_WEIGHT_TENSORS and owner is not None and target not in params:
            raise ValueError(f"checkpoint tensor {raw_name!r}: the checkpoint quantises {owner_name}, which "
                             "plait keeps in 16 bits (a MoE router, the lm_head, or a layer "
                             "modules_to_not_convert names); such checkpoints are not supported")
        if target not in params:
            raise ValueError(f"checkpoint tensor {raw_name!r} has no place in {type(model).__name__}")
        dst, start = params[target], 0
        if sizes is not None:
            dst, start = dst.split(sizes, dim=0)[shard], sum(sizes[:shard])
        if dst.shape != tensor.shape:
            raise ValueError(f"tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        load_rows = weight_row_loader(modules, target)
        if load_rows is not None:
            load_rows(start, tensor)
        else:
            dst.copy_(tensor)
        loaded.add(target)
        if live is not None:
            live.add(target, start, dst.shape[0] if dst.dim() else 1)
    missing = sorted(set(params) - loaded - not_in_checkpoint)
    if missing and live is None:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
    for module in modules.values():
        if hasattr(module, "check_loaded"):
            module.check_loaded()


def decoder_shard_sizes(cfg) -> dict[str, list[int]]:
    """The row counts of a Llama-style decoder's fused projections' shards (load_checked's shard_sizes):
    q / k / v in qkv_proj, gate / up in gate_up_proj (and a shared expert's); ``cfg`` a ModelConfig."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    if cfg.moe is not None and cfg.moe.shared_intermediate_size:
        sizes["shared_expert.gate_up_proj"] = [cfg.moe.shared_intermediate_size] * 2
    return sizes


def load_decoder_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         not_in_checkpoint: frozenset[str] = frozenset()) -> None:
    """A Llama-style checkpoint (q/k/v and gate/up fused at load, rotary tables skipped, a tied
    lm_head's stored copy skipped) into ``model``, whose ``config`` is a ModelConfig; ``not_in_checkpoint``
    names parameters loaded elsewhere (an image-text model's vision tower)."""
    cfg = model.config
    sizes = decoder_shard_sizes(cfg)

    def rename(name: str) -> str | None:
        if "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            return None  # tied checkpoints sometimes store a copy of the embedding
        return mixtral_name(name) if cfg.moe is not None else name

    load_checked(model, weights, STACKED_PROJECTIONS, sizes, rename, not_in_checkpoint)


# The vision side of an image model (plait.models.llava, .qwen2_vl, .pixtral): its modules' names (a
# checkpoint's may sit under "model."), kept 16-bit in a quantised model and whole on every tensor-parallel
# rank, and which a checkpoint's list of unquantised layers may name.
IMAGE_SIDE_MODULES = ("vision_tower", "multi_modal_projector", "visual")
IMAGE_SIDE_TENSOR = re.compile(r"^(?:model\.)?(?:vision_tower|multi_modal_projector|visual|image_newline)\b")

# An image-text checkpoint's text decoder, under transformers 4's and 5's names -> the decoder's own names.
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                           ("language_model.lm_head.", "lm_head."))


def language_model_name(name: str) -> str | None:
    """An image-text checkpoint's tensor under its text decoder's name; None for the vision tower's and the
    projector's (served as text, the model loads neither)."""
    for prefix, to in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    if name.startswith("lm_head."):
        return name
    return None


def load_image_model_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                             image_side: tuple[str, ...], image_name: Callable[[str], str | None],
                             decoder_name: Callable[[str], str | None] = language_model_name,
                             skip: Callable[[str], bool] = lambda _: False) -> None:
    """An image-text checkpoint into ``model``: the decoder's tensors (``decoder_name`` gives a tensor's
    decoder name, None: not the decoder's) as a Llama's; the image side's (its parameters named from
    ``image_side``; ``image_name`` gives a tensor's, None: not the image side's) copied by name, each checked
    and every one required (but in a live load), those ``skip`` names ignored (what the model never reads)."""
    own = dict(model.named_parameters())
    image_names = {n for n in own if n.startswith(image_side)}
    loaded: set[str] = set()

    def decoder(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            renamed = image_name(name)
            if renamed is None:
                to = decoder_name(name)
                if to is not None:
                    yield to, tensor
                continue
            if skip(renamed):
                continue
            if renamed not in own:
                raise ValueError(f"unexpected tensor {name!r} in a {type(model).__name__} checkpoint")
            if own[renamed].shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match "
                                 f"{tuple(own[renamed].shape)}")
            with torch.no_grad():
                own[renamed].copy_(tensor)
            loaded.add(renamed)

    load_decoder_weights(model, decoder(weights), not_in_checkpoint=frozenset(image_names))
    missing = image_names - loaded
    if missing and not in_live_load():
        raise ValueError(f"the checkpoint lacks vision tensors: {sorted(missing)[:5]}")


def language_model_weights(weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The text decoder's tensors of an image-text checkpoint, renamed (language_model_name)."""
    for name, tensor in weights:
        renamed = language_model_name(name)
        if renamed is not None:
            yield renamed, tensor


def halves_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The channel order that makes GPT-J's rotary pairs (2i, 2i + 1) of a head's first rotary_dim channels
    neox's pairs (i, i + rotary_dim / 2): the even channels, then the odd ones, then the unrotated rest."""
    # -> [head_dim] channel indices
    rotated = torch.arange(rotary_dim)
    return torch.cat([rotated[0::2], rotated[1::2], torch.arange(rotary_dim, head_dim)])


def pairs_as_halves(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, q_proj's and k_proj's rows (weights and biases) put in halves_order within
    each head, for models whose rotary turns adjacent channel pairs (GPT-J's: GLM-4, ERNIE 4.5): plait
    rotates halves (neox), and scores are dot products, the same under one reordering of both q and k, so
    the reordered pairs turn as neox pairs do. An adapter's q/k rows would need the same reordering."""
    order = halves_order(cfg.head_dim, int(cfg.head_dim * cfg.partial_rotary_factor))
    for name, tensor in weights:
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias")):
            # [heads * head_dim, ...] -> [heads, head_dim, ...], channels reordered, flattened back
            per_head = tensor.reshape(-1, cfg.head_dim, *tensor.shape[1:])
            tensor = per_head[:, order.to(tensor.device)].reshape(tensor.shape)
        yield name, tensor
