"""Engine and model configuration: every knob in one validated place."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from plait.sampling_params import LOGPROBS_MODES, MAX_LOGPROBS, RAW_LOGPROBS

# max_logprobs meaning no cap but the vocabulary's size (vLLM's -1).
FULL_VOCAB_LOGPROBS = -1

# How a step is composed, and in what order requests are served. "mixed": running decodes first, prompts
# chunked into the rest, requests first come first served; "prefill_first" swaps the two, for comparison
# (W4). vLLM's names: "fcfs" (its default) is "mixed"; "priority" composes steps as "mixed" and serves
# requests by their ``priority`` (lower first, then arrival), taking KV blocks from lower-priority running
# requests where a higher-priority one needs them.
SchedulingPolicy = Literal["mixed", "prefill_first", "fcfs", "priority"]
Usage = Literal["offline", "serve"]
USAGES: tuple[str, ...] = ("offline", "serve")
SCHEDULING_POLICIES: tuple[str, ...] = ("mixed", "prefill_first", "fcfs", "priority")
# The two ways of composing a step, which W4 compares.
STEP_COMPOSITIONS: tuple[str, ...] = ("mixed", "prefill_first")
# What the engine runs the model for, as vLLM's --runner: "generate" (text), "pooling" (embeddings), or
# "auto": pooling for a checkpoint of a base model (LlamaModel, Qwen3Model, ...: no LM head), else generate.
RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")
EMBED_CONVERSION = "embed"
CONVERSIONS: tuple[str, ...] = ("auto", "none", EMBED_CONVERSION)

ATTENTION_BACKENDS: tuple[str, ...] = ("torch_ref", "triton")
QUANTIZATION_METHODS: tuple[str, ...] = ("fp8",)
# vLLM's --quantization names for what a quantised checkpoint holds (its quantization_config says so; the
# flag may only name it again, as vLLM's, whose *_marlin names are its kernels for the same checkpoints).
CHECKPOINT_QUANTIZATION_METHODS: tuple[str, ...] = ("gptq", "awq", "gptq_marlin", "awq_marlin",
                                                     "compressed-tensors")
# vLLM's --kv-cache-dtype choices plait takes -> the one stored. "auto": the model's dtype.
KV_CACHE_DTYPES: dict[str, str] = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}

# Hashes a prefix-cached block's context may be named by (plait.engine.kv_cache._BLOCK_HASHES).
PREFIX_CACHING_HASH_ALGOS = ("blake2b", "sha256")
# vLLM's optimization levels run 0 (no graphs) to 3.
MAX_OPTIMIZATION_LEVEL = 3
# vLLM's compilation_config cudagraph_mode values; NONE captures no graph (enforce_eager), and every other
# mode is plait's own: full graphs of decode steps and of mixed steps up to a cap.
NO_CUDAGRAPHS = "NONE"
CUDAGRAPH_MODES = (NO_CUDAGRAPHS, "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# compilation_config keys plait acts on (EngineConfig._compilation_<key>).
COMPILATION_KEYS = ("cudagraph_mode", "use_cudagraph", "cudagraph_capture_sizes",
                    "max_cudagraph_capture_size")
# compilation_config keys that tune vLLM's torch.compile of the model, which plait does not run.
TORCH_COMPILE_KEYS = ("level", "mode", "backend", "custom_ops", "splitting_ops", "compile_sizes",
                      "compile_ranges_split_points", "use_inductor", "inductor_compile_config",
                      "inductor_passes", "pass_config", "use_inductor_graph_partition", "compile_mm_encoder",
                      "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph",
                      "debug_dump_path", "cache_dir", "compile_cache_save_format", "dynamic_shapes_config",
                      "local_cache_dir")

# vLLM's --safetensors-load-strategy values (EngineConfig.safetensors_load_strategy).
LAZY_LOAD, EAGER_LOAD, PREFETCH_LOAD = "lazy", "eager", "prefetch"
SAFETENSORS_LOAD_STRATEGIES = (LAZY_LOAD, EAGER_LOAD, PREFETCH_LOAD)
# vLLM's --model-loader-extra-config keys of its default (safetensors) loader, which plait's honours: shards
# read on threads, DEFAULT_LOAD_THREADS of them unless num_threads says.
LOADER_EXTRA_CONFIG_KEYS = ("enable_multithread_load", "num_threads")
DEFAULT_LOAD_THREADS = 8

# long_prefill_token_threshold / max_prefill_tokens_beside_decodes value that means "no cap".
NO_CHUNK_CAP = 0
# Memory handed to the KV cache on CPU when num_kv_blocks is not given: the whole
# machine is shared with the OS and the Python process, so take a modest slice.
CPU_KV_CACHE_BYTES = 2 * 1024**3


@dataclass
class EngineConfig:
    """Knobs of the engine; validated on construction so bad values never reach a step."""

    model: str | None = None  # path to a .gguf file or an HF folder; None = the default model
    load_format: Literal["auto", "dummy"] = "auto"  # "dummy": random weights of the model's config
    device: str | None = None  # None = best available ("cuda" if present, else "cpu")
    # None or "auto" = float32 on CPU, bfloat16 on GPU; vLLM's aliases ("half", "float"...) are accepted
    # and stored under their canonical name (see DTYPE_ALIASES).
    dtype: str | None = None
    # vLLM's --quantization for an unquantised checkpoint: None, or "fp8" (every linear layer but the
    # lm_head keeps FP8 weights with per-row scales, and quantises its input per token: W8A8,
    # plait.layers.fp8). A quantised checkpoint's own method needs no flag; "gptq" / "awq" (or vLLM's
    # "*_marlin" names) only repeat it, and a mismatch is refused.
    quantization: str | None = None
    # vLLM's --kv-cache-dtype: "auto" (the model's dtype) or "fp8" (alias "fp8_e4m3"): K and V are stored as
    # float8_e4m3fn codes, half the bytes of bf16, so twice the tokens fit and decode attention reads half as
    # much. A code times its layer's scale (1.0, as vLLM's default, or the checkpoint's k_scale / v_scale)
    # is the value; values beyond +-448 x scale saturate.
    kv_cache_dtype: str = "auto"
    # The generation_config.json whose sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens) apply where a request leaves them out, as vLLM's
    # --generation-config: "auto" = the model folder's, "vllm" = none (plait's and vLLM's own defaults), or
    # a folder holding one. Its eos_token_id ids stop generation under every choice, as in vLLM.
    generation_config: str = "auto"
    # vLLM's --override-generation-config: generation_config.json fields (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens) over the file's, or over none under "vllm"; a dict or its JSON.
    override_generation_config: dict | str | None = None
    # vLLM's --tokenizer: the tokenizer (and chat template) of another GGUF file, HF folder or cached Hub
    # id instead of the model's own (None: the model's); --tokenizer-revision picks its Hub snapshot.
    tokenizer: str | None = None
    # vLLM's --skip-tokenizer-init: no tokenizer is loaded; prompts are token ids and outputs token ids
    # (their text empty), as for a model folder that holds no tokenizer.
    skip_tokenizer_init: bool = False
    tokenizer_revision: str | None = None
    # vLLM's --revision (a branch, tag or commit of a Hub id's snapshots in the local HF cache; None: main)
    # and --download-dir (the HF cache folder to look Hub ids up in instead of $HF_HUB_CACHE's): plait never
    # downloads, so both only choose among what is on disk.
    revision: str | None = None
    download_dir: str | None = None
    # vLLM's --max-logprobs: the most logprobs (and prompt_logprobs) a request may ask for at each position;
    # FULL_VOCAB_LOGPROBS (vLLM's -1) allows the whole vocabulary.
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's --logprobs-mode: what sampled tokens' logprobs hold (plait.sampling_params.LOGPROBS_MODES): the
    # raw model's (default) or the processed distribution a token was drawn from, log-softmaxed or as
    # logits. Prompt logprobs stay the raw model's (as logits under the *_logits modes).
    logprobs_mode: str = RAW_LOGPROBS
    # Seeds the engine's random sampling (requests without their own seed) and dummy weights, so two
    # engines with the same seed given the same requests in the same order sample the same tokens.
    seed: int = 0

    # Token budget of one step (decodes + prefill chunks). None = vLLM's defaults for the device and the
    # usage (see default_token_budget): large GPUs take 16,384 offline and 8,192 when serving.
    max_num_batched_tokens: int | None = None
    usage: Usage = "offline"  # who drives the engine: the LLM class/CLI ("offline") or `plait serve`
    max_num_seqs: int = 256  # rows (requests) in one step
    long_prefill_token_threshold: int = NO_CHUNK_CAP  # per-request chunk cap; 0 = off
    # Prompt tokens a step may carry beside running decodes (policy "mixed"); 0 = no cap; None = the usage's
    # (PREFILL_CAP_BY_USAGE: 256 serving, no cap offline). A decode step reads every weight once however few
    # rows it has, so it can carry prompt tokens up to about compute / bandwidth (~190 on an H200) almost
    # for free; much more and every stream's next token waits for the prompt's matmuls. Offline nobody
    # watches a stream, and the cap cost LLM.generate a third of W1's throughput.
    max_prefill_tokens_beside_decodes: int | None = None
    # ... unless prompts pile up: with B prompt tokens queued ahead of the last prompt waiting, a step beside
    # decodes may carry up to B / prefill_drain_steps of them, so a burst of prompts drains in about this
    # many steps instead of queueing behind the cap (a lone long prompt, which delays nobody else's first
    # token, still rides in small chunks). 0 = fixed cap. W5 at 16 req/s on an H200 (Llama-8B, 100
    # requests): 8 met the TTFT/TPOT goodput of prefill_first (9.47 vs 9.48 req/s, ITL p99 54 vs 189 ms),
    # 16 fell short (8.72), 4 drained no better (9.31, ITL p99 72 ms) (benchmarks/results/w5_drain_h200/).
    prefill_drain_steps: int = 8
    max_num_partial_prefills: int = 4  # requests allowed to be mid-prompt at once
    # vLLM's max_long_partial_prefills: of those, how many may have prompts longer than
    # long_prefill_token_threshold (which must then be set). A waiting long prompt past this limit lets the
    # shorter prompts behind it start first, so one long prompt being chunked in does not hold up every
    # short one behind it. None: max_num_partial_prefills (no distinction, FCFS for all).
    max_long_partial_prefills: int | None = None
    scheduling_policy: SchedulingPolicy = "mixed"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = sized from gpu_memory_utilization / CPU budget
    # vLLM's kv_cache_memory_bytes: the KV cache's bytes on each device, in place of the share of
    # gpu_memory_utilization (or the CPU budget) left after a profiling step; num_kv_blocks wins over it.
    kv_cache_memory_bytes: int | None = None
    # vLLM's --kv-offloading-size: GiB of host memory that keep the prefix cache's evicted blocks (the second
    # tier: plait.engine.kv_offload), whence a later prompt's prefix is copied back instead of recomputed.
    # None: no host tier. Split over GPUs, the ranks' pools together (each holds its heads' share of every
    # block), as vLLM's. kv_offloading_backend: vLLM's; "native" (plait's own) only.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # vLLM's --kv-transfer-config for its OffloadingConnector (the form older vLLM versions and their
    # deployment guides use for the same host tier): {"kv_connector": "OffloadingConnector", "kv_role":
    # "kv_both", "kv_connector_extra_config": {"num_cpu_blocks": N}}. __post_init__ reads it into
    # kv_offloading_blocks: N host blocks on each rank (of its heads), the engine's block size. Other
    # connectors (disaggregated prefill, LMCache) are refused by name.
    kv_transfer_config: dict | str | None = None
    # Host blocks a rank keeps: set from kv_transfer_config, or by an EAGLE head's runner to its target's
    # count (not a vLLM flag).
    kv_offloading_blocks: int | None = None
    # GPU: share of the device's memory plait may use (weights, activations, graphs, KV cache).
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    # vLLM's --disable-sliding-window: max_model_len is capped at the model's (narrowest) attention window, so
    # that every layer attends to the whole context; no effect on a model without windows.
    disable_sliding_window: bool = False
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier requests
    # vLLM's --prefix-caching-hash-algo: the hash naming a full block's context (PREFIX_CACHING_HASH_ALGOS),
    # plait's blake2b (16 bytes) or vLLM's default sha256 (32 bytes).
    prefix_caching_hash_algo: str = "blake2b"
    attention_backend: str | None = None  # None = "triton" on CUDA (when triton imports), else "torch_ref"
    enforce_eager: bool = False  # True: never capture or replay CUDA graphs
    # vLLM's --cuda-graph-sizes: the decode batch sizes captured (one size N: 1, 2, 4 and every 8 up to N;
    # sizes over max_num_seqs left out); larger decode steps run eager. None: 1, 2, 4, 8, every 8 up to 64,
    # then every 16 up to max_num_seqs, so every decode step replays a graph.
    cuda_graph_sizes: list[int] | None = None
    # vLLM's optimization level (-O0 .. -O3): 0 is enforce_eager (no graphs); 1-3 are plait's default. plait
    # runs no torch.compile, so the levels differ in nothing else.
    optimization_level: int | None = None
    # vLLM's compilation_config (a dict or its JSON text; an int is an optimization level): its graph keys
    # set the knobs above (COMPILATION_KEYS), its torch.compile keys change nothing (TORCH_COMPILE_KEYS), and
    # any other key is refused by name.
    compilation_config: dict | str | int | None = None
    # Launch step N+1 before step N's sampled ids reach the host, so host work overlaps the device.
    async_scheduling: bool = True
    # GPU: before the engine is handed out, run made-up requests shaped like a server's first ones, so no real
    # request waits for a kernel to compile (plait/engine/warmup.py); off saves seconds of start-up.
    warm_up: bool = True
    # Models with recurrent (Mamba) layers: requests that can hold state at once; admission waits
    # when all are taken. None = max_num_seqs. Ignored by attention-only models.
    max_num_state_slots: int | None = None
    # Multi-LoRA serving (vLLM's knobs and defaults): requests may name a PEFT LoRA adapter of rank up to
    # max_lora_rank; up to max_loras adapters are on the device at once (a request waits for a slot while
    # all serve other adapters' running requests), and up to max_cpu_loras (None = max_loras) stay read on
    # the host. Llama-family models only.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's speculative_config: None (off), {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m} or {"model": DRAFT, "num_speculative_tokens": k}, as a
    # SpeculativeConfig, a dict or its JSON text (the CLI's --speculative-config). Stored as a
    # SpeculativeConfig.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # vLLM's --kv-events-config (a KVEventsConfig, a dict or its JSON text): publish the prefix cache's
    # stored / removed / cleared blocks over ZMQ in vLLM's format (plait.engine.kv_events). None: off.
    kv_events_config: KVEventsConfig | dict | str | None = None
    # vLLM's --limit-mm-per-prompt: the most items of each modality a prompt may hold, {"image": n} (a dict or
    # its JSON text); a prompt with more is refused. None: no limit but the context's length.
    limit_mm_per_prompt: dict | str | None = None
    # vLLM's --runner (RUNNERS): under "pooling" each request's prompt is run once and pooled into an
    # embedding (LLM.embed, /v1/embeddings); nothing is generated.
    runner: str = "auto"
    # vLLM's --convert (CONVERSIONS): "embed" serves a generative checkpoint as an embedding model (its last
    # hidden states pooled; the runner becomes "pooling"); "auto" / "none" keep the checkpoint's kind.
    # Classifiers come from a checkpoint's own head, or from hf_overrides' architectures.
    convert: str = "auto"
    # vLLM's --pooler-config: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}, a dict or its JSON
    # text; fields left out come from the model's sentence-transformers config, else LAST and normalize.
    pooler_config: PoolerConfig | dict | str | None = None
    # vLLM's --hf-overrides: keys merged into the checkpoint's config.json before the model is built (a dict
    # or its JSON text; nested objects merge key by key), e.g. {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]} to serve Qwen3-Reranker.
    hf_overrides: dict | str | None = None
    # vLLM's --rope-scaling (a dict or its JSON text, e.g. {"rope_type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768} to stretch Qwen's context) and --rope-theta: they replace the
    # checkpoint's rope_scaling / rope_theta (after hf_overrides), as vLLM sets them on the HF config.
    rope_scaling: dict | str | None = None
    rope_theta: float | None = None
    # vLLM's --tensor-parallel-size: the model's heads and MLP split across this many devices (cuda:0..N-1),
    # one process each (plait.parallel); 1: one device, one process.
    tensor_parallel_size: int = 1
    # vLLM's --enable-expert-parallel: under tensor parallelism, each rank holds num_experts / N whole routed
    # experts of a MoE model instead of every expert's 1/N width slice (attention, dense MLPs and shared
    # experts stay split as before). Ignored by a dense model, as in vLLM.
    enable_expert_parallel: bool = False
    # vLLM's --logits-processors: custom logits processors (plait.logits_processor.LogitsProcessor
    # subclasses), as classes or their qualified names ("module:Class" or "module.Class"); one instance each,
    # built by the engine, sees every sampling step. Not with speculative decoding or a pooling model, as in
    # vLLM.
    logits_processors: list[str | type] | None = None
    # vLLM's --worker-extension-cls: a class (or its qualified name) whose methods join each rank's worker
    # (plait.runner.worker.Worker), for LLM.collective_rpc to call on every rank: an RL loop's weight sync,
    # say. Its engine keeps the MLP norms unfolded, so that one tensor at a time may be loaded.
    worker_extension_cls: str | type | None = None
    # vLLM's --use-tqdm-on-load: a progress bar over an HF checkpoint's shards while they load.
    use_tqdm_on_load: bool = True
    # vLLM's --cpu-offload-gb: this many GiB of the first decoder layers' weights live in pinned host
    # memory and are copied into one device buffer as each of those layers runs (plait.runner.weight_offload):
    # a model larger than the GPU's memory runs, every step reading those weights over PCIe. 0: none.
    cpu_offload_gb: float = 0.0
    # vLLM's --hf-config-path: the folder (or cached Hub id) whose config.json describes the model, and whose
    # generation_config.json gives the sampling defaults under generation_config "auto" / "vllm", in place
    # of the model's own; the weights and the tokenizer still come from the model. None: the model's.
    hf_config_path: str | None = None
    # vLLM's --safetensors-load-strategy (SAFETENSORS_LOAD_STRATEGIES) for an HF checkpoint's shards: "lazy"
    # maps each file and reads a tensor as it is loaded; "eager" reads each file whole into memory first
    # (sequential reads, for network filesystems); "prefetch" maps them as "lazy" while a thread reads the
    # files ahead into the page cache.
    safetensors_load_strategy: str = LAZY_LOAD
    # vLLM's --model-loader-extra-config (a dict or its JSON text): the safetensors loader's options,
    # {"enable_multithread_load": true, "num_threads": 8} reads that many shards at once on threads
    # (LOADER_EXTRA_CONFIG_KEYS); other keys are refused by name.
    model_loader_extra_config: dict | str | None = None
    # vLLM's --additional-config: options for its platform plugins, of which plait has none; only an empty
    # object (or none) is accepted.
    additional_config: dict | str | None = None
    # vLLM's --enable-prompt-embeds: prompts may be given as embeddings ([tokens, hidden] tensors, in place of
    # the embedding layer's output) instead of token ids. Off by default, as in vLLM, since the server then
    # unpickles tensors clients send (torch.load with weights_only).
    enable_prompt_embeds: bool = False
    # vLLM's --enable-sleep-mode: LLMEngine.sleep / wake_up may free and take back the device memory of the
    # weights and the KV cache (plait.runner.sleep), on every tensor-parallel rank.
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if self.usage not in USAGES:
            raise ValueError(f"usage must be one of {USAGES}, got {self.usage!r}")
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        if self.max_prefill_tokens_beside_decodes is not None:
            _check_int("max_prefill_tokens_beside_decodes", self.max_prefill_tokens_beside_decodes, minimum=0)
        _check_int("prefill_drain_steps", self.prefill_drain_steps, minimum=0)
        _check_int("max_num_partial_prefills", self.max_num_partial_prefills, minimum=1)
        self._check_long_partial_prefills()
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, minimum=1)
        if self.cuda_graph_sizes is not None:
            if isinstance(self.cuda_graph_sizes, int) or not self.cuda_graph_sizes:
                raise ValueError(f"cuda_graph_sizes must be a list of batch sizes, got "
                                 f"{self.cuda_graph_sizes!r}")
            for size in self.cuda_graph_sizes:
                _check_int("cuda_graph_sizes", size, minimum=1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=2)
        if self.max_num_state_slots is not None:
            _check_int("max_num_state_slots", self.max_num_state_slots, minimum=1)
        _check_int("max_loras", self.max_loras, minimum=1)
        _check_int("max_lora_rank", self.max_lora_rank, minimum=1)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, minimum=self.max_loras)
        if not isinstance(self.enable_prefix_caching, bool):
            value = self.enable_prefix_caching
            raise ValueError(f"enable_prefix_caching must be true or false, got {value!r}")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of "
                             f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}, got {self.prefix_caching_hash_algo!r} "
                             "(vLLM's CBOR and xxhash forms need libraries plait does not depend on)")
        _check_int("max_logprobs", self.max_logprobs, minimum=FULL_VOCAB_LOGPROBS)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{self.logprobs_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        fraction = self.gpu_memory_utilization
        if not _is_number(fraction) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("enforce_eager", "async_scheduling", "warm_up", "enable_lora", "enable_sleep_mode",
                     "disable_sliding_window", "enable_prompt_embeds", "enable_expert_parallel",
                     "use_tqdm_on_load"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_cpu_offload()
        self._check_kv_offloading()
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            # vLLM spreads the experts over its data-parallel ranks too; plait's replicas share nothing.
            raise ValueError("enable_expert_parallel splits a MoE model's experts across tensor-parallel "
                             "ranks: it needs tensor_parallel_size > 1")
        if self.dtype is not None:
            self.dtype = canonical_dtype(self.dtype)
        methods = QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION_METHODS
        if self.quantization is not None and self.quantization not in methods:
            raise ValueError(f"quantization must be one of {methods} or unset, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        self._apply_compilation_config()
        self.speculative_config = spec = SpeculativeConfig.parse(self.speculative_config)
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if spec is not None and spec.method == MTP and spec.model is None:
            # The draft is the target checkpoint's own MTP layer (vLLM's default "model" for the method).
            self.speculative_config = spec = dataclasses.replace(spec, model=self.model)
        if spec is not None and spec.method in (*MODEL_METHODS, MTP):
            # An EAGLE head runs whole on the driver's device beside the split target (its features are the
            # driver's); a draft model would need its own ranks.
            if self.tensor_parallel_size > 1 and spec.method == DRAFT_MODEL:
                raise ValueError("draft_model speculation under tensor parallelism is not supported yet")
            if self.enable_sleep_mode:
                raise ValueError("enable_sleep_mode with a draft model is not supported yet: sleep would not "
                                 "free the draft model's memory")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        self._apply_conversion()
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        self.hf_overrides = json_object("hf_overrides", self.hf_overrides)
        self.rope_scaling = json_object("rope_scaling", self.rope_scaling)
        theta = self.rope_theta
        if theta is not None and (not _is_number(theta) or not 0 < theta < math.inf):
            raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
        self.override_generation_config = json_object("override_generation_config",
                                                       self.override_generation_config)
        self.limit_mm_per_prompt = _mm_limits(self.limit_mm_per_prompt)
        if self.logits_processors is not None and not isinstance(self.logits_processors, (list, tuple)):
            raise ValueError(f"logits_processors must be a list of classes or their qualified names, got "
                             f"{self.logits_processors!r}")
        if self.worker_extension_cls is not None and not isinstance(self.worker_extension_cls, (str, type)):
            raise ValueError(f"worker_extension_cls must be a class or its qualified name, got "
                             f"{self.worker_extension_cls!r}")
        if self.enable_prompt_embeds and spec is not None:
            raise ValueError("enable_prompt_embeds is not supported with speculative decoding yet: a draft "
                             "would need the embeddings too")
        if self.logits_processors and spec is not None:
            raise ValueError("custom logits processors are not supported with speculative decoding (as in "
                             "vLLM): a draft's rows would need them too")
        if self.pooler_config is not None and self.runner == "generate":
            raise ValueError("pooler_config applies to pooling models: it needs runner 'pooling' (or 'auto')")
        source = self.generation_config
        if not isinstance(source, str) or not source:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
        if self.hf_config_path is not None and (not isinstance(self.hf_config_path, str)
                                                or not self.hf_config_path):
            raise ValueError(f"hf_config_path must be a folder holding a config.json or a cached Hub id, got "
                             f"{self.hf_config_path!r}")
        if self.safetensors_load_strategy not in SAFETENSORS_LOAD_STRATEGIES:
            strategies = ", ".join(SAFETENSORS_LOAD_STRATEGIES)
            raise ValueError(f"safetensors_load_strategy must be one of {strategies}, got "
                             f"{self.safetensors_load_strategy!r}")
        self.model_loader_extra_config = _loader_extra_config(self.model_loader_extra_config)
        extra = json_object("additional_config", self.additional_config)
        if extra:
            raise ValueError(f"additional_config {sorted(extra)} is not available: vLLM hands it to platform "
                             "plugins, and plait has none (only {} is accepted)")
        self.additional_config = None

    def _check_kv_offloading(self) -> None:
        from plait.engine.kv_offload import OFFLOADING_BACKENDS, offloading_blocks

        transfer = json_object("kv_transfer_config", self.kv_transfer_config)
        if transfer is not None:
            self.kv_offloading_blocks = offloading_blocks(transfer, self.block_size)
        if self.kv_offloading_blocks is not None and self.kv_offloading_size is not None:
            raise ValueError("kv_transfer_config's OffloadingConnector and kv_offloading_size both size the "
                             "host tier: give one")

        size = self.kv_offloading_size
        if size is not None and (not _is_number(size) or not size > 0):
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {size!r}")
        if self.kv_offloading_backend not in OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend {self.kv_offloading_backend!r} is not supported: plait "
                             f"offloads with its own ({', '.join(OFFLOADING_BACKENDS)}); LMCache is not "
                             "bundled")

    def _check_cpu_offload(self) -> None:
        offload = self.cpu_offload_gb
        if not _is_number(offload) or not offload >= 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {offload!r}")
        if offload and (self.enable_lora or self.enable_sleep_mode):
            what = "enable_lora" if self.enable_lora else "enable_sleep_mode"
            raise ValueError(f"cpu_offload_gb with {what} is not supported yet: the offloaded layers' "
                             "weights are views of one device buffer")

    def _apply_conversion(self) -> None:
        """vLLM's convert: "embed" is the pooling runner (an embedding of the last hidden states)."""
        if self.convert not in CONVERSIONS:
            raise ValueError(f"convert must be one of {', '.join(CONVERSIONS)}, got {self.convert!r} (a "
                             "classifier: hf_overrides with a ...ForSequenceClassification architecture)")
        if self.convert == EMBED_CONVERSION:
            if self.runner == "generate":
                raise ValueError("convert 'embed' makes a pooling model: it cannot run with runner "
                                 "'generate'")
            self.runner = "pooling"

    def _apply_compilation_config(self) -> None:
        """vLLM's optimization_level and compilation_config, as enforce_eager and cuda_graph_sizes."""
        if isinstance(self.compilation_config, int) and not isinstance(self.compilation_config, bool):
            self.optimization_level, self.compilation_config = self.compilation_config, None
        if self.optimization_level is not None:
            _check_int("optimization_level", self.optimization_level, minimum=0)
            if self.optimization_level > MAX_OPTIMIZATION_LEVEL:
                raise ValueError(f"optimization_level must be 0 to {MAX_OPTIMIZATION_LEVEL}, got "
                                 f"{self.optimization_level}")
            if self.optimization_level == 0:
                self.enforce_eager = True
        self.compilation_config = config = json_object("compilation_config", self.compilation_config)
        for key, value in (config or {}).items():
            if key in COMPILATION_KEYS:
                getattr(self, f"_compilation_{key}")(value)
            elif key not in TORCH_COMPILE_KEYS:
                raise ValueError(f"compilation_config key {key!r} is not available; plait takes "
                                 f"{', '.join(COMPILATION_KEYS)} and accepts vLLM's torch.compile keys "
                                 f"({', '.join(TORCH_COMPILE_KEYS)}), which change nothing since plait runs "
                                 "no torch.compile")

    def _compilation_cudagraph_mode(self, mode: Any) -> None:
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config cudagraph_mode must be one of "
                             f"{', '.join(CUDAGRAPH_MODES)}, got {mode!r}")
        if mode == NO_CUDAGRAPHS:
            self.enforce_eager = True

    def _compilation_use_cudagraph(self, use: Any) -> None:
        if not isinstance(use, bool):
            raise ValueError(f"compilation_config use_cudagraph must be true or false, got {use!r}")
        if not use:
            self.enforce_eager = True

    def _compilation_cudagraph_capture_sizes(self, sizes: Any) -> None:
        if not isinstance(sizes, list) or not sizes:
            raise ValueError(f"compilation_config cudagraph_capture_sizes must be a list of batch sizes, got "
                             f"{sizes!r}")
        # Exactly these sizes: cuda_graph_sizes reads a lone size as a maximum, so it is given twice.
        self._set_graph_sizes("cudagraph_capture_sizes", sizes * 2 if len(sizes) == 1 else list(sizes))

    def _compilation_max_cudagraph_capture_size(self, size: Any) -> None:
        self._set_graph_sizes("max_cudagraph_capture_size", [size])  # which checks the size

    def _set_graph_sizes(self, key: str, sizes: list[int]) -> None:
        for size in sizes:
            _check_int(f"compilation_config {key}", size, minimum=1)
        if self.cuda_graph_sizes is not None and self.cuda_graph_sizes != sizes:
            raise ValueError(f"cuda_graph_sizes {self.cuda_graph_sizes} and compilation_config {key} both "
                             "choose the CUDA graph sizes: give one")
        self.cuda_graph_sizes = sizes

    @property
    def long_partial_prefills_limit(self) -> int:
        """Partial prefills of long prompts allowed at once (max_long_partial_prefills, resolved)."""
        if self.max_long_partial_prefills is None:
            return self.max_num_partial_prefills
        return self.max_long_partial_prefills

    def _check_long_partial_prefills(self) -> None:
        if self.max_long_partial_prefills is None:
            return
        _check_int("max_long_partial_prefills", self.max_long_partial_prefills, minimum=1)
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be at most "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if (self.max_long_partial_prefills < self.max_num_partial_prefills
                and self.long_prefill_token_threshold == NO_CHUNK_CAP):
            raise ValueError("max_long_partial_prefills below max_num_partial_prefills needs "
                             "long_prefill_token_threshold: the prompt length above which a prompt is long")

    @property
    def prefills_first(self) -> bool:
        """Whether a step schedules prompt chunks before the running decodes (``prefill_first``)."""
        return self.scheduling_policy == "prefill_first"

    @property
    def serves_by_priority(self) -> bool:
        """Whether requests are served by their priority rather than first come, first served."""
        return self.scheduling_policy == "priority"

    def with_token_budget(self, device_type: str, total_memory: int = 0,
                          device_name: str = "") -> EngineConfig:
        """This config with the step's token budget (max_num_batched_tokens) and its prompt part beside
        decodes (max_prefill_tokens_beside_decodes) chosen for the usage and device where left to the
        default. Chosen this late, so that a config made for one usage and replaced into another (``serve``
        does) takes the other's defaults."""
        changes: dict[str, int] = {}
        if self.max_num_batched_tokens is None:
            changes["max_num_batched_tokens"] = default_token_budget(self.usage, device_type, total_memory,
                                                                     device_name)
        if self.max_prefill_tokens_beside_decodes is None:
            changes["max_prefill_tokens_beside_decodes"] = PREFILL_CAP_BY_USAGE[self.usage]
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, naming any unknown knob instead of a bare TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(names)}")
        return cls(**kwargs)


