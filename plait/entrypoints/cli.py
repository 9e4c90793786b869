"""The ``plait`` command: generate, chat, serve (OpenAI-compatible HTTP), run-batch, bench."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
import typing
from collections.abc import Callable
from typing import Any

from plait.config import DTYPE_ALIASES, EngineConfig, merge_objects
from plait.sampling_params import SamplingParams

# Engine fields that get their own CLI flag (the rest keep their defaults).
_ENGINE_FLAGS = (
    "model", "load_format", "device", "dtype", "seed", "generation_config", "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold", "max_prefill_tokens_beside_decodes", "prefill_drain_steps",
    "max_num_partial_prefills", "max_long_partial_prefills",
    "scheduling_policy", "block_size",
    "num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len",
    "disable_sliding_window",
    "enable_prefix_caching", "prefix_caching_hash_algo",
    "attention_backend", "enforce_eager", "cuda_graph_sizes", "async_scheduling", "warm_up",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "quantization",
    "kv_cache_dtype", "speculative_config", "runner", "convert", "pooler_config", "hf_overrides",
    "tensor_parallel_size", "enable_expert_parallel",
    "override_generation_config", "max_logprobs", "logprobs_mode", "tokenizer", "tokenizer_revision",
    "skip_tokenizer_init", "revision",
    "download_dir",
    "limit_mm_per_prompt", "enable_sleep_mode", "cpu_offload_gb", "kv_events_config",
    "optimization_level", "compilation_config",
    "logits_processors", "enable_prompt_embeds", "rope_scaling", "rope_theta", "use_tqdm_on_load",
    "hf_config_path", "safetensors_load_strategy", "model_loader_extra_config", "additional_config",
    "worker_extension_cls", "kv_offloading_size", "kv_offloading_backend", "kv_transfer_config",
)


# --data-parallel-routing: where the data-parallel front sends a request (plait.entrypoints.replica_router).
PREFIX_AFFINITY = "prefix-affinity"
ROUTINGS = (PREFIX_AFFINITY, "least-busy")
DEFAULT_ROUTING = PREFIX_AFFINITY
# A command stopped by Ctrl-C exits as a shell reports a SIGINT death (128 + 2), without a traceback.
INTERRUPTED_EXIT_CODE = 130

# vLLM's structured-output backend names that mean what plait runs: llguidance.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "llguidance")

# Flags whose default is decided at start-up rather than written in EngineConfig.
_FLAG_HELP = {
    "warm_up": "GPU: run made-up requests like a server's first ones before serving, so that no real request "
               "waits for a kernel to compile (default: on; --no-warm-up starts seconds sooner)",
    "model": "a .gguf file, an HF folder, or a Hub id (org/name) in the local HF cache; plait never "
             "downloads (default: the bundled SmolLM2-135M-Instruct)",
    "max_prefill_tokens_beside_decodes": "prompt tokens a step may carry beside running decodes, so that a "
                                         "long prompt never freezes the streams (default: 256 serving, none "
                                         "offline; 0: none)",
    "max_num_batched_tokens": "the step's token budget (default: vLLM's for the device: 16384 offline "
                              "and 8192 serving on GPUs of 70 GB and more, 8192 / 2048 on smaller ones, "
                              "2048 on CPU)",
    "device": "(default: cuda where available, else cpu)",
    "dtype": f"one of {', '.join(DTYPE_ALIASES)} (default: bfloat16 on GPU, float32 on CPU)",
    "seed": "seed of random sampling for requests without their own seed, and of dummy weights: the same "
            "seed and the same requests give the same tokens (default: 0)",
    "generation_config": "as vLLM's: 'auto' (default): the sampling defaults (temperature, top_p, top_k, "
                         "min_p, repetition_penalty, max_new_tokens) of the model folder's "
                         "generation_config.json apply to requests that leave them out; 'vllm': plait's "
                         "own defaults; or a folder holding a generation_config.json (its max_new_tokens "
                         "then caps every request). Its eos_token_id always stops generation",
    "scheduling_policy": "'mixed' (default; vLLM's 'fcfs' is the same): running decodes first, prompts "
                         "chunked into the rest of the budget, first come first served; 'priority' "
                         "(vLLM's): the same steps, requests served by their 'priority' field (lower "
                         "first) and lower priorities preempted for higher ones' KV blocks; "
                         "'prefill_first': prompt chunks before decodes, for comparison",
    "kv_events_config": "as vLLM's, a JSON object: '{\"enable_kv_cache_events\": true, \"endpoint\": "
                        "\"tcp://*:5557\"}' publishes the prefix cache's stored / removed / cleared blocks "
                        "over ZMQ in vLLM's format, for KV-aware routers (default: off)",
    "cpu_offload_gb": "as vLLM's: GiB of the first decoder layers' weights kept in host memory, each layer's "
                      "copied to the GPU as it runs (a model larger than the GPU runs, slower) (default: 0)",
    "enable_sleep_mode": "let POST /sleep free the GPU memory of the weights and KV cache until POST "
                         "/wake_up (with VLLM_SERVER_DEV_MODE=1, as vLLM) (default: off)",
    "enable_lora": "serve requests with PEFT LoRA adapters (Llama-family models) (default: off)",
    "max_loras": "LoRA adapters on the device at once; a request waits while all serve others (default: 1)",
    "max_lora_rank": "the largest LoRA rank served (default: 16)",
    "quantization": "as vLLM's --quantization on an unquantised checkpoint: 'fp8' keeps every linear layer "
                    "but the lm_head in FP8 with per-row scales, its input quantised per token (W8A8) "
                    "(default: none). A quantised checkpoint (FP8; GPTQ, AWQ or compressed-tensors W4A16 / "
                    "W8A16) is served as it is without it; 'gptq', 'awq', their '_marlin' names and "
                    "'compressed-tensors' may only repeat its method",
    "kv_cache_dtype": "as vLLM's --kv-cache-dtype: 'auto' (default: the model's dtype) or 'fp8' (alias "
                      "'fp8_e4m3'): K/V stored in FP8, twice the tokens in the same memory",
    "max_cpu_loras": "LoRA adapters kept read on the host (default: --max-loras)",
    "num_kv_blocks": "the KV cache's blocks (vLLM's --num-gpu-blocks-override; default: as many as "
                     "--gpu-memory-utilization, or --kv-cache-memory-bytes, leaves room for)",
    "kv_cache_memory_bytes": "as vLLM's: the KV cache's size on each device in bytes, or '8G' (8 GiB) / "
                             "'8g' (8e9) as --max-model-len's sizes, in place of what "
                             "--gpu-memory-utilization leaves after a profiling step (default: that)",
    "speculative_config": "as vLLM's, a JSON object: '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                          "4, \"prompt_lookup_max\": 4}' drafts up to 4 tokens a step by prompt lookup, "
                          "'{\"model\": \"DRAFT\", \"num_speculative_tokens\": 3}' with a smaller model of "
                          "the same tokenizer, '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}' with a "
                          "GLM-4.5 / DeepSeek-V3 checkpoint's own MTP layer; the tokens the model would have "
                          "produced anyway are kept (default: off)",
    "runner": "as vLLM's --runner: 'pooling' serves the model's embeddings (/v1/embeddings) or, for a "
              "...ForSequenceClassification checkpoint, its class probabilities (/classify); 'generate' its "
              "text; 'auto' (default) pools base-model and classifier checkpoints and generates with any "
              "other",
    "pooler_config": "as vLLM's, a JSON object for a pooling model: '{\"pooling_type\": \"MEAN\", "
                     "\"normalize\": false}' (LAST, MEAN or CLS; default: the model's sentence-transformers "
                     "config, else LAST, normalised)",
    "tensor_parallel_size": "as vLLM's: split the model's attention heads, MLP and experts across this many "
                            "GPUs (cuda:0..N-1), one process each; the Llama family's models, MoE ones "
                            "included (default: 1)",
    "enable_expert_parallel": "as vLLM's: with --tensor-parallel-size N, a MoE model's routed experts are "
                              "dealt out whole, E / N to each GPU, instead of split in width; "
                              "attention and dense layers stay split. Ignored by dense models (default: off)",
    "limit_mm_per_prompt": "as vLLM's, a JSON object: '{\"image\": 2}' refuses prompts with more images than "
                           "that (default: no limit but the context's length)",
    "override_generation_config": "as vLLM's, a JSON object of generation_config.json fields over the "
                                  "model's (or over none, with --generation-config vllm): "
                                  "'{\"temperature\": 0.5, \"max_new_tokens\": 256}' (temperature, top_p, "
                                  "top_k, min_p, repetition_penalty, max_new_tokens)",
    "max_logprobs": "as vLLM's --max-logprobs: the most logprobs / top_logprobs / prompt_logprobs a request "
                    "may ask for at a position (default: 20; -1: the whole vocabulary)",
    "tokenizer": "as vLLM's: a GGUF file, HF folder or cached Hub id whose tokenizer (and chat template) "
                 "to use instead of the model's (default: the model's)",
    "prefix_caching_hash_algo": "as vLLM's: the hash naming a cached block's context: blake2b (default, 16 "
                                "bytes) or sha256 (vLLM's default, 32 bytes)",
    "disable_sliding_window": "as vLLM's: cap --max-model-len at the model's (narrowest) sliding window, so "
                              "every layer attends to the whole context; no effect on models without one",
    "rope_scaling": "as vLLM's, a JSON object in place of the checkpoint's rope_scaling: '{\"rope_type\": "
                    "\"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}' stretches a "
                    "32K model to 128K (with --max-model-len 131072)",
    "rope_theta": "as vLLM's: the rotary base in place of the checkpoint's",
    "use_tqdm_on_load": "as vLLM's: a progress bar over an HF checkpoint's shards while they load "
                        "(default: on)",
    "hf_config_path": "as vLLM's: a folder holding a config.json (or a cached Hub id) that describes the "
                      "model in place of its own; its generation_config.json, if any, gives the sampling "
                      "defaults under --generation-config auto / vllm. Weights and tokenizer stay the "
                      "model's (default: the model's config)",
    "safetensors_load_strategy": "as vLLM's, how an HF checkpoint's safetensors files are read: 'lazy' "
                                 "(default): mapped, a tensor read as it loads; 'eager': each file read "
                                 "whole into memory first (sequential reads, for network filesystems; a "
                                 "shard's size in host memory); 'prefetch': mapped while a thread reads the "
                                 "files ahead into the page cache. GGUF files are read as always",
    "model_loader_extra_config": "as vLLM's, a JSON object of the safetensors loader's options: "
                                 "'{\"enable_multithread_load\": true, \"num_threads\": 8}' reads that many "
                                 "shards at once on threads (default 8; up to that many shards plus one in "
                                 "host memory); other keys are refused",
    "additional_config": "vLLM's options for platform plugins: plait has none, so only '{}' is accepted",
    "convert": "as vLLM's: 'embed' serves a generative checkpoint as an embedding model (its last hidden "
               "states pooled: --runner pooling); 'auto' / 'none' keep its kind",
    "logits_processors": "as vLLM's: custom logits processors, plait.logits_processor.LogitsProcessor "
                         "subclasses named module:Class or module.Class (importable: on PYTHONPATH); "
                         "requests give them settings in vllm_xargs",
    "kv_offloading_size": "as vLLM's: GiB of host memory that keep the prefix cache's evicted KV blocks, "
                          "copied back where a later prompt shares their prefix (default: none)",
    "kv_offloading_backend": "as vLLM's: 'native' (plait's own host pool; the default); LMCache is not "
                             "bundled",
    "kv_transfer_config": "as vLLM's, a JSON object, for its OffloadingConnector only: '{\"kv_connector\": "
                          "\"OffloadingConnector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": "
                          "{\"num_cpu_blocks\": N}}' keeps N evicted KV blocks a GPU in host memory (as "
                          "--kv-offloading-size); other connectors are refused",
    "worker_extension_cls": "as vLLM's: a class (module:Class or module.Class, importable: on PYTHONPATH) "
                            "whose methods join each GPU's worker, for POST /collective_rpc (development "
                            "mode) and LLM.collective_rpc to call: an RL loop's weight sync, say",
    "optimization_level": "as vLLM's -O0 .. -O3: 0 captures no CUDA graphs (--enforce-eager); 1-3 are "
                          "plait's default, since plait runs no torch.compile (default: 2)",
    "compilation_config": "as vLLM's (also -cc, -O '{...}' and dotted keys: -O.cudagraph_mode=NONE), a JSON "
                          "object: cudagraph_mode (NONE: no graphs), cudagraph_capture_sizes, "
                          "max_cudagraph_capture_size and use_cudagraph act; torch.compile keys (level, "
                          "pass_config, ...) change nothing; others are refused",
    "cuda_graph_sizes": "as vLLM's: the decode batch sizes captured as CUDA graphs, e.g. 1 2 4 8 16; one "
                        "size N means 1, 2, 4 and every 8 up to N; larger decode steps run eager "
                        "(default: 1, 2, 4, 8, every 8 up to 64, then every 16 up to --max-num-seqs)",
    "logprobs_mode": "as vLLM's: what sampled tokens' logprobs hold: raw_logprobs (default: the model's), "
                     "processed_logprobs (the distribution the token was drawn from: after masks, bias, "
                     "penalties, temperature, top-k/top-p/min-p), raw_logits or processed_logits (the values "
                     "before the softmax)",
    "skip_tokenizer_init": "as vLLM's: load no tokenizer; prompts are token ids, outputs token ids (their "
                           "text empty) (default: off)",
    "tokenizer_revision": "the Hub snapshot (branch, tag or commit) of --tokenizer, or of the model's own "
                          "tokenizer without it (default: main)",
    "revision": "as vLLM's: the Hub id's snapshot (branch, tag or commit) in the local HF cache "
                "(default: main); plait never downloads",
    "download_dir": "as vLLM's: the HF cache folder to find Hub ids in (default: $HF_HUB_CACHE, else "
                    "~/.cache/huggingface/hub); plait never downloads into it",
    "hf_overrides": "as vLLM's, a JSON object merged into the checkpoint's config.json: '{\"architectures\": "
                    "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"]}' "
                    "serves Qwen3-Reranker as a cross-encoder (/score, /rerank) (default: none)",
}


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine knob of _ENGINE_FLAGS, but those the command already uses for its own ends
    (`bench w4 --seed` seeds its prompts); args.engine_flags names the knobs that got a flag."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    added = []
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _ENGINE_FLAGS:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if hints[f.name] is bool:  # --enforce-eager / --no-enforce-eager
            kwargs: dict[str, Any] = {"action": argparse.BooleanOptionalAction,
                                      "help": _FLAG_HELP.get(f.name, f"(default: {f.default!r})")}
        else:
            kwargs = {"type": _FLAG_TYPES.get(f.name) or _arg_type(hints[f.name]),
                      "help": _FLAG_HELP.get(f.name, f"(default: {f.default!r})")}
            if f.name in _LIST_FLAGS:
                kwargs["nargs"] = "+"
        try:
            group.add_argument(flag, *_FLAG_ALIASES.get(f.name, ()), dest=f.name, default=None, **kwargs)
        except argparse.ArgumentError:  # the command's own flag of that name stays
            continue
        added.append(f.name)
    parser.set_defaults(engine_flags=tuple(added))
    _add_vllm_compat_args(group)


# vLLM flags that change nothing here: (flag, its argparse form, what plait does instead).
_NO_OP_FLAGS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("--trust-remote-code", {"action": "store_true"},
     "plait runs no code from checkpoints, and a model that needs its own code is refused by architecture"),
    ("--code-revision", {"metavar": "REVISION"}, "plait runs no code from checkpoints"),
    ("--hf-token", {"nargs": "?", "const": True, "metavar": "TOKEN"},
     "plait never downloads, so sends no token"),
    ("--disable-custom-all-reduce", {"action": "store_true"}, "plait's tensor-parallel all-reduce is NCCL's"),
    ("--disable-cascade-attn", {"action": "store_true"},
     "plait's attention has no cascade (shared-prefix) kernel to disable"),
    ("--swap-space", {"type": float, "metavar": "GIB"},
     "plait never swaps KV blocks to the host; a preempted request is recomputed, as vLLM v1's"),
    ("--max-parallel-loading-workers", {"type": int, "metavar": "N"},
     "plait reads a checkpoint's shards one at a time (--model-loader-extra-config's "
     "enable_multithread_load reads several)"),
    ("--max-seq-len-to-capture", {"type": int, "metavar": "N"},
     "plait's decode graphs serve every context length up to --max-model-len"),
    ("--ignore-patterns", {"nargs": "+", "metavar": "PATTERN"}, "plait never downloads, so skips no file"),
    ("--mm-processor-cache-gb", {"type": float, "metavar": "GIB"},
     "plait keeps no cache of processed images: a request's images are processed once, as it arrives"),
    ("--disable-hybrid-kv-cache-manager", {"action": "store_true"},
     "plait's KV cache is one block pool for every layer"),
    ("--allowed-media-domains", {"nargs": "+", "metavar": "DOMAIN"},
     "plait fetches no URL: images come as data URLs or, under --allowed-local-media-path, local files"),
    ("--show-hidden-metrics-for-version", {"metavar": "VERSION"}, "plait's /metrics hides none"),
)


def _add_vllm_compat_args(group: argparse._ArgumentGroup) -> None:
    """vLLM flags whose behaviour plait always has, accepted so that vLLM command lines run unchanged."""
    for flag, form, instead in _NO_OP_FLAGS:
        group.add_argument(flag, help=f"accepted for vLLM command lines: {instead}", **form)
    for name, (values, instead) in _VLLM_CHOICES.items():
        if name in _SERVE_CHOICES:
            continue
        flag = f"--{name.replace('_', '-')}"
        group.add_argument(flag, *_CHOICE_ALIASES.get(name, ()), default=values[0], metavar="VALUE",
                           help=f"vLLM's {flag}: {instead} ({' / '.join(values)} accepted; others are "
                                "refused)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="always on in plait: prompts are chunked into every step beside the decodes "
                            "(--no-enable-chunked-prefill is refused)")
    group.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                       help="vLLM's structured-outputs config: its backend may be plait's (auto, guidance, "
                            "llguidance) and disable_fallback is accepted (llguidance has no fallback); "
                            "other keys are refused")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                       help="vLLM's pipeline stages: plait splits a model across GPUs by tensor parallelism "
                            "(--tensor-parallel-size) only, so 1 is accepted and more is refused")
    group.add_argument("--distributed-executor-backend", default=None, metavar="BACKEND",
                       help="vLLM's workers: plait runs one process per GPU, vLLM's 'mp' ('uni' with one "
                            "GPU; 'ray' and 'external_launcher' are refused)")


# vLLM's human-readable sizes: a decimal suffix (k, m, g, t: powers of 1,000, decimals allowed) or a binary
# one (K, M, G, T: powers of 1,024, whole numbers only).
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's --max-model-len values: "32768", "32k" (32,000), "32K" (32,768), "25.6k" (25,600)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if match is None:
        try:
            return int(value)
        except ValueError:
            message = f"not a whole number or a size like 32k / 32K: {value!r}"
            raise argparse.ArgumentTypeError(message) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: binary suffixes (K, M, G, T) take whole numbers")
    return int(number) * _BINARY_SUFFIXES[suffix]


# Engine flags whose values are not plain numbers.
_FLAG_TYPES: dict[str, Callable[[str], Any]] = {"max_model_len": human_readable_int,
                                                "kv_cache_memory_bytes": human_readable_int,
                                                "cuda_graph_sizes": int, "compilation_config": str,
                                                "rope_scaling": str}
# Engine flags that take one or more values.
_LIST_FLAGS = frozenset({"cuda_graph_sizes", "logits_processors"})
# vLLM's other names for engine flags.
_FLAG_ALIASES = {"tensor_parallel_size": ("-tp",), "num_kv_blocks": ("--num-gpu-blocks-override",),
                 "pooler_config": ("--override-pooler-config",),
                 "compilation_config": ("-cc",), "enable_expert_parallel": ("-ep",)}


def positive_int(value: str) -> int:
    """A whole number >= 1 (refused when the command line is read, before anything starts)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return number


