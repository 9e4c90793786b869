#!/usr/bin/env bash
# Run from the repository root on the device (the device tool copies the tree; carry .whl from
# scripts/device_wheels.sh, and .gpu for the model folder).
# plait serve with the engine's loop in a process of its own (the default) against --no-engine-process (a
# thread of the server's process), interleaved, on the serve_prof.sh workload: Qwen3-0.6B shape (dummy
# weights) with SmolLM2's tokenizer, 2,000 streamed completions at once, 256-512 prompt tokens, 128 out.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
M=.gpu/qwen3-0.6b-tok
ROUNDS=${EP_ROUNDS:-2}
run() {  # $1: label, $2: the engine placement flag
  local start=$(date +%s)
  python3 -m plait.entrypoints.cli serve --model $M --load-format dummy --port 8100 --disable-log-stats \
    --log-level warning --disable-uvicorn-access-log $2 > $OUT/serve_$1.log 2>&1 &
  PID=$!
  python3 scripts/device/wait_healthy.py http://127.0.0.1:8100
  echo "== $1 ($2), up after $(( $(date +%s) - start )) s"
  timeout -s ABRT 150 python3 -m plait.entrypoints.cli bench serve --base-url http://127.0.0.1:8100 \
    --endpoint-type completions --num-prompts 2000 --prompt-mix 1:256-512 --output-len 128 --vocab-size 49000 \
    --result-file $OUT/bench_$1.json --disable-tqdm 2>&1 | grep -iE "successful|failed|duration|output token thr|mean tpot|median itl|p99 itl|mean ttft"
  kill -INT $PID; wait $PID
  echo "   server exit code $?"
}
swap() {  # swap plait/entrypoints' files with those in folder $1 (twice: back)
  for f in $(ls $1); do
    cp plait/entrypoints/$f /tmp/$f.swap; cp $1/$f plait/entrypoints/$f; cp /tmp/$f.swap $1/$f
  done
}
# EP_RUNS: the runs of each round. process / thread: this tree with --engine-process / --no-engine-process;
# process_<name>: the engine process with plait/entrypoints' files from .gpu/<name> (nomerge: before streams
# merged a lagging reader's outputs; nogc: server.py before serve froze its heap and raised its GC threshold).
for r in $(seq 1 $ROUNDS); do
  for run in ${EP_RUNS:-process thread process_nomerge}; do
    case $run in
      process) run process_$r --engine-process ;;
      thread) run thread_$r --no-engine-process ;;
      process_*) swap .gpu/${run#process_}; run ${run}_$r --engine-process; swap .gpu/${run#process_} ;;
    esac
  done
done
ls $OUT
