"""CPU linears by row count: torch's F.linear (MKL for fp32) against oneDNN's linear
(torch.ops.mkldnn._linear_pointwise, what plait.layers.linear runs on CPU), over the weights of a whole
SmolLM2-135M-shaped model (30 layers of qkv, o, gate_up and down, then the lm_head), so each step streams
them from memory as a decode step does. Random fp32 weights; nothing to download.

    python benchmarks/cpu_linear_rows.py --out benchmarks/results/cpu_linear_onednn_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
# (out, in) of each layer's fused projections: qkv (9 + 2 x 3 heads of 64), o, gate_up, down.
SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
ROWS = (1, 2, 3, 4, 8, 32, 256)
ROUNDS = 3  # the two paths alternate, so a busy neighbour slows both


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def step_ms(linear, layers: list[list[torch.Tensor]], head: torch.Tensor, rows: int, repeats: int) -> float:
    """One pass over every weight with ``rows`` input rows (the lm_head with one row past 32: a prompt
    chunk samples its last token only), in ms."""
    inputs = {HIDDEN: torch.randn(rows, HIDDEN), INTERMEDIATE: torch.randn(rows, INTERMEDIATE)}
    head_input = inputs[HIDDEN][-1:] if rows > 32 else inputs[HIDDEN]

    def one_pass() -> None:
        for weights in layers:
            for w in weights:
                linear(inputs[w.shape[1]], w)
        linear(head_input, head)

    one_pass()
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/cpu_linear_onednn_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [[torch.randn(shape) for shape in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN)
    paths = {"mkl_f_linear": F.linear, "onednn_linear": onednn_linear}
    times: dict[str, dict[int, list[float]]] = {name: {r: [] for r in ROWS} for name in paths}
    with tqdm(total=len(ROWS) * ROUNDS * len(paths), desc="passes") as bar:
        for rows in ROWS:
            for _ in range(ROUNDS):
                for name, linear in paths.items():
                    times[name][rows].append(step_ms(linear, layers, head, rows, 2 if rows > 32 else 4))
                    bar.update()
    best = {name: {r: min(v) for r, v in by_rows.items()} for name, by_rows in times.items()}
    result = {
        "what": "ms for one pass over a SmolLM2-135M-shaped model's linear weights (fp32, random), by input "
                "rows; the best of 3 alternated rounds; mkl_f_linear: torch's F.linear, onednn_linear: "
                "torch.ops.mkldnn._linear_pointwise (plait.layers.linear on CPU)",
        "command": "python benchmarks/cpu_linear_rows.py",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "weight_bytes": 4 * (sum(w.numel() for w in layers[0]) * LAYERS + head.numel()),
        "ms": best,
        "speedup": {r: best["mkl_f_linear"][r] / best["onednn_linear"][r] for r in ROWS},
        "rounds": times,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in ROWS:
        mkl, onednn = best["mkl_f_linear"][r], best["onednn_linear"][r]
        print(f"{r:4d} rows: F.linear {mkl:7.1f} ms, oneDNN {onednn:7.1f} ms ({mkl / onednn:.2f}x)")


if __name__ == "__main__":
    main()