def _arg_type(hint: Any) -> type:
    args = typing.get_args(hint) or (hint,)
    for t in (int, float):
        if t in args:
            return t
    return str


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    # No per-request --seed: each command runs a fresh engine, so the engine's --seed already makes its
    # samples reproducible, and one flag keeps one meaning across generate, chat and serve (as vLLM's).
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    _check_vllm_choices(args)
    if getattr(args, "enable_chunked_prefill", True) is False:
        raise ValueError("plait always chunks prompts beside running decodes (that is how a step is built); "
                         "to take each prompt whole, raise --max-num-batched-tokens, or use "
                         "--scheduling-policy prefill_first")
    names = getattr(args, "engine_flags", _ENGINE_FLAGS)
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return EngineConfig(**given)


# vLLM flags accepted where their value means what plait does: (the values, what plait does instead).
_VLLM_CHOICES = {
    "guided_decoding_backend": (STRUCTURED_OUTPUT_BACKENDS, "structured outputs are llguidance's, vLLM's "
                                                            "'guidance' backend"),
    "tokenizer_mode": (("auto", "hf"), "plait runs the checkpoint's fast (tokenizers) tokenizer"),
    "model_impl": (("auto", "vllm"), "plait runs its own model code"),
    "config_format": (("auto", "hf"), "plait reads HF's config.json or a GGUF file's header"),
    "lora_dtype": (("auto",), "plait's LoRA adapters compute in the model's dtype"),
    "preemption_mode": (("recompute",), "plait preempts by recompute, as vLLM v1 does; it never swaps"),
    "data_parallel_backend": (("mp",), "plait's data-parallel replicas are processes of this host"),
    "mamba_cache_dtype": (("auto",), "plait keeps Mamba layers' conv state in the model's dtype and their "
                                     "SSM state in float32"),
    "mamba_ssm_cache_dtype": (("auto", "float32"), "plait keeps Mamba layers' SSM state in float32"),
    "pt_load_map_location": (("cpu",), "plait reads PyTorch checkpoint files (*.bin) into host memory, then "
                                       "moves each tensor to its device"),
}
# _VLLM_CHOICES flags that only `plait serve` has (its own parser adds them); other names vLLM gives a flag.
_SERVE_CHOICES = frozenset({"data_parallel_backend"})
_CHOICE_ALIASES = {"guided_decoding_backend": ("--structured-outputs-backend",)}
EXECUTOR_BACKENDS = ("mp", "uni")
SINGLE_PROCESS_BACKEND = "uni"


