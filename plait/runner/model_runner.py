"""ModelRunner: owns the device, weights and KV tensors; turns a StepPlan into sampled tokens."""

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from plait.attention.base import KVCacheSpec, get_backend
from plait.attention.fp8_kv import UNIT_SCALES, KVScales, cache_torch_dtype
from plait.config import (
    CPU_KV_CACHE_BYTES,
    EAGLE,
    HIDDEN_STATE_METHODS,
    MTP,
    NO_CHUNK_CAP,
    EngineConfig,
    load_threads,
)
from plait.engine.grammar import next_token_bitmasks
from plait.engine.kv_cache import MIN_KV_BLOCKS, cdiv
from plait.engine.kv_offload import KVTransfer, transfer_runs
from plait.engine.request import Request
from plait.engine.scheduler import StepPlan
from plait.engine.state_slots import PAD_STATE_SLOT
from plait.kernels.dispatch import triton_enabled, triton_importable
from plait.layers.fp8 import FP8_DTYPE
from plait.layers.mamba import allocate_mamba_states
from plait.loader.hf import ModelSource, resolve_model
from plait.loader.model_loader import (
    check_split,
    load_model,
    read_source,
    resolve_device_dtype,
    to_model_dtype,
)
from plait.lora.model import LoRAModel
from plait.models.base import checkpoint_layout
from plait.models.eagle import aux_layer_ids, check_eagle_target, read_head_config
from plait.models.mtp import check_mtp_target
from plait.models.weights import live_load
from plait.multimodal.images import ImageProcessor
from plait.parallel.group import ParallelRank, TPGroup
from plait.parallel.shard import sum_row_parallel_outputs
from plait.parallel.workers import (
    END_OF_WEIGHTS,
    FORWARD,
    IDS,
    KV_TRANSFER,
    LOAD_WEIGHTS,
    LORA_LOAD,
    RPC,
    SLEEP,
    WAKE_UP,
    DriverLink,
    Workers,
    lora_message,
    tensor_message,
)
from plait.runner.cuda_graphs import MAX_GRAPH_PROMPT_TOKENS, StepGraphs, graph_shapes
from plait.runner.feature_tap import FeatureTap
from plait.runner.forward_batch import ForwardBatch, StepArrays, build_step_arrays, forward_batch_from_arrays
from plait.runner.image_embeddings import TOWER_GRAPH_BATCHES, ImageEmbeddings, TowerGraphs
from plait.runner.input_buffers import InputBuffers, Layout
from plait.runner.mrope_positions import MRopePositions
from plait.runner.padding import GraphShape
from plait.runner.pooler import Pooler, resolve_pooling
from plait.runner.prompt_embeds import PromptEmbeds, input_embedding
from plait.runner.sampler import (
    Logprobs,
    Sampler,
    SamplingRow,
    host_to_device,
    logprob_table,
    unpack_logprobs,
)
from plait.runner.sleep import SLEEP_DISCARD_WEIGHTS, WAKE_TAGS, ReleasableTensors, module_tensors
from plait.runner.step_timer import StepBreakdown
from plait.runner.weight_offload import GIB, WeightOffload
from plait.runner.worker import make_worker
from plait.sampling_params import LOGITS_MODES, SamplingParams

logger = logging.getLogger(__name__)

# The most blocks one copy between the KV tiers stages on the device at a time.
MAX_TRANSFER_BLOCKS = 64

# GPU memory held back from the KV cache beyond the profiled peak: CUDA-graph pools, allocator
# fragmentation, and the sampler's work on batches the profile did not shape exactly.
GPU_MEMORY_MARGIN_BYTES = 1 << 30
# PLAIT_FOLD_NORMS=0 keeps the MLP norms' weights out of gate/up, and so the norms in launches of
# their own on decode steps (A/B comparisons).
FOLD_NORMS_ENV = "PLAIT_FOLD_NORMS"
# Mixed-step graphs reach this many prompt tokens where a backlog can raise the cap beside decodes;
# larger steps run eager, their GPU time hiding their ~15 ms of kernel launches.
DRAINED_GRAPH_PROMPT_TOKENS = 512
# Sampling settings of the profiling step: top-p is the sampler's most memory-hungry path (a
# full-vocabulary sort on the torch path, an fp32 copy of the logits on the GPU).
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, seed=0)


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprobs: Logprobs | None
    # Speculative decoding: j, where this token was sampled after the row's first j draft tokens (0: after
    # its known tokens alone, as every row without drafts samples).
    draft_position: int = 0


@dataclass
class PromptLogprobs:
    """Logprobs of a run of one request's prompt tokens, computed by a step that prefilled them."""

    request: Request
    start: int  # the prompt position of entries[0] (>= 1: the first prompt token has no context)
    entries: list[Logprobs]  # prompt tokens start, start + 1, ...


@dataclass
class StepOutput:
    sampled: list[SampledToken]  # one per sampling row, in row order
    logits: torch.Tensor | None  # [S, vocab] fp32: the rows that were sampled (for tests/tools)
    used_cuda_graph: bool = False
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Pooling runner: each request whose prompt ended in the step, and its pooled vector [hidden] fp32 on the
    # host (a per-token task's matrix [tokens, hidden]; before dimensions and normalisation: Pooler.finish).
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)


