#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/ and the qwen3-0.6b-tok model
# folder, and .whl from scripts/device_wheels.sh). `plait run-batch` end to end, start-up included, with the
# engine on a thread of its process (run-batch's default) against a process of its own (--engine-process,
# serve's default), interleaved: RB_REQUESTS of W1's mix (Qwen3-0.6B shape, dummy weights, SmolLM2's
# tokenizer, 100-1,024 prompt tokens, 512 out unless RB_OUTPUT_LEN), RB_ROUNDS rounds.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx 2>&1 | grep -v "root. user" | tail -3
nvidia-smi --query-gpu=name --format=csv,noheader
M=.gpu/qwen3-0.6b-tok
python3 - "${RB_REQUESTS:-2048}" /tmp/batch.jsonl $RB_OUTPUT_LEN <<'PY'
import importlib.util, sys
sys.path.insert(0, "benchmarks")
from run_batch_throughput import batch_file
spec = importlib.util.spec_from_file_location("workloads", "shared/bench/workloads.py")
w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
_, _, lo, hi, out_len = w.OFFLINE["W1"]
out_len = int(sys.argv[3]) if len(sys.argv) > 3 else out_len
prompts = w.random_prompts(int(sys.argv[1]), lo, hi, 49152, seed=1)
open(sys.argv[2], "w").write("\n".join(batch_file(prompts, out_len)) + "\n")
PY
for r in $(seq 1 ${RB_ROUNDS:-2}); do
  for flag in --no-engine-process --engine-process; do
    start=$(date +%s.%N)
    timeout -s INT ${RB_LIMIT_S:-200} python3 -m plait.entrypoints.cli run-batch -i /tmp/batch.jsonl \
      -o /tmp/answers.jsonl --model $M --load-format dummy --disable-log-stats $flag > $OUT/rb${flag}_$r.log 2>&1
    rc=$?
    end=$(date +%s.%N)
    python3 - "$flag" "$r" "$rc" "$start" "$end" $OUT/rb${flag}_$r.log <<'PY' | tee -a $OUT/run_batch_process.jsonl
import json, re, sys
flag, r, rc, start, end, log = sys.argv[1:]
# The progress bar's last elapsed time: the batch from its first line read, start-up excluded.
elapsed = re.findall(r"(\d+):(\d\d)<", open(log).read())
batch_s = 60 * int(elapsed[-1][0]) + int(elapsed[-1][1]) if elapsed else None
answers = [json.loads(line) for line in open("/tmp/answers.jsonl")]
tokens = sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers if not a["error"])
wall = float(end) - float(start)
print(json.dumps({"placement": flag.lstrip("-"), "round": int(r), "rc": int(rc), "lines": len(answers),
                  "errors": sum(1 for a in answers if a["error"]), "output_tokens": tokens,
                  "wall_s": round(wall, 2), "output_tok_s_with_startup": round(tokens / wall, 1),
                  "batch_s": batch_s, "output_tok_s": round(tokens / batch_s, 1) if batch_s else None}))
PY
    rm -f /tmp/answers.jsonl
  done
done
