"""The tensor-parallel process group: this process's rank, and the collectives the model and runner use."""

from __future__ import annotations

import ctypes
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.parallel.symmetric_memory import SymmetricAllReduce

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
    """The ranks' process group: NCCL on CUDA (its collectives are captured by CUDA graphs), gloo on CPU. On
    CUDA, decode-sized all-reduces go through symmetric memory instead (SymmetricAllReduce), where the GPUs
    can read each other's.

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
            self.symmetric = SymmetricAllReduce.create(store, where.rank, where.world_size, where.store_path,
                                                       device, self._pg)
        else:
            self._pg = dist.ProcessGroupGloo(store, where.rank, where.world_size, GROUP_TIMEOUT)
            self.symmetric = None

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; the current stream waits for it (on CUDA the host does not)."""
        if self.symmetric is not None and self.symmetric.fits(x):
            return self.symmetric.all_reduce_(x)
        self._pg.allreduce([x]).wait()
        return x

    def broadcast_(self, x: torch.Tensor, src: int = DRIVER_RANK) -> torch.Tensor:
        """Every rank's ``x`` becomes rank ``src``'s, in place."""
        self._pg.broadcast(x, src).wait()
        return x

    def close(self) -> None:
        """Let go of this rank's communicators. Gloo's are dropped: its destructor closes them. An NCCL group
        is never torn down: its abort and its destructor both wait on NCCL's proxy threads, which can wait
        for peers that are gone (NVIDIA/nccl#1013): on two H200s each abort stalled until given up on, and
        the process then hung at exit in the destructor. So the group (and the symmetric-memory group over it)
        keeps one reference no one holds until the process ends, and the OS frees its memory and connections
        then."""
        if self.device.type == "cuda":
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._pg))
            if self.symmetric is not None:  # its group wraps the NCCL one, and peers map its buffer
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.symmetric))
        self._pg = None
        self.symmetric = None
