#!/usr/bin/env bash
# Run from the repository root on a 2-GPU device (carry .whl from scripts/device_wheels.sh and .gpu). Families
# built without a GPU, now on GPUs: (tests, GPU 0) their CPU test files with the engines on the GPU (fp32
# against transformers on the CPU; Triton compiled, not interpreted); (bench, GPU 1, beside them) W1 and W3's
# requests on each family's real shape with random bf16 weights (CUDA graphs, the step breakdown); (granite4,
# GPU 1) Granite 4.0's tests and its h-tiny shape's throughput; (two_gpus, both) their two-rank tests over
# NCCL, one file at a time. PARTS picks them (default all); PART_LIMIT_S bounds each part (240 s),
# BENCH_LIMIT_S each bench (150 s), RANKS_LIMIT_S each two-rank file (90 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
LIMIT=${PART_LIMIT_S:-240}
BENCH_LIMIT=${BENCH_LIMIT_S:-150}
PARTS=${PARTS:-tests bench granite4 two_gpus}
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
SHARED=${SHARED:-.gpu/shared/bench}
TWO_RANKS="two_ranks or over_two_ranks or splits_over_two or tensor_parallel"
has() { [[ " $PARTS " == *" $1 "* ]]; }
part() {  # part NAME DEVICES LIMIT PYTEST-ARGS...
  local name=$1 devices=$2 limit=$3; shift 3
  CUDA_VISIBLE_DEVICES=$devices timeout -s INT $limit python3 -m pytest -q -p no:cacheprovider -rfEs \
    --tb=short --durations=10 "$@" > $OUT/families_$name.log 2>&1
  echo "== $name (GPUs $devices): $(tail -1 $OUT/families_$name.log)"
}
bench() {  # bench CONFIG [ARGS...]
  local cfg=$1; shift
  CUDA_VISIBLE_DEVICES=1 timeout -s INT $BENCH_LIMIT python3 -m plait.entrypoints.cli bench throughput \
    --shared $SHARED --config benchmarks/configs/$cfg --workloads ${WORKLOADS:-W1,W3} \
    --out $OUT/throughput_$cfg.json "$@" 2>&1 | tail -4 > $OUT/throughput_$cfg.log
  echo "== bench $cfg: $(grep -E "^W1|^W3" $OUT/throughput_$cfg.log | tr '\n' ' ')"
}
if has tests; then (
  part one_gpu 0 $LIMIT tests/test_idefics3.py tests/test_glm4_moe.py tests/test_cohere.py \
    tests/test_moe_families.py -k "not ($TWO_RANKS)"
  part gpu_engine_cohere 0 $LIMIT tests/test_gpu_engine.py -k "cohere"
) & fi
if has bench; then (
  bench olmoe-1b-7b
  bench granite-3.1-3b-a800m --no-roofline
  bench command-r7b --no-roofline
  bench glm-4.5-air-12-layers --no-roofline
) & fi
if has granite4; then (
  part granite4 1 $LIMIT tests/test_granite4.py
  CUDA_VISIBLE_DEVICES=1 timeout -s INT $BENCH_LIMIT python3 benchmarks/hybrid_throughput.py \
    --config benchmarks/configs/granite-4.0-h-tiny --workloads $SHARED \
    --out $OUT/granite4_h_tiny_throughput_h200.json \
    > $OUT/granite4_h_tiny_throughput.log 2>&1
  echo "== granite-4.0-h-tiny throughput: rc $? $(tail -2 $OUT/granite4_h_tiny_throughput.log | tr '\n' ' ')"
) & fi
wait
if has two_gpus; then
  for f in test_glm4_moe test_cohere test_moe_families test_tensor_parallel; do
    part two_gpus_$f 0,1 ${RANKS_LIMIT_S:-90} tests/$f.py -k "($TWO_RANKS) and ($f and not tensor_parallel or olmo3)"
  done
fi
grep -h "^FAILED\|^ERROR" $OUT/families_*.log | head -40
