"""The KV block pool: block tables, reference counts, and prefix caching of full blocks."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from plait.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from plait.engine.kv_offload import HostBlockPool, KVTransfer
from plait.engine.request import Request

# Block 0 is never handed out: padded block-table entries and padded slot_mapping rows point at it,
# so a padded (graph-captured) forward writes its junk K/V somewhere harmless.
PAD_BLOCK_ID = 0
# The pad block and one that holds tokens.
MIN_KV_BLOCKS = 2
# Hash of the (absent) parent of a request's first block.
ROOT_HASH = b""
_HASH_BYTES = 16
CACHE_SALT_KEY_BYTES = 16  # digest of a request's cache_salt, hashed into its first block's key


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# EngineConfig.prefix_caching_hash_algo -> the hash of a block's key. blake2b (plait's default) at 16 bytes;
# sha256 at its full 32, vLLM's default, for those who want SHA-2's collision resistance across tenants.
_BLOCK_HASHES = {
    "blake2b": lambda parent: hashlib.blake2b(parent, digest_size=_HASH_BYTES),
    "sha256": hashlib.sha256,
}


def block_hash(parent: bytes, token_ids: list[int], extra_key: bytes = b"", algo: str = "blake2b") -> bytes:
    """Chained hash of a full block: its parent's hash, its tokens, and anything else that changes
    its K/V (a LoRA or multimodal id), so two different contexts never share a block."""
    h = _BLOCK_HASHES[algo](parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_key)
    return h.digest()


def salt_key(cache_salt: str | None) -> bytes:
    """The first block's hash input for vLLM's ``cache_salt`` (b"" for none): a fixed-length digest, so no
    salt reads as another salt followed by a LoRA or image key."""
    if cache_salt is None:
        return b""
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string if given")
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=CACHE_SALT_KEY_BYTES, person=b"plait-salt")
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Counters since start (set by KVCacheManager). Queries and hits count prompt tokens."""

    queries: int = 0  # tokens looked up at admission
    hits: int = 0  # of those, tokens found cached (in host memory too)
    # Of the hits, tokens found in host memory (KV offloading): vLLM's external hits, which its
    # prefix_cache_hits leave out. Counted per admission, as hits are.
    external_hits: int = 0
    evicted_blocks: int = 0
    host_hits: int = 0  # tokens copied back from host memory, admitted or not (a retried admission finds
    # them on the device)
    offloaded_blocks: int = 0  # evicted blocks copied to host memory

    @property
    def local_hits(self) -> int:
        """Hits found on the device (vLLM's prefix_cache_hits)."""
        return self.hits - self.external_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns which block belongs to which request. Pure Python: the tensors live in the runner.

    A block is in use while its reference count is > 0. Free blocks sit in one LRU queue; a free
    block that still holds a full, hashed block of some earlier request stays findable by its hash
    until a new allocation evicts it (least recently freed first). With a host pool (KV offloading), an
    evicted cached block is kept there and a prefix match goes on into it, each such block copied back into
    a free device block; the copies wait in ``take_transfers`` for the runner.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_algo: str = "blake2b", num_host_blocks: int = 0) -> None:
        if hash_algo not in _BLOCK_HASHES:
            raise ValueError(f"prefix caching hash {hash_algo!r} is not one of {sorted(_BLOCK_HASHES)}")
        if num_blocks < MIN_KV_BLOCKS:
            raise ValueError(f"the KV cache needs at least {MIN_KV_BLOCKS} blocks (one is the pad block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.stats = PrefixCacheStats()
        self._ref_count = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}  # hash -> the block holding it
        # Free blocks, next to be reused first. Values unused: an ordered set with O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # The prefix cache's block events since the engine last took them (plait.engine.kv_events), where
        # the engine publishes them (kv_events_config); None: not recorded.
        self.events: list[KVEvent] | None = None
        # The host tier (EngineConfig.kv_offloading_size), and the copies between the tiers the runner has
        # yet to make, in order (an eviction's copy out before a load into the same block).
        self.host = HostBlockPool(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self._transfers: list[KVTransfer] = []

    # -- sizes ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (held by a request or free-but-cached)."""
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    # -- allocation -------------------------------------------------------------------------

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens; all or nothing."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_count[block] = 1
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references. Tail blocks are queued for reuse before head blocks, and
        unhashed blocks before cached ones, so shared prefixes survive longest."""
        for block in reversed(request.block_ids):
            if self._ref_count[block] <= 0:
                raise RuntimeError(f"block {block} freed while not referenced (request {request.request_id})")
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    self._free.move_to_end(block, last=False)
        request.block_ids = []
        request.num_hashed_blocks = 0

    def _evict(self, block: int, offload: bool = True) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            del self._block_of[h]
            self.stats.evicted_blocks += 1
            if self.events is not None:
                self.events.append(BlockRemoved([h]))
            host_block = self.host.store(h) if offload and self.host is not None else None
            if host_block is not None:  # its K/V leaves for host memory before anything overwrites it
                self._transfers.append(KVTransfer(True, block, host_block))
                self.stats.offloaded_blocks += 1

    def take_transfers(self) -> list[KVTransfer]:
        """The block copies between device and host memory to make before the next forward, in order."""
        transfers, self._transfers = self._transfers, []
        return transfers

    # -- prefix caching ---------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache): only while no request holds a block, so
        nothing computed is lost; False, and nothing forgotten, otherwise."""
        if self.num_used_blocks:
            return False
        events, self.events = self.events, None  # one AllBlocksCleared, not a removal a block
        for block in list(self._block_of.values()):
            self._evict(block, offload=False)
        if self.host is not None:  # forgotten too: their K/V came from what is being reset (the weights)
            self.host.clear()
            self._transfers.clear()
        self.events = events
        if events is not None:
            events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (none where they are not recorded)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def reset(self) -> bool:
        """Back to a new manager's state (nothing cached, the free blocks in their first order, zero
        counters), so what ran before leaves no trace (the start-up warm-up); only while no request holds a
        block: False, and nothing reset, otherwise."""
        if not self.reset_prefix_cache():
            return False
        self._free = OrderedDict.fromkeys(range(1, self.num_blocks))
        self.stats = PrefixCacheStats()
        return True

    def match_prefix(self, request: Request) -> int:
        """Give a request that holds no blocks the longest cached prefix of its known tokens, always
        leaving at least one token to compute so that it samples normally. Returns the number of
        tokens now counted as computed (0 when caching is off)."""
        request.num_host_cached_tokens = 0
        if not self.enable_prefix_caching or request.block_ids:
            return 0
        if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
            return 0  # every prompt position must be computed for its logprobs
        if request.pooling_params is not None and request.pooling_params.per_token:
            return 0  # every prompt position's hidden state is an output (token_embed, token_classify)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_blocks)
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                block = self._load_from_host(h) if self.host is not None else None
                if block is None:
                    break
                request.num_host_cached_tokens += self.block_size
            elif self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1
            request.block_ids.append(block)
        request.num_computed_tokens = len(request.block_ids) * self.block_size
        request.num_hashed_blocks = len(request.block_ids)
        return request.num_computed_tokens

    def _load_from_host(self, h: bytes) -> int | None:
        """The device block that block hash ``h`` is copied back into from the host pool (taken from the free
        ones, cached under ``h``, unreferenced yet), or None where the pool does not hold it or no block is
        free."""
        host_block = self.host.find(h)
        if host_block is None or not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        self._evict(block)  # its own cached K/V may go to the host pool first, evicting one there ...
        if not self.host.holds(h, host_block):  # ... this very one (a pool of one block)
            self._free[block] = None
            self._free.move_to_end(block, last=False)
            return None
        self._transfers.append(KVTransfer(False, block, host_block))
        self._hash_of[block] = h
        self._block_of[h] = block
        self.stats.host_hits += self.block_size
        return block

    def record_admission(self, request: Request) -> None:
        """Count one admission's lookup (only admissions that happen, not retries)."""
        if self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += request.num_computed_tokens
            self.stats.external_hits += request.num_host_cached_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Make the request's newly filled blocks findable. Called when a step it ran in is collected."""
        if not self.enable_prefix_caching or request.is_finished:
            return
        # A block is hashed from its token ids, so only blocks whose tokens are all on the host count.
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
        hashes = self._hashes(request, num_full)
        stored = []  # indices of the blocks this call makes findable
        for i in range(request.num_hashed_blocks, num_full):
            block, h = request.block_ids[i], hashes[i]
            # If another request computed the same block first, keep its copy findable; ours is
            # simply not cached and is reused like any unhashed block when freed.
            if self._hash_of[block] is None and h not in self._block_of:
                self._hash_of[block] = h
                self._block_of[h] = block
                stored.append(i)
        if stored and self.events is not None:
            self._record_stored(request, hashes, stored)
        request.num_hashed_blocks = max(request.num_hashed_blocks, num_full)

    def _record_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """BlockStored events for the blocks at ``stored``, one a run of consecutive blocks."""
        bs, runs = self.block_size, [[stored[0]]]
        for i in stored[1:]:
            if i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        lora = request.lora.request.lora_int_id if request.lora is not None else None
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.events.append(BlockStored([hashes[i] for i in run], hashes[first - 1] if first else None,
                                           request.token_ids(first * bs, end * bs), bs, lora))

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (memoised)."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            start, end = i * bs, (i + 1) * bs
            hashes.append(block_hash(parent, request.token_ids(start, end), request.block_key(start, end),
                                     self.hash_algo))
        return hashes[:num_blocks]