# vLLM's structured_outputs_config keys plait takes: the backend (checked against plait's), and
# disable_fallback, which changes nothing since llguidance never falls back to another backend.
STRUCTURED_OUTPUTS_CONFIG_KEYS = ("backend", "disable_fallback")


def _check_structured_outputs_config(text: str | None) -> None:
    """vLLM's --structured-outputs-config, accepted where it asks for what plait does, refused by key else."""
    from plait.config import json_object

    config = json_object("--structured-outputs-config", text) or {}
    for key, value in config.items():
        if key not in STRUCTURED_OUTPUTS_CONFIG_KEYS:
            raise ValueError(f"--structured-outputs-config {key!r} is not available; plait takes "
                             f"{', '.join(STRUCTURED_OUTPUTS_CONFIG_KEYS)}")
        if key == "backend" and value not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"--structured-outputs-config backend {value!r} is not available: structured "
                             f"outputs are llguidance's ({' / '.join(STRUCTURED_OUTPUT_BACKENDS)})")


def _check_vllm_choices(args: argparse.Namespace) -> None:
    """vLLM flags accepted where their value is what plait does, and refused by name where it is not."""
    for name, (values, instead) in _VLLM_CHOICES.items():
        value = getattr(args, name, values[0])
        if value not in values:
            raise ValueError(f"--{name.replace('_', '-')} {value} is not available: {instead} (vLLM's "
                             f"{' / '.join(values)}); leave it out")
    _check_structured_outputs_config(getattr(args, "structured_outputs_config", None))
    if getattr(args, "pipeline_parallel_size", 1) != 1:
        raise ValueError("pipeline parallelism is not available: plait splits a model across GPUs by tensor "
                         "parallelism (--tensor-parallel-size N) instead")
    backend = getattr(args, "distributed_executor_backend", None)
    tensor_parallel = getattr(args, "tensor_parallel_size", None) or 1
    if backend is not None and (backend not in EXECUTOR_BACKENDS
                                or (backend == SINGLE_PROCESS_BACKEND and tensor_parallel > 1)):
        raise ValueError(f"--distributed-executor-backend {backend} is not available: plait runs one process "
                         "per GPU (vLLM's 'mp'; 'uni' with one GPU)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, stop=args.stop)


def _cmd_generate(args: argparse.Namespace) -> int:
    from plait.engine.engine import LLMEngine

    params = _sampling_params(args)  # bad values fail before the model loads
    engine = LLMEngine(_engine_config(args))
    for prompt in args.prompts:
        _stream(engine, prompt, params)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.llm import apply_chat_template

    params = _sampling_params(args)
    engine = LLMEngine(_engine_config(args))
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    turns = [args.message] if args.message else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            user = turns.pop(0)
        else:
            try:
                user = input("you> ")
            except EOFError:
                print()
                return 0
            if user.strip() in ("", "/exit", "/quit"):
                return 0
        history.append({"role": "user", "content": user})
        reply = _stream(engine, apply_chat_template(engine.tokenizer, history), params)
        history.append({"role": "assistant", "content": reply})


# Kept in step with plait.entrypoints.server, which is not imported until `serve` runs (it needs the
# optional server dependencies).
_DEFAULT_HOST = "127.0.0.1"
_DEFAULT_PORT = 8000
_API_KEY_ENV = "PLAIT_API_KEY"
_VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's, read where plait's is not set: vLLM deployments run as they are
_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's development switch, which turns --log-error-stack on
_CORS_ANY = ("*",)


def _json_string_list(text: str) -> list[str]:
    """A CORS flag's value: a JSON list of strings, as vLLM's (--allowed-origins '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, such as '[\"*\"]', got {text!r}")
    return value


def _lora_module(text: str) -> Any:
    """A --lora-modules value: name=path, or vLLM's JSON form."""
    from plait.lora.request import LoRAModulePath  # no torch

    try:
        return LoRAModulePath.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _needs_server_dependencies(command: str, err: ImportError) -> ValueError:
    return ValueError(f"`plait {command}` needs the server dependencies: pip install 'plait[serve]' ({err})")


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    local, size = args.data_parallel_size_local, args.data_parallel_size
    if local not in (None, size):
        raise ValueError(f"--data-parallel-size-local {local}: plait runs every replica on this host, so it "
                         f"must be --data-parallel-size ({size})")
    if args.api_server_count != 1:
        raise ValueError("plait serves HTTP from one process (its engine loop runs in another); leave "
                         "--api-server-count out, or add engines with --data-parallel-size")
    _load_parsers(args)
    engine_config = _engine_config(args)
    launched = None
    if args.data_parallel_size == 1:
        from plait.entrypoints.launcher import launch

        # The port, and the engine process loading the model, before the server stack's imports (torch,
        # FastAPI: ~1.4 s of a 2-core start), so that those happen meanwhile.
        launched = launch(engine_config, args.host, args.port, args.engine_process, args.uds)
    try:
        from plait.entrypoints.server import ServerConfig, serve
    except ImportError as err:
        raise _needs_server_dependencies("serve", err) from err

    api_key = args.api_key
    if api_key is None:
        api_key = os.environ.get(_API_KEY_ENV) or os.environ.get(_VLLM_API_KEY_ENV) or None
    config = ServerConfig(**_request_handling_config(args), host=args.host, port=args.port, api_key=api_key,
                          request_timeout_s=args.request_timeout,
                          allowed_origins=args.allowed_origins,
                          allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                          allow_credentials=args.allow_credentials,
                          allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                          enable_ssl_refresh=args.enable_ssl_refresh, stream_interval=args.stream_interval,
                          root_path=args.root_path, uds=args.uds,
                          disable_fastapi_docs=args.disable_fastapi_docs,
                          enable_force_include_usage=args.enable_force_include_usage,
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          middleware=args.middleware, log_config_file=args.log_config_file,
                          uvicorn_log_level=args.uvicorn_log_level,
                          disable_uvicorn_access_log=args.disable_uvicorn_access_log,
                          enable_server_load_tracking=args.enable_server_load_tracking,
                          enable_request_id_headers=args.enable_request_id_headers,
                          step_timeline_file=args.step_timeline_file, log_error_stack=args.log_error_stack,
                          h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                          h11_max_header_count=args.h11_max_header_count)
    if launched is None:
        from plait.entrypoints.data_parallel import serve_data_parallel

        serve_data_parallel(engine_config, config, args.data_parallel_size,
                            prefix_affinity=args.data_parallel_routing == PREFIX_AFFINITY,
                            engine_process=args.engine_process)
    else:
        serve(engine_config, config, engine_process=args.engine_process, launched=launched)
    return 0


def _cmd_run_batch(args: argparse.Namespace) -> int:
    try:
        from plait.engine.engine import LLMEngine
        from plait.entrypoints.batch_runner import IN_FLIGHT_PER_SEQ, check_paths, run_batch_file
        from plait.entrypoints.engine_process import EngineProcess
        from plait.entrypoints.server import OpenAIServer, ServerConfig
    except ImportError as err:
        raise _needs_server_dependencies("run-batch", err) from err
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request: the bar counts them
    check_paths(args.input_file, args.output_file)
    config = ServerConfig(**_request_handling_config(args))
    # Offline defaults (the larger token budget): a batch job.
    engine = EngineProcess(_engine_config(args)) if args.engine_process else LLMEngine(_engine_config(args))
    server = OpenAIServer(engine, config)
    max_num_seqs = (engine.info if args.engine_process else engine).config.max_num_seqs
    summary = run_batch_file(server, args.input_file, args.output_file, IN_FLIGHT_PER_SEQ * max_num_seqs,
                             tmp_dir=args.output_tmp_dir)
    print(f"plait: {summary.total} requests, {summary.succeeded} answered, {summary.failed} failed; "
          f"answers in {args.output_file}", file=sys.stderr)
    return 0


def _add_engine_process_arg(parser: argparse.ArgumentParser, default: bool) -> None:
    placement = "a process of its own" if default else "a thread of this process"
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=default,
                        help="run the engine's step loop in a process of its own (vLLM's engine core), so "
                             "the HTTP work does not share a GIL with it; --no-engine-process: on a thread "
                             f"of this process (default: {placement})")


