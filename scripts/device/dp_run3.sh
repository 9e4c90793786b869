#!/usr/bin/env bash
# Run from the repository root on the device (the device tool copies the tree; carry .whl from
# scripts/device_wheels.sh, and .gpu where a script reads from it).
# nvidia-h200-x2: Qwen3-0.6B shape (dummy weights) served with --data-parallel-size 2, then 1; 2,000 requests
# at once from one bench client, then (same server) from two clients of 1,000 each at once.
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
M=benchmarks/configs/qwen3-0.6b
T0=$(date +%s)
bench() {  # $1: prompts, $2: result file
  timeout -s ABRT 120 python3 -m plait.entrypoints.cli bench serve --base-url http://127.0.0.1:8100 \
    --endpoint-type completions --num-prompts $1 --prompt-mix 1:256-512 --output-len 128 --vocab-size 150000 \
    --seed $3 --result-file $2 --disable-tqdm 2>&1 | grep -iE "successful|failed|duration|output token throughput" 
}
for dp in 2 1; do
  python3 -m plait.entrypoints.cli serve --model $M --load-format dummy --port 8100 --data-parallel-size $dp \
    --disable-log-stats --log-level warning --disable-uvicorn-access-log > $OUT/serve_dp$dp.log 2>&1 &
  PID=$!
  python3 scripts/device/wait_healthy.py http://127.0.0.1:8100
  echo "dp=$dp up at $(( $(date +%s) - T0 ))s"
  echo "-- one client, 2000"; bench 2000 $OUT/dp${dp}_one_client.json 0
  echo "-- two clients, 1000 each"
  bench 1000 $OUT/dp${dp}_client_a.json 1 > $OUT/dp${dp}_client_a.txt & A=$!
  bench 1000 $OUT/dp${dp}_client_b.json 2 > $OUT/dp${dp}_client_b.txt & B=$!
  wait $A $B; cat $OUT/dp${dp}_client_a.txt $OUT/dp${dp}_client_b.txt
  kill -INT $PID; wait $PID; echo "dp=$dp stopped rc=$? at $(( $(date +%s) - T0 ))s"
done
grep -c "retrying elsewhere" $OUT/serve_dp2.log; grep "retrying elsewhere" $OUT/serve_dp2.log | head -3
