#!/usr/bin/env bash
# Run from the repository root on the device (the device tool copies the tree; carry .whl from
# scripts/device_wheels.sh, and .gpu where a script reads from it).
# One plait serve on an H200: Qwen3-0.6B shape (dummy weights) with SmolLM2's tokenizer (vocab 49,152), so that
# every streamed token is detokenized; 2,000 completions at once. The Detokenizer of this tree, then 33ad747's,
# then this tree's again under py-spy (raw stacks of every thread).
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai py-spy 2>&1 | grep -v "root. user" | tail -3
# The model folder: benchmarks/configs/qwen3-0.6b/config.json with vocab_size 49152, bos 1, eos 2, beside the
# tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) that load_tokenizer makes of the
# default model's GGUF (saved with save_pretrained).
M=.gpu/qwen3-0.6b-tok
run() {  # $1: label, $2: 1 to profile
  python3 -m plait.entrypoints.cli serve --model $M --load-format dummy --port 8100 --disable-log-stats \
    --log-level warning --disable-uvicorn-access-log > $OUT/serve_$1.log 2>&1 &
  PID=$!
  python3 scripts/device/wait_healthy.py http://127.0.0.1:8100
  PROF=""
  if [ "$2" = 1 ]; then
    (sleep 6; timeout 30 py-spy record -p $PID -o $OUT/prof_$1.txt -f raw -d 10 -r 250 --threads --nonblocking \
      > $OUT/pyspy_$1.log 2>&1) &
    PROF=$!
  fi
  echo "== $1"
  timeout -s ABRT 150 python3 -m plait.entrypoints.cli bench serve --base-url http://127.0.0.1:8100 \
    --endpoint-type completions --num-prompts 2000 --prompt-mix 1:256-512 --output-len 128 --vocab-size 49000 \
    --result-file /tmp/bench_$1.json --disable-tqdm 2>&1 | grep -iE "successful|failed|duration|output token thr|mean tpot|median itl"
  [ -n "$PROF" ] && wait $PROF
  kill -INT $PID; wait $PID
}
run new 0
cp plait/engine/detokenizer.py /tmp/new_detokenizer.py
cp .gpu/old_detokenizer.py plait/engine/detokenizer.py  # git show 33ad747:plait/engine/detokenizer.py
run old 0
cp /tmp/new_detokenizer.py plait/engine/detokenizer.py
run new_profiled 1
ls -la $OUT; tail -3 $OUT/pyspy_new_profiled.log