def _request_handling_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields of _add_request_handling_args', the tool and the LoRA modules' flags."""
    return dict(served_model_name=args.served_model_name,
                trust_request_chat_template=args.trust_request_chat_template,
                allowed_local_media_path=args.allowed_local_media_path, chat_template=args.chat_template,
                chat_template_content_format=args.chat_template_content_format,
                default_chat_template_kwargs=args.default_chat_template_kwargs,
                **({"response_role": args.response_role} if args.response_role is not None else {}),
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                tool_parser_plugin=args.tool_parser_plugin,
                reasoning_parser_plugin=args.reasoning_parser_plugin,
                exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                log_level=args.log_level, disable_log_stats=args.disable_log_stats,
                lora_modules=args.lora_modules or (),
                enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                enable_log_outputs=args.enable_log_outputs,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details)


def _add_request_handling_args(parser: argparse.ArgumentParser) -> None:
    """How served requests are named, read, answered and logged: flags of serve and run-batch alike."""
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients send; the first is the one responses report "
                             "(default: the model file's stem or folder's name)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let chat requests bring their own chat template (a Jinja program)")
    parser.add_argument("--allowed-local-media-path", default=None, metavar="FOLDER",
                        help="let image parts name files in this folder by file:// URL, as vLLM's (clients "
                             "then read the server's files: trusted clients only) (default: data URLs only)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name tokens 'token_id:<id>' (as vLLM) unless a request sets "
                             "return_tokens_as_token_ids false")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats lines (throughputs, queue, KV cache, speculation), as vLLM's")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="as vLLM's: usage gives prompt_tokens_details.cached_tokens, the prompt tokens "
                             "the prefix cache served")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's id, prompt, token ids and sampling params, as vLLM's")
    parser.add_argument("--enable-log-outputs", action="store_true",
                        help="log each finished completion's or chat's text, token ids and finish reason, as "
                             "vLLM's (named as its --enable-log-requests line)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="accepted for vLLM command lines (requests are not logged unless "
                             "--enable-log-requests)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="with --enable-log-requests: the prompt characters and ids logged "
                             "(default: all)")


def _add_cors_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags: which web pages' scripts may call the server from a browser."""
    group = parser.add_argument_group("CORS")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "request headers")):
        group.add_argument(flag, type=_json_string_list, default=_CORS_ANY, metavar="JSON",
                           help=f"allowed {what}, a JSON list (default: '[\"*\"]': any)")
    group.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                       help="let browsers send cookies and HTTP auth with cross-origin requests "
                            "(default: off)")


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's chat template, tool-calling and reasoning flags."""
    from plait.entrypoints.reasoning_parsers import REASONING_PARSERS  # no server dependencies
    from plait.entrypoints.tool_parsers import TOOL_PARSERS
    from plait.multimodal.chat import AUTO_CONTENT_FORMAT, CONTENT_FORMATS

    group = parser.add_argument_group("chat template, tool calling and reasoning")
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template's text) instead of the model's, "
                            "e.g. one that renders tools and tool calls")
    group.add_argument("--chat-template-content-format", default=AUTO_CONTENT_FORMAT, choices=CONTENT_FORMATS,
                       help="a message's content as the template gets it: 'string' (text parts joined by "
                            "newlines), 'openai' (the list of parts), 'auto' (default: 'openai' for a "
                            "template that loops over a message's content, else 'string')")
    group.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                       help="as vLLM's: chat template variables every chat request gets unless it sets them, "
                            "e.g. '{\"enable_thinking\": false}' (Qwen3 answers without thinking; "
                            "--reasoning-parser reads them too)")
    group.add_argument("--response-role", default=None, metavar="ROLE",
                       help="the role of chat answers to requests with add_generation_prompt (the default); "
                            "others continue the last message, in its role (default: assistant)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice 'auto' (the default where tools are given): the model's tool "
                            "calls are read by --tool-call-parser")
    # Names without argparse's choices: a --tool-parser-plugin may add one, and it has not run yet
    # (_load_parsers checks them once it has, before the model loads).
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the model's tool-call format, e.g. hermes (Qwen2.5, Qwen3, Hermes), llama3_json "
                            f"(Llama 3.x); built in: {', '.join(sorted(TOOL_PARSERS))}; or a name that "
                            "--tool-parser-plugin registers")
    group.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                       help="as vLLM's: a Python file run at start-up whose @register_tool_parser classes "
                            "(plait.entrypoints.tool_parsers.ToolParser subclasses) --tool-call-parser may "
                            "name; a parser named as a built-in one replaces it")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="leave a request's tools out of the prompt when its tool_choice is 'none' (also "
                            "in /tokenize)")
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split chat answers' reasoning (<think>...</think>) into 'reasoning': qwen3, "
                            "deepseek_r1 (also QwQ), deepseek_v3 (DeepSeek-V3.1, reasoning only when asked); "
                            f"built in: {', '.join(sorted(REASONING_PARSERS))}; or a name that "
                            "--reasoning-parser-plugin registers")
    group.add_argument("--reasoning-parser-plugin", default=None, metavar="FILE",
                       help="as vLLM's: a Python file run at start-up whose @register_reasoning_parser "
                            "classes (plait.entrypoints.reasoning_parsers.ReasoningParser subclasses) "
                            "--reasoning-parser may name; a parser named as a built-in one replaces it")


