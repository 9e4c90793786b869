"""Structured outputs and bad_words on the GPU path (bf16, CUDA graphs, overlapped steps) with the real
SmolLM2 tokenizer and a small random Llama over its vocabulary: every constrained output must match.

    python benchmarks/structured_outputs_gpu.py --prepare DIR   # where gguf is installed (this machine)
    PYTHONPATH=.:<llguidance's folder> python benchmarks/structured_outputs_gpu.py DIR   # on the GPU
    ... structured_outputs_gpu.py DIR --throughput 256 --out result.json   # JSON mode's cost at scale
    ... structured_outputs_gpu.py DIR --throughput 256 --collect-first    # and without late sampling

--throughput N runs N requests at once through a Qwen3-0.6B-sized random Llama over the same vocabulary:
unconstrained, under a regex no output can end before max_tokens (the same token count, so the cost of
the masks and of the steps not overlapping), as JSON objects (which end early), and unconstrained again;
output tokens a second for each.

--prepare writes DIR: the default model's tokenizer (save_pretrained) and a config.json for random weights.
The GPU image has neither gguf nor llguidance: carry DIR and an unpacked llguidance wheel with the tree.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams, StructuredOutputsParams

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
          "bos_token_id": 1, "eos_token_id": 2}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "mood": {"enum": ["happy", "sad"]}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
SPECS = [dict(json=SCHEMA, disable_any_whitespace=True), dict(regex=PHONE),
         dict(json_object=True, disable_any_whitespace=True)]
NUM_REQUESTS = 24


def prepare(folder: Path) -> None:
    from plait.loader.source import default_model_path
    from plait.loader.tokenizer import load_tokenizer

    load_tokenizer(default_model_path()).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(CONFIG))


def run_all(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return outs


def check_output(spec: dict, text: str) -> None:
    if "json" in spec:
        value = json.loads(text)
        assert set(value) == {"name", "age", "mood"} and value["mood"] in ("happy", "sad"), text
    elif "regex" in spec:
        assert re.fullmatch(PHONE, text), text
    else:
        assert isinstance(json.loads(text), dict), text


def contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i: i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


# --throughput's model: Qwen3-0.6B's dimensions over SmolLM2's vocabulary.
THROUGHPUT_CONFIG = dict(CONFIG, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128)
THROUGHPUT_TOKENS = 128
# Lower-case words, as long as the model likes (it rarely picks EOS among the ~10K tokens allowed), and the
# same with a minimum length: a counted repetition makes a lexer state per count, which llguidance's mask
# cache cannot share across rows or steps.
LONG_TEXT = r"[a-z ]+"
COUNTED_TEXT = r"[a-z ]{2000,}"
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)


def throughput(folder: Path, num: int, collect_first: bool = False) -> dict:
    """Output tok/s of ``num`` requests at once, unconstrained and as JSON objects (ignore_eos off: a JSON
    object ends when its grammar does); with ``collect_first`` the constrained runs again without late
    sampling."""
    import shutil
    import tempfile
    import time

    big = Path(tempfile.mkdtemp())
    for f in folder.iterdir():
        if f.name != "config.json":
            shutil.copy(f, big / f.name)
    (big / "config.json").write_text(json.dumps(THROUGHPUT_CONFIG))
    engine = LLMEngine(EngineConfig(model=str(big), load_format="dummy", max_model_len=1024,
                                    max_num_seqs=num))
    json_mode = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    samples_late = engine._samples_late
    result = {}
    long_text = StructuredOutputsParams(regex=LONG_TEXT)
    runs = [("unconstrained", {}), ("regex " + LONG_TEXT, dict(structured_outputs=long_text)),
            ("regex " + COUNTED_TEXT, dict(structured_outputs=StructuredOutputsParams(regex=COUNTED_TEXT))),
            ("json_object", dict(structured_outputs=json_mode)), ("penalties", PENALTIES),
            ("unconstrained again", {})]
    if collect_first:
        # The same runs with the steps after grammar / penalty rows collected before the next launch (the
        # engine before late sampling): their forward no longer overlaps the host's masks.
        runs += [(f"{name}, collect first", kw) for name, kw in runs[1:5]]
    for name, kw in runs:
        engine._samples_late = (lambda plan, step: False) if name.endswith("collect first") else samples_late
        for i in range(num):
            engine.add_request(f"Item {i}: describe it as JSON.", SamplingParams(
                max_tokens=THROUGHPUT_TOKENS, temperature=1.0, seed=i, **kw))
        start, steps = time.perf_counter(), engine.num_steps
        outs = run_all(engine)
        seconds, steps = time.perf_counter() - start, engine.num_steps - steps
        tokens = sum(len(o.token_ids) for o in outs.values())
        result[name] = dict(output_tokens=tokens, seconds=seconds, output_tok_per_s=tokens / seconds,
                            steps=steps, ms_per_step=1e3 * seconds / steps)
        print(name, result[name], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prepare", action="store_true")
    parser.add_argument("--throughput", type=int, default=0, metavar="N")
    parser.add_argument("--collect-first", action="store_true",
                        help="with --throughput: the constrained runs again, collecting each step before "
                             "the next launches (no late sampling)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.throughput:
        result = throughput(args.folder, args.throughput, args.collect_first)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if args.prepare:
        args.folder.mkdir(parents=True, exist_ok=True)
        prepare(args.folder)
        return
    engine = LLMEngine(EngineConfig(model=str(args.folder), load_format="dummy", max_model_len=1024,
                                    max_num_seqs=32))
    print("device", engine.runner.device, "graphs", engine.runner.graphs is not None)
    specs = {}
    for i in range(NUM_REQUESTS):
        specs[f"g{i}"] = SPECS[i % len(SPECS)]
        params = SamplingParams(max_tokens=64, temperature=[0.0, 1.0, 0.8][i % 3], seed=i if i % 2 else None,
                                structured_outputs=StructuredOutputsParams(**specs[f"g{i}"]))
        engine.add_request(f"Item {i}:", params, request_id=f"g{i}")
    engine.add_request("Hello world", SamplingParams(max_tokens=32, temperature=0.0), request_id="free")
    outs = run_all(engine)
    cut = 0
    for rid, spec in specs.items():
        if outs[rid].finish_reason == "length":  # random weights may write digits until max_tokens
            cut += 1
            continue
        assert outs[rid].finish_reason == "stop", (outs[rid].finish_reason, outs[rid].stop_reason)
        check_output(spec, outs[rid].text)
    assert cut <= NUM_REQUESTS // 3, cut
    print(f"structured outputs: {NUM_REQUESTS}, valid and finished: {NUM_REQUESTS - cut}, cut by max_tokens: "
          f"{cut}; e.g. {[outs[r].text for r in ('g0', 'g1')]}")
    word = outs["free"].text.split()[0]
    seqs = {tuple(engine.tokenizer.encode(p + word, add_special_tokens=False)) for p in ("", " ")}
    assert any(contains(outs["free"].token_ids, s) for s in seqs)
    engine.add_request("Hello world", SamplingParams(max_tokens=32, temperature=0.0, bad_words=[word]),
                       request_id="banned")
    banned = run_all(engine)["banned"]
    assert not any(contains(banned.token_ids, s) for s in seqs)
    print(f"bad_words: {word!r} gone: {outs['free'].text[:40]!r} -> {banned.text[:40]!r}")


if __name__ == "__main__":
    main()
