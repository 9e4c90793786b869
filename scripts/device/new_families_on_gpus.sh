#!/usr/bin/env bash
# Run from the repository root on a 2-GPU device (carry .whl from scripts/device_wheels.sh and .gpu). Families
# built without a GPU, now on GPUs: (A, GPU 0) their CPU test files with the engines on the GPU (fp32 against
# transformers on the CPU; Triton compiled, not interpreted); (B, GPU 1, beside A) W1 and W3's requests on
# each family's real shape with random bf16 weights (CUDA graphs, the step breakdown); (C, both GPUs) their
# two-rank tests over NCCL. PART_LIMIT_S bounds A and C each (default 240 s), BENCH_LIMIT_S each bench.
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${PART_LIMIT_S:-240}
BENCH_LIMIT=${BENCH_LIMIT_S:-150}
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
SHARED=${SHARED:-.gpu/shared/bench}
TWO_RANKS="two_ranks or over_two_ranks or splits_over_two or tensor_parallel"
part() {  # part NAME DEVICES PYTEST-ARGS...
  local name=$1 devices=$2; shift 2
  CUDA_VISIBLE_DEVICES=$devices timeout -s INT $LIMIT python3 -m pytest -q -p no:cacheprovider -rfEs \
    --tb=short --durations=10 "$@" > $OUT/families_$name.log 2>&1
  echo "== $name (GPUs $devices): $(tail -1 $OUT/families_$name.log)"
}
bench() {  # bench CONFIG [ARGS...]
  local cfg=$1; shift
  CUDA_VISIBLE_DEVICES=1 timeout -s INT $BENCH_LIMIT python3 -m plait.entrypoints.cli bench throughput \
    --shared $SHARED --config benchmarks/configs/$cfg --workloads ${WORKLOADS:-W1,W3} \
    --out $OUT/throughput_$cfg.json "$@" > $OUT/throughput_$cfg.log 2>&1
  echo "== bench $cfg: rc $? $(grep -E "W1|W3" $OUT/throughput_$cfg.log | tail -2 | tr '\n' ' ')"
}
(
  part one_gpu 0 tests/test_idefics3.py tests/test_glm4_moe.py tests/test_cohere.py tests/test_moe_families.py \
    -k "not ($TWO_RANKS)"
  part gpu_engine_cohere 0 tests/test_gpu_engine.py -k "cohere"
) &
(
  bench olmoe-1b-7b
  bench granite-3.1-3b-a800m --no-roofline
  bench command-r7b --no-roofline
  bench glm-4.5-air-12-layers --no-roofline
) &
wait
part two_gpus 0,1 tests/test_glm4_moe.py tests/test_cohere.py tests/test_moe_families.py tests/test_tensor_parallel.py \
  -k "($TWO_RANKS) and (test_glm4_moe or test_cohere or test_moe_families or olmo3)"
grep -h "^FAILED\|^ERROR" $OUT/families_*.log | head -40
