#!/usr/bin/env bash
# Run from the repository root on a 2-GPU device (carry .whl from scripts/device_wheels.sh). The CPU tests of
# features first built without a GPU, run where CUDA is present: their engines then take the GPU (Triton
# kernels compiled, not interpreted; NCCL across the two GPUs for tensor parallelism), in fp32 against
# transformers on the CPU. PART_LIMIT_S bounds each part (default 280 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${PART_LIMIT_S:-280}
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
part() {  # part NAME DEVICES PYTEST-ARGS...
  local name=$1 devices=$2; shift 2
  CUDA_VISIBLE_DEVICES=$devices timeout -s INT $LIMIT python3 -m pytest -q -p no:cacheprovider -rfEs \
    -v --tb=short --durations=10 "$@" > $OUT/cpu_features_$name.log 2>&1
  echo "== $name (GPUs $devices): $(tail -1 $OUT/cpu_features_$name.log)"
}
# One GPU: image models quantised and with LoRA, the EAGLE head's K/V offloaded, the engine freed without
# the cycle collector (the Worker's weak reference to its runner).
part one_gpu 0 tests/test_qwen2_vl.py tests/test_multimodal.py tests/test_kv_offload.py \
  "tests/test_eagle.py::test_the_heads_kv_comes_back_from_host_memory_with_the_targets" \
  tests/test_gpu_engine.py -k "${ONE_GPU_K:-freed or host_memory or on_a_gpu or lora or quantis or fp8 or \
  (test_qwen2_vl and greedy and 7) or preempted or gpu_qwen25 or gpu_image}"
# Two GPUs: image models split across them (fp32, NCCL) and a GPTQ MoE (bf16, against one GPU).
part two_gpus 0,1 tests/test_qwen2_vl.py tests/test_multimodal.py tests/test_gpu_tensor_parallel.py \
  -k "${TWO_GPUS_K:-two_ranks or gptq_moe}"
grep -h "^FAILED\|^ERROR" $OUT/cpu_features_*.log | head -40
