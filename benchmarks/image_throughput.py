"""What images cost a LLaVA model: the same batch of requests run twice on one engine, once with an image in
every prompt and once with random text tokens in place of each image's placeholders (the same prompt
lengths, so the decoder does the same work), and the vision tower alone on batches of images, against the
GPU's bf16 matmul limit measured in the same run.

Random weights of a LLaVA-1.5-7B config (CLIP ViT-L/14 at 336 px, 576 placeholders an image, a Llama-7B
decoder); prompts are token ids (the config ships no tokenizer) with one image token after a BOS, and every
request decodes ``--output-len`` tokens.

    PYTHONPATH=. python benchmarks/image_throughput.py --config benchmarks/configs/llava-1.5-7b \\
        --out benchmarks/results/image_throughput_llava_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from tqdm import tqdm

from plait import LLM, SamplingParams
from plait.bench.shared import device_name, find_shared
from plait.bench.throughput import measure_roofline


def _images(num: int, size: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(num)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_generate(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    runner = llm.engine.runner
    _sync(runner.device)
    runner.breakdown.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    _sync(runner.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tok_s": tokens / seconds, "requests_per_s": len(prompts) / seconds,
            "step_breakdown": runner.breakdown.as_dict()}


def _tower_flops(model: torch.nn.Module) -> float:
    """Matmul FLOPs of one image through the layers built and the projector: 2 per weight per patch token,
    and attention's QK^T and PV over all patches."""
    tower = model.vision_tower
    tokens = tower.num_patches + 1
    weights = sum(p.numel() for name, p in tower.encoder.named_parameters() if name.endswith("weight")
                  and p.dim() == 2)
    hidden = tower.pre_layrnorm.normalized_shape[0]
    attention = 4 * tokens * tokens * hidden * len(tower.encoder.layers)
    projector = sum(p.numel() for name, p in model.multi_modal_projector.named_parameters() if p.dim() == 2)
    return 2 * weights * tokens + attention + 2 * projector * (tokens - 1)


def _tower_rate(llm: LLM, batch: int, repeats: int) -> dict:
    runner = llm.engine.runner
    model, device = runner.model, runner.device
    processed = runner.image_processor.preprocess(_images(batch, 336, 1))
    pixels = torch.cat([p.tensor for p in processed]).to(device)  # [tiles, C, H, W]
    with torch.inference_mode():
        model.embed_images(pixels)  # warm-up
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            model.embed_images(pixels)
        _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    return {"batch": batch, "ms": seconds * 1e3, "images_per_s": batch / seconds,
            "tflops": _tower_flops(model) * batch / seconds / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/llava-1.5-7b")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--text-len", type=int, default=64, help="prompt tokens besides the image's placeholders")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--shared", default=None, help="the shared bench folder (its roofline.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    llm = LLM(args.config, load_format="dummy", seed=0)
    runner = llm.engine.runner
    model = runner.model
    image_token, n = model.image_token_id, model.num_image_tokens
    rng = np.random.default_rng(0)
    vocab = runner.model_config.vocab_size
    texts = [rng.integers(3, image_token, args.text_len).tolist() for _ in range(args.num_requests)]
    images = _images(args.num_requests, 336, 0)
    with_images = [{"prompt_token_ids": [1, image_token] + t, "multi_modal_data": {"image": im}}
                   for t, im in zip(texts, images)]
    as_text = [[1] + rng.integers(3, min(vocab, image_token), n).tolist() + t for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(with_images[:8], params, use_tqdm=False)  # warm-up: the image steps' eager shapes
    llm.generate(as_text[:8], params, use_tqdm=False)
    images_run = _timed_generate(llm, with_images, params)
    text_run = _timed_generate(llm, as_text, params)
    towers = [_tower_rate(llm, batch, 10) for batch in tqdm((1, 8, 32), desc="vision tower", unit="batch")]
    roofline = (measure_roofline(find_shared(args.shared, "roofline.py")) if runner.device.type == "cuda"
                else None)
    peak = roofline["bf16_TFLOPs"] if roofline else None
    result = {
        "what": __doc__.splitlines()[0],
        "command": "PYTHONPATH=. python benchmarks/image_throughput.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "device": device_name(),
        "config": args.config,
        "num_requests": args.num_requests, "prompt_len": 1 + n + args.text_len, "output_len": args.output_len,
        "with_images": images_run,
        "text_in_their_place": text_run,
        "images_over_text_throughput": images_run["output_tok_s"] / text_run["output_tok_s"],
        "vision_tower": [dict(t, share_of_matmul_peak=t["tflops"] / peak if peak else None) for t in towers],
        "roofline": roofline,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
