#!/usr/bin/env bash
# Run from the repository root on the device. The GPU test of an MXFP4 checkpoint (dequantised on the GPU, bit
# for bit its dequantised twin), then a gpt-oss-20b-shaped random MXFP4 checkpoint written, loaded and run.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short tests/test_gpt_oss.py \
  > $OUT/gpu_mxfp4_test.log 2>&1
echo "== test: $(tail -1 $OUT/gpu_mxfp4_test.log)"; grep -h "^FAILED\|^ERROR\|Error" $OUT/gpu_mxfp4_test.log | head
timeout -s INT 330 python3 benchmarks/mxfp4_load.py --config benchmarks/configs/gpt-oss-20b --dir /tmp \
  --out $OUT/mxfp4_load_gpt_oss_20b_h200.json > $OUT/mxfp4_load.log 2>&1
tail -15 $OUT/mxfp4_load.log
