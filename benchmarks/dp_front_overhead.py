"""What the data-parallel front costs (plait/entrypoints/data_parallel.py): streamed chunks a second.

A stand-in replica (an SSE endpoint answering as fast as it can, no engine) is read directly and through
the front.

Each server is a process of its own (uvicorn), the client this one; ``--streams`` streams at once, each of
``--chunks`` SSE chunks of a completion's size. The ratio bounds the front's share of a serving box's CPU: a
front that relays fewer chunks a second than the replicas make would cap throughput. Writes a JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

from plait.bench.serve_client import wait_healthy

# One streamed completion chunk, as plait's server writes it (a token of text, usage off).
CHUNK = ('data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764300000,'
         '"model":"m","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]}\n\n')
REPLICA_APP = """
import sys
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
import uvicorn
CHUNK, N = {chunk!r}, {chunks}
app = FastAPI()

@app.get("/health")
async def health():
    return {{}}

@app.post("/v1/completions")
async def completions():
    async def body():
        for _ in range(N):
            yield CHUNK
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(body(), media_type="text/event-stream")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""
FRONT_APP = """
import sys
import uvicorn
from plait.entrypoints.data_parallel import DataParallelFront, Replica

class Running:  # stands in for a replica process the front does not start here
    def poll(self):
        return None

front = DataParallelFront([Replica(0, Running(), url=sys.argv[2])], api_key=None, max_body_bytes=1 << 20)
uvicorn.run(front.app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def _serve(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env)


def _wait(url: str) -> None:
    if not wait_healthy(url, limit_s=60, poll_s=0.1, probe_timeout_s=1.0):
        raise RuntimeError(f"{url} did not start")


async def _chunks_per_second(url: str, streams: int) -> float:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        async def one() -> int:
            n = 0
            async with client.stream("POST", f"{url}/v1/completions", json={}) as r:
                async for _ in r.aiter_bytes():
                    n += 1
            return n

        await one()  # warm the connections up
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        return 0.0 if not (elapsed := time.perf_counter() - start) else streams / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=500, help="SSE chunks per stream")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    replica_url, front_url = "http://127.0.0.1:18701", "http://127.0.0.1:18702"
    replica = _serve(REPLICA_APP.format(chunk=CHUNK, chunks=args.chunks), "18701")
    front = _serve(FRONT_APP, "18702", replica_url)
    try:
        _wait(replica_url)
        _wait(front_url)
        rates = {}
        for name, url in (("direct", replica_url), ("through_front", front_url)):
            streams_per_s = asyncio.run(_chunks_per_second(url, args.streams))
            rates[name] = streams_per_s * (args.chunks + 1)  # chunks a second, [DONE] included
    finally:
        for p in (front, replica):
            p.terminate()
            p.wait()
    result = {"what": __doc__.splitlines()[0], "cpu_count": os.cpu_count(), "streams": args.streams,
              "chunks_per_stream": args.chunks, "chunks_per_s": rates,
              "front_over_direct": rates["through_front"] / rates["direct"]}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
