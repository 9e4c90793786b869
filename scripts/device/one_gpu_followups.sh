#!/usr/bin/env bash
# Run from the repository root on a 1-GPU device (carry .whl from scripts/device_wheels.sh and .gpu). What the
# last sessions built without a GPU, at real shapes on one: (deepseek) W1 and W3's requests on
# DeepSeek-V2-Lite's and Moonlight's shapes with random bf16 weights (MLA's 512 + 64 latent rows, CUDA
# graphs); (granite4) Granite 4.0 h-tiny's throughput. Their tests run in scripts/device/gpu_suite.sh (the
# CPU test files compare bf16 engines with fp32 transformers when run on a GPU: their engines default to
# bf16 there, so only their gpu-marked tests, which ask for fp32, mean anything on a device). PARTS picks them
# (default both); BENCH_LIMIT_S bounds each bench (150 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
BENCH_LIMIT=${BENCH_LIMIT_S:-150}
PARTS=${PARTS:-deepseek granite4}
SHARED=${SHARED:-.gpu/shared/bench}
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
has() { [[ " $PARTS " == *" $1 "* ]]; }
bench() {  # bench CONFIG [ARGS...]
  local cfg=$1; shift
  timeout -s INT $BENCH_LIMIT python3 -m plait.entrypoints.cli bench throughput \
    --shared $SHARED --config benchmarks/configs/$cfg --workloads ${WORKLOADS:-W1,W3} \
    --out $OUT/throughput_$cfg.json "$@" > $OUT/throughput_$cfg.log 2>&1
  echo "== bench $cfg: rc $? $(grep -E "^W1|^W3" $OUT/throughput_$cfg.log | tr '\n' ' ')"
}
if has deepseek; then
  bench deepseek-v2-lite
  bench moonlight-16b-a3b --no-roofline
fi
if has granite4; then
  timeout -s INT $BENCH_LIMIT python3 benchmarks/hybrid_throughput.py \
    --config benchmarks/configs/granite-4.0-h-tiny --workloads $SHARED \
    --out $OUT/granite4_h_tiny_throughput_h200.json > $OUT/granite4_h_tiny_throughput.log 2>&1
  echo "== granite-4.0-h-tiny throughput: rc $? $(tail -3 $OUT/granite4_h_tiny_throughput.log | tr '\n' ' ')"
fi
