"""MRopePositions: each step token's (temporal, height, width) positions for an M-RoPE model (Qwen2-VL),
staged into one static [3, max_tokens] buffer that eager steps and CUDA graphs alike read
(ForwardBatch.mrope_positions)."""

from __future__ import annotations

import numpy as np
import torch

from plait.engine.request import Request, RequestStatus
from plait.engine.scheduler import StepPlan
from plait.layers.rotary import MROPE_COMPONENTS


class MRopePositions:
    """A request's prompt positions come from the model (``mrope_positions(prompt ids, images)``: [3, L] and
    the delta of every later token), computed once for a request with images and kept while it runs; a token
    past its prompt (a decode, a recomputed output token, a draft) is at position + delta on all three, as is
    every token of a request without images (delta 0)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_tokens: int) -> None:
        self.model = model
        self.device = device
        self.buffer = torch.zeros(MROPE_COMPONENTS, max_tokens, dtype=torch.int64, device=device)
        self._prompts: dict[Request, tuple[np.ndarray, int]] = {}  # request -> ([3, prompt len], delta)

    def views(self, num_tokens: int) -> torch.Tensor:
        """[3, num_tokens]: ForwardBatch.mrope_positions. Under a graph the tokens past the step's are stale
        positions of earlier steps (valid rows of the table), which only padding reads."""
        return self.buffer[:, :num_tokens]

    def put(self, host: np.ndarray) -> None:
        """Write a step's [3, T] positions (for_step's, or on a tensor-parallel worker the driver's)."""
        num_tokens = host.shape[1]
        if self.device.type != "cuda":
            self.buffer[:, :num_tokens].copy_(torch.from_numpy(host))
            return
        # pinned, so the copy queues behind the steps in flight instead of waiting for them
        self.buffer[:, :num_tokens].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)

    def for_step(self, plan: StepPlan, positions: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
        """[3, T] int64: each token's three positions."""
        self._forget_finished()
        out = np.broadcast_to(positions, (MROPE_COMPONENTS, len(positions))).copy()
        for r, row in enumerate(plan.rows):
            request = row.request
            if not request.images:
                continue
            prompt, delta = self._prompt(request)
            lo, hi = int(query_start_loc[r]), int(query_start_loc[r + 1])
            pos = positions[lo:hi]
            inside = pos < prompt.shape[1]
            out[:, lo:hi] = np.where(inside, prompt[:, np.minimum(pos, prompt.shape[1] - 1)], pos + delta)
        return out

    def _prompt(self, request: Request) -> tuple[np.ndarray, int]:
        if request not in self._prompts:
            self._prompts[request] = self.model.mrope_positions(request.prompt_token_ids, request.images)
        return self._prompts[request]

    def _forget_finished(self) -> None:
        for request in [r for r in self._prompts if r.status is RequestStatus.FINISHED]:
            del self._prompts[request]
