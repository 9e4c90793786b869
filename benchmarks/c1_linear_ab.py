"""C1 (WORKLOADS.md: the default model, fp32, 32 chat prompts x 64 tokens) on one engine, CPU linears on
oneDNN (plait's default) and on torch's F.linear (MKL, with 2-3 rows padded to 4) in alternation, so that a
noisy machine slows both alike; and one stream of 128 tokens the same way.

    python benchmarks/c1_linear_ab.py --out benchmarks/results/c1_linear_ab_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.modules["triton"] = None  # the CPU path, as benchmarks/c1_cpu.py runs it

import torch  # noqa: E402
from c1_cpu import OUTPUT_TOKENS, chat_prompts  # noqa: E402

import plait.layers.linear as plait_linear  # noqa: E402
from plait import LLM, SamplingParams  # noqa: E402

ROUNDS = 3
ONE_STREAM_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/c1_linear_ab_cpu.json")
    args = parser.parse_args()
    llm = LLM()
    conversations = chat_prompts()
    batch = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=ONE_STREAM_TOKENS, ignore_eos=True)
    llm.chat(conversations[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    onednn = plait_linear._onednn_linear
    runs: dict[str, dict[str, list[float]]] = {}
    texts = {}
    for _ in range(ROUNDS):
        for variant, use_onednn in (("onednn", onednn), ("f_linear", False)):
            plait_linear._onednn_linear = use_onednn
            start = time.perf_counter()
            outs = llm.chat(conversations, batch, use_tqdm=False)
            c1 = len(conversations) * OUTPUT_TOKENS / (time.perf_counter() - start)
            start = time.perf_counter()
            llm.generate("Write a story about a cat.", one, use_tqdm=False)
            single = ONE_STREAM_TOKENS / (time.perf_counter() - start)
            runs.setdefault(variant, {"c1_out_tok_s": [], "one_stream_tok_s": []})
            runs[variant]["c1_out_tok_s"].append(c1)
            runs[variant]["one_stream_tok_s"].append(single)
            texts[variant] = [o.outputs[0].text for o in outs]
            print(f"{variant}: C1 {c1:.1f} out tok/s, one stream {single:.1f} tok/s", flush=True)
    plait_linear._onednn_linear = onednn
    same = sum(a == b for a, b in zip(texts["onednn"], texts["f_linear"], strict=True))
    def speedup(metric: str) -> float:  # of the medians
        return sorted(runs["onednn"][metric])[ROUNDS // 2] / sorted(runs["f_linear"][metric])[ROUNDS // 2]

    result = {
        "what": "C1 and one 128-token stream on one engine (default model, fp32, greedy), CPU linears on "
                "oneDNN (plait's default) and on F.linear (MKL) alternated, 3 rounds each",
        "command": "python benchmarks/c1_linear_ab.py",
        "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "onednn_available": onednn,
        "runs": runs,
        "c1_speedup_of_medians": speedup("c1_out_tok_s"),
        "one_stream_speedup_of_medians": speedup("one_stream_tok_s"),
        "c1_texts_identical": f"{same} of {len(conversations)}",
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("c1_speedup_of_medians", "one_stream_speedup_of_medians",
                                             "c1_texts_identical")}))


if __name__ == "__main__":
    main()
