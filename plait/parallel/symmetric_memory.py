"""The one-shot all-reduce of decode-sized tensors: every rank reads the others' copies over NVLink."""

from __future__ import annotations

import hashlib
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Tensors up to this size are summed here, larger ones by NCCL. On two H200s one such launch took 7.8 us for a
# row of 4,096 bf16 where NCCL's ring took 11.0 us in a graph, 23.5 against 32.5 us at 256 rows (2 MiB); they
# tie at 4 MiB and NCCL wins beyond (benchmarks/kernels/allreduce_graph.py,
# benchmarks/results/tensor_parallel_h200x2/allreduce_graph.json).
MAX_BYTES = 2 << 20
# Set to 0 to sum every tensor with NCCL (for comparison, or where symmetric memory misbehaves).
ENV_SWITCH = "PLAIT_SYMM_ALL_REDUCE"


class SymmetricAllReduce:
    """Sums tensors of at most ``MAX_BYTES`` over the ranks with torch's symmetric memory: one launch
    (``one_shot_all_reduce_copy_out``) copies this rank's tensor into its buffer, meets the other ranks at a
    barrier on the buffers' signal pads, and sums every rank's buffer into the tensor; CUDA graphs capture it.

    Every rank must call ``all_reduce_`` with the same shapes in the same order, as with NCCL."""

    def __init__(self, group: dist.ProcessGroup, group_name: str, buffer: torch.Tensor) -> None:
        # c10d's registry holds the group weakly: this reference keeps its name resolvable.
        self._group = group
        self.group_name = group_name
        self._buffer = buffer  # uint8, MAX_BYTES: each call's dtype is a view of it
        self.num_calls = 0  # read by tests: the decode steps' all-reduces came here

    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int, store_path: str, device: torch.device,
               nccl: dist.ProcessGroupNCCL) -> SymmetricAllReduce | None:
        """One for this rank's group, or None on every rank where any rank cannot run it (the reason logged):
        the ranks tell each other through the store first, so that they all take the same path."""
        global _rendezvous_done
        reason = _why_not(rank, world_size, device)
        store.set(f"symmetric-memory-ok-{rank}", "1" if reason is None else "0")
        if reason is None:
            ready = [store.get(f"symmetric-memory-ok-{r}") == b"1" for r in range(world_size)]
            reason = None if all(ready) else f"rank {ready.index(False)} cannot use it"
        if reason is not None:
            logger.info("tensor parallel: NCCL sums every tensor (no symmetric memory: %s)", reason)
            return None
        from torch.distributed import _symmetric_memory as symm_mem

        # The same name on every rank, and another for each engine.
        name = "plait-tp-" + hashlib.sha1(store_path.encode()).hexdigest()[:16]
        group = _register_group(name, dist.PrefixStore("symmetric-memory", store), rank, world_size, nccl)
        buffer = symm_mem.empty(MAX_BYTES, dtype=torch.uint8, device=device)
        _rendezvous_done = True
        symm_mem.rendezvous(buffer, name)
        return cls(group, name, buffer)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= MAX_BYTES and x.is_contiguous()

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``fits(x)`` must hold)."""
        self.num_calls += 1
        flat = x.view(-1)
        buffer = self._buffer.view(x.dtype)[: flat.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, flat, "sum", self.group_name, flat)
        return x


# Whether this process took part in a rendezvous. torch numbers a process's rendezvous exchanges in the store
# from 0, so a process that made one before (a second engine in the driver's process) would wait for keys its
# fresh peers never write: it says it cannot, and the group sums with NCCL.
_rendezvous_done = False


def _why_not(rank: int, world_size: int, device: torch.device) -> str | None:
    """Why this rank cannot use symmetric memory, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if _rendezvous_done:
        return "this process's one rendezvous went to an earlier engine"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has none"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return "this torch lacks symm_mem.one_shot_all_reduce_copy_out"
    if not all(hasattr(dist.ProcessGroup, f) for f in ("_register_backend", "_set_group_name")):
        return "this torch cannot register a process group by name"
    peers = [r for r in range(world_size) if r != rank]
    if not all(torch.cuda.can_device_access_peer(device.index, p) for p in peers):
        return "the GPUs cannot read each other's memory"
    return None


def _register_group(name: str, store: dist.Store, rank: int, world_size: int,
                    nccl: dist.ProcessGroupNCCL) -> dist.ProcessGroup:
    """Register the ranks as a process group named ``name``, which symmetric memory looks its peers up by: a
    ProcessGroup over the NCCL backend plait made from its store (not torch.distributed's default group, so
    one process can hold several engines)."""
    group = dist.ProcessGroup(store, rank, world_size)
    kind = dist.ProcessGroup.BackendType.NCCL
    group._set_default_backend(kind)
    group._register_backend(torch.device("cuda"), kind, nccl)
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)
    return group
