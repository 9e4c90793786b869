"""Where step time goes: host phases by wall clock, the forward pass on the GPU by CUDA events."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# "draft": a draft model's forwards for the step's drafts (speculative decoding), run before it is scheduled,
# and the wait for the last one's ids once the step that verifies them is launched.
HOST_PHASES = ("schedule", "draft", "prepare", "launch", "sample", "postprocess")


@dataclass
class StepBreakdown:
    """Totals since start (or the last ``reset``). Host phases are set by the engine (schedule,
    postprocess) and the runner (prepare: plan to staged inputs; launch: issuing the forward;
    sample: lm_head, sampling and the wait for the token ids). ``gpu_forward_s`` is the device time
    of the forwards, read from events; ``wall_s`` is the engine's step wall time. A draft model's forwards
    (their device time included: the drafter waits for each one's tokens) count as the "draft" phase."""

    steps: int = 0
    single_token_steps: int = 0  # steps whose rows all have one new token (pure decodes, mostly)
    graph_single_token_steps: int = 0  # of those, steps that replayed a CUDA graph
    graph_steps: int = 0  # steps that replayed a CUDA graph (mixed steps too)
    lora_steps: int = 0  # steps with a LoRA row
    image_steps: int = 0  # steps whose prompt chunks hold image placeholders (an image model's)
    graph_image_steps: int = 0  # of those, steps that replayed a CUDA graph
    wall_s: float = 0.0
    gpu_forward_s: float = 0.0
    gpu_forward_graph_s: float = 0.0  # the part spent in graph replays (the rest: eager, mixed steps)
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOST_PHASES, 0.0))
    _pending: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = field(default_factory=list, repr=False)

    def add(self, phase: str, seconds: float) -> None:
        self.host_s[phase] += seconds

    def add_gpu_interval(self, start: torch.cuda.Event, end: torch.cuda.Event, graph: bool) -> None:
        self._pending.append((start, end, graph))

    def resolve(self) -> None:
        """Fold finished event pairs into gpu_forward_s (call after a sync, e.g. the sampler's)."""
        still = []
        for start, end, graph in self._pending:
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                self.gpu_forward_s += seconds
                self.gpu_forward_graph_s += seconds if graph else 0.0
            else:
                still.append((start, end, graph))
        self._pending = still

    def reset(self) -> None:
        fresh = StepBreakdown()
        self.__dict__.update(fresh.__dict__)

    def as_dict(self) -> dict:
        self.resolve()
        out = asdict(self)
        out.pop("_pending")
        out["graph_replay_rate_of_single_token_steps"] = (
            self.graph_single_token_steps / self.single_token_steps if self.single_token_steps else None
        )
        out["host_total_s"] = sum(self.host_s.values())
        return out
