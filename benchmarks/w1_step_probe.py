"""Why two of W1's prompt steps (the 3rd and 7th) last 50-75 ms where the others last ~22 (the throughput
JSONs' "prompt_steps"): W1 twice, each step's wall time and caching-allocator counters, the first pass as the
benchmark runs (async), the second with a device synchronise after every step, so that each step's own GPU
time shows. GPU only.

    PYTHONPATH=. python benchmarks/w1_step_probe.py   (with shared/ next to the tree)
"""
import argparse
import time
from pathlib import Path

import torch

import plait.bench.throughput as T
from plait.engine.engine import LLMEngine

COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def record_steps(records: list[dict], sync: bool) -> None:
    """Wrap LLMEngine.step: each timed step's wall time, its tokens and the allocator counters it moved."""
    step = LLMEngine.step

    def timed_step(self: LLMEngine) -> list:
        if not self.record_timeline:  # the warm-up
            return step(self)
        before, start = torch.cuda.memory_stats(), time.perf_counter()
        out = step(self)
        if sync:
            torch.cuda.synchronize()
        wall, after = time.perf_counter() - start, torch.cuda.memory_stats()
        last = self.timeline[-1]
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
        records.append({"ms": round(wall * 1e3, 2), "prefill": last.num_prefill_tokens,
                        "decode": last.num_decode_tokens, **moved})
        return out

    LLMEngine.step = timed_step


def main() -> None:
    parser = argparse.ArgumentParser()
    T.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["throughput", "--shared", "shared/bench", "--workloads", "W1", "--no-roofline",
                              "--in-process"])
    step = LLMEngine.step
    for sync in (False, True):
        records: list[dict] = []
        record_steps(records, sync)
        res = T.run_workload("W1", Path("shared/bench"), None, args)
        LLMEngine.step = step
        print("sync" if sync else "async", round(res["output_tok_per_s"]), flush=True)
        for i, r in enumerate(records[:16]):
            print(i, r)
        allocating = [r for r in records if r["num_device_alloc"] or r["num_alloc_retries"]]
        print("steps with device allocs:", len(allocating), allocating[:6])


if __name__ == "__main__":
    main()
