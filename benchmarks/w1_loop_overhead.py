"""W1's timed loop, instrumented: time inside engine.step() against the rest of the bench loop (GPU).

    PYTHONPATH=. python benchmarks/w1_loop_overhead.py

Runs in this process (the patched loop would not reach a spawned one); finds shared/bench as
`plait bench` does.
"""
import argparse
import time

from plait.bench import throughput as tp
from plait.bench.shared import find_shared


def run(engine, prompts, output_len, desc):
    import torch

    from plait.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    t1 = time.perf_counter()
    inside, outside, steps, big = 0.0, 0.0, 0, []
    last = time.perf_counter()
    while engine.has_unfinished_requests():
        a = time.perf_counter()
        outs = engine.step()
        b = time.perf_counter()
        n = sum(len(o.outputs[0].delta_token_ids) for o in outs)
        c = time.perf_counter()
        inside += b - a
        outside += (a - last) + (c - b)
        big.append((round((b - a) * 1e3, 2), len(outs), n))
        last = c
        steps += 1
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    big.sort(reverse=True)
    print(f"{desc}: add {t1 - t0:.3f} s, steps {steps}, in step() {inside:.3f} s, outside {outside:.3f} s, "
          f"total {t2 - t0:.3f} s; slowest steps (ms, outputs, tokens): {big[:8]}", flush=True)
    return t2 - t0, 0, t1 - t0


def main() -> None:
    tp._run = run
    p = argparse.ArgumentParser()
    tp.add_parser(p.add_subparsers())
    args = p.parse_args(["throughput", "--workloads", "W1", "--no-roofline", "--in-process"])
    tp.run_workload("W1", find_shared(required="workloads.py"), None, args)


if __name__ == "__main__":
    main()
