"""fused_moe benchmark (GPU): a Qwen3-30B-A3B MoE layer's routed experts in bf16, Triton vs the torch ref.

    PYTHONPATH=. python benchmarks/kernels/fused_moe_bench.py --out benchmarks/results/fused_moe_h200.json
    PYTHONPATH=. python benchmarks/kernels/fused_moe_bench.py --sweep --out /tmp/fused_moe_sweep.json
    PYTHONPATH=. python benchmarks/kernels/fused_moe_bench.py --fp8 --no-ref --out /tmp/fused_moe_fp8.json
    PYTHONPATH=. python benchmarks/kernels/fused_moe_bench.py --mxfp4 gpt-oss-120b --out /tmp/mxfp4.json
    PYTHONPATH=. python benchmarks/kernels/fused_moe_bench.py --int4 --no-ref --out /tmp/fused_moe_int4.json

fused_moe is timed as the median of CUDA-graph replays (triton.testing.do_bench_cudagraph), each graph a run
of back-to-back calls as a captured step holds them; the calls cycle through several copies of the layer's
weights, together at least L2_COPIES_FACTOR x the L2 size, so a call's experts are not in L2 when it reads
them. fused_moe_ref syncs the host (it cannot be captured): it is timed plainly (triton.testing.do_bench).
Per T it reports ms, the expert weights the routing touches (distinct experts x 3 x H x I x 2 bytes) over
the time (GB/s: the figure that matters at decode sizes) and 6 x T x k x H x I FLOPs over the time
(TFLOP/s: the one that matters at prompt sizes), and the kernel's largest error against the reference in
fp32. --sweep also times SWEEP_CONFIGS per T and reports the best (block_k other than moe_config's gives up
batch invariance of the K loop: note it before adopting one).

--fp8 also times the block-wise FP8 experts (W8A8) at every T, beside bf16: the same random bf16 experts
(every copy) quantised by plait.layers.fp8_block.quantize_blocks with FP8_BLOCK tiles per expert, x in bf16
(quantised per token and K group inside fused_moe). Its touched bytes count the 1-byte codes and their fp32
tile scales; its error is against the FP8 reference (fused_moe_ref with the scales, fp32 arithmetic rounded
where the kernel rounds). The sweeps stay bf16-only (the FP8 kernels' K step is the tile's bk).

--int4 also times the experts as a GPTQ-Int4 checkpoint holds them (Qwen3-30B-A3B-GPTQ-Int4: 4-bit codes,
groups of INT4_GROUP, fp16 scales; W4A16, dequantised in the kernels' K loops) at every T, beside bf16: the
same random bf16 experts (every copy) quantised round-to-nearest per expert (plait.layers.wna16.quantize_rtn),
reported as --fp8's are (touched bytes: codes, scales and zeros; error against the integer reference).

--mxfp4 MODEL times a gpt-oss layer's experts (MODEL: a key of GPT_OSS; biases, the clamped SwiGLU) held in
MXFP4 (W4A16: packed E2M1 codes and E8M0 scales, decoded in the kernels' K loops) against the same experts in
bf16 (the MXFP4 values dequantised, which bf16 holds exactly), at every T: both timed as above, the touched
bytes each reads (MXFP4: codes and scales, 4.25 bits a weight), and the largest difference between the two
outputs (the same tiles multiply the same values: zero unless the two paths' tiles differ).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.kernels.fused_moe import MoeConfig, fused_moe, fused_moe_ref, moe_config
from plait.layers.fp8_block import quantize_blocks

QWEN3_30B_A3B = dict(experts=128, top_k=8, hidden=2048, inter=768)
GPT_OSS = {"gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880),
           "gpt-oss-120b": dict(experts=128, top_k=4, hidden=2880, inter=2880)}
T_VALUES = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096)
DTYPE = torch.bfloat16
DEVICE = "cuda"
L2_COPIES_FACTOR = 3  # weight copies read in turn cover this many L2 sizes
MAX_COPIES = 8  # one layer's experts are 1.2 GB: 8 copies (9.7 GB) cover any L2 many times
REP_MS = 20  # per graph replay; do_bench_cudagraph takes the median of its replays
REF_REP_MS = 200
FP8_BLOCK = (128, 128)  # Qwen3-30B-A3B-FP8's weight_block_size
INT4_GROUP = 128  # Qwen3-30B-A3B-GPTQ-Int4's group_size
# (block_m, block_n, block_k, group_m, num_warps, num_stages): tried per T beside moe_config's pick.
SWEEP_CONFIGS = [
    (16, 32, 64, 1, 4, 4), (16, 64, 64, 1, 4, 4), (16, 64, 128, 1, 4, 3), (16, 128, 64, 1, 4, 4),
    (32, 64, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 8, 4), (64, 128, 64, 16, 8, 3),
    (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3),
]


def routing(t: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of random logits, top k, renormalised (Qwen3-MoE's norm_topk_prob)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    probs = F.softmax(torch.randn(t, experts, generator=g, device=DEVICE), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def layer_copies(c: dict, l2_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    e, h, i = c["experts"], c["hidden"], c["inter"]
    size = 3 * e * h * i * torch.finfo(DTYPE).bits // 8
    count = max(2, min(MAX_COPIES, math.ceil(L2_COPIES_FACTOR * l2_bytes / size)))
    return [(torch.randn(e, 2 * i, h, device=DEVICE, dtype=DTYPE) * h**-0.5,
             torch.randn(e, h, i, device=DEVICE, dtype=DTYPE) * i**-0.5) for _ in range(count)]


def quantized_layer(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's experts quantised tile by tile per expert: fused_moe's FP8 weight arguments."""
    q13 = [quantize_blocks(w, FP8_BLOCK) for w in w13]
    q2 = [quantize_blocks(w, FP8_BLOCK) for w in w2]
    return {"w13": torch.stack([c for c, _ in q13]), "w2": torch.stack([c for c, _ in q2]),
            "w13_scale": torch.stack([sc for _, sc in q13]), "w2_scale": torch.stack([sc for _, sc in q2]),
            "block": FP8_BLOCK}


