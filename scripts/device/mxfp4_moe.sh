#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/). MXFP4 experts on one GPU.
# PART=tests: the GPU tests (the kernels against their bf16 twins and the reference at gpt-oss-20b's and -120b's
# shapes, CUDA-graph replay, the MXFP4 checkpoint against its dequantised twin), the kernels timed against the
# bf16 twin, and gpt-oss-20b (MXFP4 experts, dummy weights) through W1's and W3's requests.
# PART=models: the MXFP4 kernels' tiles swept at gpt-oss-20b's shape, gpt-oss-20b with bf16 experts through
# W3's requests and gpt-oss-120b (MXFP4 experts) through W1's and W3's.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
bench() {  # name config workloads limit
  timeout -s INT $4 python3 -m plait.entrypoints.cli bench throughput --shared shared/bench --config \
    benchmarks/configs/$2 --workloads $3 --out $OUT/$1.json > $OUT/$1.log 2>&1
  echo "== $1 ($2, $3) rc=$?"; grep -E "^W[13] |floor|rror|memory|GiB" $OUT/$1.log | head -12
}
if [ "${PART:-tests}" = tests ]; then
  timeout -s INT 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short --durations=8 \
    tests/test_mxfp4_moe.py tests/test_gpt_oss.py > $OUT/gpu_tests.log 2>&1
  echo "== tests: $(tail -1 $OUT/gpu_tests.log)"; grep -h "^FAILED\|^ERROR" $OUT/gpu_tests.log | head -20
  for model in gpt-oss-20b gpt-oss-120b; do
    timeout -s INT 100 python3 benchmarks/kernels/fused_moe_bench.py --mxfp4 $model \
      --tokens 1 4 16 64 256 1024 4096 --out $OUT/mxfp4_moe_$model.json > $OUT/mxfp4_moe_$model.log 2>&1
    echo "== kernels $model rc=$?"; cat $OUT/mxfp4_moe_$model.log | tail -9
  done
  bench gpt_oss_20b_mxfp4 gpt-oss-20b W1,W3 190
else
  timeout -s INT 170 python3 benchmarks/kernels/fused_moe_bench.py --mxfp4 gpt-oss-20b --sweep \
    --tokens 1 16 256 1024 4096 --out $OUT/mxfp4_moe_sweep_gpt-oss-20b.json > $OUT/mxfp4_moe_sweep.log 2>&1
  echo "== sweep rc=$?"; grep -E "^T=|sweep best" $OUT/mxfp4_moe_sweep.log | cut -c1-400
  bench gpt_oss_20b_bf16 gpt-oss-20b-bf16 W3 100
  bench gpt_oss_120b_mxfp4 gpt-oss-120b W1,W3 300
fi
