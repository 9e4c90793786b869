"""Prompts given as embeddings (vLLM's --enable-prompt-embeds): greedy outputs match HF transformers'
generate(inputs_embeds=...) in fp32, chunked and beside other requests; the embedding of a prompt's ids
answers as the ids do; the prefix cache tells two prompts of embeddings apart; bad embeddings are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from plait.config import EngineConfig
from plait.entrypoints.llm import LLM
from plait.sampling_params import SamplingParams

MAX_TOKENS = 10


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def _hf_generate(hf, embeds: torch.Tensor) -> list[int]:
    with torch.no_grad():
        mask = torch.ones(1, len(embeds), dtype=torch.long)
        out = hf.generate(inputs_embeds=embeds[None], attention_mask=mask, max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, -MAX_TOKENS:].tolist()


# Gemma scales its embedding rows by sqrt(hidden) inside the layer, so given embeddings are taken as they are;
# Granite scales the layer's output by its multiplier after it, given embeddings too: as transformers reads
# inputs_embeds.
@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2", "granite"])
def test_prompt_embeds_match_hf_inputs_embeds(tiny_models, family):
    from transformers import AutoModelForCausalLM

    folder = tiny_models[family]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(5)
    scale = hf.get_input_embeddings().weight.std()
    # Random vectors, not rows of the embedding table: no token id could stand in for them. One prompt
    # spans several 16-token steps; a token prompt runs beside them.
    lengths = (5, 37, 12)
    embeds = [torch.randn(n, hf.config.hidden_size, generator=g) * scale for n in lengths]
    ids = random_prompts(1, 20, 20, seed=9)[0]
    llm = LLM(model=str(folder), block_size=8, max_num_batched_tokens=16, enable_prompt_embeds=True)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds] + [{"prompt_token_ids": ids}], _greedy(),
                        use_tqdm=False)
    for e, out in zip(embeds, outs):
        assert out.outputs[0].token_ids == _hf_generate(hf, e), family
        assert out.prompt_token_ids == [] and out.prompt is None
    with torch.no_grad():
        looked_up = hf.get_input_embeddings()(torch.tensor(ids))
    # The embedding of a prompt's ids answers as the ids themselves.
    again = llm.generate({"prompt_embeds": looked_up}, _greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert llm.engine.is_idle_and_clean()


def test_prefix_cache_tells_prompts_of_embeddings_apart(tiny_llama):
    """Two prompts of embeddings of one length share no block (their ids are the same placeholders); the same
    embeddings again hit the cache and answer the same; penalties see no placeholder ids."""
    llm = LLM(model=str(tiny_llama), block_size=8, enable_prompt_embeds=True)
    hidden = llm.engine.model_config.hidden_size
    g = torch.Generator().manual_seed(2)
    first, second = (torch.randn(24, hidden, generator=g) for _ in range(2))
    a = llm.generate({"prompt_embeds": first}, _greedy(), use_tqdm=False)[0]
    b = llm.generate({"prompt_embeds": second}, _greedy(), use_tqdm=False)[0]
    assert b.num_cached_tokens == 0 and a.outputs[0].token_ids != b.outputs[0].token_ids
    again = llm.generate({"prompt_embeds": first}, _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == a.outputs[0].token_ids
    # A repetition penalty counts prompt tokens; a prompt of embeddings has none, so with the placeholder id
    # (0) never output, the penalty changes nothing for a model that never says it.
    penalised = llm.generate({"prompt_embeds": first}, _greedy(repetition_penalty=1.0), use_tqdm=False)[0]
    assert penalised.outputs[0].token_ids == a.outputs[0].token_ids


def test_prompt_embeds_survive_preemption(tiny_llama):
    """Too few KV blocks for every request at once: prompts of embeddings are preempted and recomputed (their
    embeddings, then their outputs' ids) and answer as they do alone."""
    g = torch.Generator().manual_seed(8)
    roomy = LLM(model=str(tiny_llama), block_size=8, enable_prompt_embeds=True)
    hidden = roomy.engine.model_config.hidden_size
    embeds = [torch.randn(n, hidden, generator=g) for n in (30, 45, 25, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [roomy.generate({"prompt_embeds": e}, params, use_tqdm=False)[0].outputs[0].token_ids
             for e in embeds]
    tight = LLM(model=str(tiny_llama), block_size=8, enable_prompt_embeds=True, num_kv_blocks=20,
                max_model_len=80, max_num_batched_tokens=32)
    tight.engine.record_timeline = True
    outs = tight.generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    assert sum(s.num_preempted for s in tight.engine.timeline) > 0, "no request was preempted"
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert tight.engine.is_idle_and_clean()


def test_prompt_embeds_under_tensor_parallelism(tiny_llama):
    """Two ranks (gloo, CPU): the driver sends each step's embedding rows to the other rank with its inputs,
    and prompts of embeddings, chunked beside a token prompt, answer as on one rank."""
    g = torch.Generator().manual_seed(6)
    one = LLM(model=str(tiny_llama), block_size=8, max_num_batched_tokens=16, enable_prompt_embeds=True)
    hidden = one.engine.model_config.hidden_size
    prompts = [{"prompt_embeds": torch.randn(n, hidden, generator=g)} for n in (9, 27)]
    prompts.append({"prompt_token_ids": random_prompts(1, 12, 12, seed=3)[0]})
    want = [o.outputs[0].token_ids for o in one.generate(prompts, _greedy(), use_tqdm=False)]
    two = LLM(model=str(tiny_llama), block_size=8, max_num_batched_tokens=16, enable_prompt_embeds=True,
              tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, _greedy(), use_tqdm=False)] == want
    finally:
        two.engine.shutdown()


def test_bad_prompt_embeds_are_refused(tiny_llama):
    off = LLM(model=str(tiny_llama), block_size=8)
    hidden = off.engine.model_config.hidden_size
    with pytest.raises(ValueError, match="need enable_prompt_embeds"):
        off.generate({"prompt_embeds": torch.zeros(3, hidden)}, _greedy(), use_tqdm=False)
    llm = LLM(model=str(tiny_llama), block_size=8, max_model_len=64, enable_prompt_embeds=True)
    for bad, message in ((torch.zeros(3, hidden + 1), r"must be \[tokens, \d+\]"),
                         (torch.zeros(0, hidden), "at least one token"),
                         (torch.full((3, hidden), float("nan")), "finite floating-point"),
                         (torch.zeros(3, hidden, dtype=torch.long), "finite floating-point"),
                         (torch.zeros(70, hidden), "maximum context length is 64")):
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_embeds": bad}, _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs and truncate_prompt_tokens need prompt token ids"):
        llm.generate({"prompt_embeds": torch.zeros(3, hidden)}, _greedy(prompt_logprobs=1), use_tqdm=False)
    from plait.entrypoints.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="beam search takes text or token-id prompts, not prompt_embeds"):
        llm.beam_search([{"prompt_embeds": torch.zeros(3, hidden)}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(TypeError, match="prompt_embeds must be a torch.Tensor"):
        llm.generate({"prompt_embeds": [[0.0] * hidden]}, _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="not supported with speculative decoding yet"):
        EngineConfig(enable_prompt_embeds=True, speculative_config={"method": "ngram",
                                                                    "num_speculative_tokens": 2})
    assert llm.engine.is_idle_and_clean()


def _encoded(tensor: torch.Tensor) -> str:
    """A tensor as vLLM's clients send prompt_embeds: base64 of torch.save."""
    import base64
    import io

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_server_takes_prompt_embeds_as_vllm(tiny_llama):
    """The openai client's prompt="" with extra_body prompt_embeds (vLLM's example), one or a batch beside a
    token prompt: the answers are LLM.generate's; usage counts the embeddings' tokens; bad ones are 400s."""
    openai = pytest.importorskip("openai")
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8,
                                    enable_prompt_embeds=True))
    hidden = engine.model_config.hidden_size
    g = torch.Generator().manual_seed(4)
    embeds = [torch.randn(n, hidden, generator=g) for n in (6, 11)]
    expected = []
    for e in embeds:
        engine.add_request(e, _greedy(), request_id=f"x{len(expected)}")
        while engine.has_unfinished_requests():
            expected += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt, **extra):
            extra_body = {"return_token_ids": True, "ignore_eos": True, **extra}
            return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body=extra_body)

        one = complete("", prompt_embeds=_encoded(embeds[0]))
        assert one.choices[0].token_ids == expected[0] and one.usage.prompt_tokens == 6
        both = complete([5, 6, 7], prompt_embeds=[_encoded(e[None]) for e in embeds])  # a batch axis of one
        assert [c.token_ids for c in both.choices[:2]] == expected and len(both.choices) == 3
        assert both.usage.prompt_tokens == 6 + 11 + 3
        for bad, message in (("not base64!", "not a base64 torch.save"),
                             (_encoded(torch.zeros(3, hidden, dtype=torch.long)), "must hold a tensor of"),
                             (_encoded(torch.zeros(3, hidden + 1)), "prompt_embeds must be")):
            with pytest.raises(openai.BadRequestError, match=message):
                complete("", prompt_embeds=bad)
        with pytest.raises(openai.BadRequestError, match="cannot be used with echo"):
            complete("", prompt_embeds=_encoded(embeds[0]), echo=True)
        assert complete("", prompt_embeds=_encoded(embeds[1])).choices[0].token_ids == expected[1]
        import httpx

        schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert "prompt_embeds" in schema["properties"] and len(schema["anyOf"]) == 2
