"""CausalLM: what the runner calls on every model family."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.layers.linear import logits_fp32
from plait.layers.mamba import Mamba2Dims, MambaStateSpec
from plait.runner.forward_batch import ForwardBatch


def refuse_config_keys(raw: dict, family: str, keys: tuple[str, ...]) -> None:
    """Refuse, by name, a config that turns on one of ``keys``: a variant of ``family`` plait does not
    compute (biases it has no parameter for, say)."""
    for key in keys:
        if raw.get(key):
            raise ValueError(f"{family} with {key} is not supported")


def checkpoint_layout(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` in ``model``'s own layout (CausalLM.checkpoint_layout); models with no such method (the
    encoders) take their checkpoints as they are."""
    layout = getattr(model, "checkpoint_layout", None)
    return weights if layout is None else layout(weights)


class CausalLM(nn.Module):
    """A pure model: hidden states from a ForwardBatch, logits only where the runner samples.

    Subclasses set ``model`` (the trunk: ``(input_ids, batch) -> hidden``) and ``lm_head``, and define
    ``load_weights(weights)`` for HF-named tensors; recurrent ones add ``recurrent_state_specs()`` and
    turn prefix caching off.
    """

    # Whether cached KV blocks are all a token's past needs (False where layers keep recurrent state).
    supports_prefix_caching = True
    # Whether LoRA adapters may wrap its projections from outside (plait.lora.model.lora_targets).
    supports_lora = False
    model: nn.Module
    lm_head: nn.Linear

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]; layers read positions from the batch
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] (only the sampled positions) -> [S, vocab] in fp32
        return logits_fp32(hidden, self.lm_head.weight)

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors in the names and layouts of the model's own parameters where they differ
        by more than a slice (GPT-OSS's interleaved, transposed or MXFP4 experts). The loaders call it before
        tensor parallelism slices each tensor, so that the slices are the model's; load_weights then takes
        them. Most checkpoints are already so."""
        return weights


class RecurrentCausalLM(CausalLM):
    """A model with Mamba2 layers: their state lives in slots the runner allocates from these specs."""

    # A cached KV block cannot restore a recurrent state: prefix caching is turned off (and logged).
    supports_prefix_caching = False
    dims: Mamba2Dims
    num_mamba_layers: int  # set by the subclass

    def recurrent_state_specs(self) -> list[MambaStateSpec]:
        """Per-slot state shapes, one per Mamba layer in state_index order."""
        return [self.dims.state_spec()] * self.num_mamba_layers
