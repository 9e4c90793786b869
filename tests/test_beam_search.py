"""LLM.beam_search against a plain reference beam search over HF transformers' next-token logprobs (fp32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from plait import LLM, BeamSearchParams
from plait.entrypoints.beam_search import get_beam_search_score

PROMPTS = [[5, 17, 300, 42, 9], [100, 7, 250]]
BEAM_WIDTH = 3
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def eos_model(tiny_llama, tmp_path_factory):
    """The tiny Llama with, as its EOS, a token its first prompt's beams meet in the first step (the second
    most likely), so finished beams and their length penalty really compete with live ones."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    eos = int(_next_logprobs(hf, PROMPTS[0]).topk(2).indices[1])
    folder = tmp_path_factory.mktemp("tiny-llama-eos")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    return folder, hf, eos


@pytest.fixture(scope="module")
def llm(eos_model) -> LLM:
    return LLM(str(eos_model[0]), dtype="float32", device="cpu")


def _next_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def _reference(hf, prompt: list[int], params: BeamSearchParams, eos: int) -> list[tuple[list[int], float]]:
    """Beam search written out plainly: every step each beam's 2 x width most likely tokens are candidates;
    an EOS one is a finished sequence, the width best of the others live on; at the end all rank by score."""
    beams, finished = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in beams:
            top = _next_logprobs(hf, tokens).topk(2 * params.beam_width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                ended = token == eos and not params.ignore_eos
                (finished if ended else candidates).append((tokens + [token], cum + logprob))
        beams = sorted(candidates, key=lambda beam: beam[1], reverse=True)[:params.beam_width]
    ranked = sorted(finished + beams, reverse=True,
                    key=lambda beam: get_beam_search_score(beam[0], beam[1], {eos}, params.length_penalty))
    return ranked[:params.beam_width]


# (length_penalty, ignore_eos, whether a sequence ended by EOS ranks among the best): a steep penalty favours
# the longer live beams over the short finished one.
CASES = [(1.0, False, True), (3.0, False, False), (1.0, True, False)]


@pytest.mark.parametrize(("length_penalty", "ignore_eos", "eos_ranks"), CASES)
def test_beam_search_matches_a_reference_over_hf_logprobs(eos_model, llm, length_penalty, ignore_eos,
                                                          eos_ranks):
    _, hf, eos = eos_model
    params = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = _reference(hf, prompt, params, eos)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for sequence, (_, cum) in zip(out.sequences, expected):
            assert sequence.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(sequence.logprobs) == len(sequence.tokens) - len(prompt)
    finished = [s for out in outputs for s in out.sequences if s.finish_reason == "stop"]
    assert bool(finished) == eos_ranks
    assert all(s.tokens[-1] == eos and s.stop_reason == eos for s in finished)


def test_beam_search_params_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)  # 2 x 11 candidates exceed the 20 logprobs
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))


def test_score_counts_the_prompt_and_not_a_final_eos():
    # vLLM's: cum_logprob / len ** length_penalty, the length of prompt and output, less a final EOS.
    assert get_beam_search_score([1, 2, 3, 9], -4.0, {9}, 1.0) == pytest.approx(-4.0 / 3)
    assert get_beam_search_score([1, 2, 3, 4], -4.0, {9}, 2.0) == pytest.approx(-4.0 / 16)
