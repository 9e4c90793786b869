#!/usr/bin/env bash
# Run from the repository root on a 1-GPU device (carry .whl from scripts/device_wheels.sh and .gpu). What the
# last sessions built without a GPU, at real shapes on one: (deepseek) W1 and W3's requests on
# DeepSeek-V2-Lite's and Moonlight's shapes with random bf16 weights (MLA's 512 + 64 latent rows, CUDA
# graphs); (granite4) Granite 4.0 h-tiny's throughput. Their tests run in scripts/device/gpu_suite.sh (the
# CPU test files compare bf16 engines with fp32 transformers when run on a GPU: their engines default to
# bf16 there, so only their gpu-marked tests, which ask for fp32, mean anything on a device); (new_tests) the
# gpu-marked tests of what was merged since the last whole suite (NemotronH's relu^2 experts, MTP); (trace)
# DeepSeek-V2-Lite's W3 decode step kernel by kernel (benchmarks/trace_decode.py); (nemotron3) Nemotron 3
# Nano 30B-A3B's throughput at its real size (31.6B parameters, 63 GB in bf16). PARTS picks them (default
# deepseek granite4); BENCH_LIMIT_S bounds each bench (150 s).
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
if has new_tests; then
  timeout -s INT 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short --durations=10 \
    tests/test_fused_moe.py tests/test_nemotron_h_moe.py tests/test_mtp.py -k "relu2 or nemotron or mtp or gpu_engine" \
    > $OUT/new_gpu_tests.log 2>&1
  echo "== new gpu tests: $(tail -1 $OUT/new_gpu_tests.log)"
fi
if has trace; then
  timeout -s INT $BENCH_LIMIT python3 benchmarks/trace_decode.py --config benchmarks/configs/deepseek-v2-lite \
    --rows 1 --steps 10 --out $OUT/trace_w3_deepseek_v2_lite.json > $OUT/trace_w3_deepseek_v2_lite.log 2>&1
  echo "== trace deepseek-v2-lite W3: rc $?"; head -30 $OUT/trace_w3_deepseek_v2_lite.log
fi
if has nemotron3; then
  timeout -s INT ${NEMOTRON_LIMIT_S:-240} python3 benchmarks/hybrid_throughput.py \
    --config benchmarks/configs/nemotron-3-nano-30b-a3b --workloads $SHARED \
    --out $OUT/nemotron3_nano_throughput_h200.json > $OUT/nemotron3_nano_throughput.log 2>&1
  echo "== nemotron-3-nano throughput: rc $? $(tail -3 $OUT/nemotron3_nano_throughput.log | tr '\n' ' ')"
fi
