"""The LoRA slot pool: which adapter each of the max_loras slots holds, and how many requests use it."""

from __future__ import annotations

# Request.lora_slot of a request that holds no slot (no adapter, or not running).
NO_LORA_SLOT = -1


class LoRASlotPool:
    """Slots 0..capacity-1, each holding at most one adapter (by its int id). A request takes its adapter's
    slot at admission and gives it back when it finishes, is aborted or is preempted, as a state slot.

    An adapter stays in its slot after its last user leaves, so the next request for it loads nothing; a
    new adapter takes an empty slot, else the least recently used slot nobody uses (its adapter is
    evicted). While every slot serves other adapters' running requests, admission waits (FCFS), as vLLM's
    does. Pure Python: the weights live in the runner, which loads a slot whose adapter changed.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a LoRA slot pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self._adapter: list[int | None] = [None] * capacity  # the adapter id each slot holds
        self._users = [0] * capacity  # running requests using each slot
        self._last_used = [0] * capacity  # a tick of the last take or give_back: LRU order
        self._tick = 0
        self._slot_of: dict[int, int] = {}  # adapter id -> its slot

    @property
    def num_used(self) -> int:
        """Slots some running request uses."""
        return sum(1 for users in self._users if users)

    def adapter_in(self, slot: int) -> int | None:
        return self._adapter[slot]

    def can_take(self, lora_id: int) -> bool:
        """Whether a request for adapter ``lora_id`` can get a slot now."""
        return lora_id in self._slot_of or 0 in self._users

    def take(self, lora_id: int) -> int:
        """The slot of adapter ``lora_id`` for one more running request (assigned where it has none)."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            idle = [s for s in range(self.capacity) if not self._users[s]]
            if not idle:
                raise RuntimeError("no LoRA slot is free; the scheduler must check can_take before admitting")
            # Empty slots first, then the least recently used adapter.
            slot = min(idle, key=lambda s: (self._adapter[s] is not None, self._last_used[s]))
            evicted = self._adapter[slot]
            if evicted is not None:
                del self._slot_of[evicted]
            self._adapter[slot] = lora_id
            self._slot_of[lora_id] = slot
        self._users[slot] += 1
        self._touch(slot)
        return slot

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or not self._users[slot]:
            raise RuntimeError(f"LoRA slot {slot} given back while nobody uses it")
        self._users[slot] -= 1
        self._touch(slot)

    def _touch(self, slot: int) -> None:
        self._tick += 1
        self._last_used[slot] = self._tick