def _load_parsers(args: argparse.Namespace) -> None:
    """Run the parser plugins and check the parser names (ValueErrors naming what is wrong) before the model
    loads; the ServerConfig made later finds the plugins already run."""
    from plait.entrypoints.reasoning_parsers import REASONING_PARSERS  # no server dependencies
    from plait.entrypoints.tool_parsers import TOOL_PARSERS

    TOOL_PARSERS.load(args.tool_call_parser, args.tool_parser_plugin)
    REASONING_PARSERS.load(args.reasoning_parser, args.reasoning_parser_plugin)


def _add_lora_args(parser: argparse.ArgumentParser, runtime_updates: bool = True) -> None:
    """vLLM's LoRA serving flags (--enable-lora, --max-loras and --max-lora-rank are engine knobs)."""
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                       help="PEFT LoRA adapters served under their own model names (needs --enable-lora): "
                            "name=path, or JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    if not runtime_updates:
        return
    runtime = os.environ.get(_RUNTIME_LORA_ENV, "").lower() in ("1", "true")
    group.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                       default=runtime,
                       help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                            f"${_RUNTIME_LORA_ENV}, vLLM's switch, if true; else off)")


def _stream(engine: Any, prompt: str | list[int], params: SamplingParams) -> str:
    """Run one request alone, printing text as it arrives."""
    request_id = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                text = out.outputs[0].text
    sys.stdout.write("\n")
    return text


