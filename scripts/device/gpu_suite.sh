#!/usr/bin/env bash
# Run from the repository root on the device (the device tool copies the tree; carry .whl from
# scripts/device_wheels.sh, and .gpu where a script reads from it).
# The whole GPU suite (pytest -m gpu) on one H200 (the tensor-parallel tests skip there), engine-level files first, kernels after.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
git rev-parse --short HEAD 2>/dev/null
timeout -s INT 390 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=line --durations=20 \
  tests/test_gpu_engine.py tests/test_gpu_tensor_parallel.py tests/test_sleep.py tests/test_multimodal.py \
  tests/test_lora.py tests/test_encoder_embeddings.py tests/test_mamba2.py tests/test_moe.py tests/test_wna16.py \
  tests/test_fp8.py tests/test_fp8_kv.py tests/test_fp8_block.py tests/test_sampler.py tests/test_triton_kernels.py \
  tests/test_triton_attention.py tests/test_mamba_kernels.py tests/test_fused_moe.py tests/test_dense_kernels.py \
  tests/test_wna16_kernels.py 2>&1 | tee $OUT/gpu_suite.log | tail -60
