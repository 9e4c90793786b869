#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/). What a fresh machine's first
# requests wait for: benchmarks/first_requests.py on Llama-8B's shape (random weights), each run in its own
# process on an empty Triton cache, without then with the start-up warm-up. FR_LIMIT_S bounds each run
# (default 280 s); FR_GPU_TESTS=1 then runs the warm-up's GPU test.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
LIMIT=${FR_LIMIT_S:-280}
nvidia-smi --query-gpu=name --format=csv,noheader
for mode in no_warm_up warm_up; do
  flag=""; [ $mode = no_warm_up ] && flag=--no-warm-up
  timeout -s INT $LIMIT python3 benchmarks/first_requests.py --config shared/bench/models/llama-8b $flag \
    --out $OUT/first_requests_$mode.json > $OUT/first_requests_$mode.log 2>&1
  echo "== $mode: exit $?"; grep -v "^\[" $OUT/first_requests_$mode.log | tail -16
done
if [ "${FR_GPU_TESTS:-0}" = 1 ]; then
  timeout -s INT ${FR_TEST_LIMIT_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_warmup.py \
    > $OUT/test_warmup_gpu.log 2>&1
  echo "== GPU test: $(tail -1 $OUT/test_warmup_gpu.log)"
fi