# `plait bench` subcommands: each module has add_parser(subparsers) and main(args) -> exit status, and
# imports torch only inside its functions (parsing must stay light: `bench serve` is a client).
BENCH_MODULES = (
    "plait.bench.throughput", "plait.bench.latency", "plait.bench.serve_client", "plait.bench.w4",
    "plait.bench.timeline",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="plait: LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts (raw text, no chat template)")
    gen.add_argument("prompts", nargs="+")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model; interactive when no message is given")
    chat.add_argument("message", nargs="?", default=None)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=_cmd_chat)

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    # `plait serve MODEL`, as `vllm serve MODEL`. Only serve takes it: the positionals of generate and
    # chat are prompts, so a model there could not be told from a prompt.
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="a .gguf file, an HF folder, or a Hub id in the local HF cache (as --model)")
    srv.add_argument("--host", default=_DEFAULT_HOST,
                     help=f"address to bind (default: {_DEFAULT_HOST}, this machine only)")
    srv.add_argument("--port", type=int, default=_DEFAULT_PORT,
                     help=f"(default: {_DEFAULT_PORT}; 0 = any free port)")
    srv.add_argument("--uds", default=None, metavar="PATH",
                     help="serve on a Unix domain socket at this path instead of --host and --port, as "
                          "vLLM's (clients connect through it: curl --unix-socket PATH http://localhost/v1/...)")
    srv.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer <key>' on the /v1 endpoints, as vLLM "
                          f"(default: ${_API_KEY_ENV}, else vLLM's ${_VLLM_API_KEY_ENV}, if set; prefer "
                          "them, as flags show in `ps`)")
    _add_request_handling_args(srv)
    _add_tool_args(srv)
    _add_lora_args(srv)
    srv.add_argument("--request-timeout", type=float, default=None,
                     help="abort requests running longer than this many seconds (default: never)")
    _add_engine_process_arg(srv, default=True)
    srv.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                     help="as vLLM's: N engine replicas behind this address, each on its own "
                          "--tensor-parallel-size GPUs (default: 1)")
    srv.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None, metavar="N",
                     help="vLLM's replicas on this host: all of plait's are, so N must be "
                          "--data-parallel-size")
    srv.add_argument("--data-parallel-backend", "-dpb", default="mp", metavar="BACKEND",
                     help="vLLM's replica launcher: plait's replicas are processes of this host, vLLM's 'mp' "
                          "('ray' is refused)")
    srv.add_argument("--data-parallel-routing", default=DEFAULT_ROUTING, choices=ROUTINGS,
                     help="where the front sends a request: 'prefix-affinity' (default): to the replica that "
                          "served the same beginning (a conversation's earlier turns, a shared system "
                          "prompt), for its prefix cache, unless that one is much busier, else to the one "
                          "with the fewest in flight; 'least-busy': always the latter. Requests naming a "
                          "stored response go to the replica storing it either way")
    srv.add_argument("--uvicorn-log-level", default=None,
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="the HTTP server's log level (default: --log-level)")
    srv.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    srv.add_argument("--enable-server-load-tracking", action="store_true",
                     help="as vLLM's: GET /load gives the model-running requests in flight")
    srv.add_argument("--enable-request-id-headers", action="store_true",
                     help="as vLLM's: every response carries X-Request-Id (the request's own, else the id "
                          "of its response, else a new one)")
    srv.add_argument("--step-timeline-file", default=None, metavar="PATH",
                     help="when the server stops, write the engine's step timeline here (each step's time, "
                          "prompt and decode tokens, rows, graph replay, KV blocks, preemptions; "
                          "`plait bench timeline PATH` plots it)")
    srv.add_argument("--log-error-stack", action=argparse.BooleanOptionalAction,
                     default=os.environ.get(_DEV_MODE_ENV, "").lower() in ("1", "true"),
                     help="as vLLM's: log the stack trace of every error response (4xx and 5xx, and a "
                          "stream's error chunk) (default: on under VLLM_SERVER_DEV_MODE=1, as vLLM's; else "
                          "off)")
    srv.add_argument("--h11-max-incomplete-event-size", type=positive_int, default=None, metavar="BYTES",
                     help="as vLLM's: the most bytes of a request's line and headers the server buffers "
                          "before answering 400; given, the server runs uvicorn's h11 HTTP protocol, which "
                          "bounds them, instead of httptools (default: httptools where installed, else h11 "
                          "with its 16 KiB)")
    srv.add_argument("--h11-max-header-count", type=positive_int, default=None, metavar="N",
                     help="as vLLM's: requests with more headers are answered 431 (default: no limit)")
    srv.add_argument("--root-path", default="",
                     help="the path prefix a proxy in front of the server strips, as vLLM's")
    srv.add_argument("--disable-fastapi-docs", action="store_true",
                     help="serve no /docs, /redoc or /openapi.json (the API's browsable description)")
    srv.add_argument("--enable-force-include-usage", action="store_true",
                     help="end every stream with a usage chunk, whether stream_options asks for it or not")
    srv.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="serve GET /tokenizer_info: the tokenizer's configuration and the chat template "
                          "(off by default, as vLLM's: a template may be its owner's to keep)")
    srv.add_argument("--middleware", action="append", default=[], metavar="MODULE.NAME",
                     help="an ASGI middleware class or async function (request, call_next) to wrap every "
                          "request with, imported by its path (repeatable), as vLLM's")
    srv.add_argument("--log-config-file", default=None, metavar="PATH",
                     help="uvicorn's logging configuration (JSON, YAML or INI) instead of its own")
    srv.add_argument("--disable-frontend-multiprocessing", dest="engine_process", action="store_false",
                     help="vLLM's name for --no-engine-process: the engine's loop in the server's process")
    srv.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                     help="vLLM's HTTP server processes: plait's one serves every request (its engine "
                          "loop runs apart; --data-parallel-size adds engines), so 1 is accepted and more "
                          "is refused")
    srv.add_argument("--ssl-keyfile", default=None,
                     help="serve HTTPS with this private key (with --ssl-certfile)")
    srv.add_argument("--ssl-certfile", default=None, help="and this certificate")
    srv.add_argument("--ssl-ca-certs", default=None,
                     help="check clients' certificates against these CAs (with --ssl-certfile)")
    srv.add_argument("--stream-interval", type=int, default=1, metavar="N",
                     help="as vLLM's: after a streamed answer's first tokens, send a chunk once N new tokens "
                          "are in (or it ends): fewer, fuller chunks (default: 1, every step's)")
    srv.add_argument("--enable-ssl-refresh", action="store_true",
                     help="as vLLM's: reload the key, certificate and CA files when they change on disk (new "
                          "connections get them; no restart)")
    srv.add_argument("--ssl-cert-reqs", type=int, default=None, choices=(0, 1, 2),
                     help="whether clients must show a certificate: 0 no, 1 optional, 2 required (default: 2 "
                          "with --ssl-ca-certs, else 0)")
    _add_cors_args(srv)
    _add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)

    batch = sub.add_parser("run-batch",
                           help="answer a file of OpenAI batch requests (JSONL) offline, as vLLM's run-batch")
    batch.add_argument("-i", "--input-file", required=True, metavar="FILE_OR_URL",
                       help="one request a line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} "
                            "(url: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score, "
                            "/v1/rerank, /classify or /pooling); a path, - for standard input, or an http(s) "
                            "URL to GET")
    batch.add_argument("-o", "--output-file", required=True, metavar="FILE_OR_URL",
                       help="one answer a line, in input order: {\"id\", \"custom_id\", \"response\": "
                            "{\"status_code\", \"request_id\", \"body\"}, \"error\"}; a path, - for standard "
                            "output, or an http(s) URL to PUT the file to when it is complete")
    batch.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                       help="where the answers wait before they are PUT to an output URL (default: the "
                            "system's temporary folder)")
    _add_request_handling_args(batch)
    _add_tool_args(batch)
    _add_lora_args(batch, runtime_updates=False)
    # As vLLM's run-batch (its engine core apart): on an H200, 1.15x a thread's output tok/s (W1's mix);
    # on a 2-core CPU with a tiny model it was 10% slower, start-up included.
    _add_engine_process_arg(batch, default=True)
    _add_engine_args(batch)
    batch.set_defaults(func=_cmd_run_batch)

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve (load generator), w4 (mminf "
                                         "workload), timeline")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in BENCH_MODULES:
        importlib.import_module(module).add_parser(bench_sub)
    return parser