# Token budgets by device and usage, as vLLM chooses them (EngineArgs.get_batch_defaults): a GPU of at
# least LARGE_GPU_BYTES (H100, H200, MI300X; not the A100, where vLLM measured large budgets slower)
# takes big prefill steps, whose matmuls run near peak and whose kernel launches are few; smaller GPUs
# take less. On CPU a step of 2,048 tokens already takes seconds.
LARGE_GPU_BYTES = 70 * 1024**3
# max_prefill_tokens_beside_decodes by usage: serving protects running streams' inter-token latency (W4,
# W5); offline every request arrives at once and only throughput counts (W1 on an H200: 31,761 out tok/s
# uncapped against 20,486 at 256; W2 10,307 against 9,110: benchmarks/results/offline_prefill_cap_h200/).
SERVING_PREFILL_CAP = 256
PREFILL_CAP_BY_USAGE = {"offline": NO_CHUNK_CAP, "serve": SERVING_PREFILL_CAP}
TOKEN_BUDGETS = {
    "large_gpu": {"offline": 16384, "serve": 8192},
    "gpu": {"offline": 8192, "serve": 2048},
    "cpu": {"offline": 2048, "serve": 2048},
}


def default_token_budget(usage: str, device_type: str, total_memory: int = 0, device_name: str = "") -> int:
    """The step token budget for ``usage`` ("offline" or "serve") on a device of this type and size."""
    if device_type != "cuda":
        tier = "cpu"
    elif total_memory >= LARGE_GPU_BYTES and "a100" not in device_name.lower():
        tier = "large_gpu"
    else:
        tier = "gpu"
    return TOKEN_BUDGETS[tier][usage]


