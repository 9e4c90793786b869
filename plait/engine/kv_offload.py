"""HostBlockPool: the prefix cache's second tier in host memory (vLLM's native KV offloading), and the block
copies between the tiers that the runner makes before a step's forward."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

# vLLM's --kv-offloading-backend values: plait has its own ("native"); LMCache is not bundled.
OFFLOADING_BACKENDS = ("native",)
# vLLM's --kv-transfer-config: the connector that is its native CPU offloading, which plait's host pool is,
# the role it takes there (saving and loading), and its kv_connector_extra_config keys plait reads.
OFFLOADING_CONNECTOR = "OffloadingConnector"
OFFLOADING_ROLE = "kv_both"
CONNECTOR_KEYS = frozenset({"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id",
                            "kv_buffer_device"})
CONNECTOR_EXTRA_KEYS = frozenset({"num_cpu_blocks", "block_size", "spec_name"})
# vLLM's offloading spec, the only one there is: CPU memory.
CPU_OFFLOADING_SPEC = "CPUOffloadingSpec"


def offloading_blocks(config: dict | None, block_size: int) -> int | None:
    """The host blocks a rank keeps from vLLM's kv_transfer_config (an OffloadingConnector's
    num_cpu_blocks); None where there is none. Every other connector, role or key is a ValueError."""
    if config is None:
        return None
    connector = config.get("kv_connector")
    if connector != OFFLOADING_CONNECTOR:
        raise ValueError(f"kv_transfer_config kv_connector {connector!r} is not supported: plait has no "
                         "disaggregated prefill or external KV stores; its native KV offloading (host "
                         f"memory) is {OFFLOADING_CONNECTOR!r} (also --kv-offloading-size)")
    unknown = sorted(set(config) - CONNECTOR_KEYS)
    if unknown:
        raise ValueError(f"kv_transfer_config keys {unknown} are not supported")
    if config.get("kv_role", OFFLOADING_ROLE) != OFFLOADING_ROLE:
        raise ValueError(f"kv_transfer_config kv_role {config['kv_role']!r}: the {OFFLOADING_CONNECTOR} both "
                         f"saves and loads ({OFFLOADING_ROLE!r})")
    extra = config.get("kv_connector_extra_config") or {}
    unknown = sorted(set(extra) - CONNECTOR_EXTRA_KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config keys {unknown} are not supported (plait reads "
                         f"{sorted(CONNECTOR_EXTRA_KEYS)})")
    if extra.get("spec_name", CPU_OFFLOADING_SPEC) != CPU_OFFLOADING_SPEC:
        raise ValueError(f"kv_connector_extra_config spec_name {extra['spec_name']!r}: plait offloads to "
                         f"host memory ({CPU_OFFLOADING_SPEC!r})")
    if extra.get("block_size", block_size) != block_size:
        raise ValueError(f"kv_connector_extra_config block_size {extra['block_size']!r}: plait's host blocks "
                         f"are the engine's ({block_size} tokens)")
    blocks = extra.get("num_cpu_blocks")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"kv_connector_extra_config num_cpu_blocks must be a count of blocks >= 1, got "
                         f"{blocks!r}")
    return blocks


@dataclass(frozen=True)
class KVTransfer:
    """One block copy, made in order with the others before the next forward (ModelRunner.transfer_kv):
    ``to_host`` an evicted cached device block kept in host block ``host_block``, else host block
    ``host_block`` back into device block ``device_block`` (a prefix match found it there)."""

    to_host: bool
    device_block: int
    host_block: int


class HostBlockPool:
    """Which block hash each host block holds, least recently used first. Pure Python: the tensor lives in the
    runner (ModelRunner.host_kv). A block is stored when the device cache evicts it (so blocks that stay hot
    cost no copy) and found by the same chained hashes as the device's cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._block_of: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, LRU first
        self._free = list(range(num_blocks))

    def __len__(self) -> int:
        return len(self._block_of)

    def find(self, block_hash: bytes) -> int | None:
        """The host block holding ``block_hash`` (now the most recently used), or None."""
        block = self._block_of.get(block_hash)
        if block is not None:
            self._block_of.move_to_end(block_hash)
        return block

    def holds(self, block_hash: bytes, block: int) -> bool:
        return self._block_of.get(block_hash) == block

    def store(self, block_hash: bytes) -> int | None:
        """A host block for ``block_hash``, taking a free one or the least recently used; None where the hash
        is held already (nothing to copy)."""
        if self.find(block_hash) is not None:
            return None
        block = self._free.pop() if self._free else self._block_of.popitem(last=False)[1]
        self._block_of[block_hash] = block
        return block

    def clear(self) -> None:
        self._block_of.clear()
        self._free = list(range(self.num_blocks))


def transfer_runs(transfers: list[KVTransfer]) -> list[list[KVTransfer]]:
    """``transfers`` as runs of one direction each, to copy run by run: every copy out, then every copy in,
    where that order reads and writes what the given one does (no copy out after a copy in may write the
    host block it reads, nor read the device block it writes); else the given order's runs. Two runs, not
    one a block, where an admission's copies in alternate with the evictions that make room for them."""
    read: set[int] = set()  # host blocks copied in so far
    written: set[int] = set()  # device blocks copied into so far
    for t in transfers:
        if not t.to_host:
            read.add(t.host_block)
            written.add(t.device_block)
        elif t.host_block in read or t.device_block in written:  # it must come after those copies in
            return [list(run) for _, run in itertools.groupby(transfers, key=lambda t: t.to_host)]
    runs = [[t for t in transfers if t.to_host], [t for t in transfers if not t.to_host]]
    return [run for run in runs if run]