# vLLM's dotted compilation keys: -O.cudagraph_mode=NONE, -cc.max_cudagraph_capture_size=64,
# --compilation-config.pass_config.fuse_norm_quant=false (values read as JSON where they are JSON).
_DOTTED_COMPILATION_KEY = re.compile(r"(?:-O|-cc|--compilation-config)\.([\w.]+)=(.*)", re.DOTALL)
COMPILATION_FLAG = "--compilation-config"


def vllm_compilation_argv(argv: list[str]) -> list[str]:
    """vLLM's short compilation flags as plait's: -O3 / -O 3 is --optimization-level 3, -O '{...}' is
    --compilation-config '{...}', and dotted keys are merged into the --compilation-config object."""
    out: list[str] = []
    dotted: dict[str, Any] = {}
    args = iter(argv)
    for arg in args:
        if arg == "--":
            out += [arg, *args]
            break
        if match := _DOTTED_COMPILATION_KEY.fullmatch(arg):
            _set_dotted(dotted, match[1].split("."), _json_or_text(match[2]))
        elif arg == "-O" or (arg.startswith("-O") and not arg.startswith("-O.")):
            value = arg[2:].removeprefix("=") or next(args, "")
            out += ["--optimization-level" if value.isdigit() else COMPILATION_FLAG, value]
        else:
            out.append(arg)
    if dotted:
        _merge_dotted(out, dotted)
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _set_dotted(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def _merge_dotted(argv: list[str], dotted: dict[str, Any]) -> None:
    """Merge dotted keys into the command line's --compilation-config object (the last one), or add one."""
    for i in range(len(argv) - 1, -1, -1):
        if argv[i] in (COMPILATION_FLAG, "-cc") and i + 1 < len(argv):
            given = _json_or_text(argv[i + 1])
            if isinstance(given, dict):
                argv[i + 1] = json.dumps(merge_objects(given, dotted))
                return
    argv += [COMPILATION_FLAG, json.dumps(dotted)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; a positional MODEL lands in args.model, as --model does."""
    parser = build_parser()
    args = parser.parse_args(vllm_compilation_argv(sys.argv[1:] if argv is None else argv))
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            parser.error(f"the model is given twice, as {tag!r} and as --model {args.model!r}; give one")
        args.model = tag
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"plait: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before serving (a model loading) or mid-job: stopped, as asked
        print("plait: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
