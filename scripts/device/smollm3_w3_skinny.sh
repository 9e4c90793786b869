#!/usr/bin/env bash
# Run from the repository root on the device (carry .gpu, which holds shared/). W3-shaped batch-1 decoding of a
# SmolLM3-3B shape (dummy weights), its GEMVs on the skinny Triton kernels where SKINNY_CONFIGS lists them
# (PLAIT_SKINNY_GEMM=auto) against cuBLAS for every matmul (=0), alternated twice, each a fresh process; then
# the dense-kernel GPU tests.
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -e shared ] || ln -s .gpu/shared shared
for round in 1 2; do
  for mode in auto 0; do
    PLAIT_SKINNY_GEMM=$mode python3 -m plait.entrypoints.cli bench throughput --shared shared/bench --no-roofline \
      --config benchmarks/configs/smollm3-3b --workloads W3 --out $OUT/w3_smollm3_${mode}_$round.json > $OUT/w3_${mode}_$round.log 2>&1
    echo "round $round skinny=$mode: $(grep '^W3 ' $OUT/w3_${mode}_$round.log)"
  done
done
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_dense_kernels.py 2>&1 | tail -2
