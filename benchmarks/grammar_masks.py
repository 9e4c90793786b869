"""A step's grammar masks: one row after another against next_token_bitmasks (llguidance's thread pool).

    python benchmarks/grammar_masks.py --rows 64 --out grammar_masks.json

JSON-schema matchers over the default model's tokenizer, each a few tokens into its object; median of
repeats, ms a step. Needs llguidance and the default model's tokenizer (gguf)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from plait.engine.grammar import GrammarCompiler, next_token_bitmasks
from plait.loader.source import default_model_path
from plait.loader.tokenizer import load_tokenizer
from plait.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
PREFIXES = ['{"', '{"name": "A', '{"name": "Ann", "age": 4', '{"name": "B", "age": 1, "tags": ["x']
REPEATS = 20


def one_by_one(grammars) -> np.ndarray:
    return np.stack([g.next_token_bitmask() for g in grammars])


def median_ms(fn, grammars) -> float:
    fn(grammars)  # warm up (the thread pool starts on first use)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(grammars)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    compiler = GrammarCompiler(tokenizer, {tokenizer.eos_token_id})
    grammars = []
    for i in range(args.rows):
        grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
        for t in tokenizer.encode(PREFIXES[i % len(PREFIXES)], add_special_tokens=False):
            grammar.consume(t)
        grammars.append(grammar)
    assert np.array_equal(one_by_one(grammars), next_token_bitmasks(grammars))
    result = {"rows": args.rows, "cpus": os.cpu_count(), "one_by_one_ms": median_ms(one_by_one, grammars),
              "together_ms": median_ms(next_token_bitmasks, grammars)}
    print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
