#!/usr/bin/env bash
# Wheels of plait's server dependencies for a GPU machine that has no network and no fastapi/uvicorn (the
# device tool's image: Python 3.12, x86_64), into ./.whl (git ignores it; ~15 MB). Carry .whl to the machine
# and, there, before `plait serve`, `plait bench serve` or scripts/w5_sweep.py:
#   pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client llguidance pydantic \
#       uvloop httptools httpx openai
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
python3 -m pip download -q --dest .whl --only-binary=:all: --implementation cp \
    --python-version "$PYTHON_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "fastapi>=0.115" "uvicorn>=0.30" "prometheus_client>=0.20" "llguidance>=1.0" "pydantic>=2.12" \
    "uvloop>=0.19" "httptools>=0.6" httpx "openai>=1.40"
echo "wheels for Python $PYTHON_VERSION in $(pwd)/.whl ($(du -sh .whl | cut -f1))"
