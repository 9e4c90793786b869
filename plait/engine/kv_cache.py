"""The KV block pool: fixed-size blocks, per-request block tables, all-or-nothing allocation."""

from __future__ import annotations

from collections import deque

from plait.engine.request import Request

# Block 0 is never handed out: padded block-table entries and padded slot_mapping rows point at it,
# so a padded (graph-captured) forward writes its junk K/V somewhere harmless.
PAD_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns which block belongs to which request. Pure Python: the tensors live in the runner."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the pad block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens; all or nothing."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        request.block_ids.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, request: Request) -> None:
        # Freed blocks go to the back: recently used blocks are reused last, which prefix caching
        # will want, and which makes use-after-free bugs show up in tests instead of hiding.
        self._free.extend(request.block_ids)
        request.block_ids = []