def int4_layer(w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """One layer's experts quantised round-to-nearest per expert as GPTQ-Int4 (symmetric, groups of
    INT4_GROUP, fp16 scales): fused_moe's integer weight arguments ([E, K / 8, N] codes, [E, G, N] scales
    and zeros)."""
    from plait.layers.wna16 import WNA16Spec, pack_rows, quantize_rtn

    spec = WNA16Spec("gptq", 4, INT4_GROUP)
    layer: dict = {"bits": spec.bits}
    for name, stack in (("w13", w13), ("w2", w2)):
        parts = [quantize_rtn(w, spec) for w in stack]
        layer[name] = torch.stack([pack_rows(codes, spec.bits) for codes, _, _ in parts])
        layer[f"{name}_scale"] = torch.stack([scales for _, scales, _ in parts])
        layer[f"{name}_zeros"] = torch.stack([zeros for _, _, zeros in parts]).to(spec.zero_dtype())
    return layer


def expert_bytes(layer: dict) -> int:
    """Bytes of one expert's weights (and FP8 tile scales, or integer scales and zeros) that a routed entry
    makes the kernels read."""
    return sum(t[0].numel() * t.element_size() for t in layer.values() if isinstance(t, torch.Tensor))


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call that runs each of ``calls`` in turn (each weight copy, so none is found in L2)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def graph_ms(layers, x, weights, ids, config: MoeConfig | None, gemv: bool | None = None) -> float:
    """layers: (w13, w2) pairs, or dicts of fused_moe's weight arguments (FP8: w13, w2, scales, block)."""
    from triton.testing import do_bench_cudagraph

    layers = [layer if isinstance(layer, dict) else {"w13": layer[0], "w2": layer[1]} for layer in layers]
    calls = [lambda kw=kw: fused_moe(x, topk_weights=weights, topk_ids=ids, config=config, gemv=gemv, **kw)
             for kw in layers]
    for fn in calls[:1]:  # compile outside the capture
        fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(rotating(calls), rep=REP_MS, return_mode="median")


def rates(ms: float, touched_bytes: int, flops: int) -> dict:
    return {"ms": ms, "weight_GBps": touched_bytes / (ms * 1e-3) / 1e9, "TFLOPs": flops / (ms * 1e-3) / 1e12}


GEMV_SWEEP = [(bn, bk, warps, stages) for bn in (8, 16, 32) for bk in (64, 128, 256) for warps in (2, 4)
              for stages in (2, 3, 4)]
GEMV_SWEEP_MAX_ENTRIES = 256


def sweep_gemv(layers, x, weights, ids, touched: int, flops: int) -> list[dict]:
    """The GEMV path's tiles (fused_moe's module constants, patched in turn), fastest first."""
    import plait.kernels.fused_moe as fm

    saved = (fm.GEMV_BLOCK_N, fm.GEMV_BLOCK_K, fm.GEMV_WARPS, fm.GEMV_STAGES)
    results = []
    try:
        for bn, bk, warps, stages in GEMV_SWEEP:
            fm.GEMV_BLOCK_N, fm.GEMV_BLOCK_K, fm.GEMV_WARPS, fm.GEMV_STAGES = bn, bk, warps, stages
            ms = graph_ms(layers, x, weights, ids, None, gemv=True)
            results.append({"block_n": bn, "block_k": bk, "warps": warps, "stages": stages,
                            **rates(ms, touched, flops)})
    finally:
        fm.GEMV_BLOCK_N, fm.GEMV_BLOCK_K, fm.GEMV_WARPS, fm.GEMV_STAGES = saved
    return sorted(results, key=lambda r: r["ms"])


def bench_fp8(fp8_layers: list[dict], x, weights, ids, distinct: int, flops: int,
              with_ref: bool) -> dict:
    """The FP8 (or integer) experts at one T: moe_config's pick, both paths, the error against their
    reference."""
    from triton.testing import do_bench

    touched = distinct * expert_bytes(fp8_layers[0])
    row = {"touched_bytes": touched, "fused_moe": rates(graph_ms(fp8_layers, x, weights, ids, None), touched,
                                                       flops)}
    row["paths"] = {name: rates(graph_ms(fp8_layers, x, weights, ids, None, gemv=flag), touched, flops)
                    for name, flag in (("gemv", True), ("grouped", False))}
    kw = fp8_layers[0]
    got = fused_moe(x, topk_weights=weights, topk_ids=ids, **kw)
    want = fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **kw).float()
    row["max_err_over_max_out"] = ((got.float() - want).abs().max() / want.abs().max()).item()
    del want
    if with_ref:
        ref_ms = do_bench(lambda: fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **kw), rep=REF_REP_MS,
                          return_mode="median")
        row["fused_moe_ref"] = rates(ref_ms, touched, flops)
    return row


