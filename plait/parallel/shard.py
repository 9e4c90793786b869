"""How a model is cut across tensor-parallel ranks, applied from outside it: each rank builds the model of
a narrower config (its share of the heads, of the MLP and of every expert), takes its slice of every
checkpoint tensor, and sums the attention's and the feed-forward's outputs over the ranks (Megatron's column
/ row split).

Under expert parallelism (vLLM's enable_expert_parallel) a MoE model's routed experts are dealt out whole
instead: rank r of N holds experts [r * E / N, (r + 1) * E / N) at their full width, renumbered from 0, and
computes their share of every token's output (the router, replicated, still picks among all E); the MoE
block's sum over the ranks is the same all-reduce. Attention, dense MLPs and shared experts split as
before.

A Mamba2 mixer (Mamba2, Bamba, NemotronH, Granite 4) splits by heads as vLLM's MambaMixer2: in_proj's z, x and
dt rows, conv1d's x channels, A_log / D / dt_bias and the gated norm's weight by heads, B and C (in_proj rows,
conv1d channels) by groups, or replicated where there is one group; out_proj by columns, summed. Each rank's
recurrent state holds its own heads."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from plait.config import DEEPSEEK_ARCHITECTURES, ModelConfig, mla_dims
from plait.layers.mamba import Mamba2Dims, Mamba2Mixer
from plait.layers.moe import FusedMoE
from plait.layers.mxfp4 import BLOCK_VALUES
from plait.models.bamba import bamba_dims
from plait.models.mamba2 import mamba2_dims
from plait.models.nemotron_h import nemotron_h_dims
from plait.models.weights import IMAGE_SIDE_MODULES, IMAGE_SIDE_TENSOR
from plait.parallel.group import DRIVER_RANK, TPGroup

# The hybrids of Mamba2 mixers (and attention, MLPs, MoE blocks): how each reads its mixer's dims from its
# HF config.
MAMBA2_DIMS: dict[str, Callable[[dict], Mamba2Dims]] = {
    "Mamba2ForCausalLM": mamba2_dims, "BambaForCausalLM": bamba_dims, "NemotronHForCausalLM": nemotron_h_dims,
    "GraniteMoeHybridForCausalLM": bamba_dims,
}
# The decoders whose layers are the Llama family's attention and MLP or sparse MoE block, or a Mamba2
# mixer: those a rank can build from a narrower config alone. (OLMo 2 / 3 and OLMoE normalise q and k across
# all heads: each rank its slice, with the sums of squares of every rank's: Attention.qk_norm_group.)
SHARDABLE_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "GraniteForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
    "SmolLM3ForCausalLM", "Ministral3ForCausalLM", "SeedOssForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
    "Ernie4_5ForCausalLM", "Exaone4ForCausalLM", "GptOssForCausalLM",
    # Cohere's parallel block: o_proj and down_proj each summed over the ranks, their sum added to the stream.
    "CohereForCausalLM", "Cohere2ForCausalLM",
    "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM",
    # Granite MoE's checkpoint names are made the MoE block's before the split (checkpoint_layout).
    "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
    # MLA (DeepSeek-V2 / V3): query, kv_b_proj and o_proj split by heads, the latent projections replicated
    # (Shard._mla_attention), so every rank caches the same latent rows for its own heads.
    *DEEPSEEK_ARCHITECTURES,
    # Their pooling forms (the same decoder; the driver pools or classifies the whole hidden states).
    "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "LlamaForSequenceClassification",
    "MistralForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
    # Image models: their decoder split as a Llama's, the vision side whole on every rank (IMAGE_SIDE_TENSOR;
    # only the driver runs it, and sends the other ranks each step's image embeddings).
    "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration", "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration", "Mistral3ForConditionalGeneration",
    "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    # Gemma 3's step arrays carry its key limits (StepArrays.key_limits): every rank masks images alike.
    "Gemma3ForConditionalGeneration",
    *MAMBA2_DIMS,
})
# A checkpoint tensor of a decoder layer's attention: (projection, "weight" | "bias" | a quantised
# checkpoint's tensor beside the weight (SCALE_KINDS, INTEGER_KINDS)), or (its own name, None) for a tensor of
# the attention itself (GPT-OSS's ``self_attn.sinks``, one per query head).
_SUFFIXES = (r"(?:\.(weight|bias|weight_scale|weight_scale_inv|input_scale|qweight|qzeros|scales|g_idx|"
             r"weight_packed|weight_zero_point|weight_g_idx|weight_shape))?$")
# NemotronH names every layer's module ``mixer``: attention's, its MLP's, its MoE block's and the Mamba2
# mixer's (MAMBA_TENSOR, matched first); the MoE block's router (``mixer.gate``) and latent projections
# (``mixer.fc1_latent_proj``, ``mixer.fc2_latent_proj``) land here too, whole on every rank.
ATTENTION_TENSOR = re.compile(r"\.layers\.\d+\.(?:self_attn|mixer)\.(\w+)" + _SUFFIXES)
# A feed-forward's: a dense MLP's (``mlp.gate_proj.weight``), a routed expert's
# (``mlp.experts.3.up_proj.weight``, Mixtral's ``block_sparse_moe.experts.3.w1.weight``), transformers 5's
# stacked experts (``mlp.experts.gate_up_proj``, and FusedMoE's ``gate_up_bias`` / ``down_bias`` as
# GPT-OSS's checkpoint_layout names its experts' biases), Bamba's ``feed_forward``, NemotronH's MLP layer's
# ``mixer.up_proj`` or a shared expert's
# (``mlp.shared_expert.down_proj.weight``; GLM-4.5's ``mlp.shared_experts...``), or GPT-OSS's MXFP4
# experts (``mlp.experts.down_proj_blocks``): (which MLP, projection, "_blocks" | "_scales" | None, "weight" |
# "bias" | None). Routers (``mlp.gate``, with GLM-4.5's ``mlp.gate.e_score_correction_bias``,
# ``block_sparse_moe.gate``, ``shared_expert_gate``, GPT-OSS's ``mlp.router``) are replicated.
FFN_TENSOR = re.compile(r"\.layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward|mixer)\."
                        r"(experts\.\d+\.|experts\.|shared_experts?\.)?"
                        r"(gate_proj|up_proj|down_proj|gate_up_proj|gate_up_bias|down_bias|w1|w2|w3)"
                        r"(_blocks|_scales)?" + _SUFFIXES)
# A Mamba2 mixer's tensor (Bamba's and Granite 4's ``mamba``, Mamba2's and NemotronH's ``mixer``): (its
# parameter or projection, "weight" | "bias" | a quantised checkpoint's tensor beside the weight | None).
MAMBA_TENSOR = re.compile(r"\.layers\.\d+\.(?:mamba|mixer)\.(in_proj|conv1d|dt_bias|A_log|D|norm|out_proj)"
                          + _SUFFIXES)
# Under expert parallelism, a routed expert's tensor: one expert's (``mlp.experts.3.up_proj.weight``,
# Mixtral's ``block_sparse_moe.experts.3.w1.weight``, an FP8 one's ``weight_scale_inv``), its index
# captured, or a stack of every expert's along dim 0 (``mlp.experts.gate_up_proj``, ``down_bias``, GPT-OSS's
# MXFP4 ``down_proj_blocks`` and ``_scales``).
EXPERT_TENSOR = re.compile(r"\.layers\.\d+\.(?:mlp|block_sparse_moe|mixer)\.experts\.(?:(\d+)\.)?\w")
# MLA's projections cut by heads: each head's query rows (nope, then rope; q_proj, or q_b_proj after the
# query's latent), its kv_b_proj rows (K nope, then V) and o_proj's columns of its values. The latent side
# (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) is every head's: replicated.
MLA_QUERY = ("q_proj", "q_b_proj")
# NemotronH's latent MoE: fc2_latent_proj takes the routed experts' (per-rank partial) sum back to the hidden
# width before the block's sum over the ranks, so its bias is added by the driver alone.
LATENT_OUT_PROJ = "fc2_latent_proj"
# FusedMoE's stacked expert biases: the projection each belongs to.
STACKED_EXPERT_BIASES = {"gate_up_bias": "gate_up_proj", "down_bias": "down_proj"}
# The E8M0 scale (2^0) of the MXFP4 blocks that pad experts to whole blocks a rank: their codes are zeros, so
# any finite scale would do; 255 is E8M0's NaN.
PAD_SCALE = 127
# Column-parallel (each rank keeps some output rows) and row-parallel (some input columns) projections;
# Mixtral names gate, up and down w1, w3 and w2.
COLUMN_PARALLEL = ("gate_proj", "up_proj", "w1", "w3")
ROW_PARALLEL = ("down_proj", "w2")
# The projections whose outputs the ranks sum: o_proj, down / w2, a Mamba2 mixer's out_proj.
SUMMED_PROJECTIONS = (*ROW_PARALLEL, "o_proj", "out_proj")
# The modules whose outputs sum_row_parallel_outputs sums, by name (beside MoE blocks and Mamba2 mixers'
# out_proj): attention's o_proj, a dense MLP's down_proj (Bamba's MLP is its ``feed_forward``; NemotronH's
# attention and MLP are each a layer's ``mixer``).
SUMMED_MODULES = ("self_attn.o_proj", "mlp.down_proj", "feed_forward.down_proj", "mixer.o_proj",
                  "mixer.down_proj")
# An FP8 checkpoint's scales beside a projection's weight: one for the tensor (and a static input scale),
# one a row ([out] or [out, 1]), or one a tile ([out / block_n, in / block_k]; "weight_scale_inv" in
# DeepSeek / Qwen checkpoints, "weight_scale" in llm-compressor's).
SCALE_KINDS = ("weight_scale", "weight_scale_inv", "input_scale")
# The tensors of a GPTQ / AWQ / compressed-tensors integer layer, sliced by Shard._integer.
INTEGER_KINDS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_zero_point", "weight_scale",
                 "weight_g_idx", "weight_shape")
# A GPTQ / AWQ / compressed-tensors integer layer's tensors: for each, (the dim along the output columns N and
# how many columns an entry there covers, the dim along the inputs K and how many inputs an entry covers), a
# factor being "pack" (codes a 32-bit word), "group" (inputs a scale) or 1; None: no such dim.
PACK, GROUP = "pack", "group"
INTEGER_LAYOUTS = {
    ("gptq", "qweight"): ((1, 1), (0, PACK)), ("gptq", "qzeros"): ((1, PACK), (0, GROUP)),
    ("gptq", "scales"): ((1, 1), (0, GROUP)), ("gptq", "g_idx"): (None, (0, 1)),
    ("awq", "qweight"): ((1, PACK), (0, 1)), ("awq", "qzeros"): ((1, PACK), (0, GROUP)),
    ("awq", "scales"): ((1, 1), (0, GROUP)),
    ("compressed-tensors", "weight_packed"): ((0, 1), (1, PACK)),
    ("compressed-tensors", "weight_scale"): ((0, 1), (1, GROUP)),
    ("compressed-tensors", "weight_zero_point"): ((0, PACK), (1, GROUP)),
    ("compressed-tensors", "weight_g_idx"): (None, (0, 1)),
}


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's share of a model: which heads, which MLP and expert columns, or which whole experts
    (made by shard_for)."""

    rank: int
    world_size: int
    full: ModelConfig  # the checkpoint's
    local: ModelConfig  # this rank's: what its model is built from (its experts' width padded: shard_for)
    # An FP8 checkpoint's (block_n, block_k) tiles, whose scales a rank takes whole tiles of (the loader
    # sets it); None: no tiles.
    weight_block: tuple[int, int] | None = None
    # A GPTQ / AWQ / compressed-tensors checkpoint's scheme (plait.layers.wna16.WNA16Spec), whose packed
    # tensors a rank slices whole words and groups of (the loader sets it); None: not one.
    integer: object | None = None

    def of_rank(self, rank: int) -> Shard:
        """Another rank's share of the same split: the rank differs, and under expert parallelism which
        experts its local config holds (every rank's is otherwise the same)."""
        local = self.local
        if self.expert_range is not None:
            experts = experts_of_rank(self.full.moe.num_experts, rank, self.world_size)
            local = dataclasses.replace(local, moe=dataclasses.replace(local.moe, expert_range=experts))
        return dataclasses.replace(self, rank=rank, local=local)

    @property
    def expert_range(self) -> tuple[int, int] | None:
        """Expert parallelism: the global ids [first, end) of the routed experts this rank holds; or None."""
        return None if self.local.moe is None else self.local.moe.expert_range

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

    def _part(self, t: torch.Tensor, dim: int, n: int, fill: int = 0) -> torch.Tensor:
        """This rank's n entries along ``dim``; those past the tensor's end (padded experts) are ``fill``."""
        start = self.rank * n
        have = max(0, min(n, t.shape[dim] - start))
        part = t.narrow(dim, min(start, t.shape[dim]), have)
        if have == n:
            return part
        shape = list(t.shape)
        shape[dim] = n - have
        return torch.cat([part, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)

    def _summed_bias(self, t: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's bias: added once, after the ranks' outputs are summed: the driver's."""
        return t if self.is_driver else torch.zeros_like(t)

    def _attention(self, proj: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        if self.full.architecture in DEEPSEEK_ARCHITECTURES:
            return self._mla_attention(proj, kind, t)
        if proj == LATENT_OUT_PROJ:
            return self._summed_bias(t) if kind == "bias" else t
        d = self.full.head_dim
        if proj == "q_proj":
            return self._part(t, 0, self.local.num_attention_heads * d)
        if proj in ("k_proj", "v_proj"):
            lo, hi = self.kv_head_range()
            return t[lo * d: hi * d]
        if proj == "o_proj":
            if kind == "bias":
                return self._summed_bias(t)
            return self._part(t, 1, self.local.num_attention_heads * d)
        if proj == "sinks":  # one per query head
            return self._part(t, 0, self.local.num_attention_heads)
        if proj == "qkv_proj":  # Phi-3's fused q, k, v rows
            c = self.full
            q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
            parts = zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]))
            return torch.cat([self._attention(part, kind, piece) for part, piece in parts])
        if proj == "q_norm" and t.dim() == 2:  # Command R+'s: a weight row per query head [Hq, D]
            return self._part(t, 0, self.local.num_attention_heads)
        if proj == "k_norm" and t.dim() == 2:  # [Hkv, D]
            lo, hi = self.kv_head_range()
            return t[lo:hi]
        if proj in ("q_norm", "k_norm") and t.shape[0] > d:  # OLMo's across all heads: as q's or k's rows
            return self._attention(proj.replace("_norm", "_proj"), kind, t)
        return t  # q/k norms of one weight for every head (Qwen3's [D])

    def _mla_attention(self, proj: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        """An MLA layer's tensor (MLA_QUERY): this rank's heads' rows of the query and of kv_b_proj (whose
        absorbed W_UK / W_UV are then this rank's heads' alone), their columns of o_proj; the rest whole."""
        nope, rope, v, _ = mla_dims(self.full)
        heads = self.local.num_attention_heads
        if proj in MLA_QUERY:
            return self._part(t, 0, heads * (nope + rope))
        if proj == "kv_b_proj":
            return self._part(t, 0, heads * (nope + v))
        if proj == "o_proj":
            return self._summed_bias(t) if kind == "bias" else self._part(t, 1, heads * v)
        return t

    def _feed_forward(self, which: str | None, proj: str, packed: str | None, kind: str | None,
                      t: torch.Tensor) -> torch.Tensor:
        """A feed-forward's tensor ([out, in], or [experts, out, in] stacked; MXFP4 ``packed`` experts'
        "_blocks" [experts, out, in / 32, 16] or "_scales" [experts, out, in / 32]): gate and up rows (split
        first where fused), down columns, each this rank's share of that MLP's width."""
        moe = self.local.moe
        if which is None or moe is None:
            n = self.local.intermediate_size
        else:
            shared = which in ("shared_expert.", "shared_experts.")  # Qwen2-MoE's; GLM-4.5's (plural)
            n = moe.shared_intermediate_size if shared else moe.intermediate_size
        if proj in STACKED_EXPERT_BIASES:
            proj, kind = STACKED_EXPERT_BIASES[proj], "bias"
        rows = -1 if kind == "bias" else -2  # a bias is [out]: its rows are its last dim
        cols, width = -1, n  # the input columns a row-parallel rank keeps: n, or n / 32 MXFP4 blocks
        fill = PAD_SCALE if packed == "_scales" else 0
        if packed is not None:
            width = n // BLOCK_VALUES
            rows, cols = (-3, -2) if packed == "_blocks" else (-2, -1)
        if proj in ROW_PARALLEL:
            return self._summed_bias(t) if kind == "bias" else self._part(t, cols, width, fill)
        if proj in COLUMN_PARALLEL:
            return self._part(t, rows, n, fill)
        gate, up = t.chunk(2, dim=rows)  # gate_up_proj: Phi-3's fused, or transformers 5's stacked experts
        return torch.cat([self._part(gate, rows, n, fill), self._part(up, rows, n, fill)], dim=rows)

    def _mamba(self, proj: str, kind: str | None, t: torch.Tensor) -> torch.Tensor:
        """A Mamba2 mixer's tensor (MAMBA_TENSOR) as this rank holds it: in_proj's rows ([z | x | B | C | dt]
        by out channel) and conv1d's channels ([x | B | C]) each piece cut as its own, by heads or by groups
        (B and C whole where one group is replicated); A_log, D, dt_bias by heads, the gated norm's weight by
        its heads' channels; out_proj's columns of them (its bias the driver's)."""
        full = MAMBA2_DIMS[self.full.architecture](self.full.raw)
        local = full.split(self.world_size)
        inner, groups = full.intermediate_size, full.n_groups * full.state_size

        def of_groups(piece: torch.Tensor) -> torch.Tensor:  # B or C rows: [G N, ...]
            if local.group_ranks > 1:
                return piece  # the one group, every rank's
            return self._part(piece, 0, local.n_groups * full.state_size)

        heads = self._part  # z, x, dt: this rank's heads (or their channels)
        if proj == "in_proj":
            z, x, B, C, dt = t.split([inner, inner, groups, groups, full.num_heads])
            i = local.intermediate_size
            return torch.cat([heads(z, 0, i), heads(x, 0, i), of_groups(B), of_groups(C),
                              heads(dt, 0, local.num_heads)])
        if proj == "conv1d":  # weight [conv_dim, 1, K], bias [conv_dim]
            x, B, C = t.split([inner, groups, groups])
            return torch.cat([heads(x, 0, local.intermediate_size), of_groups(B), of_groups(C)])
        if proj in ("A_log", "D", "dt_bias"):  # [H]
            return heads(t, 0, local.num_heads)
        if proj == "norm":  # [I]
            return heads(t, 0, local.intermediate_size)
        # out_proj: [hidden, I]
        return self._summed_bias(t) if kind == "bias" else heads(t, 1, local.intermediate_size)

    def _held_expert(self, match: re.Match, name: str, tensor: torch.Tensor
                     ) -> tuple[str, torch.Tensor] | None:
        """Expert parallelism: a routed expert's tensor (EXPERT_TENSOR's ``match``) as this rank holds it:
        a stack's rows of its experts, one of its experts' under its local index, another's not at all (None).
        Whole, biases too: an expert's down bias is added by the one rank that runs the expert."""
        first, end = self.expert_range
        if match[1] is None:  # [E, ...]
            return name, tensor[first:end]
        expert = int(match[1])
        if not first <= expert < end:
            return None
        return f"{name[:match.start(1)]}{expert - first}{name[match.end(1):]}", tensor

    def checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of each checkpoint tensor (HF names); the LM head only on the driver, the one
        rank that samples; under expert parallelism, only its own routed experts' tensors."""
        for name, tensor in weights:
            # the LM head, an image checkpoint's too (language_model.lm_head.weight), only on the driver
            if (name.startswith("lm_head.") or ".lm_head." in name) and not self.is_driver:
                continue
            if IMAGE_SIDE_TENSOR.match(name):  # a CLIP tower's "layers.N.self_attn" are not the decoder's
                yield name, tensor
                continue
            expert = EXPERT_TENSOR.search(name) if self.expert_range is not None else None
            if expert:
                held = self._held_expert(expert, name, tensor)
                if held is not None:
                    yield held
                continue
            mamba = MAMBA_TENSOR.search(name) if self.full.architecture in MAMBA2_DIMS else None
            attention = None if mamba else ATTENTION_TENSOR.search(name)
            ffn = None if mamba else FFN_TENSOR.search(name)
            if mamba:
                cut = functools.partial(self._mamba, mamba[1])
                proj, kind = mamba[1], mamba[2]
            elif ffn:  # first: NemotronH's MLP is a ``mixer`` too
                cut = functools.partial(self._feed_forward, ffn[1], ffn[2], ffn[3])
                proj, kind = ffn[2], ffn[4]
            elif attention:
                cut = functools.partial(self._attention, attention[1])
                proj, kind = attention[1], attention[2]
            if mamba or attention or ffn:
                tensor = self._sliced(name, proj, kind, tensor, cut)
            yield name, tensor

    def projection(self, proj: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor laid out as projection ``proj``'s weight ([out, in]; HF's name: ``q_proj``, ``down_proj``,
        Phi-3's fused ``qkv_proj``) as this rank slices that weight: a LoRA adapter's B of a column-parallel
        projection, or A of a row-parallel one."""
        if proj in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"):
            return self._attention(proj, "weight", t)
        return self._feed_forward(None, proj, None, "weight", t)

    def _sliced(self, name: str, proj: str, kind: str | None, t: torch.Tensor,
                cut: Callable[[str | None, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A projection's tensor (``cut(kind, t)`` slices its weights and biases) as this rank holds it."""
        row_parallel = proj in SUMMED_PROJECTIONS
        if self.integer is not None and kind in INTEGER_KINDS:
            return self._integer(name, kind, t, functools.partial(cut, "weight"), row_parallel)
        if kind in SCALE_KINDS:
            return self._scales(name, t, functools.partial(cut, "weight"), row_parallel)
        return cut(kind, t)

    def _scales(self, name: str, scale: torch.Tensor, cut: Callable[[torch.Tensor], torch.Tensor],
                row_parallel: bool) -> torch.Tensor:
        """An FP8 checkpoint's scales for this rank's slice of their weight (``cut`` slices the weight): a
        tensor's one scale whole; a row's scales those of the rows it keeps (all of them where it keeps
        columns); a tile's those of the tiles its slice covers, which must be whole tiles."""
        if scale.numel() == 1:
            return scale
        # [N / bn, 1] is a tile column too where the checkpoint is block-wise (K within one tile: a tiny
        # model's, or MLA's kv_b_proj over a narrow latent), not N per-row scales.
        tiles = scale.dim() == 2 and (scale.shape[1] > 1 or self.weight_block is not None)
        if not tiles:
            return scale if row_parallel else scale[self._kept(cut, scale.shape[0], 1, rows=True)]
        if self.weight_block is None:
            raise ValueError(f"{name}: tile scales in a checkpoint without weight_block_size")
        block_n, block_k = self.weight_block
        if row_parallel:
            return scale[:, self._kept(cut, scale.shape[1], block_k, rows=False, name=name)]
        return scale[self._kept(cut, scale.shape[0], block_n, rows=True, name=name)]

    def _integer(self, name: str, kind: str, t: torch.Tensor, cut: Callable[[torch.Tensor], torch.Tensor],
                 row_parallel: bool) -> torch.Tensor:
        """A GPTQ / AWQ / compressed-tensors tensor (INTEGER_LAYOUTS) for this rank's slice of its weight:
        the entries of its output columns (column-parallel) or of its inputs (row-parallel), in whole packed
        words and groups. Act-order's row-parallel ranks keep every group's scales and zeros (as vLLM's do):
        their inputs' rows fall in any group (WNA16Linear pads the groups they fill unevenly)."""
        spec = self.integer
        if kind == "weight_shape":  # [N, K]: this rank's
            n, k = (int(v) for v in t.tolist())
            if row_parallel:
                k = int(cut(torch.arange(k).view(1, k)).numel())
            else:
                n = int(cut(torch.arange(n).view(n, 1)).numel())
            return torch.tensor([n, k], dtype=t.dtype)
        n_axis, k_axis = INTEGER_LAYOUTS[(spec.method, kind)]
        axis = k_axis if row_parallel else n_axis
        if axis is None:  # g_idx of a column-parallel layer: every input, whole
            return t
        dim, factor = axis
        if factor == GROUP and (not spec.group_size or spec.desc_act):
            return t  # one group spans K, or act-order's span it: a row-parallel slice keeps them whole
        size = {PACK: spec.pack, GROUP: spec.group_size, 1: 1}[factor]
        blocks = self._kept(cut, t.shape[dim], size, rows=not row_parallel, name=name)
        part = t.index_select(dim, blocks)
        if kind in ("g_idx", "weight_g_idx") and not spec.desc_act:  # ids from this rank's first group
            part = part - part.min()
        return part

    @staticmethod
    def _kept(cut: Callable[[torch.Tensor], torch.Tensor], num_blocks: int, block: int, rows: bool,
              name: str = "") -> torch.Tensor:
        """The blocks of ``block`` rows (or columns) a weight slice keeps: ``cut`` applied to the indices of
        a weight num_blocks * block long on that dim, which must keep whole blocks."""
        n = num_blocks * block
        index = torch.arange(n).view(n, 1) if rows else torch.arange(n).view(1, n)
        kept = cut(index).reshape(-1)
        starts = kept[::block]
        if len(kept) % block or bool((starts % block).any()) or not torch.equal(
                kept, (starts[:, None] + torch.arange(block)).reshape(-1)):
            raise ValueError(f"{name}: this rank's slice does not cover whole {block}-wide blocks (FP8 "
                             "tiles, packed words or scale groups); pick a tensor_parallel_size that splits "
                             "the model's widths into whole ones")
        return starts // block


def experts_of_rank(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """Expert parallelism: the global ids [first, end) of the routed experts rank ``rank`` holds."""
    per_rank = num_experts // world_size
    return rank * per_rank, (rank + 1) * per_rank


def shard_for(config: ModelConfig, rank: int, world_size: int, expert_block: int = 1,
              expert_parallel: bool = False, expert_tile: tuple[int, str] | None = None) -> Shard:
    """Rank ``rank``'s share of ``config``'s model, or a ValueError saying why it cannot be split so. The
    routed experts' width a rank is a multiple of ``expert_block`` (MXFP4 experts: whole 32-value blocks);
    where the checkpoint's width does not split so, the ranks' shares reach past it, into zero weights (as
    vLLM pads gpt-oss's experts): zero gate and up rows make zero activations, which zero down columns
    ignore. ``expert_tile``: quantised experts, (pieces, what): a rank's width must be whole pieces of this
    many columns, exactly (FP8 tiles, integer groups and words: a padded one would hold zero rows on the
    scale of real ones the checkpoint never wrote; vLLM refuses such a split too). expert_parallel: each
    rank holds whole routed experts instead (experts_of_rank; a dense model has none, and is split as
    without it, as vLLM ignores the flag for it)."""
    if config.architecture not in SHARDABLE_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {world_size}: {config.architecture} cannot be split across "
                         f"devices yet; the decoders that can: {sorted(SHARDABLE_ARCHITECTURES)}")
    moe = config.moe
    split_experts = expert_parallel and moe is not None
    if split_experts and moe.num_experts % world_size:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {world_size} must divide the model's "
                         f"{moe.num_experts} routed experts, so that every rank holds as many whole ones")
    widths = [("attention heads", config.num_attention_heads),
              ("intermediate size", config.intermediate_size)]
    if moe is not None:
        widths += [("shared expert intermediate size", moe.shared_intermediate_size)]
        if expert_block == 1 and not split_experts:
            widths += [("expert intermediate size", moe.intermediate_size)]
    for what, n in widths:
        if n % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {what} ({n})")
    if moe is not None and expert_tile is not None and not split_experts:
        _check_whole_expert_tiles(moe.intermediate_size, world_size, *expert_tile)
    mamba_ranks = _check_mamba_split(config, world_size)
    kv_heads = config.num_key_value_heads
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} and the model's {kv_heads} KV heads: one must "
                         "divide the other")
    if split_experts:
        moe = dataclasses.replace(moe, expert_range=experts_of_rank(moe.num_experts, rank, world_size),
                                  shared_intermediate_size=moe.shared_intermediate_size // world_size)
    elif moe is not None:
        per_rank = -(-moe.intermediate_size // (world_size * expert_block)) * expert_block
        moe = dataclasses.replace(moe, intermediate_size=per_rank,
                                  shared_intermediate_size=moe.shared_intermediate_size // world_size)
    local = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                                num_key_value_heads=max(1, kv_heads // world_size),
                                intermediate_size=config.intermediate_size // world_size, moe=moe,
                                mamba_ranks=mamba_ranks)
    return Shard(rank, world_size, config, local)


def _check_mamba_split(config: ModelConfig, world_size: int) -> int:
    """The ranks a hybrid's Mamba2 mixers split over (ModelConfig.mamba_ranks: world_size; 1 where the model
    has no Mamba2 mixer), or a ValueError where they cannot: every rank takes as many heads, and whole groups
    of its own or the one group replicated (vLLM's MambaMixer2 refuses the rest too)."""
    dims_of = MAMBA2_DIMS.get(config.architecture)
    if dims_of is None:
        return 1
    dims = dims_of(config.raw)
    if dims.num_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {dims.num_heads} Mamba "
                         "heads")
    if dims.n_groups % world_size and dims.n_groups != 1:
        raise ValueError(f"tensor_parallel_size {world_size} and the model's {dims.n_groups} Mamba groups: "
                         "each rank must hold whole groups of its own, or the model have one group "
                         "(replicated on every rank)")
    return world_size


def _check_whole_expert_tiles(width: int, world_size: int, tile: int, what: str) -> None:
    """A ValueError naming the fixes where ``world_size`` ranks' shares of an expert's ``width`` (already
    known to divide) are not whole ``tile``-wide pieces (``what``: FP8 tiles, integer groups and words) of
    gate and up rows and down columns."""
    per_rank = width // world_size
    if per_rank % tile:
        raise ValueError(f"tensor_parallel_size {world_size} gives each rank {per_rank} of every routed "
                         f"expert's {width} intermediate columns, not a whole number of its {tile}-wide "
                         f"{what} (the checkpoint's, or the smallest --quantization fp8 quantises experts "
                         "in): serve it with enable_expert_parallel=True (each rank holds whole experts) or "
                         f"a tensor_parallel_size that splits {width} into multiples of {tile}")


def sum_row_parallel_outputs(model: nn.Module, group: TPGroup) -> None:
    """Make a rank's model (built from Shard.local, loaded from Shard.checkpoint) one slice of the whole: the
    outputs of o_proj, of a dense MLP's down_proj and of a sparse MoE block (its experts' and shared expert's
    partial sums together; under expert parallelism its own experts' whole outputs) are summed over the
    ranks after each call, and so are a Mamba2 mixer's out_proj's, so every rank's residual stream is the
    whole model's; attention whose q/k norms span all heads (OLMo's), and a Mamba2 mixer's gated norm over
    one group replicated on the ranks, take the group, to sum their rows' squares over the ranks before
    normalising."""
    for name, module in model.named_modules():
        if name.split(".", 1)[0] in IMAGE_SIDE_MODULES:  # whole on every rank (Qwen2.5-VL's has a down_proj)
            continue
        moe_block = any(isinstance(child, FusedMoE) for child in module.children())
        if getattr(module, "flat_qk_norm", False):  # OLMo's q/k norms span the ranks' heads
            module.qk_norm_group = group
        if isinstance(module, Mamba2Mixer):
            if module.dims.group_ranks > 1:  # one group across the ranks: its norm sums their squares
                module.norm.group = group
            module.out_proj.register_forward_hook(lambda _m, _x, out: group.all_reduce_(out))
        if name.endswith(SUMMED_MODULES) or moe_block:
            module.register_forward_hook(lambda _m, _x, out: group.all_reduce_(out))
