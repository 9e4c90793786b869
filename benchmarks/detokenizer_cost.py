"""Host time of incremental detokenisation, per streamed token: 256 requests of 128 tokens each (plait's
README as the text, the default model's tokenizer), fed one token a step in turn, as the engine feeds them.
Every token a server streams pays this on the engine's loop thread, which shares the GIL with the HTTP loop.

    PYTHONPATH=. python benchmarks/detokenizer_cost.py --out benchmarks/results/detokenizer_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from plait.engine.detokenizer import Detokenizer
from plait.loader.hf import default_model_path
from plait.loader.tokenizer import load_tokenizer
from plait.sampling_params import SamplingParams

STREAMS = 256
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 128
REPEATS = 3


def _streams(tokenizer) -> list[tuple[list[int], list[int]]]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tokenizer.encode(text)
    span = PROMPT_TOKENS + OUTPUT_TOKENS
    out = []
    for i in range(STREAMS):
        start = (i * 97) % (len(ids) - span)
        out.append((ids[start:start + PROMPT_TOKENS], ids[start + PROMPT_TOKENS:start + span]))
    return out


def _us_per_token(tokenizer, streams, rust: bool) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        detoks = [Detokenizer(tokenizer, prompt, SamplingParams(stop=["\n\n\n"])) for prompt, _ in streams]
        if not rust:
            for d in detoks:
                d._backend = None  # transformers' decode, as before plait.engine.detokenizer.rust_decoder
        start = time.perf_counter()
        for k in range(OUTPUT_TOKENS):
            for d, (_, output) in zip(detoks, streams):
                d.feed(output[k:k + 1])
        best = min(best, time.perf_counter() - start)
    return best / (STREAMS * OUTPUT_TOKENS) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    streams = _streams(tokenizer)
    result = {
        "what": " ".join(__doc__.split("\n\n")[0].split()),
        "machine": f"{platform.processor() or platform.machine()}, CPU",
        "streams": STREAMS, "output_tokens": OUTPUT_TOKENS,
        "us_per_token": {"rust_decoder": round(_us_per_token(tokenizer, streams, rust=True), 2),
                         "transformers_decode": round(_us_per_token(tokenizer, streams, rust=False), 2)},
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