def bench_t(c: dict, layers, t: int, sweep: bool, with_ref: bool, gemv_sweep: bool = False,
            fp8_layers: list[dict] | None = None, int4_layers: list[dict] | None = None) -> dict:
    from triton.testing import do_bench

    e, k, h, i = c["experts"], c["top_k"], c["hidden"], c["inter"]
    x = torch.randn(t, h, device=DEVICE, dtype=DTYPE)
    weights, ids = routing(t, e, k, seed=t)
    distinct = int(torch.unique(ids).numel())
    touched = distinct * 3 * h * i * torch.finfo(DTYPE).bits // 8
    flops = 6 * t * k * h * i
    picked = moe_config(t, k, e, h, i, DTYPE)
    row = {"T": t, "distinct_experts": distinct, "touched_bytes": touched, "flops": flops,
           "config": asdict(picked)}
    row["fused_moe"] = rates(graph_ms(layers, x, weights, ids, None), touched, flops)
    # Both paths at this T: the alignment-free GEMV and the grouped GEMM (moe_config's tiles).
    row["paths"] = {name: rates(graph_ms(layers, x, weights, ids, None, gemv=flag), touched, flops)
                    for name, flag in (("gemv", True), ("grouped", False))}
    if gemv_sweep and t * k <= GEMV_SWEEP_MAX_ENTRIES:
        row["gemv_sweep"] = sweep_gemv(layers, x, weights, ids, touched, flops)
    w13, w2 = layers[0]
    got = fused_moe(x, w13, w2, weights, ids)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    row["max_err_over_max_out"] = ((got.float() - want).abs().max() / want.abs().max()).item()
    del want
    if with_ref:
        ref_ms = do_bench(lambda: fused_moe_ref(x, w13, w2, weights, ids), rep=REF_REP_MS,
                          return_mode="median")
        row["fused_moe_ref"] = rates(ref_ms, touched, flops)
    if fp8_layers:
        row["fp8"] = bench_fp8(fp8_layers, x, weights, ids, distinct, flops, with_ref)
    if int4_layers:
        row["int4"] = bench_fp8(int4_layers, x, weights, ids, distinct, flops, with_ref)
    if sweep:
        results = [{"config": asdict(picked), "ms": row["fused_moe"]["ms"]}]
        for bm, bn, bk, gm, warps, stages in SWEEP_CONFIGS:
            cfg = MoeConfig(bm, bn, bk, group_m=gm, num_warps=warps, num_stages=stages)
            if cfg == picked:
                continue
            try:
                ms = graph_ms(layers, x, weights, ids, cfg)
            except Exception as exc:  # e.g. a config past the shared memory: recorded, skipped
                results.append({"config": asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            results.append({"config": asdict(cfg), "ms": ms})
        timed = [r for r in results if "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        row["sweep"] = results
        row["best"] = {**best, **rates(best["ms"], touched, flops),
                       "speedup_over_picked": row["fused_moe"]["ms"] / best["ms"]}
    return row


def mxfp4_layer_copies(c: dict, l2_bytes: int) -> list[tuple[dict, dict]]:
    """(bf16 kwargs, MXFP4 kwargs) of fused_moe per weight copy: random MXFP4 experts (uniform code bytes,
    scales putting each row's norm near 1), the bf16 twin their exact values; biases, the clamped SwiGLU."""
    from plait.kernels.fused_moe import dequantize_mxfp4_experts
    from plait.layers.moe import SWIGLU_OAI
    from plait.layers.mxfp4 import BLOCK_VALUES, E8M0_BIAS

    e, h, i = c["experts"], c["hidden"], c["inter"]
    count = max(2, min(MAX_COPIES, math.ceil(L2_COPIES_FACTOR * l2_bytes / (3 * e * h * i // 2))))
    copies = []
    for _ in range(count):
        common = {"w13_bias": torch.randn(e, 2 * i, device=DEVICE, dtype=DTYPE) * 0.1,
                  "w2_bias": torch.randn(e, h, device=DEVICE, dtype=DTYPE) * 0.1, "activation": SWIGLU_OAI}
        packed = {}
        for name, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
            # random codes' values have an rms of ~2.9: 2^-(log2(2.9 * sqrt(k))) brings a row's norm near 1
            exponent = E8M0_BIAS - round(math.log2(2.9 * math.sqrt(k)))
            packed[name] = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=DEVICE)
            packed[f"{name}_scale"] = torch.randint(exponent - 1, exponent + 1, (e, n, k // BLOCK_VALUES),
                                                    dtype=torch.uint8, device=DEVICE)
        twin = {name: dequantize_mxfp4_experts(packed[name], packed[f"{name}_scale"], DTYPE)
                for name in ("w13", "w2")}
        copies.append((twin | common, packed | common))
    return copies


def bench_mxfp4(c: dict, copies: list[tuple[dict, dict]], t: int) -> dict:
    e, k, h, i = c["experts"], c["top_k"], c["hidden"], c["inter"]
    x = torch.randn(t, h, device=DEVICE, dtype=DTYPE)
    weights, ids = routing(t, e, k, seed=t)
    distinct = int(torch.unique(ids).numel())
    flops = 6 * t * k * h * i
    row = {"T": t, "distinct_experts": distinct, "flops": flops}
    for label, which in (("bf16", 0), ("mxfp4", 1)):
        layers = [copy[which] for copy in copies]
        touched = distinct * sum(v[0].numel() * v.element_size() for name, v in layers[0].items()
                                 if name in ("w13", "w2", "w13_scale", "w2_scale"))
        ms = graph_ms(layers, x, weights, ids, None)
        row[label] = {"touched_bytes": touched, **rates(ms, touched, flops)}
        row[label]["paths"] = {name: graph_ms(layers, x, weights, ids, None, gemv=flag)
                               for name, flag in (("gemv", True), ("grouped", False))}
    twin, packed = copies[0]
    got = fused_moe(x, topk_weights=weights, topk_ids=ids, **packed).float()
    want = fused_moe(x, topk_weights=weights, topk_ids=ids, **twin).float()
    row["max_abs_diff_vs_bf16_twin"] = (got - want).abs().max().item()
    row["bf16_over_mxfp4"] = row["bf16"]["ms"] / row["mxfp4"]["ms"]
    return row


# MXFP4 tiles tried with --mxfp4 --sweep: the grouped GEMM's (block_m, block_n, block_k 64 as the 16-bit
# weights', group_m, warps, stages), and the GEMV's (block_n, MXFP4 block_k, warps, stages).
MXFP4_SWEEP_CONFIGS = [
    (16, 64, 64, 8, 4, 4), (16, 128, 64, 8, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 8, 4),
    (64, 128, 64, 8, 8, 3), (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3),
]
MXFP4_GEMV_SWEEP = [(bn, bk, warps, 2) for bn in (8, 16) for bk in (256, 512, 1024) for warps in (4, 8)]


def sweep_mxfp4(layers, x, weights, ids, t: int, top_k: int) -> dict:
    """The MXFP4 experts' grouped-GEMM tiles and (at GEMV sizes) GEMV tiles at one T, fastest first."""
    import plait.kernels.fused_moe as fm

    grouped = []
    for bm, bn, bk, gm, warps, stages in MXFP4_SWEEP_CONFIGS:
        cfg = MoeConfig(bm, bn, bk, group_m=gm, num_warps=warps, num_stages=stages)
        try:
            grouped.append({"config": asdict(cfg), "ms": graph_ms(layers, x, weights, ids, cfg)})
        except Exception as exc:  # e.g. past the shared memory: recorded, skipped
            grouped.append({"config": asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
    found = {"grouped": sorted(grouped, key=lambda r: r.get("ms", math.inf))}
    if t * top_k <= fm.GEMV_MAX_ENTRIES:
        saved = (fm.GEMV_BLOCK_N, fm.MXFP4_GEMV_BLOCK_K, fm.GEMV_WARPS, fm.GEMV_STAGES)
        gemv = []
        try:
            for bn, bk, warps, stages in MXFP4_GEMV_SWEEP:
                fm.GEMV_BLOCK_N, fm.MXFP4_GEMV_BLOCK_K, fm.GEMV_WARPS, fm.GEMV_STAGES = bn, bk, warps, stages
                try:
                    ms = graph_ms(layers, x, weights, ids, None, gemv=True)
                except Exception as exc:
                    gemv.append({"tiles": [bn, bk, warps, stages], "error": f"{type(exc).__name__}"[:100]})
                    continue
                gemv.append({"tiles": [bn, bk, warps, stages], "ms": ms})
        finally:
            fm.GEMV_BLOCK_N, fm.MXFP4_GEMV_BLOCK_K, fm.GEMV_WARPS, fm.GEMV_STAGES = saved
        found["gemv"] = sorted(gemv, key=lambda r: r.get("ms", math.inf))
    return found


def main_mxfp4(model: str, tokens: list[int], out: Path | None, sweep: bool = False) -> None:
    c = GPT_OSS[model]
    props = torch.cuda.get_device_properties(0)
    copies = mxfp4_layer_copies(c, props.L2_cache_size)
    result = {"device": props.name, "model": model, "dtype": str(DTYPE), "shape": c,
              "weight_copies": len(copies), "rows": []}
    t0 = time.perf_counter()
    for t in tokens:
        row = bench_mxfp4(c, copies, t)
        if sweep:
            x = torch.randn(t, c["hidden"], device=DEVICE, dtype=DTYPE)
            weights, ids = routing(t, c["experts"], c["top_k"], seed=t)
            row["mxfp4_sweep"] = sweep_mxfp4([copy[1] for copy in copies], x, weights, ids, t, c["top_k"])
            best = {path: found[0] for path, found in row["mxfp4_sweep"].items()}
            print(f"        sweep best: {json.dumps(best)}", flush=True)
        result["rows"].append(row)
        b, m = row["bf16"], row["mxfp4"]
        print(f"T={t:5d} experts {row['distinct_experts']:3d}  "
              f"bf16 {b['ms']:8.4f} ms {b['weight_GBps']:6.0f} GB/s"
              f"  mxfp4 {m['ms']:8.4f} ms {m['weight_GBps']:6.0f} GB/s {m['TFLOPs']:6.1f} TFLOP/s"
              f"  (gemv {m['paths']['gemv']:.4f} / grouped {m['paths']['grouped']:.4f})"
              f"  bf16/mxfp4 {row['bf16_over_mxfp4']:.2f}x  diff {row['max_abs_diff_vs_bf16_twin']:.1e}",
              flush=True)
    result["wall_s"] = time.perf_counter() - t0
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(T_VALUES), help="batch sizes T")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP_CONFIGS per T, report the best")
    parser.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help=f"time GEMV_SWEEP's tiles at T * k <= {GEMV_SWEEP_MAX_ENTRIES}")
    parser.add_argument("--fp8", action="store_true",
                        help=f"also time block-wise FP8 experts (the same experts quantised in {FP8_BLOCK} "
                             "tiles) at every T")
    parser.add_argument("--int4", action="store_true",
                        help="also time GPTQ-Int4 experts (the same experts, 4-bit codes in groups of "
                             f"{INT4_GROUP}) at every T")
    parser.add_argument("--mxfp4", choices=sorted(GPT_OSS),
                        help="time this gpt-oss layer's experts in MXFP4 against their bf16 twin instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_moe_bench needs a CUDA device")
    if args.mxfp4:
        main_mxfp4(args.mxfp4, args.tokens, args.out, args.sweep)
        return
    c = QWEN3_30B_A3B
    props = torch.cuda.get_device_properties(0)
    layers = layer_copies(c, props.L2_cache_size)
    # FP8 copies of the same experts: half the bytes of the bf16 ones, which already cover the L2 many times.
    fp8_layers = [quantized_layer(w13, w2) for w13, w2 in layers] if args.fp8 else None
    int4_layers = [int4_layer(w13, w2) for w13, w2 in layers] if args.int4 else None
    result = {"device": props.name, "model": "qwen3-30b-a3b", "dtype": str(DTYPE), "shape": c,
              "weight_copies": len(layers), "fp8_block": list(FP8_BLOCK) if args.fp8 else None,
              "int4_group": INT4_GROUP if args.int4 else None, "rows": []}
    t0 = time.perf_counter()
    for t in args.tokens:
        row = bench_t(c, layers, t, args.sweep, not args.no_ref, args.gemv_sweep, fp8_layers, int4_layers)
        result["rows"].append(row)
        line = (f"T={t:5d} experts {row['distinct_experts']:3d}  fused_moe {row['fused_moe']['ms']:8.4f} ms "
                f"{row['fused_moe']['weight_GBps']:7.0f} GB/s {row['fused_moe']['TFLOPs']:6.1f} TFLOP/s  "
                f"err {row['max_err_over_max_out']:.2e}")
        if "fused_moe_ref" in row:
            line += f"  ref {row['fused_moe_ref']['ms']:8.3f} ms"
        paths = row["paths"]
        line += f"  gemv {paths['gemv']['ms']:.4f} / grouped {paths['grouped']['ms']:.4f} ms"
        if "gemv_sweep" in row:
            top = row["gemv_sweep"][0]
            tiles = [top[k] for k in ("block_n", "block_k", "warps", "stages")]
            line += f"  gemv best {top['ms']:.4f} ms {tiles}"
        if "best" in row:
            line += f"  best {row['best']['ms']:8.4f} ms {row['best']['config']}"
        print(line, flush=True)
        for kind in ("fp8", "int4"):
            if kind in row:
                q = row[kind]
                print(f"        {kind:4s} fused_moe {q['fused_moe']['ms']:8.4f} ms "
                      f"{q['fused_moe']['weight_GBps']:7.0f} GB/s {q['fused_moe']['TFLOPs']:6.1f} TFLOP/s  "
                      f"err {q['max_err_over_max_out']:.2e}  "
                      f"gemv {q['paths']['gemv']['ms']:.4f} / grouped {q['paths']['grouped']['ms']:.4f} ms  "
                      f"bf16 / {kind} {row['fused_moe']['ms'] / q['fused_moe']['ms']:.2f}x", flush=True)
    result["wall_s"] = time.perf_counter() - t0
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
