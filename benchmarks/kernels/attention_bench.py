"""Triton paged-attention benchmark (GPU): decode KV-read bandwidth with split-KV on/off, prefill TFLOP/s
against SDPA on contiguous tensors, a big ``x.sum()`` as the read-bandwidth ceiling, and whole steps of a
32-layer Llama-8B replayed from a CUDA graph: mixed steps (decodes beside a 256-token chunk) and batch-1
decode, with split-KV off / heuristic / forced and precise P.V on / off.

    PYTHONPATH=. python benchmarks/kernels/attention_bench.py --out benchmarks/results/attention_h200.json
    PYTHONPATH=. python benchmarks/kernels/attention_bench.py --cases steps --out /tmp/steps.json
    PYTHONPATH=. python benchmarks/kernels/attention_bench.py --cases chunks --out /tmp/chunks.json

``--cases chunks`` sets W4's prompt chunks (Llama-8B) beside each of torch's SDPA backends (flash, cuDNN,
memory-efficient) on the same sizes laid out contiguously: how far the paged kernel is from the fastest
attention this GPU's torch has, before counting what gathering paged K/V into that layout would cost.

Times are triton.testing.do_bench medians (L2 flushed between runs) after a warm-up call that compiles.
Decode GB/s counts the K and V bytes the rows actually need (rows x context x Hkv x D x 2 x bytes).
Step times are CUDA-graph replays of every layer's launches (each layer its own KV cache, so nothing
stays in L2 from one layer to the next), as the runner replays a step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from plait.kernels.paged_attention import (
    PagedAttentionPlan,
    paged_attention,
    plan_paged_attention,
    precise_pv_mode,
    set_precise_pv,
)

# (name, Hq, Hkv, D)
MODELS = [("qwen3-0.6b", 16, 8, 128), ("llama-8b", 32, 8, 128)]
DECODE_ROWS = [1, 8, 64, 256]
DECODE_CONTEXTS = [512, 1024, 4096, 32768]
# (name, [(context_len, query_len) per row])
PREFILLS = [("4x512 fresh", [(0, 512)] * 4), ("1x2048 after 2048 cached", [(2048, 2048)])]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
SUM_BYTES = 4 << 30
WARMUP_MS, REP_MS = 25, 100
# Whole steps: Llama-8B's attention shapes and layer count, each step's launches replayed from a graph.
STEP_MODEL = ("llama-8b", 32, 8, 128)
NUM_LAYERS = 32
# (name, decode rows, prompt rows), rows as (context_len, query_len): W4's mixed step and its chunk alone.
MIXED_STEPS = [
    ("4 dec@2200 + 256 after 2048", [(2200, 1)] * 4, [(2048, 256)]),
    ("4 dec@2200 + 256 after 3840", [(2200, 1)] * 4, [(3840, 256)]),
    ("256 after 2048 alone", [], [(2048, 256)]),
    ("256 after 3840 alone", [], [(3840, 256)]),
]
DECODE_B1_CONTEXTS = [512, 4096]
# W4's prompt chunks as (context_len, query_len): its 256-token chunks early and late, a 384-token one, and
# the whole 4,096-token prompt in one step (prefill_first).
CHUNK_CASES = [(2048, 256), (3840, 256), (2048, 384), (0, 4096)]
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
# Split settings: None is the heuristic, 1 is off, the rest are forced counts.
STEP_SPLITS = [1, None, 2, 4, 8]
# A CUDA graph's bounds for the "graph" variant: max_seq_len = max_model_len, and the prompt part padded
# to this many rows (max_num_seqs + 1 less the decode bucket), all but the real one empty.
GRAPH_MAX_MODEL_LEN = 8192
GRAPH_PROMPT_ROWS = 253
STEP_REPLAYS = 20


def median_ms(fn) -> float:
    fn()  # compile / first touch outside the timing
    torch.cuda.synchronize()
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


class PagedSetup:
    """One shared KV pool (big enough for the largest case) and per-case metadata over shuffled blocks."""

    def __init__(self, num_kv_heads: int, head_dim: int, rows: list[tuple[int, int]],
                 device: torch.device) -> None:
        self.num_blocks = 1 + sum(triton.cdiv(c + n, BLOCK_SIZE) for c, n in rows)
        shape = (self.num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
        self.v_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
        self.device = device

    def metadata(self, rows: list[tuple[int, int]], seed: int):
        """(query_start_loc, seq_lens, block_tables) for rows of (context_len, query_len)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        perm = torch.randperm(self.num_blocks - 1, generator=g, device=self.device) + 1
        blocks = [triton.cdiv(c + n, BLOCK_SIZE) for c, n in rows]
        width = max(blocks)
        tables = torch.zeros(len(rows), width, dtype=torch.int32, device=self.device)
        start = 0
        for i, nb in enumerate(blocks):
            tables[i, :nb] = perm[start: start + nb].int()
            start += nb
        qsl = torch.tensor([0] + [n for _, n in rows], device=self.device).cumsum(0).int()
        seq_lens = torch.tensor([c + n for c, n in rows], dtype=torch.int32, device=self.device)
        return qsl, seq_lens, tables


