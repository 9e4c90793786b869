"""LoRARegistry: the adapters the engine has been asked for, each read and checked once, recent ones kept."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from plait.lora.adapter import LoRAAdapter, LoRATarget, load_adapter
from plait.lora.request import LoRARequest


class LoRARegistry:
    """Adapters by int id: read from their folders and checked against the model at a request's
    validation (a bad one is a ValueError there, before the request enters the engine), the
    ``max_cached`` most recently asked for kept on the host. A request holds its adapter until it finishes,
    so one dropped from here is reread only by a later request."""

    def __init__(self, targets: dict[str, LoRATarget], max_rank: int, max_cached: int) -> None:
        self.targets = targets
        self.max_rank = max_rank
        self.max_cached = max_cached
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # Every id ever asked for and the folder it named (a path each): an id names one adapter.
        self._paths: dict[int, Path] = {}

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """``request``'s adapter, read (and checked) unless it was recently."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        lora_id = request.lora_int_id
        folder = Path(request.lora_path).expanduser().resolve()
        known = self._paths.get(lora_id)
        if known is not None and known != folder:
            raise ValueError(f"lora_int_id {lora_id} already names the adapter at {known}, not "
                             f"{request.lora_path}; give each adapter its own id")
        adapter = self._cache.get(lora_id)
        if adapter is None:
            adapter = load_adapter(request, self.targets, self.max_rank)
            self._cache[lora_id] = adapter
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        self._cache.move_to_end(lora_id)
        self._paths[lora_id] = folder
        return adapter
