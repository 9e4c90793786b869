"""NCCL all-reduce latency inside a CUDA graph on this host's GPUs: one process a GPU, torch.distributed's
NCCL group made from a store as plait.parallel.group makes it; 64 all-reduces of [rows, 4096] bf16 a replay
(each after a tiny mul kernel, as each follows a matmul in a forward). Prints one JSON line per rank."""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = (1, 4, 64, 256)
HIDDEN = 4096
PER_REPLAY = 64
REPLAYS = 20


def _measure(rank: int, world: int, store_path: str, results: mp.Queue) -> None:
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    pg = dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
    device = torch.device("cuda", rank)
    out: dict[str, object] = {"rank": rank}
    for rows in ROWS:
        y = torch.ones((rows, HIDDEN), device=device, dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and the communicator's set-up) outside the capture
            for _ in range(3):
                pg.allreduce([y]).wait()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(PER_REPLAY):
                y.mul_(1.0 / world)
                pg.allreduce([y]).wait()
        y.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        out[f"correct_{rows}"] = bool((y == 1).all())
        start = time.perf_counter()
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        out[f"us_per_allreduce_{rows}"] = (time.perf_counter() - start) / REPLAYS / PER_REPLAY * 1e6
    results.put(out)
    pg.abort()  # a group left to its destructor waits for its peers at exit


def main() -> None:
    world = torch.cuda.device_count()
    store_path = os.path.join(tempfile.mkdtemp(), "store")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_measure, args=(r, world, store_path, results)) for r in range(world)]
    for p in procs:
        p.start()
    for _ in procs:
        print(json.dumps(results.get(timeout=300)))
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
