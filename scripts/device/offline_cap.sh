#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/). `plait bench throughput` W1 and
# W2 with no cap on the prompt tokens beside decodes (the benchmark's offline default), then with the
# engine's serving cap (256, with its drain rule), one machine, alternated: what LLM.generate's users paid
# for the engine default being the serving one.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
for cap in 0 256; do
  python3 -m plait.entrypoints.cli bench throughput --shared shared/bench --workloads W1,W2 --no-roofline \
    --max-prefill-tokens-beside-decodes $cap --out $OUT/throughput_cap$cap.json > $OUT/throughput_cap$cap.log 2>&1
  echo "== cap $cap: exit $?"; tr '\r' '\n' < $OUT/throughput_cap$cap.log | grep -E "^W[12] \|" | tail -2
done
