"""The shared benchmark folder beside the repo (workloads, W4 metrics, model configs, roofline), and what
every benchmark shares: a run in a fresh process, a result written as JSON."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

SHARED_ENV = "PLAIT_SHARED"
REPO = Path(__file__).resolve().parents[2]


def find_shared(explicit: str | None = None, required: str = "w4_metrics.py") -> Path:
    """The shared/bench folder: ``explicit``, else the first of $PLAIT_SHARED, <repo>/shared/bench,
    <repo>/../shared/bench that holds ``required``. It is never copied into the repo: the same files
    measured the peers."""
    if explicit:
        candidates = [Path(explicit)]
    else:
        env = os.environ.get(SHARED_ENV)
        candidates = [Path(env)] if env else []
        candidates += [REPO / "shared" / "bench", REPO.parent / "shared" / "bench"]
    for folder in candidates:
        if (folder / required).is_file():
            return folder
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no shared/bench folder with {required} found (tried {tried}); "
                            f"pass --shared DIR or set ${SHARED_ENV}")


def load_shared_module(shared: Path, filename: str) -> ModuleType:
    """Import a file of shared/bench by path (it is not part of the package)."""
    path = shared / filename
    spec = importlib.util.spec_from_file_location(f"plait_shared_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a fresh Python process, spawned so that it inherits no heap, GPU context or
    allocator state, and its result (an exception there is raised here). ``fn`` and the arguments must
    pickle: a module-level function and plain data. A benchmark runs each workload in one, so that its
    numbers do not depend on what ran before it: on an H200 W3 ran up to 2% slower in later engines of
    one process, and W1 ~2% slower after W3 (benchmarks/results/throughput_h200_history/README.md)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def write_json(path: str | Path, obj: Any, indent: int = 1) -> Path:
    """Write a benchmark's result (or timeline) as JSON, making its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent))
    return path


def device_name() -> str:
    """The GPU's name for a result's "device" field, or "cpu"."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