# Every dtype name plait accepts (vLLM's --dtype choices and short forms) -> the one it is stored as.
DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def canonical_dtype(name: str) -> str:
    """The canonical name of a dtype alias ("half" -> "float16"); ValueError for an unknown one."""
    canonical = DTYPE_ALIASES.get(name) if isinstance(name, str) else None
    if canonical is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_ALIASES)}, got {name!r}")
    return canonical


def _is_number(value: Any) -> bool:
    """An int or a float (a bool is neither, though Python counts it an int)."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def json_object(name: str, value: dict | str | None) -> dict | None:
    """A JSON-object knob: a dict, or its JSON text as the CLI gives it; None where it is unset or empty."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value or None


def _loader_extra_config(value: dict | str | None) -> dict[str, Any] | None:
    """model_loader_extra_config checked: vLLM's safetensors loader keys (LOADER_EXTRA_CONFIG_KEYS), with a
    bool and a whole number >= 1 (num_threads without enable_multithread_load changes nothing, as in vLLM)."""
    config = json_object("model_loader_extra_config", value)
    if config is None:
        return None
    unknown = sorted(set(config) - set(LOADER_EXTRA_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"model_loader_extra_config {unknown} is not available: plait's safetensors loader "
                         f"takes {', '.join(LOADER_EXTRA_CONFIG_KEYS)}")
    if not isinstance(config.get("enable_multithread_load", False), bool):
        raise ValueError(f"model_loader_extra_config enable_multithread_load must be true or false, got "
                         f"{config['enable_multithread_load']!r}")
    if "num_threads" in config:
        _check_int("model_loader_extra_config num_threads", config["num_threads"], minimum=1)
    return config


def load_threads(config: EngineConfig) -> int:
    """The shards an HF checkpoint's loading reads at once: 1, or model_loader_extra_config's num_threads
    (DEFAULT_LOAD_THREADS) under its enable_multithread_load."""
    extra = config.model_loader_extra_config or {}
    if not extra.get("enable_multithread_load"):
        return 1
    return extra.get("num_threads", DEFAULT_LOAD_THREADS)


MULTIMODAL_MODALITIES = ("image",)


def _mm_limits(value: dict | str | None) -> dict[str, int] | None:
    """limit_mm_per_prompt checked: modalities plait takes, each a whole number >= 0 (vLLM's form)."""
    limits = json_object("limit_mm_per_prompt", value)
    if limits is None:
        return None
    for modality, n in limits.items():
        if modality not in MULTIMODAL_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: plait takes {MULTIMODAL_MODALITIES} alone, got "
                             f"{modality!r}")
        _check_int(f"limit_mm_per_prompt[{modality!r}]", n, minimum=0)
    return limits


