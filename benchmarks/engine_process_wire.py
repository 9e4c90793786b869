"""What one step's outputs cost to cross from the engine process to the server, per step of 256 streams, as
their outputs grow: the wire plait uses (deltas with the prompt once, encode_output -> pickle -> unpickle
-> decode_output, the server summing cumulative outputs back) against pickling the cumulative RequestOutputs
whole (every step's message then grows with every stream's length); for requests that asked for DELTA
outputs (the server's streamed ones) and for CUMULATIVE ones. Host time on this machine's CPU.

    PYTHONPATH=. python benchmarks/engine_process_wire.py \
        --out benchmarks/results/engine_process_wire_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import time

from tqdm import tqdm

from plait.entrypoints.engine_process import PICKLE_PROTOCOL, decode_output, encode_output
from plait.outputs import CompletionOutput, RequestOutput

STREAMS = 256
PROMPT_TOKENS = 512
# Output lengths at which a step is timed (the stream's token count after that step).
POSITIONS = (1, 128, 1024, 4096)
REPEATS = 5
TEXT_PER_TOKEN = "abcd"


def _output(k: int, position: int, cumulative: bool) -> RequestOutput:
    """Stream k's output of the step that made its ``position``-th token, as the engine makes it."""
    ids = [(k * 31 + i) % 49_152 for i in range(position)]
    delta_ids, delta_text = ids[-1:], TEXT_PER_TOKEN
    text, token_ids = (TEXT_PER_TOKEN * position, ids) if cumulative else (delta_text, delta_ids)
    completion = CompletionOutput(0, text, token_ids, None, None, None, delta_text, delta_ids)
    metrics = {"arrival_time": 1.0, "first_token_time": 2.0, "now": 3.0, "num_preemptions": 0,
               "first_scheduled_time": 1.5}
    prompt_ids = [(k + i) % 49_152 for i in range(PROMPT_TOKENS)]
    return RequestOutput(f"req-{k}", "p" * PROMPT_TOKENS, prompt_ids, [completion], finished=False,
                         metrics=metrics)


def _plait_wire_ms(position: int, summed: bool) -> tuple[float, int]:
    """One step of plait's wire at ``position``: (ms, bytes), the request's earlier outputs already seen;
    ``summed``: the requests asked for CUMULATIVE outputs (the server sums the deltas back), else DELTA (what
    the server's streamed requests ask for)."""
    prompt_sent = {f"req-{k}" for k in range(STREAMS)}
    received: dict = {}
    cumulative = {f"req-{k}" for k in range(STREAMS)} if summed else set()
    first = [encode_output(_output(k, 1, False), set()) for k in range(STREAMS)]
    for record in first:  # the first outputs, carrying the prompts
        decode_output(record, received, cumulative)
    for request in received.values():  # their cumulative state at position - 1
        request.token_ids = list(range(position - 1))
        request.text = TEXT_PER_TOKEN * (position - 1)
    outputs = [_output(k, position, False) for k in range(STREAMS)]
    start = time.perf_counter()
    data = pickle.dumps([encode_output(out, prompt_sent) for out in outputs], protocol=PICKLE_PROTOCOL)
    records = pickle.loads(data)
    decoded = [decode_output(record, received, cumulative) for record in records]
    elapsed = time.perf_counter() - start
    assert len(decoded[0].outputs[0].token_ids) == (position if summed else 1)
    return elapsed * 1e3, len(data)


def _whole_ms(position: int) -> tuple[float, int]:
    outputs = [_output(k, position, True) for k in range(STREAMS)]
    start = time.perf_counter()
    data = pickle.dumps(outputs, protocol=PICKLE_PROTOCOL)
    pickle.loads(data)
    return (time.perf_counter() - start) * 1e3, len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for position in tqdm(POSITIONS, desc="output lengths"):
        plait_runs = [_plait_wire_ms(position, summed=True) for _ in range(REPEATS)]
        delta_runs = [_plait_wire_ms(position, summed=False) for _ in range(REPEATS)]
        whole_runs = [_whole_ms(position) for _ in range(REPEATS)]
        rows.append({"output_tokens": position,
                     "plait_wire_delta_ms": round(min(ms for ms, _ in delta_runs), 3),
                     "plait_wire_cumulative_ms": round(min(ms for ms, _ in plait_runs), 3),
                     "plait_wire_bytes": plait_runs[0][1],
                     "whole_cumulative_ms": round(min(ms for ms, _ in whole_runs), 3),
                     "whole_cumulative_bytes": whole_runs[0][1]})
        print(rows[-1])
    result = {"what": __doc__.splitlines()[0] + " (see the module docstring)", "streams": STREAMS,
              "prompt_tokens": PROMPT_TOKENS, "repeats": REPEATS, "best_of_repeats": True,
              "machine": platform.processor() or platform.machine(), "rows": rows,
              "command": "PYTHONPATH=. python benchmarks/engine_process_wire.py --out "
                         "benchmarks/results/engine_process_wire_cpu.json"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
