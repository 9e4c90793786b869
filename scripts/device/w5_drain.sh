#!/usr/bin/env bash
# Run from the repository root on the device (carry .whl and .gpu). W5 at one rate under `mixed` with each
# prefill_drain_steps in W5_DRAINS (default 8 4), each server writing its step timeline: how far a faster
# drain of a prompt backlog moves mixed's TTFT towards prefill_first's, and what it costs the ITL.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -3
for drain in ${W5_DRAINS:-8 4}; do
  timeout -s INT ${W5_LIMIT_S:-150} python3 scripts/w5_sweep.py --out $OUT/w5_drain$drain --rates ${W5_RATES:-16} \
    --policies mixed --num-prompts ${W5_PROMPTS:-100} --step-timelines --disable-tqdm -- \
    --model shared/bench/models/llama-8b --load-format dummy --prefill-drain-steps $drain > $OUT/w5_drain$drain.log 2>&1
  echo "== drain $drain: exit $?"; tail -1 $OUT/w5_drain$drain/w5.md
  rm -f $OUT/w5_drain$drain/w5.png $OUT/w5_drain$drain/w5_mixed.json $OUT/w5_drain$drain/server_mixed.log
done
