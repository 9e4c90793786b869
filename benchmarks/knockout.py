"""What each small per-layer kernel costs on the critical path of a graph-replayed decode step (GPU).

    PYTHONPATH=. python benchmarks/knockout.py --workload W3 --out knockout.json

Runs a `plait bench throughput` workload once per setting, with a kernel "knocked out": its Python
wrapper returns its input without launching anything, so the numerics are garbage but everything else
(weights read, graph shapes, launches of every other kernel) is as in a real step. Each setting runs in
its own process (later engines in one process run slower). A time saved by a knock-out is what that
kernel costs the token, launch latency and PDL overlap included, which a kernel trace cannot show.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from plait.bench.shared import find_shared, run_isolated

KERNELS = ("norm", "rope", "silu", "attn")
SETTINGS = [(), ("norm",), ("rope",), ("silu",), ("attn",), KERNELS]


def run_knocked_out(workload: str, shared: Path, names: tuple[str, ...]) -> dict:
    """One workload run with ``names`` knocked out (run in a fresh process: the patches stay there)."""
    from plait.attention import triton_backend
    from plait.bench import throughput
    from plait.kernels import activation, rms_norm

    if "norm" in names:
        rms_norm.fused_add_rms_norm = lambda x, residual, weight, eps, inplace=False: (x, residual)
        rms_norm.rms_norm = lambda x, weight, eps, inplace=False: x
    if "silu" in names:
        activation.silu_and_mul = lambda gate_up: gate_up[..., : gate_up.shape[-1] // 2]
    if "rope" in names:
        triton_backend.rope_store_kv = lambda positions, q, *args, **kwargs: q
    if "attn" in names:
        triton_backend.paged_attention = lambda q, k_cache, v_cache, out, *args, **kwargs: out
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--workloads", workload, "--no-roofline", "--in-process"])
    result = throughput.run_workload(workload, shared, None, args)
    return {"knocked_out": list(names), "ms_per_token": result["ms_per_token"],
            "output_tok_per_s": result["output_tok_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W3")
    parser.add_argument("--shared", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shared = find_shared(args.shared, required="workloads.py")
    rows = [run_isolated(run_knocked_out, args.workload, shared, names)
            for names in tqdm(SETTINGS + [()], desc="knock-outs")]
    for row in rows:
        print(f"knocked out {row['knocked_out'] or 'nothing'}: {row['ms_per_token'] or 0:.3f} ms/token, "
              f"{row['output_tok_per_s']:.0f} tok/s")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
