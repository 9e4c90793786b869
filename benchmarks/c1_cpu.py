"""Workload C1 (WORKLOADS.md): the default model on CPU, fp32, 32 chat prompts x 64 output tokens,
all submitted at once; plait against HF transformers' padded-batch ``generate`` in the same run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# C1 measures the CPU path, which uses no Triton kernel in either engine. With triton importable (the
# test set-up installs it for the kernel tests' interpreter), HF transformers' CPU `generate` runs 2.6x
# slower on this machine (45-59 vs 118 tok/s), so the benchmark hides it from both engines.
sys.modules["triton"] = None

import torch  # noqa: E402

NUM_PROMPTS = 32
OUTPUT_TOKENS = 64
TOPICS = ["rivers", "bread", "the moon", "bicycles", "tea", "volcanoes", "libraries", "winter",
          "octopuses", "chess", "trains", "gardens", "jazz", "deserts", "bees", "lighthouses"]
TASKS = ["Write a short poem about {}.", "Tell me two facts about {}."]


def chat_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": TASKS[i % 2].format(TOPICS[i % len(TOPICS)])}]
            for i in range(NUM_PROMPTS)]


def run_plait(conversations, threads: int) -> dict:
    from plait import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.chat(conversations[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
    wall = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    prompts = [llm.apply_chat_template(c) for c in conversations]
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_per_s": n_out / wall,
            "prompt_tokens": sum(map(len, prompts)), "prompts": prompts,
            "texts": [o.outputs[0].text for o in outs]}


def run_hf(prompts: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    from plait.loader.gguf import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    pad = 2  # <|im_end|>; ignored under the attention mask
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for generation
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=OUTPUT_TOKENS,
                             min_new_tokens=OUTPUT_TOKENS, do_sample=False, pad_token_id=pad)
        wall = time.perf_counter() - start
    n_out = (out.shape[1] - width) * len(prompts)
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_per_s": n_out / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/c1_cpu.json")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    conversations = chat_prompts()
    plait_res = run_plait(conversations, threads)
    hf_res = run_hf(plait_res.pop("prompts"))
    result = {
        "workload": "C1", "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to fp32)",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": threads, "torch": torch.__version__},
        "requests": NUM_PROMPTS, "output_tokens_each": OUTPUT_TOKENS,
        "plait": plait_res, "hf_generate_padded": hf_res,
        "ratio_plait_over_hf": plait_res["output_tok_per_s"] / hf_res["output_tok_per_s"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"plait {plait_res['output_tok_per_s']:.1f} tok/s, "
          f"HF generate {hf_res['output_tok_per_s']:.1f} tok/s, "
          f"ratio {result['ratio_plait_over_hf']:.2f}x  -> {args.out}")


if __name__ == "__main__":
    main()
