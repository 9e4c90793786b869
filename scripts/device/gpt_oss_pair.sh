#!/usr/bin/env bash
# Run from the repository root on a 2-GPU device (carry .gpu, which holds shared/). The tensor-parallel GPU tests
# (GPT-OSS among the MoE families: two GPUs against one), the MXFP4 GPU tests, then gpt-oss-20b and -120b with
# MXFP4 experts (dummy weights, one GPU) through W1's and W3's requests with moe_config's MXFP4 tiles.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short -s --durations=8 \
  tests/test_gpu_tensor_parallel.py -k "moe" > $OUT/gpu_tp_tests.log 2>&1
echo "== tp tests: $(tail -1 $OUT/gpu_tp_tests.log)"; grep -h "^FAILED\|^ERROR\|tensor parallel 2 vs 1" $OUT/gpu_tp_tests.log | head -20
timeout -s INT 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short --durations=5 \
  tests/test_mxfp4_moe.py tests/test_gpt_oss.py > $OUT/gpu_mxfp4_tests.log 2>&1
echo "== mxfp4 tests: $(tail -1 $OUT/gpu_mxfp4_tests.log)"; grep -h "^FAILED\|^ERROR" $OUT/gpu_mxfp4_tests.log | head
bench() {  # name config workloads limit
  timeout -s INT $4 python3 -m plait.entrypoints.cli bench throughput --shared shared/bench --config \
    benchmarks/configs/$2 --workloads $3 --out $OUT/$1.json > $OUT/$1.log 2>&1
  echo "== $1 ($2, $3) rc=$?"; grep -E "^W[13] |rror" $OUT/$1.log | head -6
}
bench gpt_oss_20b_mxfp4_tuned gpt-oss-20b W1,W3 100
bench gpt_oss_120b_mxfp4_tuned gpt-oss-120b W1 110
