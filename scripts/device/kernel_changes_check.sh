#!/usr/bin/env bash
# Run from the repository root on a 2-GPU device (carry .whl and .gpu). After a change to the shared paged
# attention kernel: (GPU 0) its GPU tests against torch_ref and the models that use the new paths (MLA's
# latent rows, Gemma 3's key limits); (GPU 1, beside them) W1 and W3 with the GPU's limits, to compare with the
# last numbers on main. LIMIT_S bounds each side (default 250 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
LIMIT=${LIMIT_S:-250}
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
(
  CUDA_VISIBLE_DEVICES=0 timeout -s INT $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short \
    --durations=10 tests/test_triton_attention.py tests/test_deepseek.py tests/test_gemma3_images.py \
    > $OUT/kernel_gpu_tests.log 2>&1
  echo "== GPU tests: $(tail -1 $OUT/kernel_gpu_tests.log)"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout -s INT $LIMIT python3 -m plait.entrypoints.cli bench throughput \
    --shared .gpu/shared/bench --workloads W1,W3 --out $OUT/throughput.json 2>&1 | tail -5 > $OUT/throughput.log
  cat $OUT/throughput.log
) &
wait
grep -h "^FAILED\|^ERROR" $OUT/kernel_gpu_tests.log | head -20