def run_paged(
    setup: PagedSetup, q: torch.Tensor, rows: list[tuple[int, int]], plan: PagedAttentionPlan, scale: float
) -> tuple[float, torch.Tensor]:
    qsl, seq_lens, tables = setup.metadata(rows, seed=len(rows))
    out = torch.empty_like(q)
    max_q, max_s = max(n for _, n in rows), max(c + n for c, n in rows)
    fn = lambda: paged_attention(q, setup.k_cache, setup.v_cache, out, qsl, seq_lens, tables, scale,
                                 max_q, max_s, plan=plan)
    return median_ms(fn), out


def bench_decode(device: torch.device) -> list[dict]:
    results = []
    largest = [(max(DECODE_CONTEXTS), 1)] * max(DECODE_ROWS)
    for name, hq, hkv, d in MODELS:
        setup = PagedSetup(hkv, d, largest, device)
        for rows in DECODE_ROWS:
            for context in DECODE_CONTEXTS:
                spec = [(context, 1)] * rows
                q = torch.randn(rows, hq, d, dtype=DTYPE, device=device)
                kv_bytes = rows * (context + 1) * hkv * d * 2 * DTYPE.itemsize
                for split in ("auto", "off"):
                    plan = plan_paged_attention(rows, rows, hq, hkv, d, DTYPE, 1, context + 1, device,
                                                None if split == "auto" else 1)
                    ms, _ = run_paged(setup, q, spec, plan, d**-0.5)
                    results.append(dict(model=name, rows=rows, context=context, split=split, ms=ms,
                                        num_splits=plan.config.num_splits, kv_gbps=kv_bytes / ms / 1e6))
        del setup
        torch.cuda.empty_cache()
    return results