def with_rope_overrides(hf_config: dict, rope_scaling: dict | None, rope_theta: float | None) -> dict:
    """``hf_config`` with vLLM's --rope-scaling and --rope-theta in place of its own (a new dict): replaced
    whole, not merged, so no key of the checkpoint's scaling (its type, say) survives into the user's."""
    replaced = dict(hf_config)
    if rope_scaling is not None:
        replaced["rope_scaling"] = rope_scaling
    if rope_theta is not None:
        replaced["rope_theta"] = rope_theta
    return replaced


def merge_objects(base: dict, overrides: dict | None) -> dict:
    """``base`` with ``overrides`` merged in (a new dict): nested objects key by key, anything else
    replaced, as vLLM applies --hf-overrides (and its dotted keys to a JSON flag)."""
    merged = dict(base)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_objects(merged[key], value)
        else:
            merged[key] = value
    return merged


def _config_object(name: str, value: dict | str, cls: type) -> dict | None:
    """A JSON-object knob (a dict, or its JSON text as the CLI gives it) whose keys must be ``cls``'s fields;
    None where it is empty ({} or "")."""
    value = json_object(name, value)
    if value is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"unknown {name} key(s) {unknown}; known: {sorted(names)}")
    return value


KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's kv_events_config: with ``enable_kv_cache_events`` the engine publishes the prefix cache's block
    events each step through ``publisher`` ("zmq": a PUB socket bound at ``endpoint``, the last
    ``buffer_steps`` batches replayed at ``replay_endpoint``; "null": recorded and dropped); vLLM's
    defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" where events are on, else "null" (vLLM's)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # Set by the data-parallel front for each replica (not a vLLM key): the rank its batches carry.
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        if publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config publisher must be one of {KV_EVENT_PUBLISHERS}, got "
                             f"{publisher!r}")
        object.__setattr__(self, "publisher", publisher)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            _check_int(f"kv_events_config {name}", getattr(self, name), minimum=1)
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config {name} must be a string, got {getattr(self, name)!r}")

    def for_replica(self, index: int) -> KVEventsConfig:
        """Data-parallel replica ``index``'s config, as vLLM offsets its ranks': tcp endpoints' ports plus
        ``index``, other transports' addresses with ``_dp<index>`` appended, its batches carrying the rank."""
        def offset(endpoint: str | None) -> str | None:
            if endpoint is None:
                return None
            if endpoint.startswith("tcp://"):
                host, _, port = endpoint.rpartition(":")
                return f"{host}:{int(port) + index}"
            return f"{endpoint}_dp{index}"

        return dataclasses.replace(self, endpoint=offset(self.endpoint),
                                   replay_endpoint=offset(self.replay_endpoint), data_parallel_rank=index)

    @property
    def publishes(self) -> bool:
        """Whether events go out on a socket (on, through "zmq")."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """A KVEventsConfig from a dict or its JSON text (None, {} and "" are off)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = _config_object("kv_events_config", value, cls)
        return None if value is None else cls(**value)


NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
EAGLE = "eagle"
EAGLE3 = "eagle3"
# Multi-token prediction: the target checkpoint's own MTP layer drafts (plait.models.mtp); "model" defaults
# to the target's. vLLM's older names for it are read as this one.
MTP = "mtp"
MTP_ALIASES = {"deepseek_mtp": MTP, "glm4_moe_mtp": MTP}
# Methods whose drafts come from a model of their own (speculative_config's "model").
MODEL_METHODS: tuple[str, ...] = (DRAFT_MODEL, EAGLE, EAGLE3)
SPECULATIVE_METHODS: tuple[str, ...] = (NGRAM, *MODEL_METHODS, MTP)
# Methods whose head drafts from the target's hidden states (plait.engine.eagle.EagleDrafter).
HIDDEN_STATE_METHODS: tuple[str, ...] = (EAGLE, EAGLE3, MTP)
# vLLM's n-gram lengths where a config names neither prompt_lookup_max nor prompt_lookup_min.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``speculative_config``: each decode row proposes up to
    ``num_speculative_tokens`` draft tokens and one step scores them all; the tokens the model would have
    produced anyway are kept.

    Method "ngram" (prompt lookup): the tokens that followed the latest earlier occurrence of the row's last
    n tokens (n from prompt_lookup_max down to prompt_lookup_min). Method "draft_model" (the default where
    ``model`` is given, as in vLLM): a smaller model of the same vocabulary decodes them greedily
    (plait.engine.draft_model). Methods "eagle" and "eagle3": an EAGLE-1 / EAGLE-3 head (``model``) drafts
    from the target's hidden states (plait.engine.eagle). Method "mtp" (vLLM's, also "deepseek_mtp" and
    "glm4_moe_mtp"): the multi-token-prediction layer of the target's checkpoint (``model``: the target's
    where not given) drafts as an EAGLE-1 head does (plait.models.mtp)."""

    method: str | None = None  # None: "draft_model" with a model, else "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # "draft_model": the draft's checkpoint (a .gguf file, an HF folder or a cached Hub id), its context
    # (None: its max_position_embeddings) and vLLM's draft_tensor_parallel_size (1: it runs on the driver).
    model: str | None = None
    max_model_len: int | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method or (DRAFT_MODEL if self.model is not None else NGRAM)
        method = MTP_ALIASES.get(method, method)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPECULATIVE_METHODS}, "
                             f"got {method!r}")
        object.__setattr__(self, "method", method)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        if method in MODEL_METHODS and not self.model:
            raise ValueError(f'speculative_config method "{method}" needs "model": the draft checkpoint')
        if method == MTP and self.max_model_len is not None:
            raise ValueError('speculative_config "max_model_len" is not for "mtp": its layer is the '
                             "target's, at the target's context")
        if method == NGRAM and (self.model is not None or self.max_model_len is not None):
            raise ValueError('speculative_config "model" and "max_model_len" are for the methods with a '
                             f'model ({", ".join(MODEL_METHODS)}), not "ngram"')
        if self.max_model_len is not None:
            _check_int("speculative_config max_model_len", self.max_model_len, minimum=1)
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError("speculative_config draft_tensor_parallel_size must be 1: the draft model runs "
                             "whole on the driver's device")
        # vLLM's defaults: both 5 where neither is given, else the one given for both.
        lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP
        lookup_min = self.prompt_lookup_min or self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP
        _check_int("prompt_lookup_min", lookup_min, minimum=1)
        _check_int("prompt_lookup_max", lookup_max, minimum=lookup_min)
        object.__setattr__(self, "prompt_lookup_max", lookup_max)
        object.__setattr__(self, "prompt_lookup_min", lookup_min)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict or its JSON text (None, {} and "" are off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = _config_object("speculative_config", value, cls)
        if value is None:
            return None
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)


POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one embedding, as vLLM's ``pooler_config``:
    ``pooling_type`` LAST (the last token's, as decoder embedding models are trained), MEAN (the average over
    the prompt) or CLS (the first token's); ``normalize``: L2-normalised. None: the model's own (its
    sentence-transformers config), else LAST and normalised."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", kind)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
        """A PoolerConfig from a dict or its JSON text (None, {} and "" leave the model's own)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        value = _config_object("pooler_config", value, cls)
        return cls(**value) if value is not None else None


# MoEConfig.router: the routers plait.layers.moe computes.
SOFTMAX_ROUTER = "softmax"
NOAUX_TC_ROUTER = "noaux_tc"
# DeepSeek-V2's "group_limited_greedy": softmax scores, the experts of the topk_group groups with the best
# single score kept, then the top-k among them (plait.layers.moe.route_group_limited).
GROUP_LIMITED_ROUTER = "group_limited_greedy"
# DeepSeek-V2's topk_method names -> MoEConfig.router ("greedy" is the plain softmax top-k).
DEEPSEEK_V2_ROUTERS = {"greedy": SOFTMAX_ROUTER, GROUP_LIMITED_ROUTER: GROUP_LIMITED_ROUTER}
# Multi-head latent attention decoders (plait.models.deepseek): DeepSeek-V2 (V2-Lite, V2.5, Coder-V2) and
# DeepSeek-V3 (R1, V3.1, Kimi K2, Moonlight).
DEEPSEEK_V2_ARCHITECTURE = "DeepseekV2ForCausalLM"
DEEPSEEK_V3_ARCHITECTURE = "DeepseekV3ForCausalLM"
DEEPSEEK_ARCHITECTURES = (DEEPSEEK_V2_ARCHITECTURE, DEEPSEEK_V3_ARCHITECTURE)
GLM4_MOE_MODEL_TYPE = "glm4_moe"  # GLM-4.5 / GLM-4.6 (plait.models.glm4_moe)
GLM4_MOE_ARCHITECTURE = "Glm4MoeForCausalLM"
# The MTP draft head's architecture (vLLM's names) for each target whose checkpoints hold MTP layers
# (num_nextn_predict_layers): speculative_config method "mtp" (plait.models.mtp).
MTP_HEAD_ARCHITECTURES = {GLM4_MOE_ARCHITECTURE: "Glm4MoeMTPModel",
                          DEEPSEEK_V3_ARCHITECTURE: "DeepSeekMTPModel"}
MTP_TARGET_ARCHITECTURES = {head: target for target, head in MTP_HEAD_ARCHITECTURES.items()}
# MoE decoders whose configs name their experts' width intermediate_size (plait.models.olmo, .granite).
OLMOE_MODEL_TYPES = ("olmoe",)
# Granite 4.0 (GraniteMoeHybridForCausalLM, plait.models.granite4): Granite MoE shared's block, or its
# shared MLP alone where it has no experts.
GRANITE4_MODEL_TYPE = "granitemoehybrid"
GRANITE_MOE_MODEL_TYPES = ("granitemoe", "granitemoeshared", GRANITE4_MODEL_TYPE)
# NemotronH (plait.models.nemotron_h): MoE layers are its "moe" layer kind ("E" in hybrid_override_pattern).
NEMOTRON_H_MODEL_TYPE = "nemotron_h"


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MoE blocks of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / Granite MoE config (read from its
    HF config.json)."""

    num_experts: int
    top_k: int  # experts each token is routed to (num_experts_per_tok)
    intermediate_size: int  # of each routed expert (Qwen: moe_intermediate_size; Mixtral: intermediate_size)
    renormalize: bool  # the top_k weights renormalised to sum to one (Mixtral always; Qwen: norm_topk_prob)
    shared_intermediate_size: int  # Qwen2-MoE's gated shared expert, Granite MoE's ungated one; 0: none
    # Whether a sigmoid gate (shared_expert_gate) scales the shared expert's output (Qwen2-MoE) or not
    # (Granite MoE's shared_mlp, added as it is).
    shared_expert_gated: bool = True
    # Qwen-MoE: layers in mlp_only_layers, or not at a multiple of decoder_sparse_step, keep a dense MLP.
    dense_layers: tuple[int, ...] = ()
    # Expert parallelism (a tensor-parallel rank's config, plait.parallel.shard): the routed experts this rank
    # holds whole, global ids [first, end); the router still picks among all num_experts. None: every one.
    expert_range: tuple[int, int] | None = None
    # How the router picks: SOFTMAX_ROUTER (plait.layers.moe.route), or NOAUX_TC_ROUTER (GLM-4.5's and
    # DeepSeek-V3's: plait.layers.moe.route_noaux_tc, with these three numbers; GLM-4.5's shared experts are
    # ungated, and shared_intermediate_size is their n_shared_experts x moe_intermediate_size).
    router: str = SOFTMAX_ROUTER
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict) -> MoEConfig | None:
        """None for a dense model."""
        model_type = cfg.get("model_type", "")
        if model_type == GLM4_MOE_MODEL_TYPE:
            return cls._from_glm4_moe(cfg)
        if model_type == NEMOTRON_H_MODEL_TYPE:
            return cls._from_nemotron_h(cfg)
        architecture = (cfg.get("architectures") or [""])[0]
        architecture = MTP_TARGET_ARCHITECTURES.get(architecture, architecture)  # an MTP head: its target's
        if architecture in DEEPSEEK_ARCHITECTURES:
            return cls._from_deepseek(cfg, architecture == DEEPSEEK_V3_ARCHITECTURE)
        num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if not num_experts:
            return None
        # Mixtral's, GPT-OSS's, OLMoE's and Granite MoE's experts are intermediate_size wide.
        mixtral_like = model_type in ("mixtral", "gpt_oss", *OLMOE_MODEL_TYPES, *GRANITE_MOE_MODEL_TYPES)
        # Top-k weights that sum to one: Mixtral's and GPT-OSS's always; Granite MoE's router takes the top-k
        # logits, then a softmax over them alone, which is the same (the softmax is monotonic, so its top-k
        # are the logits'; renormalising the chosen probabilities cancels the other experts' share of the
        # denominator): route(renormalize=True), up to fp32 rounding. OLMoE's and Qwen's: norm_topk_prob.
        renormalized = model_type in ("mixtral", "gpt_oss", *GRANITE_MOE_MODEL_TYPES)
        # Granite MoE shared's shared MLP is shared_intermediate_size wide and ungated; Qwen2-MoE's is gated.
        shared = cfg.get("shared_expert_intermediate_size") or 0
        if model_type in GRANITE_MOE_MODEL_TYPES:
            shared = cfg.get("shared_intermediate_size") or 0
        step = cfg.get("decoder_sparse_step") or 1
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only_mlp or (i + 1) % step)
        return cls(
            num_experts=num_experts,
            top_k=cfg.get("num_experts_per_tok", 2),
            intermediate_size=cfg["intermediate_size"] if mixtral_like else cfg["moe_intermediate_size"],
            renormalize=True if renormalized else bool(cfg.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_expert_gated=model_type not in GRANITE_MOE_MODEL_TYPES,
            dense_layers=dense,
        )

    @classmethod
    def _from_glm4_moe(cls, cfg: dict) -> MoEConfig:
        """GLM-4.5 / GLM-4.6 (Glm4MoeConfig's names and defaults): the first first_k_dense_replace layers
        dense, noaux_tc routing, n_shared_experts ungated shared experts of the routed experts' width."""
        inter = cfg.get("moe_intermediate_size", 1408)
        return cls(
            num_experts=cfg.get("n_routed_experts", 128),
            top_k=cfg.get("num_experts_per_tok", 8),
            intermediate_size=inter,
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * inter,
            shared_expert_gated=False,
            dense_layers=tuple(range(min(cfg.get("first_k_dense_replace", 1), cfg["num_hidden_layers"]))),
            router=NOAUX_TC_ROUTER,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )

    @classmethod
    def _from_nemotron_h(cls, cfg: dict) -> MoEConfig | None:
        """NemotronH (NemotronHConfig's names and defaults), None without MoE layers (its configs name
        experts either way): noaux_tc routing over ungated relu^2 experts, one ungated shared expert of
        moe_shared_expert_intermediate_size (transformers reads no n_shared_experts). Which layers are MoE
        is the model's layer list, not dense_layers."""
        kinds = cfg.get("layers_block_type") or list(cfg.get("hybrid_override_pattern") or "")
        if "moe" not in kinds and "E" not in kinds:
            return None
        return cls(
            num_experts=cfg.get("n_routed_experts", 8),
            top_k=cfg.get("num_experts_per_tok", 2),
            intermediate_size=cfg.get("moe_intermediate_size", 7688),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            shared_intermediate_size=cfg.get("moe_shared_expert_intermediate_size", 7688),
            shared_expert_gated=False,
            router=NOAUX_TC_ROUTER,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )

    @classmethod
    def _from_deepseek(cls, cfg: dict, v3: bool) -> MoEConfig:
        """DeepSeek-V2 / V3 (DeepseekV2Config's / DeepseekV3Config's names and defaults): dense MLPs in the
        first first_k_dense_replace layers and, as DeepSeek's own code and vLLM read moe_layer_freq, in those
        whose index it does not divide; n_shared_experts ungated shared experts of the routed experts' width.
        V3's router is always noaux_tc (transformers' V3 has no other); V2's is its topk_method."""
        if v3:
            router = NOAUX_TC_ROUTER
        else:
            method = cfg.get("topk_method") or "greedy"
            if method not in DEEPSEEK_V2_ROUTERS:
                raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported; supported: "
                                 f"{sorted(DEEPSEEK_V2_ROUTERS)}")
            router = DEEPSEEK_V2_ROUTERS[method]
        inter = cfg.get("moe_intermediate_size", 2048 if v3 else 1407)
        layers = cfg["num_hidden_layers"]
        first_dense = cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0
        freq = cfg.get("moe_layer_freq") or 1
        return cls(
            num_experts=cfg.get("n_routed_experts", 256 if v3 else 64),
            top_k=cfg.get("num_experts_per_tok") or 8,
            intermediate_size=inter,
            renormalize=bool(cfg.get("norm_topk_prob", v3)),
            shared_intermediate_size=(cfg.get("n_shared_experts", 1 if v3 else 2) or 0) * inter,
            shared_expert_gated=False,
            dense_layers=tuple(i for i in range(layers) if i < first_dense or i % freq),
            router=router,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        )


@dataclass
class ModelConfig:
    """The architecture of a decoder, read from an HF config.json dict (or a GGUF header)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the tokens a sequence may hold (XLM-RoBERTa: fewer than its rows)
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None  # Mistral: attend to at most this many previous tokens
    rope_scaling: dict | None
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoEConfig | None = None  # sparse MoE feed-forward blocks; None: dense MLPs
    # The fraction of each head's channels the rotary turns (Phi-4-mini: 0.75, GLM-4: 0.5), read for Phi-3 and
    # GLM configs only: transformers' other Llama-family models ignore the key, and Bamba keeps its own.
    partial_rotary_factor: float = 1.0
    # Ministral 3: (beta, period) of Llama 4's query scaling by position (rotary.llama4_query_scale)
    llama4_scaling: tuple[float, int] | None = None
    # Tensor parallelism: the ranks a Mamba2 mixer's heads are split over (a rank's config builds
    # Mamba2Dims.split(mamba_ranks) of its checkpoint's mixer; plait.parallel.shard sets it).
    mamba_ranks: int = 1
    raw: dict = field(default_factory=dict, repr=False)  # the original dict, for HF references

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("model config has no 'architectures' field; cannot choose a model class")
        if cfg.get("model_type") in COMPLETED_CONFIGS:
            cfg = completed_text_config(cfg)
        missing = [key for key in REQUIRED_CONFIG_KEYS if key not in cfg]
        if missing:
            raise ValueError(f"model config ({archs[0]}) lacks {', '.join(missing)}: every model needs them")
        model_type = cfg.get("model_type", "")
        # Attention-free models (Mamba2) have no attention heads; their "head_dim" is the SSM's.
        heads = cfg.get("num_attention_heads", 0)
        head_dim = (cfg.get("head_dim") or cfg["hidden_size"] // heads) if heads else 0
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # Qwen2 has q/k/v bias without saying so (Qwen2-MoE: in qkv_bias), Seed-OSS and GLM by their configs'
        # defaults; Llama-style configs say it.
        default_bias = cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe", "seed_oss", "glm", "glm4"))
        attention_bias = bool(cfg.get("attention_bias", default_bias))
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window they do not use
        if model_type in ("smollm3", "gpt_oss"):
            sliding = None  # a window of some layers only: plait.models.smollm3 and .gpt_oss read it
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers 5 keeps theta and scaling here
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if rope_kind(params) != "default":
                rope_scaling = rope_scaling or params
        if rope_kind(rope_scaling) == "default":
            rope_scaling = None
        partial_rotary_factor = 1.0
        if model_type == PHI3_MODEL_TYPE:
            rope_scaling, partial_rotary_factor = phi3_rope(cfg, rope_scaling)
        elif model_type in GLM_MODEL_TYPES:  # at the top level (transformers 4) or in rope_parameters (5)
            given = cfg.get("partial_rotary_factor") or (params or {}).get("partial_rotary_factor")
            partial_rotary_factor = float(given or GLM_PARTIAL_ROTARY_FACTOR)
        elif rope_kind(rope_scaling) == "yarn":
            rope_scaling = yarn_rope(cfg, rope_scaling)
        max_positions = cfg.get("max_position_embeddings", 4096)
        if model_type in ("roberta", "xlm-roberta"):
            # Their positions start at pad_token_id + 1 (plait.models.bert), so fewer tokens fit than rows, as
            # transformers and vLLM count them: bge-m3's 8194 rows hold 8192 tokens, RoBERTa's 514 hold 512.
            max_positions -= cfg.get("pad_token_id", 1) + 1
        intermediate_size = cfg.get("intermediate_size", 0)  # 0: no MLP (Mamba2)
        if model_type == GRANITE4_MODEL_TYPE and not cfg.get("num_local_experts"):
            # Granite 4's dense models (granite-4.0-micro, -h-micro): the shared MLP is the layer's MLP;
            # intermediate_size would be the experts' width, and they have none.
            intermediate_size = cfg["shared_intermediate_size"]
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=intermediate_size,
            # NemotronH gives its layers as a list of kinds instead of a count.
            num_hidden_layers=cfg.get("num_hidden_layers") or len(cfg.get("layers_block_type") or []),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            # The decoder norms' eps: RMSNorm's, Cohere's LayerNorm's (layer_norm_eps) or NemotronH's.
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", cfg.get("layer_norm_epsilon",
                                                                                   1e-6))),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=(model_type in ("qwen3", "qwen3_moe", "gemma3_text")
                     or (model_type == GLM4_MOE_MODEL_TYPE and bool(cfg.get("use_qk_norm")))),
            sliding_window=sliding,
            rope_scaling=rope_scaling,
            hidden_act=hidden_activation(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf(cfg),
            partial_rotary_factor=partial_rotary_factor,
            llama4_scaling=llama4_scaling(cfg),
            raw=cfg,
        )


# Gemma 1's configs name the tanh-approximated GELU it was trained with "gelu", as transformers reads them
# (GemmaConfig: "a legacy value of the official releases").
GEMMA_MODEL_TYPE = "gemma"
GEMMA_LEGACY_ACTIVATIONS = {"gelu": "gelu_pytorch_tanh"}


def mla_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank) of a DeepSeek (MLA) config, with
    DeepSeek-V3's defaults (plait.models.deepseek; plait.parallel.shard slices its heads by them)."""
    raw = cfg.raw
    return (raw.get("qk_nope_head_dim", 128), raw.get("qk_rope_head_dim", 64), raw.get("v_head_dim", 128),
            raw.get("kv_lora_rank", 512))


def hidden_activation(cfg: dict) -> str:
    """The MLP's activation: hidden_act, else hidden_activation (Gemma 2 / 3's name for it), else SiLU;
    Gemma 1's legacy "gelu" read as the tanh approximation."""
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if cfg.get("model_type") == GEMMA_MODEL_TYPE:
        return GEMMA_LEGACY_ACTIVATIONS.get(act, act)
    return act


# GLM-4's configs (plait.models.glm) and GLM-4.5's (plait.models.glm4_moe), and the share of each head their
# rotary turns where they do not say.
GLM_MODEL_TYPES = ("glm", "glm4", GLM4_MOE_MODEL_TYPE)
GLM_PARTIAL_ROTARY_FACTOR = 0.5
# The decoders whose rope parameters' llama_4_scaling_beta scales queries (other models ignore it).
LLAMA4_SCALING_MODEL_TYPES = ("ministral3",)


def llama4_scaling(cfg: dict) -> tuple[float, int] | None:
    """(beta, period) of a Ministral 3 config's query scaling, from its rope parameters; None elsewhere."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if cfg.get("model_type") not in LLAMA4_SCALING_MODEL_TYPES or not beta:
        return None
    period = params.get("original_max_position_embeddings")
    if not period:
        raise ValueError("llama_4_scaling_beta needs the rope parameters' original_max_position_embeddings")
    return float(beta), int(period)


# What a model's config.json must say (transformers has no default for them); the rest has defaults.
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size")


def rope_kind(scaling: dict | None) -> str:
    """A rope_scaling / rope_parameters dict's kind ("rope_type", or the older "type"); "default" for none."""
    if scaling is None:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


# Configs completed from transformers' defaults (Hub configs list only what differs from them, a multimodal
# checkpoint's text_config most of all): model_type -> (transformers' config class, the text decoder's
# model_type). Image-text checkpoints ("gemma3", "mistral3", "llava") are read by their text_config, their
# vision keys kept beside it (_KEPT_IMAGE_KEYS).
COMPLETED_CONFIGS = {
    "gemma": ("GemmaConfig", "gemma"),
    "gemma2": ("Gemma2Config", "gemma2"),
    "gemma3_text": ("Gemma3TextConfig", "gemma3_text"),
    "gemma3": ("Gemma3TextConfig", "gemma3_text"),
    "mistral3": ("MistralConfig", "mistral"),
    "llava": ("LlamaConfig", "llama"),
    "llava_next": ("LlamaConfig", "llama"),
    "olmo2": ("Olmo2Config", "olmo2"),
    "olmo3": ("Olmo3Config", "olmo3"),
    "gpt_oss": ("GptOssConfig", "gpt_oss"),
    # Cohere: tied embeddings, logit_scale, layer_norm_eps and (Cohere2) layer_types by transformers' defaults
    "cohere": ("CohereConfig", "cohere"),
    "cohere2": ("Cohere2Config", "cohere2"),
    # Granite 4: experts (8), shared MLP width, Mamba head width ("auto") and layer kinds (the Hub's "mamba" /
    # "attention" read as transformers 5's names) by transformers' defaults and reading
    GRANITE4_MODEL_TYPE: ("GraniteMoeHybridConfig", GRANITE4_MODEL_TYPE),
    "qwen2_vl": ("Qwen2VLTextConfig", "qwen2"),
    "qwen2_5_vl": ("Qwen2_5_VLTextConfig", "qwen2"),
    "idefics3": ("LlamaConfig", "llama"),
    "smolvlm": ("LlamaConfig", "llama"),
    "qwen3_vl": ("Qwen3VLTextConfig", "qwen3"),
    "qwen3_vl_moe": ("Qwen3VLMoeTextConfig", "qwen3_moe"),
}
IMAGE_TEXT_MODEL_TYPES = ("gemma3", "mistral3", "llava", "llava_next", "idefics3", "smolvlm")
# Image models plait runs with their images (plait.models.llava), whose decoder is the text_config's own
# model_type (LLaVA-1.5: llama; LLaVA-NeXT: llama or mistral; LLaVA-Interleave: qwen2).
LLAVA_MODEL_TYPES = ("llava", "llava_next")
LLAVA_TEXT_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
# Mistral 3's decoders: Mistral-Small-3.1 / 3.2's Mistral; the Ministral 3 models' own (Llama 4's query
# scaling).
MISTRAL3_TEXT_CONFIGS = {"mistral": "MistralConfig", "ministral3": "Ministral3Config"}
# The image-text kinds whose text_config may hold one of several decoders, each completed from its own class.
# Idefics3 and SmolVLM: a Llama decoder (Llama 3, SmolLM2).
IDEFICS3_TEXT_CONFIGS = {"llama": "LlamaConfig"}
DECODER_CONFIGS = {"llava": LLAVA_TEXT_CONFIGS, "llava_next": LLAVA_TEXT_CONFIGS,
                   "mistral3": MISTRAL3_TEXT_CONFIGS, "idefics3": IDEFICS3_TEXT_CONFIGS,
                   "smolvlm": IDEFICS3_TEXT_CONFIGS}
# A multimodal config's top-level keys that hold for its text decoder too (transformers 5 ties the
# embeddings by the top-level flag).
_IMAGE_TEXT_TOP_LEVEL_KEYS = ("architectures", "eos_token_id", "torch_dtype", "dtype", "quantization_config",
                              "tie_word_embeddings")
# The image side of a config whose images plait runs (LLaVA, Mistral 3), kept beside its text decoder's
# fields.
_IMAGE_KEYS = ("vision_config", "image_token_index", "image_token_id", "projector_hidden_act",
               "vision_feature_layer", "vision_feature_select_strategy", "multimodal_projector_bias",
               "image_grid_pinpoints", "spatial_merge_size")
# Gemma 3's (plait.models.gemma3_vision).
_GEMMA3_KEYS = ("vision_config", "image_token_index", "image_token_id", "boi_token_index", "eoi_token_index",
                "mm_tokens_per_image")
# Idefics3's and SmolVLM's (plait.models.idefics3).
_IDEFICS3_KEYS = ("vision_config", "image_token_id", "scale_factor")
# The image kinds whose images plait runs from their text_config's decoder (plait.models.llava, .pixtral,
# .idefics3) -> the image keys kept.
_KEPT_IMAGE_KEYS = {"llava": _IMAGE_KEYS, "llava_next": _IMAGE_KEYS, "mistral3": _IMAGE_KEYS,
                    "idefics3": _IDEFICS3_KEYS, "smolvlm": _IDEFICS3_KEYS, "gemma3": _GEMMA3_KEYS}


# Qwen2-VL, Qwen2.5-VL and Qwen3-VL, served with their images (plait.models.qwen2_vl, .qwen3_vl): a Qwen2
# (Qwen3-VL: Qwen3) decoder whose config is the text_config (transformers 5, Qwen3-VL) or the top level
# (transformers 4's Qwen2-VL Hub checkpoints), with M-RoPE.
QWEN_VL_MODEL_TYPES = {"qwen2_vl": "Qwen2VLVisionConfig", "qwen2_5_vl": "Qwen2_5_VLVisionConfig",
                       "qwen3_vl": "Qwen3VLVisionConfig", "qwen3_vl_moe": "Qwen3VLMoeVisionConfig"}
QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
_QWEN_VL_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
MROPE_SECTION_KEY = "mrope_section"
# Qwen3-VL's rope parameters say its M-RoPE interleaves t, h, w
# (plait.layers.rotary.interleaved_mrope_columns).
MROPE_INTERLEAVED_KEY = "mrope_interleaved"
# transformers' Qwen3VLTextRotaryEmbedding's bands where the config gives none.
QWEN3_VL_DEFAULT_MROPE_SECTION = [24, 20, 20]


def completed_qwen_vl_config(cfg: dict) -> dict:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL config: its decoder's, with transformers' defaults, its
    vision_config completed the same way, and ``mrope_section`` (Qwen3-VL: ``mrope_interleaved`` too) at the
    top (the rotary is a plain one otherwise)."""
    import transformers

    kind = cfg["model_type"]
    text_class, text_kind = COMPLETED_CONFIGS[kind]
    skip = ("architectures", "model_type", "text_config", "vision_config")
    text = {k: v for k, v in (cfg.get("text_config") or cfg).items() if k not in skip}
    full = getattr(transformers, text_class)(**text).to_dict()
    rope = full.get("rope_parameters") or full.get("rope_scaling") or {}
    section = rope.get(MROPE_SECTION_KEY) or (cfg.get("rope_scaling") or {}).get(MROPE_SECTION_KEY)
    if kind in QWEN3_VL_MODEL_TYPES:
        section = section or QWEN3_VL_DEFAULT_MROPE_SECTION
        # transformers interleaves Qwen3-VL's bands whatever the key says; its Hub configs say true
        full[MROPE_INTERLEAVED_KEY] = rope.get(MROPE_INTERLEAVED_KEY, True)
    if kind == "qwen3_vl_moe":  # its router always renormalises the top-k weights (no norm_topk_prob key)
        full["norm_topk_prob"] = True
    if not section:
        raise ValueError(f"{kind}: the config gives no rope mrope_section")
    # The 1D table M-RoPE gathers from is the default rotary's (transformers' "mrope" / "default" type).
    full["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 1e6)}
    full.pop("rope_scaling", None)
    full[MROPE_SECTION_KEY] = list(section)
    vision = getattr(transformers, QWEN_VL_MODEL_TYPES[kind])(**{
        k: v for k, v in (cfg.get("vision_config") or {}).items() if k != "model_type"})
    full["vision_config"] = vision.to_dict()
    for key in _IMAGE_TEXT_TOP_LEVEL_KEYS + _QWEN_VL_KEYS:
        if key in cfg:
            full[key] = cfg[key]
    full["model_type"] = text_kind
    return full


# transformers 5 writes a float JSON cannot hold (an infinity: time_step_limit) as {"__float__": "Infinity"}.
ENCODED_FLOAT_KEY = "__float__"


def decoded_floats(value: Any) -> Any:
    """``value`` (a config's, at any depth) with transformers 5's encoded floats as floats."""
    if isinstance(value, dict):
        if set(value) == {ENCODED_FLOAT_KEY}:
            return float(value[ENCODED_FLOAT_KEY])
        return {k: decoded_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded_floats(v) for v in value]
    return value


def completed_text_config(cfg: dict) -> dict:
    """A COMPLETED_CONFIGS config with transformers' defaults filled in; for an image-text one, its
    ``text_config`` under its own architecture."""
    import transformers

    kind = cfg["model_type"]
    if kind in QWEN_VL_MODEL_TYPES:
        return completed_qwen_vl_config(cfg)
    class_name, text_kind = COMPLETED_CONFIGS[kind]
    text = cfg.get("text_config") or {} if kind in IMAGE_TEXT_MODEL_TYPES else cfg
    decoders = DECODER_CONFIGS.get(kind)
    if decoders is not None:
        text_kind = text.get("model_type", text_kind)
        if text_kind not in decoders:
            raise ValueError(f"{kind} with a {text_kind!r} decoder is not supported; decoders: "
                             f"{sorted(decoders)}")
        class_name = decoders[text_kind]
    skip = ("architectures", "model_type", "text_config", "vision_config")
    given = {k: decoded_floats(v) for k, v in text.items() if k not in skip}  # the config classes check types
    full = getattr(transformers, class_name)(**given).to_dict()
    for key in _IMAGE_TEXT_TOP_LEVEL_KEYS + _KEPT_IMAGE_KEYS.get(kind, ()):
        if key in cfg:
            full[key] = cfg[key]
    full["model_type"] = text_kind
    return full


# Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM).
PHI3_MODEL_TYPE = "phi3"
# Phi3Config's default, which it keeps at the top level of every config and gives priority over the one in
# rope_scaling (transformers' standardize_rope_params).
PHI3_DEFAULT_ORIGINAL_MAX_POSITIONS = 4096
# LongRoPE under the names Phi-3 configs have used: early Phi-3-128k configs say "su" (or "yarn"), which
# Phi3Config reads as "longrope".
PHI3_LONGROPE_NAMES = ("longrope", "su", "yarn")


def phi3_rope(cfg: dict, scaling: dict | None) -> tuple[dict | None, float]:
    """(rope_scaling, partial_rotary_factor) of a Phi-3 config as transformers' Phi3Config reads them: the
    factor from the rope dict, else the top level, else 1; a LongRoPE scaling (the only kind Phi-3 takes)
    with original_max_position_embeddings from the top level and, where the config gives no ``factor``,
    max_position_embeddings / original_max_position_embeddings, from which its attention factor follows
    (plait.layers.rotary.longrope_attention_factor)."""
    given = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    partial = float(given.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if scaling is None:
        return None, partial
    kind = rope_kind(scaling)
    if kind not in PHI3_LONGROPE_NAMES:
        raise ValueError(f"Phi-3 rope scaling {kind!r} is not supported: Phi-3 takes only 'longrope'")
    original = int(cfg.get("original_max_position_embeddings", PHI3_DEFAULT_ORIGINAL_MAX_POSITIONS))
    longrope = {key: value for key, value in scaling.items() if key != "type"}
    longrope.update(rope_type="longrope", original_max_position_embeddings=original)
    if longrope.get("factor") is None:
        max_positions = cfg.get("max_position_embeddings", PHI3_DEFAULT_ORIGINAL_MAX_POSITIONS)
        longrope["factor"] = max_positions / original
    return longrope, partial


def yarn_rope(cfg: dict, scaling: dict) -> dict:
    """A YaRN rope_scaling as transformers completes it: original_max_position_embeddings from the config's
    top level if it has one (else its max_position_embeddings), and where no ``factor`` is given,
    max_position_embeddings over it."""
    yarn = dict(scaling)
    original = cfg.get("original_max_position_embeddings") or yarn.get("original_max_position_embeddings")
    yarn["original_max_position_embeddings"] = int(original or cfg.get("max_position_embeddings"))
    if yarn.get("factor") is None:
        yarn["factor"] = cfg["max_position_embeddings"] / yarn["original_max_position_embeddings"]
    return yarn
