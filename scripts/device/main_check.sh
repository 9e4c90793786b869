#!/usr/bin/env bash
# Re-check main on one GPU in device calls of under 600 s: named GPU test files (CHECK_FILES, with a time
# limit CHECK_LIMIT_S), then what BENCH names: "draft" (scripts/device/draft_model.sh's benchmark), "ab"
# (benchmarks/draft_chain_ab.py), "throughput" (W1-W3). Run from the repository root on the device with .gpu and .whl carried.
export PYTHONPATH=. PYTHONUNBUFFERED=1
ln -sfn .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
if [ -n "$CHECK_FILES" ]; then
  timeout -s INT ${CHECK_LIMIT_S:-400} python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short \
    --durations=10 $CHECK_FILES > $OUT/gpu_check.log 2>&1
  echo "== tests: $(tail -1 $OUT/gpu_check.log)"
  grep -h "^FAILED\|^ERROR" $OUT/gpu_check.log | head -20
fi
if [[ " $BENCH " == *" draft "* ]]; then
  timeout 200 python3 benchmarks/speculative_ngram.py --model shared/bench/models/llama-8b \
    --draft-model benchmarks/configs/llama-1b --load-format dummy --num-speculative-tokens 0,3 --batch 1 \
    --max-tokens 128 --out $OUT/speculative_draft.json > $OUT/draft_bench.log 2>&1
  tr '\r' '\n' < $OUT/draft_bench.log | grep -v "it/s\]\|tok/s\]\|?it\|?tok" | tail -4
  python3 -c "
import json; d=json.load(open('$OUT/speculative_draft.json'))
for n, w in d['workloads'].items():
    for k, r in w.items():
        print(n, k, {x: r.get(x) for x in ('ms_per_step', 'gpu_forward_ms_per_step', 'draft_forwards_per_step',
              'draft_graph_forwards_per_step', 'draft_gpu_forward_ms_per_step', 'cuda_graph_steps', 'steps')},
              r['host_ms_per_step'])"
fi
if [[ " $BENCH " == *" ab "* ]]; then
  timeout 200 python3 benchmarks/draft_chain_ab.py --model shared/bench/models/llama-8b \
    --draft-model benchmarks/configs/llama-1b --load-format dummy --out $OUT/draft_chain_ab.json \
    > $OUT/draft_chain_ab.log 2>&1
  tr '\r' '\n' < $OUT/draft_chain_ab.log | grep -v "it/s\]\|?it" | tail -4
fi
if [[ " $BENCH " == *" throughput "* ]]; then
  timeout 240 python3 -m plait.entrypoints.cli bench throughput --shared shared/bench \
    --out $OUT/throughput.json > $OUT/throughput.log 2>&1
  grep -E "^W[123] |rror" $OUT/throughput.log | head -12
fi
