"""The torch profiler around engine steps (vLLM's start_profile / stop_profile), for Perfetto."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

# Where traces go (vLLM's variable is read too, so its users' setups work unchanged).
PROFILER_DIR_ENVS = ("PLAIT_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def profiler_dir_from_env() -> str | None:
    """The trace folder the environment names, or None."""
    return next((os.environ[name] for name in PROFILER_DIR_ENVS if os.environ.get(name)), None)


class StepProfiler:
    """One profiling session at a time: CPU ops, and CUDA kernels on a GPU, from start() to stop(), which
    writes a Chrome trace (open it in https://ui.perfetto.dev) and returns its path."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._folder: Path | None = None

    def start(self, folder: str | os.PathLike | None = None) -> None:
        if self._profile is not None:
            raise ValueError("the profiler is already running: stop_profile first")
        folder = folder if folder is not None else profiler_dir_from_env()
        if folder is None:
            raise ValueError("no folder for the trace: pass one, or set PLAIT_TORCH_PROFILER_DIR "
                             "(vLLM's VLLM_TORCH_PROFILER_DIR works too)")
        self._folder = Path(folder).expanduser()
        self._folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()

    def stop(self) -> Path:
        if self._profile is None:
            raise ValueError("the profiler is not running: start_profile first")
        profile, self._profile = self._profile, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the steps' kernels still queued belong in the trace
        profile.__exit__(None, None, None)
        path = self._folder / f"plait_trace_{os.getpid()}_{time.strftime('%Y%m%d-%H%M%S')}.json"
        profile.export_chrome_trace(str(path))
        return path
