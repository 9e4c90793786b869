#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/). GPT-OSS's GPU tests (the model
# against torch_ref in fp32 beside the other new families; sinks in the attention kernel; the experts' biases and
# clamped SwiGLU in the fused MoE), then a gpt-oss-20b shape (dummy weights, bf16) through W1's and W3's
# requests, then W1-W3 themselves (a check that the kernels' new switches cost the old paths nothing).
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT ${TEST_LIMIT_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short --durations=10 \
  "tests/test_gpu_engine.py::test_dense_families_on_the_gpu_path_compute_the_reference_function_in_fp32" \
  tests/test_triton_attention.py::test_gpu_sinks_match_torch_ref tests/test_fused_moe.py -k "gpt_oss or sinks or dense" \
  > $OUT/gpu_tests.log 2>&1
echo "== tests: $(tail -1 $OUT/gpu_tests.log)"; grep -h "^FAILED\|^ERROR" $OUT/gpu_tests.log | head -20
timeout -s INT ${GPT_OSS_LIMIT_S:-180} python3 -m plait.entrypoints.cli bench throughput --shared shared/bench \
  --config benchmarks/configs/gpt-oss-20b-bf16 --workloads W1,W3 --out $OUT/gpt_oss_20b.json > $OUT/gpt_oss_20b.log 2>&1
echo "== gpt-oss-20b"; grep -E "^W[13] |floor|rror" $OUT/gpt_oss_20b.log | head -12
timeout -s INT ${W123_LIMIT_S:-190} python3 -m plait.entrypoints.cli bench throughput --shared shared/bench \
  --out $OUT/throughput.json > $OUT/throughput.log 2>&1
echo "== W1-W3"; grep -E "^W[123] |rror" $OUT/throughput.log | head -12