def causal_pairs(rows: list[tuple[int, int]]) -> int:
    """(query, key) pairs a causal mask lets through: query i of a row sees context + i + 1 keys."""
    return sum(n * c + n * (n + 1) // 2 for c, n in rows)


def sdpa_peer(rows, hq: int, hkv: int, d: int, device: torch.device):
    """SDPA on the same sizes laid out contiguously ([B, H, S, D], K/V heads expanded for GQA), with a
    bottom-right causal mask where queries follow cached context."""
    from torch.nn.attention.bias import causal_lower_right

    (context, n), count = rows[0], len(rows)
    assert all(r == rows[0] for r in rows), "the peer batches equal rows"
    q = torch.randn(count, hq, n, d, dtype=DTYPE, device=device)
    k = torch.randn(count, hq, context + n, d, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    if context == 0:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = causal_lower_right(n, context + n)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bench_prefill(device: torch.device) -> list[dict]:
    results = []
    for name, hq, hkv, d in MODELS:
        for case, rows in PREFILLS:
            setup = PagedSetup(hkv, d, rows, device)
            tokens = sum(n for _, n in rows)
            q = torch.randn(tokens, hq, d, dtype=DTYPE, device=device)
            plan = plan_paged_attention(tokens, len(rows), hq, hkv, d, DTYPE, max(n for _, n in rows),
                                        max(c + n for c, n in rows), device)
            ms, _ = run_paged(setup, q, rows, plan, d**-0.5)
            flops = 4 * hq * d * causal_pairs(rows)
            peer_ms = median_ms(sdpa_peer(rows, hq, hkv, d, device))
            results.append(dict(model=name, case=case, ms=ms, tflops=flops / ms / 1e9,
                                sdpa_ms=peer_ms, sdpa_tflops=flops / peer_ms / 1e9))
    return results


def bench_chunks(device: torch.device) -> list[dict]:
    """Llama-8B prompt chunks: the paged kernel (heuristic plan) against each SDPA backend, TFLOP/s."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, hq, hkv, d = STEP_MODEL
    results = []
    for context, n in CHUNK_CASES:
        rows = [(context, n)]
        setup = PagedSetup(hkv, d, rows, device)
        q = torch.randn(n, hq, d, dtype=DTYPE, device=device)
        plan = plan_paged_attention(n, 1, hq, hkv, d, DTYPE, n, context + n, device)
        ms, _ = run_paged(setup, q, rows, plan, d**-0.5)
        flops = 4 * hq * d * causal_pairs(rows)
        entry = dict(case=f"{n} after {context}", triton_ms=ms, triton_tflops=flops / ms / 1e9,
                     num_splits=plan.config.num_splits, sdpa={})
        peer = sdpa_peer(rows, hq, hkv, d, device)
        for name in SDPA_BACKENDS:
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    peer_ms = median_ms(peer)
                entry["sdpa"][name] = dict(ms=peer_ms, tflops=flops / peer_ms / 1e9)
            except RuntimeError as exc:  # a backend that does not take this mask / shape on this build
                entry["sdpa"][name] = dict(error=str(exc).splitlines()[0][:200])
        results.append(entry)
        del setup
        torch.cuda.empty_cache()
    return results


class StepPart:
    """One launch of a step (decode rows, or prompt rows) in every layer, each layer over its own cache."""

    def __init__(self, rows: list[tuple[int, int]], hq: int, hkv: int, d: int, device: torch.device,
                 pad_rows: int = 0, max_seq_len: int | None = None) -> None:
        self.setups = [PagedSetup(hkv, d, rows, device) for _ in range(NUM_LAYERS)]
        padded = rows + [(0, 0)] * pad_rows
        self.qsl, self.seq_lens, self.tables = self.setups[0].metadata(padded, seed=len(rows))
        self.num_tokens = sum(n for _, n in rows)
        self.q = torch.randn(self.num_tokens, hq, d, dtype=DTYPE, device=device)
        self.out = torch.empty_like(self.q)
        self.max_query_len = max(n for _, n in rows)
        self.max_seq_len = max_seq_len or max(c + n for c, n in rows)
        self.num_rows, self.hq, self.hkv, self.d = len(padded), hq, hkv, d

    def plan(self, splits: int | None) -> PagedAttentionPlan:
        return plan_paged_attention(self.num_tokens, self.num_rows, self.hq, self.hkv, self.d, DTYPE,
                                    self.max_query_len, self.max_seq_len, self.q.device, splits)

    def launch(self, layer: int, plan: PagedAttentionPlan) -> None:
        setup = self.setups[layer]
        paged_attention(self.q, setup.k_cache, setup.v_cache, self.out, self.qsl, self.seq_lens, self.tables,
                        self.d**-0.5, self.max_query_len, self.max_seq_len, plan=plan)


def step_ms(parts: list[StepPart], plans: list[PagedAttentionPlan]) -> float:
    """Median ms of one step (every layer's launches) replayed from a CUDA graph."""
    def step() -> None:
        for layer in range(NUM_LAYERS):
            for part, plan in zip(parts, plans):
                part.launch(layer, plan)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()  # first replay uploads the graph
    times = []
    for _ in range(STEP_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def _split_name(splits: int | None) -> str:
    return "auto" if splits is None else "off" if splits == 1 else str(splits)


def bench_steps(device: torch.device) -> list[dict]:
    """Mixed steps and batch-1 decode steps of a 32-layer Llama-8B, precise P.V on / off. Split-KV off /
    heuristic / forced applies to the prompt launch of a mixed step (its decode launch keeps the
    heuristic, as before prompt launches could split) and to the launch of a decode step; every step also
    runs the heuristic under a graph's bounds (max_seq_len = max_model_len, padded prompt rows)."""
    name, hq, hkv, d = STEP_MODEL
    precise_before = precise_pv_mode()
    cases = [(case, decodes, prompts) for case, decodes, prompts in MIXED_STEPS]
    cases += [(f"batch-1 decode @{c}", [(c, 1)], []) for c in DECODE_B1_CONTEXTS]
    results = []
    for case, decodes, prompts in cases:
        for graph_bounds in (False, True):
            bound = GRAPH_MAX_MODEL_LEN if graph_bounds else None
            parts = [StepPart(decodes, hq, hkv, d, device, max_seq_len=bound)] if decodes else []
            if prompts:
                pad_rows = GRAPH_PROMPT_ROWS - len(prompts) if graph_bounds else 0
                parts.append(StepPart(prompts, hq, hkv, d, device, pad_rows=pad_rows, max_seq_len=bound))
            for splits in [None] if graph_bounds else STEP_SPLITS:
                # The last part's split count varies; decodes beside a prompt keep the heuristic.
                plans = [part.plan(None) for part in parts[:-1]] + [parts[-1].plan(splits)]
                for precise in (True, False):
                    set_precise_pv("all" if precise else "off")
                    ms = step_ms(parts, plans)
                    results.append(dict(model=name, case=case, split=_split_name(splits),
                                        graph_bounds=graph_bounds, precise_pv=precise, ms=ms,
                                        us_per_layer=ms * 1e3 / NUM_LAYERS,
                                        num_splits=[p.config.num_splits for p in plans]))
            del parts, plans
            torch.cuda.empty_cache()
    set_precise_pv(precise_before)
    return results


def bench_read_bandwidth(device: torch.device) -> dict:
    x = torch.ones(SUM_BYTES // 2, dtype=DTYPE, device=device)
    ms = median_ms(lambda: x.sum())
    return dict(bytes=SUM_BYTES, ms=ms, gbps=SUM_BYTES / ms / 1e6)


def print_step_table(steps: list[dict]) -> None:
    print(f"\nsteps: ms per step of {NUM_LAYERS} layers from a CUDA graph, precise P.V on / off "
          "[splits per launch: decodes, prompt]; the split setting is the prompt launch's where there is one")
    for case in dict.fromkeys(r["case"] for r in steps):
        print(f"  {case}")
        rows = [r for r in steps if r["case"] == case]
        for key in dict.fromkeys((r["split"], r["graph_bounds"]) for r in rows):
            on, off = (next(r for r in rows if (r["split"], r["graph_bounds"], r["precise_pv"]) == (*key, p))
                       for p in (True, False))
            label = f"split {key[0]}" + (" (graph bounds)" if key[1] else "")
            print(f"    {label:28} {on['ms']:7.3f} / {off['ms']:7.3f}   {on['num_splits']}")


def print_chunk_table(chunks: list[dict]) -> None:
    print("\nLlama-8B prompt chunks: TFLOP/s (causal FLOPs), triton paged vs SDPA backends, contiguous K/V")
    for r in chunks:
        peers = "   ".join(f"{name.split('_')[0].lower()} "
                            + (f"{p['tflops']:6.1f}" if "tflops" in p else " n/a")
                           for name, p in r["sdpa"].items())
        print(f"  {r['case']:18} triton {r['triton_tflops']:6.1f} ({r['triton_ms']:.3f} ms)   {peers}")


def print_tables(result: dict) -> None:
    if "read_bandwidth" not in result:
        if "steps" in result:
            print_step_table(result["steps"])
        if "chunks" in result:
            print_chunk_table(result["chunks"])
        return
    print(f"\n{result['device']}  (x.sum read: {result['read_bandwidth']['gbps']:.0f} GB/s)")
    print("\ndecode: KV read GB/s (split auto [num splits] / split off)")
    ctx_header = "".join(f"{c:>22}" for c in DECODE_CONTEXTS)
    print(f"{'model':12}{'rows':>6}{ctx_header}")
    by_key = {(r["model"], r["rows"], r["context"], r["split"]): r for r in result["decode"]}
    for name, *_ in MODELS:
        for rows in DECODE_ROWS:
            cells = []
            for c in DECODE_CONTEXTS:
                on, off = by_key[(name, rows, c, "auto")], by_key[(name, rows, c, "off")]
                cells.append(f"{on['kv_gbps']:6.0f} [{on['num_splits']:2d}] / {off['kv_gbps']:6.0f}")
            print(f"{name:12}{rows:>6}" + "".join(f"{cell:>22}" for cell in cells))
    print("\nprefill: TFLOP/s (causal FLOPs), triton paged vs SDPA contiguous")
    for r in result["prefill"]:
        print(f"{r['model']:12} {r['case']:26} triton {r['tflops']:6.1f} ({r['ms']:.3f} ms)   "
              f"sdpa {r['sdpa_tflops']:6.1f} ({r['sdpa_ms']:.3f} ms)")
    if "steps" in result:
        print_step_table(result["steps"])
    if "chunks" in result:
        print_chunk_table(result["chunks"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--cases", choices=("all", "kernels", "steps", "chunks"), default="all",
                        help="kernels: decode / prefill / read bandwidth; steps: whole graph-replayed steps; "
                             "chunks: W4's prompt chunks against every SDPA backend")
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.time()
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                  triton=triton.__version__, dtype=str(DTYPE), block_size=BLOCK_SIZE)
    if args.cases in ("all", "kernels"):
        result["read_bandwidth"] = bench_read_bandwidth(device)
        result["decode"] = bench_decode(device)
        result["prefill"] = bench_prefill(device)
    if args.cases in ("all", "steps"):
        result["steps"] = bench_steps(device)
    if args.cases in ("all", "chunks"):
        result["chunks"] = bench_chunks(device)
    result["wall_s"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(f"\nwall {result['wall_s']:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
