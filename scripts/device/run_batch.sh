#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/ and the qwen3-0.6b-tok model
# folder of serve_prof.sh, and .whl from scripts/device_wheels.sh). `plait run-batch`'s path against the
# offline engine loop on the same prompts: benchmarks/run_batch_throughput.py, Qwen3-0.6B's shape with
# SmolLM2's tokenizer (every token detokenized), dummy weights; W1's 256 requests, then RB_MANY of W1's mix.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx 2>&1 | grep -v "root. user" | tail -3
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT ${RB_LIMIT_S:-500} python3 benchmarks/run_batch_throughput.py --model .gpu/qwen3-0.6b-tok \
  --many ${RB_MANY:-2048} --out $OUT/run_batch_h200.json 2>&1 | grep -v "^\[" | tail -12
