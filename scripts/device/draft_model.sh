#!/usr/bin/env bash
# Draft-model speculative decoding on one GPU: the fp32 GPU-path test (its draft-model variant among the
# others), then what drafting costs Llama-8B at batch 1 with a Llama-3.2-1B-shaped draft (random weights:
# nothing is kept, so each step's extra time is the draft model's). Run from the repository root on the device
# with .gpu carried (scripts link .gpu/shared as shared).
export PYTHONPATH=. PYTHONUNBUFFERED=1
ln -sfn .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
PARTS=${PARTS:-test bench}  # "test", "bench" or both
[[ " $PARTS " == *" test "* ]] && timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short \
  "tests/test_gpu_engine.py::test_every_gpu_path_computes_the_reference_function_in_fp32" \
  > $OUT/draft_model_gpu_test.log 2>&1
[[ " $PARTS " == *" test "* ]] && tail -3 $OUT/draft_model_gpu_test.log
[[ " $PARTS " == *" bench "* ]] && timeout 280 python3 benchmarks/speculative_ngram.py --model shared/bench/models/llama-8b \
  --draft-model benchmarks/configs/llama-1b --load-format dummy --num-speculative-tokens 0,3 --batch 1 \
  --max-tokens 128 --out $OUT/speculative_draft_llama8b_llama1b_dummy_h200.json > $OUT/draft_model_bench.log 2>&1
tr '\r' '\n' < $OUT/draft_model_bench.log | grep -v "it/s\]\|tok/s\]\|?it\|?tok" | tail -6
