#!/usr/bin/env bash
# Run from the repository root on a 1-GPU device (carry .whl and .gpu). DeepSeek's decode path after the
# one-launch routers and MLA's split knobs: (1) the router kernels compiled on CUDA against the torch
# routers (tests/test_fused_moe.py's route tests run on the GPU when there is one), (2) the gpu-marked tests
# of the MoE / DeepSeek / MTP files, (3) W3 on DeepSeek-V2-Lite's and Moonlight's shapes, (4) the W3 step
# kernel by kernel.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
SHARED=${SHARED:-.gpu/shared/bench}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/test_fused_moe.py -k route \
  > $OUT/route_kernels_on_gpu.log 2>&1
echo "== router kernels on the GPU: $(tail -1 $OUT/route_kernels_on_gpu.log)"
timeout -s INT 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short --durations=10 \
  tests/test_deepseek.py tests/test_moe.py tests/test_nemotron_h_moe.py tests/test_mtp.py tests/test_fused_moe.py \
  > $OUT/gpu_moe_tests.log 2>&1
echo "== gpu tests: $(tail -1 $OUT/gpu_moe_tests.log)"; grep -h "^FAILED\|^ERROR" $OUT/*.log | head -20
for cfg in deepseek-v2-lite moonlight-16b-a3b; do
  timeout -s INT 100 python3 -m plait.entrypoints.cli bench throughput --shared $SHARED \
    --config benchmarks/configs/$cfg --workloads W3 --out $OUT/w3_$cfg.json > $OUT/w3_$cfg.log 2>&1
  echo "== W3 $cfg: rc $? $(grep -E "^W3" $OUT/w3_$cfg.log | tr '\n' ' ')"
done
timeout -s INT 90 python3 benchmarks/trace_decode.py --config benchmarks/configs/deepseek-v2-lite --rows 1 \
  --steps 10 --out $OUT/trace_w3_deepseek_v2_lite.json > $OUT/trace_w3_deepseek_v2_lite.log 2>&1
grep -v "Warn\|warn" $OUT/trace_w3_deepseek_v2_lite.log | head -14
