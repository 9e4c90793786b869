#!/usr/bin/env bash
# Run from the repository root on the device (the device tool copies the tree; carry .whl from
# scripts/device_wheels.sh).
# The whole GPU suite (pytest -m gpu), in three parts that each fit one 600 s call on a fresh machine (cold
# Triton caches: on one H200 on 2026-12-01 the old two halves overran limits of 580 and 560 s; the files now
# in part C took 226 + 73 s). With two GPUs the old halves run beside one another (A with C's first files, B
# with its last), then the tensor-parallel file takes both; with one GPU the parts run in turn, one a call
# (tensor parallel skips). SUITE_LIMIT_S bounds each part (default 590 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
LIMIT=${SUITE_LIMIT_S:-590}
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
suite() {  # suite NAME DEVICES LIMIT FILES...
  local name=$1 devices=$2 LIMIT=$3; shift 3
  CUDA_VISIBLE_DEVICES=$devices timeout -s INT $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    --tb=short --durations=15 "$@" > $OUT/gpu_suite_$name.log 2>&1
  echo "== $name (GPUs $devices): $(tail -1 $OUT/gpu_suite_$name.log)"
}
# Two GPUs: A and C's first files on one GPU beside B and C's last files on the other, then the tensor-parallel
# file on both. SUITE_PARTS picks "halves", "tensor_parallel" or both (the default), so a 600 s call can run the
# halves and the next the rest.
PART_A="tests/test_gpu_engine.py tests/test_sleep.py tests/test_encoder_embeddings.py tests/test_gpt_oss.py
  tests/test_warmup.py"
PART_B="tests/test_lora.py tests/test_multimodal.py tests/test_qwen2_vl.py tests/test_qwen3_vl.py tests/test_idefics3.py tests/test_gemma3_images.py tests/test_mamba2.py tests/test_moe.py
  tests/test_wna16.py tests/test_fp8.py tests/test_fp8_kv.py tests/test_fp8_block.py tests/test_sampler.py tests/test_triton_attention.py
  tests/test_fused_moe.py tests/test_mxfp4_moe.py tests/test_wna16_kernels.py tests/test_kv_offload.py"
# Part C: A's old tail and B's (two GPUs keep each beside its old half, which fit 600 s there).
C_OF_A="tests/test_dense_kernels.py tests/test_mamba_kernels.py tests/test_triton_kernels.py tests/test_eagle.py
  tests/test_load_weights.py tests/test_deepseek.py"
C_OF_B="tests/test_weight_offload.py tests/test_nemotron_h_moe.py tests/test_mtp.py"
PART_C="$C_OF_A $C_OF_B"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  PARTS=${SUITE_PARTS:-halves tensor_parallel}
  if [[ " $PARTS " == *" halves "* ]]; then
    suite half_a 0 $LIMIT $PART_A $C_OF_A &
    suite half_b 1 $LIMIT $PART_B $C_OF_B &
    wait
  fi
  [[ " $PARTS " == *" tensor_parallel "* ]] && suite tensor_parallel 0,1 $LIMIT tests/test_gpu_tensor_parallel.py
else
  # One GPU: the parts in turn, one a call (SUITE_PARTS=part_a, then part_b, then part_c).
  PARTS=${SUITE_PARTS:-part_a part_b part_c}
  [[ " $PARTS " == *" part_a "* ]] && suite part_a 0 $LIMIT $PART_A
  [[ " $PARTS " == *" part_b "* ]] && suite part_b 0 $LIMIT $PART_B
  [[ " $PARTS " == *" part_c "* ]] && suite part_c 0 $LIMIT $PART_C
fi
grep -h "^FAILED\|^ERROR" $OUT/gpu_suite_*.log | head -40
