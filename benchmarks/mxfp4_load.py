"""Load a gpt-oss-shaped MXFP4 checkpoint as the Hub ships gpt-oss (experts as FP4 blocks + E8M0 scales, the
rest bf16), random values, and time it: writing the checkpoint, building and loading the engine (the experts
dequantised to bf16 on the GPU as they stream in), and a short greedy generation.

    PYTHONPATH=. python3 benchmarks/mxfp4_load.py --config benchmarks/configs/gpt-oss-20b
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.mxfp4 import BLOCK_VALUES, E8M0_BIAS
from plait.sampling_params import SamplingParams

# Scales around 2^-6: random FP4 codes (|value| <= 6) then give weights of ~0.02-0.1, as a trained model's.
SCALE_EXPONENT = -6
STD = 0.02


def layer_tensors(cfg: dict, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under the Hub checkpoint's names and shapes."""
    h, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    kv = cfg["num_key_value_heads"]
    e, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    p = f"model.layers.{layer}."

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * STD).to(torch.bfloat16).cpu()

    def mxfp4(name: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, rows, cols // BLOCK_VALUES, BLOCK_VALUES // 2), generator=gen,
                               device="cuda", dtype=torch.uint8)
        scales = torch.full((e, rows, cols // BLOCK_VALUES), E8M0_BIAS + SCALE_EXPONENT, dtype=torch.uint8)
        return {f"{p}mlp.experts.{name}_blocks": blocks.cpu(), f"{p}mlp.experts.{name}_scales": scales}

    tensors = {
        f"{p}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}self_attn.q_proj.weight": normal(heads * d, h), f"{p}self_attn.q_proj.bias": normal(heads * d),
        f"{p}self_attn.k_proj.weight": normal(kv * d, h), f"{p}self_attn.k_proj.bias": normal(kv * d),
        f"{p}self_attn.v_proj.weight": normal(kv * d, h), f"{p}self_attn.v_proj.bias": normal(kv * d),
        f"{p}self_attn.o_proj.weight": normal(h, heads * d), f"{p}self_attn.o_proj.bias": normal(h),
        f"{p}self_attn.sinks": normal(heads),
        f"{p}mlp.router.weight": normal(e, h), f"{p}mlp.router.bias": normal(e),
        f"{p}mlp.experts.gate_up_proj_bias": normal(e, 2 * inter),
        f"{p}mlp.experts.down_proj_bias": normal(e, h),
    }
    tensors |= mxfp4("gate_up_proj", 2 * inter, h)
    tensors |= mxfp4("down_proj", h, inter)
    return tensors


def write_checkpoint(cfg: dict, folder: Path) -> float:
    """The checkpoint in one safetensors file per layer (and one for the embeddings), with its index; GB."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0

    def save(name: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        save_file(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    vocab, h = cfg["vocab_size"], cfg["hidden_size"]
    save("model-embed.safetensors", {
        "model.embed_tokens.weight": (torch.randn(vocab, h, device="cuda") * STD).to(torch.bfloat16).cpu(),
        "lm_head.weight": (torch.randn(vocab, h, device="cuda") * STD).to(torch.bfloat16).cpu(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for layer in tqdm(range(cfg["num_hidden_layers"]), desc="writing layers"):
        save(f"model-layer{layer:03d}.safetensors", layer_tensors(cfg, layer, gen))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="benchmarks/configs/gpt-oss-20b")
    parser.add_argument("--out", default="mxfp4_load.json")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    cfg = json.loads((Path(args.config) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        start = time.perf_counter()
        size_gb = write_checkpoint(cfg, folder)
        (folder / "config.json").write_text(json.dumps(cfg))
        write_s = time.perf_counter() - start
        torch.cuda.empty_cache()
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=4096, max_num_seqs=64))
        load_s = time.perf_counter() - start
        weights_gb = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()) / 1e9
        prompts = [[(7 * i + j) % cfg["vocab_size"] for j in range(128)] for i in range(8)]
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
        generate_s = time.perf_counter() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "device": torch.cuda.get_device_name(), "config": args.config, "checkpoint_gb": round(size_gb, 2),
        "write_s": round(write_s, 1), "engine_start_s": round(load_s, 1),
        "bf16_weights_gb": round(weights_gb, 2), "generated_tokens": tokens,
        "generate_s": round(generate_s, 2),
        "what": "a random gpt-oss-shaped MXFP4 checkpoint (Hub names and layout) loaded through plait: "
                "experts dequantised to bf16 on the GPU at load; engine_start_s includes the KV cache and "
                "graph capture",
    }
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
