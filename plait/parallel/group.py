"""The tensor-parallel process group: this process's rank, and the collectives the model and runner use."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives that wait longer than this fail instead of hanging (a worker that died mid-step).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
# NVLink multicast (NCCL's NVLS) takes a share of the GPUs' fabric for little gain at decode-sized
# all-reduces, and can leave shared machines' GPUs unusable when a process dies holding it: off unless set.
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Who runs the scheduler, samples, and sends every other rank its steps.
DRIVER_RANK = 0


@dataclass(frozen=True)
class ParallelRank:
    """Where one process sits in a tensor-parallel group (set by the driver's runner, picklable)."""

    rank: int
    world_size: int
    store_path: str  # a FileStore's file: the ranks meet through it (one host)

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK


class TPGroup:
    """The ranks' process group: NCCL on CUDA (its collectives are captured by CUDA graphs), gloo on CPU.

    Made directly from a store, not as torch.distributed's default group, so one process can hold several
    engines (tests do) and none leaks into code that uses torch.distributed for itself."""

    def __init__(self, where: ParallelRank, device: torch.device) -> None:
        self.rank, self.world_size, self.device = where.rank, where.world_size, device
        store = dist.FileStore(where.store_path, where.world_size)
        if device.type == "cuda":
            for name, value in NCCL_DEFAULTS.items():
                os.environ.setdefault(name, value)
            self._pg = dist.ProcessGroupNCCL(store, where.rank, where.world_size,
                                             dist.ProcessGroupNCCL.Options())
        else:
            self._pg = dist.ProcessGroupGloo(store, where.rank, where.world_size, GROUP_TIMEOUT)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; the current stream waits for it (on CUDA the host does not)."""
        self._pg.allreduce([x]).wait()
        return x

    def broadcast_(self, x: torch.Tensor, src: int = DRIVER_RANK) -> torch.Tensor:
        """Every rank's ``x`` becomes rank ``src``'s, in place."""
        self._pg.broadcast(x, src).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest of the ranks' ``value``s (e.g. the KV blocks every rank has room for)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        """Free the communicators (NCCL's would otherwise keep the process from exiting)."""
        shutdown = getattr(self._pg, "shutdown", None) or getattr(self._pg, "abort", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # already torn down by a failed peer
                pass
