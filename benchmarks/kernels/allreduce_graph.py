"""All-reduce latency inside a CUDA graph on this host's GPUs, NCCL against plait's one-shot
symmetric-memory all-reduce (plait.parallel.symmetric_memory): one process a GPU, the NCCL group made from a
store as plait.parallel.group makes it; 64 all-reduces of [rows, 4096] bf16 a replay (each after a tiny mul
kernel, as each follows a matmul in a forward). Both are checked against the expected sums first. Prints one
JSON line per rank; ``--out`` writes rank 0's."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)
HIDDEN = 4096
PER_REPLAY = 64
REPLAYS = 20


def _graphed(reduce, y: torch.Tensor, world: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and any set-up) outside the capture
        for _ in range(3):
            reduce(y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PER_REPLAY):
            y.mul_(1.0 / world)
            reduce(y)
    return graph


def _time(graph: torch.cuda.CUDAGraph) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPLAYS / PER_REPLAY * 1e6


def _measure(rank: int, world: int, store_path: str, results: mp.Queue) -> None:
    from plait.parallel import symmetric_memory

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world)
    pg = dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
    symmetric_memory.MAX_BYTES = max(ROWS) * HIDDEN * 2  # every size here, to find where NCCL wins
    symm = symmetric_memory.SymmetricAllReduce.create(store, rank, world, store_path, device, pg)
    reducers = {"nccl": lambda y: pg.allreduce([y]).wait()}
    if symm is not None:
        reducers["symmetric"] = symm.all_reduce_
    out: dict[str, object] = {"rank": rank, "device": torch.cuda.get_device_name(device),
                              "torch": torch.__version__, "world_size": world, "symmetric": symm is not None}
    for rows in ROWS:
        row: dict[str, object] = {"rows": rows, "bytes": rows * HIDDEN * 2}
        for name, reduce in reducers.items():
            g = torch.Generator(device=device).manual_seed(rows)
            parts = [torch.randn((rows, HIDDEN), generator=g, device=device).to(torch.bfloat16)
                     for _ in range(world)]
            y = parts[rank].clone()
            reduce(y)
            torch.cuda.synchronize()
            # Two ranks: a + b rounds once, in either order; more ranks may sum in another order.
            want = sum(p.float() for p in parts)
            row[f"{name}_max_error"] = float((y.float() - want).abs().max())
            y.fill_(1.0)
            graph = _graphed(reduce, y, world)
            y.fill_(1.0)
            graph.replay()
            torch.cuda.synchronize()
            row[f"{name}_graph_correct"] = bool((y == 1).all())
            row[f"{name}_us"] = _time(graph)
            del graph
        out.setdefault("rows", []).append(row)
    results.put(out)
    pg.abort()  # a group left to its destructor waits for its peers at exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write rank 0's results (JSON) here")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    store_path = os.path.join(tempfile.mkdtemp(), "store")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_measure, args=(r, world, store_path, results)) for r in range(world)]
    for p in procs:
        p.start()
    lines = [results.get(timeout=120) for _ in procs]
    for line in sorted(lines, key=lambda d: d["rank"]):
        print(json.dumps(line))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(min(lines, key=lambda d: d["rank"]), f, indent=1)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
