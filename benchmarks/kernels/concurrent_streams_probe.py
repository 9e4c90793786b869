"""Can decodes and a long prefill share an H200 on two CUDA streams instead of one plaited step (W4)?

W4 asks for both a stall-free window (p99 ITL at most 1.5x steady) and the long prompt's TTFT within 1.2x of
prefill_first's. One plaited batch pays for both in every step: a 256-token chunk's matmuls alone take ~1.1x a
whole decode step, so the window's steps run 7-9.5 ms against a 4.4-4.8 ms steady step, and 17 such steps
take ~150 ms against prefill_first's ~100. This probe measures the alternative, with Llama-8B's matmul
shapes (32 layers of qkv, o, gate_up, down; random bf16 weights shared by both sides) and no plait code:

- a 4-row decode step (the four streams) captured in a CUDA graph, replayed back to back on a
  high-priority stream: its step time alone, and while the prefill runs beside it;
- the 4,096-token prefill (the same matmuls at 4,096 rows plus causal SDPA over 32 heads of 128) on a
  low-priority stream, whole or in chunks: its time alone, and beside the decodes.

If the decodes beside the prefill stay within 1.5x of their steady time and the prefill within 1.2x of its
own, two streams reach what no single budget does; if cuBLAS's kernels hold every SM for their whole run,
the decodes wait behind each one and the answer is no.

    PYTHONPATH=. python benchmarks/kernels/concurrent_streams_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HIDDEN, HEADS, HEAD_DIM, KV_HEADS, INTER, LAYERS = 4096, 32, 128, 8, 14336, 32
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def _weights(device: torch.device) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.01

    return [{"qkv": w(QKV, HIDDEN), "o": w(HIDDEN, HIDDEN), "gate_up": w(2 * INTER, HIDDEN),
             "down": w(HIDDEN, INTER)} for _ in range(LAYERS)]


def _layer(x: torch.Tensor, w: dict[str, torch.Tensor], attention: bool) -> torch.Tensor:
    # x: [rows, hidden]
    qkv = F.linear(x, w["qkv"])  # [rows, QKV]
    q = qkv[:, : HEADS * HEAD_DIM]
    if attention:  # the prefill's causal attention over its own 4,096 tokens (GQA expanded to 32 heads)
        rows = x.shape[0]
        k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
        # [1, heads, rows, head_dim]: SDPA's flash backend wants 4-D inputs (3-D ones fall back to math)
        qh = q.reshape(rows, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)
        kh = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1).unsqueeze(0)
        vh = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1).unsqueeze(0)
        q = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)[0].transpose(0, 1).reshape(rows, -1)
    h = x + F.linear(q.contiguous(), w["o"])
    gate_up = F.linear(h, w["gate_up"])  # [rows, 2 * inter]
    act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    out = h + F.linear(act, w["down"])
    return out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5)  # keeps random activations finite


def _forward(x: torch.Tensor, weights, attention: bool) -> torch.Tensor:
    for w in weights:
        x = _layer(x, w, attention)
    return x


def _prefill(x: torch.Tensor, weights, chunks: int) -> None:
    # Chunks here only cut the launches into pieces (each chunk attends to itself alone): what matters to
    # the decodes beside it is how long each kernel holds the SMs.
    for piece in x.chunk(chunks):
        _forward(piece, weights, attention=True)


def _graph(fn):
    """``fn`` captured in a CUDA graph (after two warm-up runs), so that launching it costs the host nothing:
    eager launches of the prefill's thousands of kernels would keep the host from the decodes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _decode_times(graph, stream, steps: int, until: torch.cuda.Event | None = None) -> list[float]:
    """Replay ``graph`` back to back on ``stream``; each step's ms (up to ``steps``, or until ``until`` is
    done and at least 3 more steps ran)."""
    events = []
    with torch.cuda.stream(stream):
        for i in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            events.append((start, end))
            if until is not None and i > 3 and until.query():
                break
            if len(events) >= 8:  # keep the host a few steps ahead, not thousands
                events[-8][1].synchronize()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def _time_graph(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"steps": len(a), "p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunks", default="1,2,8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    weights = _weights(device)
    decode_input = torch.randn(4, HIDDEN, device=device, dtype=torch.bfloat16)
    graph = _graph(lambda: _forward(decode_input, weights, attention=False))
    high, low = torch.cuda.Stream(device, priority=-10), torch.cuda.Stream(device, priority=0)
    prompt = torch.randn(args.prompt, HIDDEN, device=device, dtype=torch.bfloat16)
    _decode_times(graph, high, 20)  # warm-up
    print("decode graph ready", flush=True)
    result = {"what": " ".join(__doc__.split("\n\n")[0].split()), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "prompt": args.prompt,
              "decode_alone": _stats(_decode_times(graph, high, 200)), "runs": []}
    for chunks in [int(c) for c in args.chunks.split(",")]:
        prefill = _graph(functools.partial(_prefill, prompt, weights, chunks))
        print(f"prefill graph of {chunks} chunks captured", flush=True)
        alone = min(_time_graph(prefill) for _ in range(3))
        print(f"prefill alone {alone:.1f} ms", flush=True)
        torch.cuda.synchronize()
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(low):
            start.record(low)
            prefill.replay()
            done.record(low)
        beside = _decode_times(graph, high, 400, until=done)
        torch.cuda.synchronize()
        beside_ms = start.elapsed_time(done)
        run = {"chunks": chunks, "prefill_alone_ms": alone, "prefill_beside_decodes_ms": beside_ms,
               "decodes_beside_prefill": _stats(beside)}
        run["prefill_ratio"] = run["prefill_beside_decodes_ms"] / alone
        run["decode_p99_ratio"] = run["decodes_beside_prefill"]["p99_ms"] / result["decode_alone"]["p99_ms"]
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        if args.out is not None:  # after every run, so that a run cut short keeps what it measured
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["decode_alone"]))


if __name__ == "__main__":
    main()
