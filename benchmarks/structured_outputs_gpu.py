"""Structured outputs and bad_words on the GPU path (bf16, CUDA graphs, overlapped steps) with the real
SmolLM2 tokenizer and a small random Llama over its vocabulary: every constrained output must match.

    python benchmarks/structured_outputs_gpu.py --prepare DIR   # where gguf is installed (this machine)
    PYTHONPATH=.:<llguidance's folder> python benchmarks/structured_outputs_gpu.py DIR   # on the GPU

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prepare", action="store_true")
    args = parser.parse_args()
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
