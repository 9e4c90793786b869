"""The tensor-parallel process group: this process's rank, and the collectives the model and runner use."""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives that wait longer than this fail instead of hanging (a worker that died mid-step).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
# NVLink multicast (NCCL's NVLS) takes a share of the GPUs' fabric for little gain at decode-sized
# all-reduces, and can leave shared machines' GPUs unusable when a process dies holding it: off unless set.
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# How long closing a group may take before the process goes on without it.
ABORT_WAIT_SECONDS = 10.0
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

    def close(self) -> None:
        """Free this rank's communicators without waiting for the other ranks: an NCCL group that is shut
        down (or destroyed at exit) waits for its peers, which hung a driver whose workers had already
        gone. Abort is local; if even it stalls, the process moves on and leaves it to exit."""
        abort = getattr(self._pg, "abort", None)
        if abort is None:
            return
        done = threading.Thread(target=_quietly, args=(abort,), name="plait-tp-abort", daemon=True)
        done.start()
        done.join(ABORT_WAIT_SECONDS)


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except RuntimeError:  # already torn down by a failed peer
        pass
