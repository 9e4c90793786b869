"""PromptEmbeds: prompts given as embeddings, staged each step into static buffers that a hook on the model's
embedding layer reads in place of its lookups, in eager steps and CUDA graphs alike."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from plait.engine.scheduler import StepPlan
from plait.runner.sampler import host_to_device


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The decoder's token embedding (``model.model.embed_tokens``, as every Llama-style family names it), or
    None for a model without one."""
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embedding if isinstance(embedding, nn.Embedding) else None


# A step's prompt-embedding rows on the host: (their token indices in the step [n] int64, the embeddings
# [n, hidden]).
StepEmbeds = tuple[np.ndarray, torch.Tensor]


class PromptEmbeds:
    """``stage`` writes the embeddings of a step's prompt-of-embeddings tokens into ``values`` and marks them
    in ``mask``; the embedding layer's forward hook returns those rows instead of its output. So a scale
    inside the layer (Gemma's sqrt(hidden): plait.models.gemma.ScaledEmbedding) does not apply to given
    embeddings and one after it (Granite's multiplier) does, as transformers reads ``inputs_embeds``. The
    buffers never move, so graphs captured with the hook replay steps with prompt embeddings (a step's writes
    are stream-ordered before its forward, and after the forward of the step before)."""

    def __init__(self, embedding: nn.Embedding, device: torch.device, max_tokens: int, dtype: torch.dtype
                 ) -> None:
        self.device = device
        self.mask = torch.zeros(max_tokens, dtype=torch.bool, device=device)  # [max_tokens]
        hidden = embedding.embedding_dim
        self.values = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)  # [max_tokens, hidden]
        self._staged = False  # whether mask marks any token (of the last step staged)
        self._hook = embedding.register_forward_hook(self._overlay)

    def _overlay(self, module: nn.Module, args: tuple, looked_up: torch.Tensor) -> torch.Tensor:
        # looked_up: [T, hidden] -> the same, with the staged rows in place
        n = looked_up.shape[0]
        return torch.where(self.mask[:n, None], self.values[:n], looked_up)

    @staticmethod
    def for_step(plan: StepPlan, query_start_loc: np.ndarray) -> StepEmbeds | None:
        """The step's prompt-embedding rows on the host (None where it has none): what the driver stages,
        and sends to the other tensor-parallel ranks with the step's inputs."""
        indices, parts = [], []
        for r, row in enumerate(plan.rows):
            embeds = row.request.prompt_embeds
            if embeds is None or not row.is_prefill:
                continue
            # After a preemption the outputs are re-prefilled too: those positions keep their token ids.
            lo, hi = row.start, min(row.start + row.num_new_tokens, len(embeds))
            if lo < hi:
                shift = int(query_start_loc[r]) - row.start
                indices.append(np.arange(lo + shift, hi + shift))
                parts.append(embeds[lo:hi])
        if not indices:
            return None
        return np.concatenate(indices), torch.cat(parts)

    def stage(self, step: StepEmbeds | None) -> int:
        """Stage a step's rows (for_step's; the last step's are cleared); how many tokens they are."""
        if self._staged:
            self.mask.zero_()
            self._staged = False
        if step is None:
            return 0
        token_indices = host_to_device(step[0], torch.long, self.device)
        self.mask.index_fill_(0, token_indices, True)
        self.values.index_copy_(0, token_indices, host_to_device(step[1], self.values.dtype, self.device))
        self._staged = True
        return len(token_indices)

    def remove(self) -> None:
        """Take the hook off the embedding layer."""
        self._hook.remove()
