"""The recurrent-state slot pool: which request owns which row of every Mamba layer's state tensors."""

from __future__ import annotations

# Request.state_slot of a request that holds no slot (waiting, finished, or an attention-only model).
NO_STATE_SLOT = -1
# Row 0 of every state tensor is never handed out: padded batch rows (graph-captured steps) point at
# it, so a padded forward writes its junk state somewhere harmless. Mirrors the KV cache's pad block.
PAD_STATE_SLOT = 0


class StateSlotPool:
    """Slot ids 1..capacity. A request takes one at admission and keeps it until it finishes, is
    aborted or is preempted; nothing is ever moved or compacted, so a slot id addresses the same
    state rows for the request's whole life. Pure Python: the tensors live in the runner."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a state slot pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        # A stack: the most recently freed slot is reused first, so stale state is the normal case
        # for a new request and a missing zero-initialisation cannot hide.
        self._free = list(range(capacity, PAD_STATE_SLOT, -1))
        self._used: set[int] = set()

    @property
    def num_tensor_rows(self) -> int:
        """Rows each state tensor needs: every slot plus the pad slot."""
        return self.capacity + 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot; the scheduler must check num_free before admitting")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed while not in use")
        self._used.remove(slot)
        self._free.append(slot)
