"""Custom logits processors (vLLM's --logits-processors): user classes that change logits before sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from plait.qualified_name import import_qualified

if TYPE_CHECKING:
    from plait.config import EngineConfig
    from plait.runner.sampler import SamplingRow
    from plait.sampling_params import SamplingParams


class LogitsProcessor:
    """The base of a custom logits processor. Subclass it, and name the class in
    ``EngineConfig.logits_processors`` (``LLM(logits_processors=[MyProcessor])``, or ``plait serve
    --logits-processors my_package.module:MyProcessor``).

    The engine builds one instance, as ``cls(config, device, is_pin_memory)`` (vLLM's signature), on the
    device that samples. Each step that samples, ``apply`` gets the step's logits in fp32, one row per
    sampling row, and the rows themselves (``SamplingRow``: ``params``, with the request's own settings in
    ``params.extra_args`` (the server's ``vllm_xargs``), ``prompt_token_ids`` and ``output_token_ids``).
    The rows change from step to step, as requests start, finish and are preempted, so a processor keeps no
    per-row state; it reads each row's settings from its params. It runs after the allowed-token, grammar,
    bad-word, logit-bias and min-tokens masks and before the penalties, temperature and top-k/top-p/min-p,
    whose logprobs under ``logprobs_mode="processed_*"`` include its changes.
    """

    # Whether ``apply`` reads rows' output_token_ids. While it applies to a request (``applies_to``), that
    # request's next token is sampled only once its last one is on the host: the ids are then whole. False
    # lets those steps overlap as any other.
    reads_output_token_ids: ClassVar[bool] = True

    def __init__(self, config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.config = config
        self.device = device
        self.is_pin_memory = is_pin_memory

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError for params (their extra_args above all) this processor cannot serve: the request
        is refused with that message (a 400 from the server) before it enters the engine."""

    def applies_to(self, params: SamplingParams) -> bool:
        """Whether ``apply`` may change the rows of requests with these params; a step none of whose rows it
        applies to skips it. By default every request's."""
        return True

    def is_argmax_invariant(self) -> bool:
        """vLLM's: True where the processor never changes which token has the largest logit (it only
        reshapes the distribution); steps whose rows are all greedy then skip it."""
        return False

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The step's logits, changed (in place or not): ``logits`` [len(rows), vocab] fp32; the same shape
        comes back. Rows of requests the processor does not apply to must be left as they are."""
        raise NotImplementedError


def load_logits_processors(names: Sequence[str | type] | None) -> list[type[LogitsProcessor]]:
    """The classes ``names`` give: classes, or their qualified names as ``module:Class`` or
    ``module.Class``; each must subclass LogitsProcessor."""
    classes = []
    for name in names or ():
        cls = import_qualified(name, "logits processor") if isinstance(name, str) else name
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise TypeError(f"logits processor {name!r} is not a subclass of plait.logits_processor."
                            "LogitsProcessor")
        classes.append(cls)
    return classes


def apply_logits_processors(processors: Sequence[LogitsProcessor], logits: torch.Tensor,
                            rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` [len(rows), vocab] through each processor in turn; a processor that returns another
    shape is named."""
    for processor in processors:
        out = processor.apply(logits, rows)
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RuntimeError(f"logits processor {type(processor).__name__} returned {shape}, not logits "
                               f"of shape {tuple(logits.shape)}")
        logits = out.float()
    return logits
