#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/). `plait bench throughput` W1 and
# W2 reading final outputs only (the default since SamplingParams.output_kind), then W1 reading every step's
# outputs (--output-kind cumulative, as the benchmark read them before), on one machine.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m plait.entrypoints.cli bench throughput --shared shared/bench --workloads W1,W2 \
  --out $OUT/throughput_final_only.json > $OUT/throughput_final_only.log 2>&1
echo "== final_only: exit $?"; grep -v "^\[" $OUT/throughput_final_only.log | grep -iE "W1|W2|tok/s|ratio" | tail -8
python3 -m plait.entrypoints.cli bench throughput --shared shared/bench --workloads W1 --no-roofline \
  --output-kind cumulative --out $OUT/throughput_w1_cumulative.json > $OUT/throughput_w1_cumulative.log 2>&1
echo "== cumulative: exit $?"; grep -v "^\[" $OUT/throughput_w1_cumulative.log | grep -iE "W1|tok/s" | tail -4
