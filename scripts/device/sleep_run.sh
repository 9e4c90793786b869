#!/usr/bin/env bash
# Run from the repository root on the device (the device tool copies the tree; carry .whl from
# scripts/device_wheels.sh, and .gpu where a script reads from it).
# GPU: sleep mode, load_weights (norms folded again), priority scheduling, with the server's deps from .whl.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic uvloop \
    httptools httpx openai 2>&1 | grep -v "root. user" | tail -8
python3 -c "import fastapi, uvicorn, openai, httpx; print('server deps ok', fastapi.__version__, openai.__version__)"
timeout -s ABRT 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_sleep.py tests/test_load_weights.py \
    tests/test_priority.py -rfs --tb=short 2>&1 | tail -60 | tee $OUT/sleep_tests_h200.log
