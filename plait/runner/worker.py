"""Worker: one rank as LLM.collective_rpc sees it (vLLM's Worker), with a worker extension's methods."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.models.weights import live_load
from plait.qualified_name import import_qualified

if TYPE_CHECKING:
    from plait.runner.model_runner import ModelRunner

# What Worker.__init__ sets on each instance (an extension may not define them either).
WORKER_ATTRIBUTES = ("model_runner", "_runner", "rank", "local_rank", "world_size", "device")


class Worker:
    """What a collective_rpc method runs on, on every rank: ``self.model_runner`` (the rank's ModelRunner;
    its ``model`` is the nn.Module), ``self.rank`` (0 is the driver), ``self.local_rank`` (the same: plait's
    ranks share one host), ``self.world_size`` and ``self.device``, as on vLLM's Worker. The methods of
    EngineConfig.worker_extension_cls join these (make_worker).

    A method runs with partial loads allowed (plait.models.weights.live_load): a vLLM extension's
    ``self.model_runner.model.load_weights(weights=[(name, tensor)])`` then replaces that one tensor on one
    GPU. Split over GPUs each rank's model holds slices: ``self.load_weights`` takes whole tensors and keeps
    this rank's slices of them."""

    def __init__(self, runner: ModelRunner) -> None:
        # Weak: the runner holds its worker, and a cycle between them would outlive a dropped engine once
        # start-up froze the heap (its KV cache with it).
        self._runner = weakref.ref(runner)
        where = runner.parallel
        self.rank = self.local_rank = 0 if where is None else where.rank
        self.world_size = 1 if where is None else where.world_size
        self.device: torch.device = runner.device

    @property
    def model_runner(self) -> ModelRunner:
        return self._runner()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Whole HF-named tensors (any subset of the checkpoint's) into this rank's model: its slices of them
        where the model is split, cast to the model's dtype, the MLP norms folded in again where they are
        folded (ModelRunner.load_weights). Every rank is given the same tensors (an RL loop's broadcast)."""
        self.model_runner.load_weights(weights, this_rank_only=True)

    def reload_weights(self, path: str | None = None) -> None:
        """vLLM's ``collective_rpc("reload_weights")``: load_weights from the checkpoint at ``path`` (an HF
        folder, a GGUF file or a cached Hub id), else the engine's own model; each rank reads it."""
        self.load_weights(self.model_runner.checkpoint_weights(path))

    def get_model(self) -> nn.Module:
        return self.model_runner.model

    def execute(self, method: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run ``method`` (this worker's method by name, or a function taking the worker first)."""
        if isinstance(method, str):
            call = getattr(self, method, None)
            if not callable(call):
                raise AttributeError(f"the worker has no method {method!r} (a worker_extension_cls adds "
                                     "methods)")
        else:
            call = functools.partial(method, self)
        with live_load() as loaded:
            try:
                return call(*args, **kwargs)
            finally:
                if loaded.rows:  # the model's own load_weights, called directly: the engine must know
                    self.model_runner.weight_loads += 1


def make_worker(runner: ModelRunner, extension: str | type | None) -> Worker:
    """The rank's Worker, with ``extension``'s methods (a class, or its qualified name) mixed in; one that
    would hide a Worker attribute is refused, as vLLM refuses it."""
    if extension is None:
        return Worker(runner)
    cls = import_qualified(extension, "worker_extension_cls") if isinstance(extension, str) else extension
    if not isinstance(cls, type):
        raise ValueError(f"worker_extension_cls {extension!r} is not a class")
    clashes = sorted(name for name in vars(cls)
                     if not name.startswith("__") and (hasattr(Worker, name) or name in WORKER_ATTRIBUTES))
    if clashes:
        raise ValueError(f"worker_extension_cls {cls.__qualname__} defines {clashes}, which plait's Worker "
                         "already has")
    return type(f"Worker[{cls.__qualname__}]", (Worker, cls), {})(runner)