def with_device_token_budget(config: EngineConfig, device: torch.device) -> EngineConfig:
    """``config`` with its token budget chosen for ``device``, where left to the default."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return config.with_token_budget("cuda", props.total_memory, props.name)
    return config.with_token_budget(device.type)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape); on CPU from calloc'd memory, whose pages the OS zero-fills when first touched, so a
    2 GiB KV cache costs no start-up time (torch.zeros wrote every byte: ~1-3 s of the default model's
    start on 2 cores) and no resident memory until its blocks are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    """One rank's runner. Under tensor parallelism the driver's (rank 0: the engine's) spawns the others
    (plait.parallel.workers), sends each step's inputs to them and broadcasts its sampled ids; a worker's
    runs only the forwards (``forward``, ``receive_sampled_ids``)."""

    def __init__(self, config: EngineConfig, parallel: ParallelRank | None = None,
                 link: DriverLink | None = None, source: ModelSource | None = None,
                 max_kv_blocks: int | None = None, target: nn.Module | None = None) -> None:
        self.device, self.dtype = resolve_device_dtype(config)
        # An EAGLE head's runner: the target model whose embedding (and LM head) it shares.
        self.target = target
        # At most this many KV blocks however much memory is left (a draft model needs no more than its
        # target holds); None: as many as the memory budget gives.
        self.max_kv_blocks = max_kv_blocks
        self.workers: Workers | None = None
        self.group: TPGroup | None = None
        if config.tensor_parallel_size > 1:
            self.device = _rank_device(self.device, config.tensor_parallel_size, parallel)
            if parallel is None:  # the driver: the other ranks start loading beside it
                # A split the model cannot take is refused before any worker starts (each would refuse it).
                check_split(config, source)
                self.workers = Workers(config, config.tensor_parallel_size)
                parallel = self.workers.driver
        self.parallel = parallel
        # Start-up's meeting points with the other ranks: the driver's Workers, or a worker's DriverLink.
        self.peers = self.workers or link
        try:
            # What collective_rpc calls methods of (a bad worker extension fails here, before loading).
            self.worker = make_worker(self, config.worker_extension_cls)
            self._build(config, source)
        except BaseException:
            # A start that failed: the workers are killed, not asked to stop (one still loading reads no STOP
            # until it has loaded, or failed as the driver did; one in a start-up collective never does).
            self.close(kill=True)
            raise

    def _build(self, config: EngineConfig, source: ModelSource | None) -> None:
        budget_given = config.max_num_batched_tokens is not None
        self.config = config = with_device_token_budget(config, self.device)
        loaded = load_model(config, self.device, self.dtype, parallel=self.parallel, source=source)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        if getattr(self.model, "reads_segments", False):  # a BERT cross-encoder: where a pair's second begins
            self.model.segment_separator_id = getattr(self.tokenizer, "sep_token_id", None)
        if self.target is not None:  # before anything runs the model: its graphs read the shared tensors
            self.model.share_target(self.target)
        # An image model's processor (host side); its images' embeddings (device side) once the buffers'
        # size is known. None for a text model.
        self.image_processor = self.image_embeddings = None
        # Prompts given as embeddings (EngineConfig.enable_prompt_embeds), staged for the embedding layer's
        # hook once the buffers' size is known; None where they are off or the model has no such layer.
        self.prompt_embeds: PromptEmbeds | None = None
        if getattr(self.model, "supports_images", False):
            self.image_processor = ImageProcessor.for_model(loaded.source, self.model, self.tokenizer)
        # An M-RoPE model's per-token (t, h, w) positions, once the buffers' size is known; None otherwise.
        # (Under tensor parallelism the driver computes them and sends them with each step.)
        self.mrope_positions: MRopePositions | None = None
        # KV heads this rank caches: its share under tensor parallelism.
        self.num_kv_heads = (loaded.shard.local if loaded.shard else loaded.config).num_key_value_heads
        self.shard = loaded.shard  # this rank's share of the model under tensor parallelism, else None
        # load_weights calls so far: whoever changed the weights (an RPC's method, too) can be told apart.
        self.weight_loads = 0
        if self.parallel is not None:
            # Every rank has its slice before any rank waits on a collective: a rank that failed to load
            # fails the driver here, with its traceback, instead of hanging it.
            self.peers.loaded()
            self.group = TPGroup(self.parallel, self.device)
        # False for encoders (plait.models.bert): each token attends to its whole prompt, so a prompt runs
        # whole in one step (never chunked) and no prefix of it is served from the cache.
        self.is_causal = getattr(self.model, "is_causal", True)
        # Gemma 3: an image's placeholders attend to each other both ways, so every step carries each token's
        # last visible key (StepArrays.key_limits); no other model stages or reads them.
        self.key_limits = bool(getattr(self.model, "bidirectional_image_spans", False))
        self.model_path = loaded.source
        # "pooling": prompts pooled into embeddings (the model has no lm_head); "generate": tokens sampled.
        self.runner_type = loaded.runner
        self.pooler = (Pooler(resolve_pooling(config.pooler_config, loaded.source, self.model_config.raw,
                                              self.model_config.hidden_size,
                                              classifier=hasattr(self.model, "classify"),
                                              default_type=getattr(self.model, "default_pooling_type", None)),
                              self.device)
                       if loaded.runner == "pooling" else None)
        # config.quantization, or what an FP8 checkpoint holds without it
        self.quantization = loaded.quantization
        if self._folds_norms():
            self.model.fold_norm_weights()
        # LoRA layers wrap their targets before the KV cache is sized (their slots take memory) and before
        # any graph is captured (graphs capture the deltas of whatever slots a step's tokens name).
        self.lora = (LoRAModel(self.model, config.max_loras, config.max_lora_rank, self.shard,
                               self._send_lora) if config.enable_lora else None)
        if self.group is not None:  # after LoRA's wrapping: the ranks' partial deltas are summed too
            sum_row_parallel_outputs(self.model, self.group)
        # vLLM's cpu_offload_gb: after every change to the weights (folded norms), before the KV cache is
        # sized from the memory they leave.
        self.weight_offload = (WeightOffload(self.model, int(config.cpu_offload_gb * GIB), self.device)
                               if config.cpu_offload_gb else None)
        self.max_model_len = self._max_model_len(config)
        if not self.is_causal:
            self.config = config = self._whole_prompt_budget(config, budget_given)
        self.attn_backend = get_backend(self._backend_name())
        self.sampler = Sampler(config.seed, config.logprobs_mode)
        self.breakdown = StepBreakdown()
        # Recurrent (Mamba) state first, so that on a GPU the KV cache is sized from what is left.
        specs_of = getattr(self.model, "recurrent_state_specs", None)
        state_specs = specs_of() if specs_of is not None else []
        self.num_state_slots = (config.max_num_state_slots or config.max_num_seqs) if state_specs else 0
        # One extra row per tensor: the pad slot (PAD_STATE_SLOT), where padded graph rows write.
        self.recurrent_states = (
            allocate_mamba_states(state_specs, self.num_state_slots + 1, self.dtype, self.device)
            if state_specs
            else None
        )
        # K/V in the model's dtype, or FP8 codes with a (k, v) scale pair per layer (plait.attention.fp8_kv).
        self.kv_cache_dtype = cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        # What each attention layer caches a token: K and V of this rank's KV heads, unless the model says
        # otherwise (MLA's one latent row: plait.models.deepseek).
        self.kv_cache_spec: KVCacheSpec = (getattr(self.model, "kv_cache_spec", None)
                                           or KVCacheSpec(2, self.num_kv_heads, self.model_config.head_dim))
        if self.kv_cache_spec.planes == 1 and self.kv_cache_dtype == FP8_DTYPE:
            raise ValueError(f"{self.model_config.architecture}: an FP8 KV cache (kv_cache_dtype='fp8') is "
                             "not supported for multi-head latent attention (MLA); use the model's dtype")
        self.kv_scales = [KVScales(*pair) for pair in loaded.kv_scales] if loaded.kv_scales else None
        if self.kv_cache_dtype == FP8_DTYPE and self.kv_scales is None:
            self.kv_scales = [UNIT_SCALES] * self._num_kv_layers()
        self.num_kv_blocks = self._choose_num_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        # As vLLM's start-up line: what --kv-cache-dtype and gpu_memory_utilization bought.
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s", self.num_kv_blocks, config.block_size,
                    self.num_kv_blocks * config.block_size, str(self.kv_cache_dtype).removeprefix("torch."))
        # The prefix cache's host tier (kv_offloading_size, or kv_transfer_config's OffloadingConnector
        # blocks): [host blocks, layers, 2, block_size, Hkv, D], a block's every layer in one row, so that it
        # crosses PCIe in one copy. None: no host tier.
        self.host_kv = self._allocate_host_kv(config.kv_offloading_size, config.kv_offloading_blocks)
        self.num_host_kv_blocks = 0 if self.host_kv is None else self.host_kv.shape[0]
        # Steps replay CUDA graphs, and an image model's vision tower too (captured again on waking up).
        self.use_graphs = use_graphs = (self.device.type == "cuda" and not config.enforce_eager
                                        and self.attn_backend.graph_safe)
        shapes = (graph_shapes(config.max_num_seqs, self._max_graph_prompt_tokens(), self.max_model_len,
                               self._max_graph_prompt_only_tokens(),
                               speculative=config.speculative_config is not None,
                               decodes=self.pooler is None, decode_sizes=config.cuda_graph_sizes)
                  if use_graphs else [])
        # The same staging on every device (on CPU the "copy" is a plain one), so CPU runs exercise it.
        # Decode steps and every graph shape stage into the compact layout (a short copy a step).
        compact = max([config.max_num_seqs + 1, *(s.num_tokens for s in shapes)])
        layout = self._layout(shapes)
        self.buffers = InputBuffers(layout, self.device, compact_tokens=compact)
        if self.image_processor is not None:  # before capture: graphs read its buffers
            # images of any size (Qwen2-VL) run their encoder eager: no fixed shape to capture
            tower_graphs = use_graphs and not getattr(self.model, "variable_size_images", False)
            # a placeholder's row: its embedding (hidden), or wider where the model carries more beside it
            # (Qwen3-VL's DeepStack features: image_embed_width), staged and sent with it alike
            width = getattr(self.model, "image_embed_width", self.model_config.hidden_size)
            self.image_embeddings = ImageEmbeddings(self.model, self.device, layout.max_tokens, width,
                                                    self.dtype, graphs=tower_graphs)
        if getattr(self.model, "uses_mrope", False):  # before capture too
            self.mrope_positions = MRopePositions(self.model, self.device, layout.max_tokens)
        embedding = input_embedding(self.model)
        if config.enable_prompt_embeds and self.pooler is None and embedding is not None:  # before capture
            self.prompt_embeds = PromptEmbeds(embedding, self.device, layout.max_tokens, self.dtype)
        allocate_features = getattr(self.model, "allocate_feature_buffers", None)
        if allocate_features is not None:  # an EAGLE head's: before capture, graphs read and write them
            allocate_features(layout.max_tokens)
        # The hidden states an EAGLE drafter reads of each step (hooks first: graphs capture them).
        self.feature_tap = self._feature_tap(config, layout.max_tokens)
        self.last_features: torch.Tensor | None = None  # the last launched step's, where tapped
        self.graph_shapes = shapes
        self.graphs: StepGraphs | None = self._capture_graphs(shapes) if use_graphs else None
        # Sleep mode (LLMEngine.sleep): the model's tensors, and the per-request state (KV cache, recurrent
        # states), whose storage can be handed back; listed by each sleep from awake.
        self._sleep_weights: ReleasableTensors | None = None
        self._sleep_cache: ReleasableTensors | None = None
        self._param_ids: set[int] = set()  # which of _sleep_weights are parameters (level 2 drops them)
        # Pinned landing places for sampled ids, used in turn: one step is collected while the
        # next one's copy may already be in flight.
        pin = self.device.type == "cuda"
        spec = config.speculative_config
        samples_per_row = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self._host_ids = [
            torch.zeros(config.max_num_seqs * samples_per_row, dtype=torch.long, pin_memory=pin)
            for _ in range(2)
        ]
        self._next_host_ids = 0
        self._copy_out_stream = torch.cuda.Stream(self.device) if pin else None
        if self.peers is not None:
            self.peers.ready()

    def _feature_tap(self, config: EngineConfig, max_tokens: int) -> FeatureTap | None:
        """The tap an EAGLE drafter reads the target's hidden states from (None without one): EAGLE-3's
        on the layers its head's config names."""
        spec = config.speculative_config
        if spec is None or spec.method not in HIDDEN_STATE_METHODS:
            return None
        if spec.method == MTP:  # the MTP layer reads the final hidden states, as EAGLE-1 does
            check_mtp_target(self.model_config, spec.model, config.download_dir)
            return FeatureTap(self.model)
        check_eagle_target(self.model, self.model_config)
        if spec.method == EAGLE:
            return FeatureTap(self.model)
        layers = aux_layer_ids(read_head_config(spec.model, config.download_dir),
                               self.model_config.num_hidden_layers)
        return FeatureTap(self.model, layers, max_tokens)

    @property
    def samples(self) -> bool:
        """Whether this rank samples (and so has an LM head): all but tensor-parallel workers."""
        return self.parallel is None or self.parallel.is_driver

    def close(self, kill: bool = False) -> None:
        """Stop the tensor-parallel workers (``kill``: at once) and let go of the group (nothing to do on one
        device)."""
        if self.workers is not None:
            if kill:
                self.workers.kill()
            self.workers.close()
        if self.group is not None:
            self.group.close()
            self.group = None

    def load_weights_refusal(self) -> str | None:
        """Why load_weights cannot replace this runner's weights (None: it can)."""
        refusals = [(self.quantization is not None, f"a {self.quantization} model (its weights are codes)"),
                    (self.lora is not None, "an engine with LoRA (its layers are wrapped)"),
                    (self.runner_type == "pooling", "a pooling model (its checkpoint's LM head is dropped)"),
                    (self.weight_offload is not None, "cpu_offload_gb (offloaded weights are host copies)")]
        return next((what for refused, what in refusals if refused), None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], in_model_layout: bool = False,
                     this_rank_only: bool = False) -> None:
        """Copy HF-named tensors into the model's parameters (LLMEngine.load_weights), cast as the loader
        casts them, then fold the MLP norms again where the model folds them. Any subset of the checkpoint's
        tensors may come (vLLM's semantics: the rest keep theirs). in_model_layout: the tensors already went
        through the model's checkpoint_layout (a tensor-parallel rank's slices, from the driver).
        this_rank_only: whole tensors that every rank is given at once (a worker extension's load, through
        collective_rpc); each takes its own slices, and the driver sends the others nothing."""
        refusal = self.load_weights_refusal()
        if refusal is not None:
            raise ValueError(f"load_weights is not supported for {refusal}")
        if self._sleep_weights is not None and self._sleep_weights.released:
            raise ValueError("the weights are asleep: wake_up(tags=['weights']) before load_weights")
        if not in_model_layout:
            weights = checkpoint_layout(self.model, weights)
        self.weight_loads += 1  # counted before it starts: a load that fails part-way changed weights too
        if self.workers is not None and not this_rank_only:
            self._load_split_weights(weights)
            return
        if this_rank_only and self.shard is not None:
            weights = self.shard.checkpoint(weights)
        with torch.no_grad(), live_load() as loaded:
            self.model.load_weights((name, to_model_dtype(name, t, self.device, self.dtype))
                                    for name, t in weights)
            if self._folds_norms():  # what came, came unfolded
                self.model.fold_norm_weights(loaded)

    def _send_lora(self, rank: int, payload: tuple) -> None:
        """A LoRA slot's slices to tensor-parallel rank ``rank`` (LoRAModel.load), before the step that reads
        them."""
        self.workers.send_to(rank, (LORA_LOAD, lora_message(payload)))

    def checkpoint_weights(self, path: str | None = None) -> Iterable[tuple[str, torch.Tensor]]:
        """The tensors of the checkpoint at ``path`` (an HF folder, a GGUF file or a cached Hub id), else of
        the model this runner was started with, read lazily (reload_weights)."""
        config = self.config
        source = (resolve_model(config.model, config.revision, config.download_dir) if path is None
                  else resolve_model(path))
        _, weights = read_source(source, "auto", strategy=config.safetensors_load_strategy,
                                 threads=load_threads(config))
        if weights is None:
            raise ValueError(f"{source.path} holds no weights to load")
        return weights

    def _load_split_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """load_weights under tensor parallelism: each tensor's slices go to the other ranks as it comes (on
        the host, through their pipes; each rank loads its own), the driver's slice to its model. A set the
        model refuses still ends every rank's stream and hears every rank's answer, so the ranks stay in step
        (its weights then mixed, as on one device)."""
        world = self.shard.world_size
        shards = [self.shard.of_rank(rank) for rank in range(world)]

        def own_slices() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for rank in range(1, world):
                    for piece, part in shards[rank].checkpoint([(name, tensor)]):
                        self.workers.send_to(rank, tensor_message(piece, part))
                for piece, part in shards[0].checkpoint([(name, tensor)]):
                    yield piece, to_model_dtype(piece, part, self.device, self.dtype)

        self.workers.send(LOAD_WEIGHTS)
        try:
            with torch.no_grad(), live_load():
                self.model.load_weights(own_slices())
        finally:
            for rank in range(1, world):
                self.workers.send_to(rank, END_OF_WEIGHTS)
            answers = self.workers.done()
        refused = next((said for said in answers if said is not None), None)
        if refused is not None:
            raise ValueError(refused)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run ``method`` on every rank's Worker at once (vLLM's collective_rpc): a Worker method's name (a
        worker extension's too) or a function taking the worker first; each rank's result, the driver's
        first. Under tensor parallelism the other ranks get the call pickled (a function must then be
        importable by name) and answer within ``timeout`` seconds (None: no limit); each rank's exception
        is raised after every rank has answered, so they stay in step."""
        kwargs = kwargs or {}
        if self.workers is not None:
            try:
                call = pickle.dumps((method, tuple(args), kwargs))
            except (pickle.PicklingError, AttributeError, TypeError) as err:
                raise ValueError(f"collective_rpc's method and arguments must pickle for the other ranks (a "
                                 f"function importable by name, not a lambda or a local one): {err}") from err
            self.workers.send(RPC, call)
        try:
            own, failure = self.worker.execute(method, tuple(args), kwargs), None
        except Exception as err:  # noqa: BLE001 - raised below, once the other ranks have answered
            own, failure = None, err
        results = [own]
        if self.workers is not None:
            for rank, (ok, detail) in enumerate(self.workers.done(timeout), start=1):
                if not ok and failure is None:
                    failure = RuntimeError(f"collective_rpc {method!r} failed on tensor-parallel rank "
                                           f"{rank}:\n{detail}")
                results.append(pickle.loads(detail) if ok else None)
        if failure is not None:
            raise failure
        return results

    # -- sleep mode ---------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Hand back the device memory of the KV cache and recurrent states (their contents forgotten) and of
        the weights: parked in host memory (level 1) or dropped (level 2: load_weights after wake_up). The
        CUDA graphs, which hold the old addresses, go too. The caller makes sure no request runs. Under
        tensor parallelism every rank does the same."""
        if self.workers is not None:
            self.workers.send(SLEEP, level)
        if not self.is_asleep:  # listed afresh: an adapter load or the like may have replaced tensors since
            weights, self._param_ids = module_tensors(self.model, self.device)
            self._sleep_weights = ReleasableTensors(weights)
            states = [t for s in self.recurrent_states or [] for t in (s.conv, s.ssm)]
            self._sleep_cache = ReleasableTensors([*self.kv_caches, *states], allocate=zeroed)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no launched step still reads them
        self.graphs = None
        if self.image_embeddings is not None:
            self.image_embeddings.tower_graphs = None
        # Level 2 keeps what no checkpoint holds (buffers, rotary tables): only parameters are dropped.
        discard = level == SLEEP_DISCARD_WEIGHTS
        self._sleep_weights.release(keep=lambda t: not (discard and id(t) in self._param_ids))
        self._sleep_cache.release(keep=lambda t: False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, for other processes
        if self.workers is not None:
            self.workers.done()
        logger.info("asleep (level %d): %.2f GiB of weights %s, %.2f GiB of KV cache and states dropped",
                    level, self._sleep_weights.nbytes() / 2**30,
                    "dropped" if level == SLEEP_DISCARD_WEIGHTS else "parked in host memory",
                    self._sleep_cache.nbytes() / 2**30)

    def wake_up(self, tags: Iterable[str] = WAKE_TAGS) -> None:
        """Take back the memory of what ``tags`` name ("weights": parked values, or zeros after level 2;
        "kv_cache": an empty cache); once both are back, capture the CUDA graphs again."""
        if self._sleep_weights is None:
            return
        tags = set(tags)
        if self.workers is not None:  # before the driver's own capture: its collectives meet theirs
            self.workers.send(WAKE_UP, tags)
        self._wake_up(tags)
        if self.workers is not None:
            self.workers.done()

    def _wake_up(self, tags: set[str]) -> None:
        if "weights" in tags:
            self._sleep_weights.take_back()
        if "kv_cache" in tags:
            self._sleep_cache.take_back()
        if self.is_asleep:
            return
        if self.use_graphs and self.graphs is None:  # sleep dropped them (the vision tower's with them)
            self.graphs = self._capture_graphs(self.graph_shapes)
            if self.image_embeddings is not None and not getattr(self.model, "variable_size_images", False):
                tile_shape = self.model.tile_shape
                self.image_embeddings.tower_graphs = TowerGraphs(self.model, self.device, tile_shape)

    @property
    def is_asleep(self) -> bool:
        """Whether the weights or the KV cache have no storage (between sleep and a full wake_up)."""
        weights, cache = self._sleep_weights, self._sleep_cache
        return weights is not None and (weights.released or cache.released)

    def _max_model_len(self, config: EngineConfig) -> int:
        """config.max_model_len, else the model's max_position_embeddings; under vLLM's disable_sliding_window
        at most the model's narrowest attention window, so that no window ever binds."""
        longest = self.model_config.max_position_embeddings
        if config.disable_sliding_window:
            windows = [m.sliding_window for m in self.model.modules() if getattr(m, "sliding_window", None)]
            longest = min([longest, *windows])
        if config.max_model_len is not None and config.max_model_len > longest:
            limit = ("the model's sliding window" if longest < self.model_config.max_position_embeddings
                     else "the model's max_position_embeddings")
            raise ValueError(f"max_model_len {config.max_model_len} exceeds {limit} {longest}")
        return config.max_model_len or longest

    def _folds_norms(self) -> bool:
        """Whether the model's MLP norm weights move into gate/up: on the Triton path of a 16-bit GPU
        model that can (decode-sized steps then apply those norms in o's and silu-and-mul's launches,
        plait.models.llama.LlamaModel.fuses_mlp_norm); PLAIT_FOLD_NORMS=0 keeps them apart."""
        return (os.environ.get(FOLD_NORMS_ENV, "1") != "0"
                and self.parallel is None  # o_proj would add the residual to its slice's partial sum
                and not self.config.enable_lora  # adapters' A read the norms' weighted output
                # an extension may load one tensor at a time (a norm without its gate/up: refold_mlp_norm)
                and self.config.worker_extension_cls is None
                and self.quantization is None  # FP8 layers have no fused norm paths to use it
                and hasattr(self.model, "fold_norm_weights")
                and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                and triton_enabled() and triton_importable())

    def _whole_prompt_budget(self, config: EngineConfig, budget_given: bool) -> EngineConfig:
        """An encoder's config: a step must hold a prompt of max_model_len tokens whole, as vLLM requires of
        models that cannot chunk prompts. A default budget below that is raised to it; one given is refused,
        as is a chunk cap (long_prefill_token_threshold) below it."""
        need, budget = self.max_model_len, config.max_num_batched_tokens
        cap = config.long_prefill_token_threshold
        if cap != NO_CHUNK_CAP and cap < need:
            raise ValueError(f"{self.model_config.architecture} attends bidirectionally, so its prompts "
                             f"cannot be chunked: long_prefill_token_threshold ({cap}) must be 0 or at least "
                             f"max_model_len ({need})")
        if budget >= need:
            return config
        if budget_given:
            raise ValueError(f"{self.model_config.architecture} attends bidirectionally, so its prompts "
                             f"cannot be chunked: max_num_batched_tokens ({budget}) is smaller than "
                             f"max_model_len ({need}); raise max_num_batched_tokens or lower max_model_len")
        logger.info("max_num_batched_tokens raised to max_model_len (%d): %s prompts run whole", need,
                    self.model_config.architecture)
        return replace(config, max_num_batched_tokens=need)

    def _backend_name(self) -> str:
        if not self.is_causal:
            # The Triton kernel masks causally; an encoder attends through torch_ref (eager: no CUDA graphs).
            if self.config.attention_backend not in (None, "torch_ref"):
                raise ValueError(f"{self.model_config.architecture} attends bidirectionally; attention "
                                 f"backend {self.config.attention_backend!r} is causal only: use 'torch_ref'")
            return "torch_ref"
        if self.config.attention_backend is not None:
            return self.config.attention_backend
        if self.device.type == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                logger.warning("triton is not installed: attending with the slow torch_ref backend")
                return "torch_ref"
            return "triton"
        return "torch_ref"

    def _layout(self, shapes: list[GraphShape]) -> Layout:
        cfg = self.config
        # Room for every graph shape's tokens, and for one spare pad row beside max_num_seqs real rows.
        return Layout(
            max_tokens=max([cfg.max_num_batched_tokens, *(s.num_tokens for s in shapes)]),
            max_rows=cfg.max_num_seqs + 1,
            block_table_width=cdiv(self.max_model_len, cfg.block_size),
            key_limits=self.key_limits,
        )

    # -- memory -----------------------------------------------------------------------------

    def _bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return self._num_kv_layers() * self.config.block_size * self.kv_cache_spec.values_per_token() * elem

    def _num_kv_layers(self) -> int:
        # Hybrid models keep KV only for their attention layers (each knows its cache index).
        return getattr(self.model, "num_kv_cache_layers", self.model_config.num_hidden_layers)

    def _choose_num_blocks(self) -> int:
        num_blocks = self._num_blocks_with_room()
        # Ranks hold the same blocks: the one with the least room decides.
        return self.peers.agree_min(num_blocks) if self.peers is not None else num_blocks

    def _num_blocks_with_room(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        room = self._num_blocks_in_budget()
        return room if self.max_kv_blocks is None else min(room, self.max_kv_blocks)

    def _num_blocks_in_budget(self) -> int:
        # Every sequence at full length: all an attention-free model's blocks are (bookkeeping only),
        # and the cap on CPU, where more would only take host memory.
        needed = self.config.max_num_seqs * cdiv(self.max_model_len, self.config.block_size) + 1
        if self._bytes_per_block() == 0:
            return needed
        size = self.config.kv_cache_memory_bytes
        if size is not None:  # the user's size, as vLLM's: no profiling step
            blocks = size // self._bytes_per_block()
            if blocks < MIN_KV_BLOCKS:
                raise ValueError(f"kv_cache_memory_bytes={size} holds {blocks} KV blocks of "
                                 f"{self._bytes_per_block()} bytes; at least {MIN_KV_BLOCKS} are needed")
            return blocks
        if self.device.type == "cuda":
            return max(MIN_KV_BLOCKS, int(self._gpu_kv_budget() // self._bytes_per_block()))
        return max(MIN_KV_BLOCKS, min(int(CPU_KV_CACHE_BYTES // self._bytes_per_block()), needed))

    def _gpu_kv_budget(self) -> float:
        """Memory left for the KV cache after a profiling step at the largest token budget."""
        torch.cuda.synchronize(self.device)
        # Memory an engine dropped earlier in this process still sits in torch's caching allocator, where
        # mem_get_info counts it as used: hand it back first, or a second engine finds no room.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_step()
        peak_extra = torch.cuda.max_memory_allocated(self.device) - allocated
        torch.cuda.empty_cache()
        used_now = total - free  # weights, CUDA context, other processes
        budget = total * self.config.gpu_memory_utilization - used_now - peak_extra - GPU_MEMORY_MARGIN_BYTES
        logger.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use, profiled step peak %.2f GiB, KV budget %.1f GiB",
            total / 2**30,
            used_now / 2**30,
            peak_extra / 2**30,
            budget / 2**30,
        )
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache (gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}); raise it or lower max_num_batched_tokens"
            )
        return budget

    @torch.inference_mode()
    def _profile_step(self) -> None:
        """One forward at the full token budget (rows of at most max_model_len tokens) and one sampling
        of max_num_seqs rows, on a throwaway KV cache just big enough for it; an image model's vision tower
        at its largest call."""
        bs = self.config.block_size
        num_tokens = self.config.max_num_batched_tokens
        row_len = min(num_tokens, self.max_model_len)
        lens = [row_len] * (num_tokens // row_len) + ([num_tokens % row_len] if num_tokens % row_len else [])
        blocks_per_row = cdiv(row_len, bs)
        kv = self._allocate_kv_caches(1 + len(lens) * blocks_per_row)
        arrays = _profile_arrays(lens, bs, blocks_per_row)
        if self.lora is not None:  # a LoRA step's deltas take memory beside the base layers' outputs
            arrays.lora_slots = np.zeros(num_tokens, dtype=np.int64)
        batch = forward_batch_from_arrays(arrays, self.device)
        self._attach(batch, kv)
        hidden = self._run_model(batch, lora=self.lora is not None)
        # A pooling model has no lm_head, and its pooled vectors take next to nothing; under tensor
        # parallelism only the driver samples.
        if self.pooler is None and self.samples:
            rows = min(self.config.max_num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[:1].expand(rows, -1).contiguous())
            self.sampler(logits, [SamplingRow(PROFILE_SAMPLING, [0], [])] * rows)
            del logits
        if getattr(self.model, "variable_size_images", False):  # its encoder at the largest image
            pixels, grid = self.model.largest_image(self.image_processor.hf_processor)
            self.model.embed_image_list([pixels.to(self.device)], [grid])
        elif self.image_processor is not None:  # the vision tower at the most tiles a call runs at once
            tiles = torch.zeros(max(TOWER_GRAPH_BATCHES), *self.model.tile_shape, device=self.device)
            self.model.embed_images(tiles)
        del kv, batch, hidden
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        spec = self.kv_cache_spec
        shape = (spec.planes, num_blocks, self.config.block_size, spec.heads, spec.width)
        num_layers = self._num_kv_layers()
        return [zeroed(shape, self.kv_cache_dtype, self.device) for _ in range(num_layers)]

    def _allocate_host_kv(self, size_gib: float | None, num_blocks: int | None) -> torch.Tensor | None:
        """The host tier: ``size_gib`` GiB of all ranks together (vLLM's kv_offloading_size), or
        ``num_blocks`` blocks a rank (vLLM's OffloadingConnector num_cpu_blocks); None for neither."""
        if (size_gib is None and num_blocks is None) or not self.kv_caches:
            return None
        block_shape = (len(self.kv_caches), *self.kv_caches[0][:, 0].shape)  # [layers, 2, bs, Hkv, D]
        block_bytes = math.prod(block_shape) * self.kv_caches[0].element_size()
        if num_blocks is None:
            world = 1 if self.parallel is None else self.parallel.world_size
            num_blocks = int(size_gib * GIB / world) // block_bytes  # vLLM's size is all ranks' together
        if num_blocks < 1:
            raise ValueError(f"kv_offloading_size {size_gib} GiB holds no KV block ({block_bytes} bytes)")
        logger.info("KV offloading: %d blocks of host memory (%.2f GiB)", num_blocks,
                    num_blocks * block_bytes / GIB)
        # Contents are written before they are read (a block is copied in before it is found). An FP8 cache's
        # bytes travel as bytes: gathers and scatters of float8 tensors are not implemented everywhere.
        dtype = torch.uint8 if self.kv_caches[0].element_size() == 1 else self.kv_cache_dtype
        return torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=self.device.type == "cuda")

    def transfer_kv(self, transfers: list[KVTransfer]) -> None:
        """Make the prefix cache's block copies between device and host memory (from
        KVCacheManager.take_transfers), in order, on the stream the next forward runs on: an evicted block's
        K/V is read before anything overwrites it, and a block copied back is in place before any row
        attends to it. Under tensor parallelism every rank copies its own heads' blocks."""
        if self.workers is not None:
            self.workers.send(KV_TRANSFER, transfers)
        for run in transfer_runs(transfers):
            for at in range(0, len(run), MAX_TRANSFER_BLOCKS):  # bounds the device staging buffer
                self._copy_blocks(run[0].to_host, run[at : at + MAX_TRANSFER_BLOCKS])

    def _copy_blocks(self, to_host: bool, transfers: list[KVTransfer]) -> None:
        device_blocks = host_to_device([t.device_block for t in transfers], torch.long, self.device)
        caches = [c.view(self.host_kv.dtype) for c in self.kv_caches]
        if to_host:
            # [layers, 2, n, bs, Hkv, D] gathered -> [n, layers, 2, bs, Hkv, D]: one contiguous row a block
            rows = torch.stack([c.index_select(1, device_blocks) for c in caches])
            rows = rows.permute(2, 0, 1, 3, 4, 5).contiguous()
            for row, t in zip(rows, transfers):
                self.host_kv[t.host_block].copy_(row, non_blocking=True)
            return
        rows = torch.empty((len(transfers), *self.host_kv.shape[1:]), dtype=self.host_kv.dtype,
                           device=self.device)
        for row, t in zip(rows, transfers):
            row.copy_(self.host_kv[t.host_block], non_blocking=True)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, device_blocks, rows[:, layer].transpose(0, 1))

    # -- CUDA graphs --------------------------------------------------------------------------

    def _capture_graphs(self, shapes: list[GraphShape]) -> StepGraphs:
        def make_batch(views: dict[str, torch.Tensor], shape: GraphShape) -> ForwardBatch:
            # Upper bounds, so the kernels' launch shapes hold for any step the graph replays.
            batch = ForwardBatch.from_views(
                views,
                [],
                max_query_len=shape.max_query_len,
                max_seq_len=self.max_model_len,
                num_leading_single_token_rows=shape.decode_rows,
            )
            self._attach(batch, num_tokens=shape.num_tokens)
            return batch

        cfg = self.config
        graphs = StepGraphs(
            self.buffers,
            make_batch,
            self._run_model,
            shapes,
            cfg.block_size,
            self.model_config.hidden_size,
            self.dtype,
            lora=self.lora is not None,
        )
        start = time.perf_counter()
        graphs.capture()
        logger.info("CUDA graph capture took %.1f s", time.perf_counter() - start)
        return graphs

    def _max_graph_prompt_tokens(self) -> int:
        """Prompt tokens a mixed-step graph may carry: the cap beside decodes, or more where a backlog
        can raise it (plait.engine.scheduler.prefill_cap)."""
        cfg = self.config
        if self.recurrent_states is not None or cfg.max_prefill_tokens_beside_decodes == NO_CHUNK_CAP:
            return 0  # Mamba layers cannot take the empty pad rows of mixed shapes; no cap: steps are big
        cap = cfg.max_prefill_tokens_beside_decodes
        if cfg.prefill_drain_steps:
            cap = max(cap, DRAINED_GRAPH_PROMPT_TOKENS)
        return min(cap, cfg.max_num_batched_tokens)

    def _max_graph_prompt_only_tokens(self) -> int:
        """Tokens a graph of prompt chunks alone (no decodes) may carry, whatever the cap beside decodes:
        a short prompt's step is bound by its launches when eager (a 128-token prompt of a Llama-8B took
        20 ms eager on an H200, a batch-1 request's whole time to first token), and graphs of prompt
        rows alone are few."""
        if self.recurrent_states is not None:
            return 0  # Mamba layers cannot take the empty pad rows of mixed shapes
        return min(MAX_GRAPH_PROMPT_TOKENS, self.config.max_num_batched_tokens)

    def _run_model(self, batch: ForwardBatch, lora: bool = False) -> torch.Tensor:
        """The model's forward; with ``lora``, the LoRA layers add the deltas of the batch's token slots
        (base tokens get exactly zero, so a step without LoRA rows may leave it off)."""
        if not lora:
            return self.model(batch.input_ids, batch.positions, batch)  # [T, hidden]
        with self.lora.running(batch):
            return self.model(batch.input_ids, batch.positions, batch)

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: InFlightStep | None, sample: bool = True
               ) -> InFlightStep | LaunchedForward:
        """Stage the step's inputs, run the forward and (with ``sample``) sample, without waiting for the
        device.

        ``prev`` is the step still in flight, if any: a row whose input token it sampled reads that
        token from ``prev``'s sampled ids on the device. Without ``sample`` the forward alone is
        launched, and ``sample(forward)`` samples it later: the host may first collect ``prev`` (a
        grammar's next mask, or a penalty, needs the token it sampled) while the forward runs.
        """
        t0 = time.perf_counter()
        arrays = build_step_arrays(plan, self.config.block_size, self.key_limits)
        pending_src = self._pending_sources(plan, arrays, prev)
        prev_ids = prev.token_ids if prev is not None else None
        lora = False
        if self.lora is not None:
            token_slots = self.lora.prepare([row.request for row in plan.rows], arrays.query_start_loc)
            if token_slots is not None:
                arrays.lora_slots, lora = token_slots, True
        embeds = (PromptEmbeds.for_step(plan, arrays.query_start_loc) if self.prompt_embeds is not None
                  else None)
        # An image model's step inputs beyond the arrays: the placeholders' embeddings (the vision side runs
        # here alone) and M-RoPE's [3, T] positions.
        found = (self.image_embeddings.for_step(plan, arrays.query_start_loc)
                 if self.image_embeddings is not None else None)
        mrope = (self.mrope_positions.for_step(plan, arrays.positions, arrays.query_start_loc)
                 if self.mrope_positions is not None else None)
        if self.workers is not None:  # the other ranks run the same forward beside this one
            sent = None if embeds is None else (embeds[0], tensor_message("prompt_embeds", embeds[1]))
            images_sent = None if found is None else (tensor_message("image_tokens", found[0]),
                                                      tensor_message("image_embeds", found[1]))
            self.workers.send(FORWARD, (arrays, pending_src, prev is not None, sent, images_sent, mrope))
        self.stage_step_extras(embeds, found, mrope)
        images = 0 if found is None else len(found[0])  # tokens holding image embeddings
        b = self.breakdown
        b.add("prepare", time.perf_counter() - t0)
        hidden, views, shape = self.forward(arrays, pending_src, prev_ids, lora)
        if self.feature_tap is not None:
            self.last_features = self.feature_tap.features(hidden)
        b.single_token_steps += arrays.num_tokens == arrays.num_rows
        b.graph_steps += shape is not None
        b.graph_single_token_steps += shape is not None and arrays.num_tokens == arrays.num_rows
        b.lora_steps += lora
        b.image_steps += images > 0
        b.graph_image_steps += images > 0 and shape is not None
        forward = LaunchedForward(plan, arrays, hidden, views["sample_indices"], shape is not None)
        return self.sample(forward) if sample else forward

    def stage_step_extras(self, embeds: tuple | None, images: tuple[torch.Tensor, torch.Tensor] | None,
                          mrope: np.ndarray | None) -> None:
        """Stage a step's inputs beside its arrays into the static buffers its forward (or graph) reads:
        prompt embeddings, image placeholders' embeddings (token indices, values) and M-RoPE positions; a
        tensor-parallel worker stages what the driver sent."""
        if self.image_embeddings is not None:
            self.image_embeddings.put(images)
        if self.mrope_positions is not None:
            self.mrope_positions.put(mrope)
        if self.prompt_embeds is not None:
            self.prompt_embeds.stage(embeds)

    @torch.inference_mode()
    def forward(self, arrays: StepArrays, pending_src: np.ndarray, prev_ids: torch.Tensor | None,
                lora: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], GraphShape | None]:
        """Stage a step's inputs and launch its forward (a graph replay where a captured shape fits):
        (hidden [T, hidden], the staged device views, the graph shape or None)."""
        t0 = time.perf_counter()
        shape = self.graphs.shape_for(arrays) if self.graphs is not None else None
        if shape is not None:  # the graph's static inputs
            views = self.buffers.stage(self.graphs.pad(arrays, shape), pending_src, prev_ids, full_width=True)
        else:
            views = self.buffers.stage(arrays, pending_src, prev_ids)
        t1 = time.perf_counter()
        # Timed on the ranks that sample: their collect resolves the events (a worker never collects).
        events = self._gpu_events() if self.samples else None
        if shape is not None:
            hidden = self.graphs.replay(shape, lora)
        else:
            hidden = self._run_model(self._eager_batch(arrays, views), lora=lora)
        if events is not None:
            events[1].record()
            self.breakdown.add_gpu_interval(*events, graph=shape is not None)
        self.breakdown.add("prepare", t1 - t0)
        self.breakdown.add("launch", time.perf_counter() - t1)
        return hidden, views, shape

    @torch.inference_mode()
    def receive_sampled_ids(self, count: int) -> torch.Tensor:
        """A worker's copy of the driver's ``count`` sampled ids, on this rank's device (its next step's
        pending inputs read them)."""
        return self.group.broadcast_(torch.empty(count, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def sample(self, forward: LaunchedForward) -> InFlightStep:
        """Sample a launched forward (and pool it, and take its prompt logprobs), without waiting for the
        device. The sampling rows are read from their requests now: outputs, grammars and choices as
        they stand."""
        t0 = time.perf_counter()
        plan, arrays, hidden = forward.plan, forward.arrays, forward.hidden
        step = self._sample(plan, arrays, hidden, forward.sample_indices)
        step.prompt_logprobs = self._prompt_logprobs(plan, arrays, hidden)
        if self.pooler is not None:
            step.pooled = self._pool(plan, arrays, hidden)
        step.used_cuda_graph = forward.used_cuda_graph
        self.breakdown.add("sample", time.perf_counter() - t0)
        return step

    def collect(self, step: InFlightStep) -> StepOutput:
        """Wait for a launched step's sampled ids and hand them out, one per sampling row."""
        t0 = time.perf_counter()
        if step.copied is not None:
            step.copied.synchronize()
        ids = step.host_ids.tolist()
        self.breakdown.add("sample", time.perf_counter() - t0)
        self.breakdown.resolve()
        if len(ids) == len(step.requests):  # one sample a row: no drafts
            sampled = [SampledToken(r, t, lp) for r, t, lp in zip(step.requests, ids, step.logprobs)]
        else:
            positions = [(r, j) for r, n in zip(step.requests, step.samples_per_row) for j in range(n)]
            sampled = [SampledToken(r, t, lp, j) for (r, j), t, lp in zip(positions, ids, step.logprobs)]
        pooled = []
        if step.pooled is not None:
            requests, host_vectors, copied, counts = step.pooled
            if copied is not None:
                copied.synchronize()
            # A per-token task's rows stay a matrix [tokens, ...]; a sequence task's one row, a vector.
            pooled = [(r, rows if r.pooling_params.per_token else rows[0])
                      for r, rows in zip(requests, host_vectors.split(counts))]
        return StepOutput(sampled, step.logits, step.used_cuda_graph, self._unpack_prompt_logprobs(step),
                          pooled)

    def _pool(self, plan: StepPlan, arrays: StepArrays, hidden: torch.Tensor
              ) -> tuple[list[Request], torch.Tensor, torch.cuda.Event | None, list[int]] | None:
        """The pooled outputs of the rows whose prompt ends in this step, on their way to the host: (requests,
        host tensor [N, hidden] of their rows, the event its copy records (None off CUDA, where the copy is
        synchronous), each request's row count: Pooler.pool)."""
        pooled = self.pooler.pool(plan, arrays.query_start_loc, hidden)
        if pooled is None:
            return None
        requests, vectors, counts = pooled
        if self.pooler.spec.task == "classify":
            vectors = self.model.classify(vectors)  # [n, num_labels] logits
        else:
            vectors = self.pooler.project(vectors)  # [n, output_size]: sentence-transformers Dense modules
        if self.device.type != "cuda":
            return requests, vectors, None, counts
        # As sampled ids: copied on the copy-out stream, so collecting this step never waits for the next.
        host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        ready, copied = torch.cuda.Event(), torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._copy_out_stream):
            self._copy_out_stream.wait_event(ready)
            vectors.record_stream(self._copy_out_stream)
            host.copy_(vectors, non_blocking=True)
            copied.record()
        return requests, host, copied, counts

    @staticmethod
    def _pending_sources(plan: StepPlan, arrays: StepArrays, prev: InFlightStep | None) -> np.ndarray:
        """For each row whose input is pending: where ``prev`` put that request's sampled id."""
        sources = []
        for row in arrays.pending_rows:
            request = plan.rows[row].request
            if prev is None or request not in prev.sample_index:
                raise RuntimeError(f"request {request.request_id}'s input token is in no step in flight")
            sources.append(prev.sample_index[request])
        return np.array(sources, dtype=np.int64)

    def _gpu_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if self.device.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _eager_batch(self, arrays: StepArrays, views: dict[str, torch.Tensor]) -> ForwardBatch:
        batch = ForwardBatch.from_views(
            views,
            arrays.sample_rows,
            arrays.max_query_len,
            arrays.max_seq_len,
            host=arrays,
            num_leading_single_token_rows=arrays.num_leading_single_token_rows,
        )
        self._attach(batch, num_tokens=arrays.num_tokens)
        return batch

    def _attach(self, batch: ForwardBatch, kv_caches: list[torch.Tensor] | None = None,
                num_tokens: int | None = None) -> None:
        """Hand a batch the device state its layers read: attention backend, KV caches (the runner's,
        or a throwaway one while profiling), recurrent state, and an image model's staged image embeddings
        (for its ``num_tokens`` tokens)."""
        batch.attn_backend = self.attn_backend
        batch.kv_caches = self.kv_caches if kv_caches is None else kv_caches
        batch.kv_scales = self.kv_scales
        batch.recurrent_states = self.recurrent_states
        if self.image_embeddings is not None and num_tokens is not None:
            batch.image_embeds = self.image_embeddings.views(num_tokens)
        if self.mrope_positions is not None and num_tokens is not None:
            batch.mrope_positions = self.mrope_positions.views(num_tokens)

    def _prompt_logprobs(self, plan: StepPlan, arrays: StepArrays, hidden: torch.Tensor
                         ) -> tuple[list[tuple[Request, int, int, int]], torch.Tensor] | None:
        """For the rows whose requests want prompt logprobs, each chunk position's logprob of the prompt
        token after it, left on the device: ([(request, first prompt position, count, top n)], table)."""
        runs, index, targets = [], [], []
        for i, row in enumerate(plan.rows):
            if not row.is_prefill:
                continue
            top_n = row.request.sampling_params.prompt_logprobs
            prompt = row.request.prompt_token_ids
            # Position p predicts token p + 1; the prompt's last position predicts the first output.
            count = min(row.num_new_tokens, len(prompt) - 1 - row.start)
            if top_n is None or count <= 0:
                continue
            first_token = int(arrays.query_start_loc[i])  # real tokens keep their indices when padded
            runs.append((row.request, row.start + 1, count, top_n))
            index.append(np.arange(first_token, first_token + count))
            targets.append(prompt[row.start + 1: row.start + 1 + count])
        if not runs:
            return None
        index_t = host_to_device(np.concatenate(index), torch.long, self.device)
        target_t = host_to_device([t for run in targets for t in run], torch.long, self.device)
        max_n = max(run[3] for run in runs)
        # lm_head over at most max_num_seqs rows at a time: the logits the sampler's largest batch makes.
        at_once = self.config.max_num_seqs
        tables = []
        for lo in range(0, len(index_t), at_once):
            logits = self.model.compute_logits(hidden[index_t[lo: lo + at_once]]).float()  # [n, vocab]
            raw = logits if self.config.logprobs_mode in LOGITS_MODES else torch.log_softmax(logits, dim=-1)
            tables.append(logprob_table(raw, target_t[lo: lo + at_once], max_n))
        return runs, torch.cat(tables)

    @staticmethod
    def _unpack_prompt_logprobs(step: InFlightStep) -> list[PromptLogprobs]:
        if step.prompt_logprobs is None:
            return []
        runs, table = step.prompt_logprobs
        rows = table.tolist()  # waits for the step: only steps that computed prompt logprobs
        max_n = (len(rows[0]) - 2) // 2
        out, at = [], 0
        for request, start, count, top_n in runs:
            out.append(PromptLogprobs(request, start, [unpack_logprobs(r, top_n, max_n)
                                                       for r in rows[at: at + count]]))
            at += count
        return out

    def _sample(
        self, plan: StepPlan, arrays: StepArrays, hidden: torch.Tensor, sample_indices: torch.Tensor
    ) -> InFlightStep:
        requests = [plan.rows[i].request for i in arrays.sample_rows]
        per_row = arrays.samples_per_row
        if not requests:
            empty = torch.zeros(0, dtype=torch.long)
            return InFlightStep(requests, empty, empty, None, [], None)
        # lm_head only where a token is sampled: one logits row per sampled position. Where those are
        # the step's first tokens (decode steps), a slice: no gather launch.
        num_samples = len(arrays.sample_indices)
        leading = arrays.sample_indices[-1] == num_samples - 1  # indices increase: 0..P-1 exactly
        logits = self.model.compute_logits(hidden[:num_samples] if leading else hidden[sample_indices])
        rows = self._sampling_rows(plan, arrays.sample_rows)
        token_ids, logprobs = self.sampler.sample(logits, rows)
        if self.device.type != "cuda":
            self._share_ids(token_ids)
            return InFlightStep(requests, token_ids, token_ids, None, logprobs, logits,
                                samples_per_row=per_row)
        host_ids = self._host_ids[self._next_host_ids][: num_samples]
        self._next_host_ids = (self._next_host_ids + 1) % len(self._host_ids)
        # The copy to the host on a stream of its own: the next step's launches queue behind the
        # sampling, not behind this copy's round trip (~9 us of a batch-1 decode token on an H200).
        sampled = torch.cuda.Event()
        sampled.record()
        self._share_ids(token_ids)  # after the event: the copy to the host need not wait for the other ranks
        copied = torch.cuda.Event()
        with torch.cuda.stream(self._copy_out_stream):
            self._copy_out_stream.wait_event(sampled)
            token_ids.record_stream(self._copy_out_stream)  # its memory outlives the copy
            host_ids.copy_(token_ids, non_blocking=True)
            copied.record()
        return InFlightStep(requests, token_ids, host_ids, copied, logprobs, logits, samples_per_row=per_row)

    def _share_ids(self, token_ids: torch.Tensor) -> None:
        """Broadcast sampled ids to the other tensor-parallel ranks: their next step may read them."""
        if self.workers is not None:
            self.workers.send(IDS, len(token_ids))
            self.group.broadcast_(token_ids)

    @staticmethod
    def _sampling_rows(plan: StepPlan, sample_rows: list[int]) -> list[SamplingRow]:
        """One SamplingRow per sampled position: a row's own, then one after each of its draft tokens, which
        samples as if the drafts before it were outputs already (penalties count them, min_tokens and a
        seeded row's draw see their positions), so a kept draft is the token the row would have sampled."""
        # Grammar rows' masks all at once (in parallel); each grammar has consumed every output, since its
        # steps sample only once the step before is collected (LLMEngine). Rows with a grammar, a guided
        # choice or a bad word of several tokens get no drafts (Scheduler._drafts), so their one position
        # reads the request as is. A request that the collect just finished is sampled unguided: its
        # grammar or choice may allow nothing more, and its token is dropped anyway.
        requests = [plan.rows[i].request for i in sample_rows]
        grammars = [r.grammar for r in requests if r.grammar is not None and not r.is_finished]
        masks = iter(next_token_bitmasks(grammars) if grammars else ())
        rows = []
        for i, r in zip(sample_rows, requests):
            drafts = plan.rows[i].draft_token_ids
            guided = not r.is_finished
            banned = r.banned_next_tokens() if guided else None  # one-token bad words only with drafts
            rows.append(SamplingRow(
                r.sampling_params,
                r.real_prompt_token_ids,
                r.output_token_ids,
                r.eos_token_ids,
                num_output_tokens=r.num_output_tokens,
                allowed_now=r.choice_continuations() if guided else None,
                token_bitmask=next(masks) if guided and r.grammar is not None else None,
                banned_now=banned,
            ))
            rows += [SamplingRow(r.sampling_params, r.real_prompt_token_ids,
                                 r.output_token_ids + list(drafts[:j]),
                                 r.eos_token_ids, num_output_tokens=r.num_output_tokens + j,
                                 banned_now=banned)
                     for j in range(1, len(drafts) + 1)]
        return rows


@dataclass
class LaunchedForward:
    """A step whose forward is launched and not yet sampled (``ModelRunner.launch(sample=False)``)."""

    plan: StepPlan
    arrays: StepArrays
    hidden: torch.Tensor  # [T, hidden]: the forward's output (a graph's static buffer until its next replay)
    sample_indices: torch.Tensor  # [P] the device view of the step's sampled positions
    used_cuda_graph: bool

    @property
    def requests(self) -> list[Request]:
        """The sampling rows' requests, in row order (InFlightStep.requests once sampled)."""
        return [self.plan.rows[i].request for i in self.arrays.sample_rows]


@dataclass
class InFlightStep:
    """A launched step whose sampled ids may still be on their way to the host (made by launch)."""

    requests: list[Request]  # [S] the sampling rows' requests, in row order
    # [P] int64 on the device, each sampling row's positions in turn (one each but with drafts): what the
    # next step's pending inputs read
    token_ids: torch.Tensor
    host_ids: torch.Tensor  # [P] int64 on the host (pinned on CUDA), filled by a non-blocking copy
    copied: torch.cuda.Event | None  # recorded after that copy; None where the copy is synchronous
    logprobs: list[Logprobs | None]
    logits: torch.Tensor | None  # [S, vocab] fp32 (tests and tools read it)
    used_cuda_graph: bool = False
    sample_index: dict[Request, int] = field(default_factory=dict)  # request -> its first entry in token_ids
    # Set by launch where rows want prompt logprobs: (runs, device table), unpacked by collect.
    prompt_logprobs: tuple[list[tuple[Request, int, int, int]], torch.Tensor] | None = None
    samples_per_row: list[int] | None = None  # [S]: each row's entries in token_ids (None: one each)
    # Set by LLMEngine.step at launch: whether a row applies penalties, a guided choice, a grammar or a
    # several-token bad word, so that its next sampling needs this step's ids on the host.
    needs_last_tokens: bool = False
    # Set by launch under the pooling runner: (requests whose prompt ended, their rows on the host once the
    # event is done (None: already there), each request's row count), or None where no prompt ended.
    pooled: tuple[list[Request], torch.Tensor, torch.cuda.Event | None, list[int]] | None = None

    def __post_init__(self) -> None:
        if self.samples_per_row is None:
            self.samples_per_row = [1] * len(self.requests)
        if len(self.token_ids) == len(self.requests):  # one sample a row: no drafts
            self.sample_index = {r: i for i, r in enumerate(self.requests)}
            return
        # A row with drafts is never an input in flight (LLMEngine does not overlap a step that drafts).
        self.sample_index = dict(zip(self.requests, itertools.accumulate([0, *self.samples_per_row[:-1]])))


def _profile_arrays(lens: list[int], block_size: int, blocks_per_row: int) -> StepArrays:
    """Host arrays of fresh prompts of the given lengths over blocks 1.. of a throwaway cache."""
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    tables = 1 + np.arange(len(lens) * blocks_per_row, dtype=np.int64).reshape(len(lens), blocks_per_row)
    row_of_token = np.repeat(np.arange(len(lens)), lens)
    slots = tables[row_of_token, positions // block_size] * block_size + positions % block_size
    num_rows = len(lens)
    return StepArrays(
        input_ids=np.zeros(int(qsl[-1]), dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=qsl,
        context_lens=np.zeros(num_rows, dtype=np.int64),
        seq_lens=np.array(lens, dtype=np.int64),
        is_first_chunk=np.ones(num_rows, dtype=np.int64),
        state_slots=np.full(num_rows, PAD_STATE_SLOT, dtype=np.int64),
        block_tables=tables,
        sample_indices=qsl[1:] - 1,
        sample_rows=list(range(num_rows)),
    )


def _rank_device(device: torch.device, world_size: int, parallel: ParallelRank | None) -> torch.device:
    """A tensor-parallel rank's device: cuda:rank (made current: kernels and NCCL run there), or the CPU."""
    if device.type != "cuda":
        return device
    visible = torch.cuda.device_count()
    if visible < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; {visible} visible")
    device = torch.device("cuda", parallel.rank if parallel is not None else 0)
    torch.cuda.set_device(device)
    return device
