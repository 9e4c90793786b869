#!/usr/bin/env bash
# Run from the repository root on the device (carry .whl from scripts/device_wheels.sh).
# W5 on Llama-8B's shape (random weights), one policy per GPU where there are two (the same host, so the
# load generators share its CPUs), each server writing its step timeline. W5_RATES / W5_PROMPTS / W5_LIMIT_S
# choose the sweep (defaults: 1,2,4,8,16 req/s, 100 requests each, 560 s); W5_SERVE_ARGS adds engine knobs.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared  # the bench folder travels in .gpu (carry it)
RATES=${W5_RATES:-1,2,4,8,16}
PROMPTS=${W5_PROMPTS:-100}
LIMIT=${W5_LIMIT_S:-560}
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
git rev-parse --short HEAD 2>/dev/null
run() {  # run POLICY GPU
  CUDA_VISIBLE_DEVICES=$2 timeout -s INT $LIMIT python3 scripts/w5_sweep.py --out $OUT/w5_$1 --rates $RATES \
    --policies $1 --num-prompts $PROMPTS --step-timelines --disable-tqdm -- \
    --model shared/bench/models/llama-8b --load-format dummy $W5_SERVE_ARGS > $OUT/w5_$1.log 2>&1
  echo "== $1: exit $?"; tail -12 $OUT/w5_$1/w5.md 2>/dev/null
}
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run mixed 0 & run prefill_first 1 & wait
else
  run mixed 0; run prefill_first 0
fi
rm -f $OUT/w5_*/*_rate*.json.tmp
