"""Speculative decoding (n-gram prompt lookup): the drafter, the config, and the engine end to end. A kept
draft is the token the model would have produced anyway, so every output, greedy or seeded, equals the
output without speculation; only the number of steps changes."""

from __future__ import annotations

import importlib.util
import logging
import re

import numpy as np
import pytest
import torch
from conftest import PHONE, TINY_VOCAB, random_prompts

from plait.config import EngineConfig, SpeculativeConfig
from plait.engine.drafter import NgramDrafter, ReplayDrafter, ngram_lookup
from plait.engine.engine import LLMEngine
from plait.engine.kv_cache import KVCacheManager
from plait.engine.request import Request, RequestStatus
from plait.engine.scheduler import Scheduler
from plait.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 24


# -- the drafter ---------------------------------------------------------------------------------


def test_lookup_takes_the_latest_occurrence_of_the_longest_suffix():
    tokens = np.array([5, 6, 7, 1, 9, 9, 6, 7, 2, 3, 6, 7])
    # "6 7" recurs twice; the latest earlier one is followed by 2, 3.
    assert ngram_lookup(tokens, 1, 2, 2) == [2, 3]
    # A longer suffix wins over a shorter one: "3 6 7" never recurred, "6 7" did. Its continuation may run
    # into the suffix itself.
    assert ngram_lookup(tokens, 2, 3, 4) == [2, 3, 6, 7]
    # Where no occurrence is followed by k tokens, the earliest (the longest continuation), to the end.
    assert ngram_lookup(np.array([1, 2, 1, 2, 1, 2]), 2, 2, 5) == [1, 2, 1, 2]
    assert ngram_lookup(np.array([8, 1, 2, 9, 1, 2, 5, 1, 2]), 2, 2, 5) == [9, 1, 2, 5, 1]


def _lookup_by_windows(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """ngram_lookup's definition, spelled out: every window of n tokens, n from max_n down."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = [s for s in range(length - n) if tokens[s: s + n] == tokens[length - n:]]
        if hits:
            full = [s for s in hits if s + n + k <= length]
            start = (full[-1] if full else hits[0]) + n
            return tokens[start: start + k]
    return []


def test_lookup_matches_its_definition_on_random_contexts():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n, k = min_n + int(rng.integers(0, 4)), int(rng.integers(1, 6))
        assert ngram_lookup(np.array(tokens), min_n, max_n, k) == _lookup_by_windows(tokens, min_n, max_n, k)


def test_lookup_without_a_recurring_ngram_proposes_nothing():
    assert ngram_lookup(np.array([1, 2, 3, 4]), 1, 3, 4) == []
    assert ngram_lookup(np.array([4, 1, 2, 4]), 2, 3, 4) == []  # "4" recurs, but min_n is 2
    assert ngram_lookup(np.array([7]), 1, 3, 4) == []
    assert ngram_lookup(np.array([4, 1, 4]), 1, 1, 0) == []


def test_drafter_follows_a_growing_history_and_its_limit():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    drafter = NgramDrafter(config)
    request = Request("r", [1, 2, 3, 1], SamplingParams(), max_tokens=50)
    assert drafter.propose(request, limit=8) == (2, 3, 1)
    assert drafter.propose(request, limit=1) == (2,)
    request.output_token_ids += [2, 3] * 200  # grows past the history's first capacity
    assert drafter.propose(request, limit=8) == (2, 3, 2)
    assert drafter.propose(request, limit=0) == ()
    # The last token still on the device: the lookup's first token stands in for it; the drafts follow.
    request.num_pending_tokens = 1
    assert drafter.propose(request, limit=8) == (3, 2, 3)
    drafter.forget(request)
    assert drafter._histories == {}


# -- the config ----------------------------------------------------------------------------------


def test_speculative_config_parses_vllm_forms():
    as_json = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert as_json.speculative_config == SpeculativeConfig("ngram", 4, 5, 5)  # vLLM's lookup defaults
    only_max = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert EngineConfig(speculative_config={}).speculative_config is None
    assert EngineConfig(speculative_config="").speculative_config is None


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ("[4]", "JSON object"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config key"),
])
def test_bad_speculative_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


# -- the scheduler -------------------------------------------------------------------------------


def _decoding(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    request = Request(request_id, prompt, SamplingParams(), max_tokens=max_tokens)
    request.output_token_ids = [prompt[0]]
    return request


def _scheduler(num_blocks: int, budget: int = 64) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=budget, block_size=4, enable_prefix_caching=False,
                          speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    return Scheduler(config, KVCacheManager(num_blocks, 4), drafter=NgramDrafter(config.speculative_config))


def _run_prompts(scheduler: Scheduler, requests: list[Request]) -> None:
    """Make the requests running decodes: prompts in the KV cache, first outputs on the host."""
    for r in requests:
        assert scheduler.kv_cache.allocate(r, r.num_prompt_tokens)
        r.num_computed_tokens = r.num_prompt_tokens
        r.status = RequestStatus.RUNNING
        scheduler.running.append(r)


def test_drafts_stay_within_max_tokens_and_the_budget():
    scheduler = _scheduler(num_blocks=64, budget=7)
    short = _decoding("short", [3, 4, 5, 3, 4, 5, 3, 4], max_tokens=3)  # room for 2 more: 1 sample + 1 draft
    long = _decoding("long", [6, 7, 8, 6, 7, 8, 6, 7], max_tokens=50)
    _run_prompts(scheduler, [short, long])
    plan = scheduler.schedule()
    drafts = {row.request.request_id: row.draft_token_ids for row in plan.rows}
    assert drafts["short"] == (4,)  # [.., 3, 4, 3] -> "3" last seen before 4
    # The budget (7) less short's 2 tokens leaves long 5: its own token and 4 drafts.
    assert drafts["long"] == (7, 8, 6, 7)
    assert plan.num_tokens == 7 and plan.num_draft_tokens == 5


def test_drafts_never_preempt_a_running_request():
    # 4-token blocks: each 8-token prompt holds 2 of the 7 usable blocks. A row with 4 drafts needs 2 more
    # (13 tokens), a plain decode 1: a's drafts fit, b's do not.
    scheduler = _scheduler(num_blocks=8)
    a = _decoding("a", [3, 4, 5, 3, 4, 5, 3, 4], max_tokens=50)
    b = _decoding("b", [6, 7, 8, 6, 7, 8, 6, 7], max_tokens=50)
    _run_prompts(scheduler, [a, b])
    plan = scheduler.schedule()
    assert not plan.preempted and len(plan.rows) == 2
    assert [len(row.draft_token_ids) for row in plan.rows] == [4, 0]  # b decodes without drafts


# -- the engine ----------------------------------------------------------------------------------


def _engine(model, speculative: dict | None, **knobs) -> LLMEngine:
    config = dict(model=str(model), seed=3, num_kv_blocks=256, block_size=8, max_num_batched_tokens=48,
                  enable_prefix_caching=False, speculative_config=speculative)
    return LLMEngine(EngineConfig(**{**config, **knobs}))


def _repetitive_prompts() -> list[list[int]]:
    """Prompts whose phrases recur (as code, quotes and lists do), and random ones, arriving together."""
    phrases = random_prompts(4, 3, 6, seed=11)
    repetitive = [(p * 6)[: 8 + 5 * i] for i, p in enumerate(phrases)]
    return repetitive + random_prompts(3, 5, 40, seed=12)


def _generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
              ) -> dict[int, tuple[list[int], str, list]]:
    """Request i arrives at step i (drafting rows run beside prompt chunks): i -> (ids, reason, logprobs)."""
    done, pending, step = {}, list(enumerate(zip(prompts, params))), 0
    while pending or engine.has_unfinished_requests():
        if pending and step >= pending[0][0]:
            i, (prompt, p) = pending.pop(0)
            engine.add_request(prompt, p, request_id=f"r-{i}")
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[int(out.request_id[2:])] = (c.token_ids, c.finish_reason, c.logprobs)
        step += 1
    assert engine.is_idle_and_clean()
    return done


def _generate_aborting(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                       aborts: dict[int, str]) -> dict[int, tuple[list[int], str, list]]:
    """Every prompt added at once, request ``aborts[n]`` aborted before step n: i -> (ids, reason, logprobs)
    of the requests that finished otherwise."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r-{i}")
    done, n = {}, 0
    while engine.has_unfinished_requests():
        if n in aborts:
            engine.abort_request(aborts[n])
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[int(out.request_id[2:])] = (c.token_ids, c.finish_reason, c.logprobs)
        n += 1
    return done


def _assert_same(got: dict, want: dict) -> None:
    for i in want:
        ids, reason, logprobs = got[i]
        assert (ids, reason) == want[i][:2], f"request {i}"
        if logprobs is not None:
            for a, b in zip(logprobs, want[i][2], strict=True):
                assert a.token_id == b.token_id and set(a.top) == set(b.top)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


class OracleDrafter(ReplayDrafter):
    """ReplayDrafter (the model's own choices, so they are kept), every third proposal with its last draft
    changed (so it is rejected there): verification, the roll-back of rejected drafts' KV and the overlap
    rules under drafts that n-gram lookups on a random tiny model would seldom make."""

    def __init__(self, config: SpeculativeConfig, outputs: dict[int, tuple]) -> None:
        super().__init__(config, {f"r-{i}": out[0] for i, out in outputs.items()})
        self.calls = 0
        self.with_pending = 0  # proposals for rows whose last token was still in flight

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        drafts = list(super().propose(request, limit))
        self.calls += 1
        self.with_pending += bool(drafts and request.num_pending_tokens)
        if drafts and self.calls % 3 == 0:
            drafts[-1] = (drafts[-1] + 1) % TINY_VOCAB
        return tuple(drafts)


@pytest.fixture(scope="module")
def plain_engine(tiny_llama):
    return _engine(tiny_llama, None)


def _with_oracle(engine: LLMEngine, outputs: dict) -> OracleDrafter:
    oracle = OracleDrafter(engine.config.speculative_config, outputs)
    engine.drafter = engine.scheduler.drafter = oracle
    return oracle


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
MIXED_PARAMS = [
    SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, seed=6, max_tokens=MAX_TOKENS, ignore_eos=True,
                   repetition_penalty=1.3, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # max_tokens inside the drafts
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=4),  # EOS banned, then allowed
    SamplingParams(temperature=1.0, seed=8, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                   allowed_token_ids=list(range(40))),
    SamplingParams(temperature=0.5, min_p=0.1, seed=9, max_tokens=MAX_TOKENS),
]


@pytest.mark.parametrize("sampling", ["greedy", "seeded-penalties-stops"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_kept_drafts_are_the_tokens_the_model_would_have_produced(tiny_llama, plain_engine, sampling,
                                                                 async_scheduling):
    """With drafts that are the model's own choices (and some wrong ones), outputs equal those without
    speculation in fewer steps. Each position samples with the draw it would have had (its seed and
    output index), after the drafts before it as outputs (penalties count them); a stop or max_tokens
    inside the kept drafts ends the request there. A step overlaps the one before only if that one carried
    no drafts, and rows whose last token is in flight draft too."""
    prompts = _repetitive_prompts()
    params = [GREEDY] * len(prompts) if sampling == "greedy" else list(MIXED_PARAMS)
    if sampling != "greedy":  # a stop token among prompt 2's first outputs ends it mid-drafts
        first = _generate(plain_engine, prompts[2:3], [params[2]])[0][0]
        params[2] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   stop_token_ids=[first[3]])
    steps = plain_engine.num_steps
    want = _generate(plain_engine, prompts, params)
    plain_steps = plain_engine.num_steps - steps
    spec = _engine(tiny_llama, NGRAM, async_scheduling=async_scheduling)
    oracle = _with_oracle(spec, want)
    overlaps = []
    can_overlap = spec._can_overlap

    def spy_overlap(plan, step):
        overlaps.append((plan.num_draft_tokens > 0, can_overlap(plan, step)))
        return overlaps[-1][1]

    spec._can_overlap = spy_overlap
    _assert_same(_generate(spec, prompts, params), want)
    stats = spec.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec.num_steps < plain_steps
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    assert {drafted for drafted, overlapped in overlaps if overlapped} <= {False}
    if async_scheduling and sampling == "greedy":
        assert (False, True) in overlaps and oracle.with_pending > 0
    if not async_scheduling:
        assert not any(overlapped for _, overlapped in overlaps)


def test_ngram_drafts_leave_outputs_unchanged(tiny_llama, plain_engine):
    """The real drafter on a random tiny model: what it drafts, kept or not, changes no output."""
    prompts = _repetitive_prompts()
    params = [GREEDY] * len(prompts)
    spec = _engine(tiny_llama, NGRAM)
    _assert_same(_generate(spec, prompts, params), _generate(plain_engine, prompts, params))
    assert spec.spec_stats.num_draft_tokens > 0


def test_prefix_cache_keeps_only_verified_blocks(tiny_llama, plain_engine):
    """Blocks are registered only up to the kept tokens: a later prompt that extends an earlier request's
    output hits its cached blocks and continues exactly as an engine without cache or speculation."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    prompt = _repetitive_prompts()[1]
    want = _generate(plain_engine, [prompt], greedy)
    spec = _engine(tiny_llama, NGRAM, enable_prefix_caching=True)
    _with_oracle(spec, want)
    first = _generate(spec, [prompt], greedy)[0][0]
    assert first == want[0][0] and spec.spec_stats.num_accepted_tokens > 0
    assert spec.spec_stats.num_accepted_tokens < spec.spec_stats.num_draft_tokens
    longer = prompt + first[:33]
    hits_before = spec.kv_cache.stats.hits
    spec.drafter = spec.scheduler.drafter = NgramDrafter(spec.config.speculative_config)
    got = _generate(spec, [longer], greedy)
    assert spec.kv_cache.stats.hits - hits_before >= 32
    assert got[0][0] == _generate(plain_engine, [longer], greedy)[0][0]


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")
def test_structured_output_rows_decode_without_drafts(default_with_ngram):
    spec = default_with_ngram
    drafted = spec.spec_stats.num_drafts
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"regex": PHONE})
    spec.add_request("Call me at", params, request_id="phone")
    text = None
    while spec.has_unfinished_requests():
        for out in spec.step():
            if out.finished:
                text = out.outputs[0].text
    assert re.fullmatch(PHONE, text)
    assert spec.spec_stats.num_drafts == drafted


@pytest.fixture(scope="module")
def default_with_ngram() -> LLMEngine:
    """The default model with n-gram speculation, loaded once for this module's tests."""
    return LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=NGRAM))


def test_default_model_copies_text_in_fewer_steps(default_with_ngram):
    """SmolLM2 asked to repeat a passage: the passage's tokens are drafted from the prompt and kept."""
    engine = default_with_ngram
    passage = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    prompt = f"Repeat this sentence exactly: {passage}\nSentence: {passage}\nSentence:"
    before = engine.num_steps, engine.spec_stats.num_accepted_tokens
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20), request_id="copy")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    text = outputs[-1].outputs[0].text
    assert text.strip().startswith("The quick brown fox")
    num_tokens = len(outputs[-1].outputs[0].token_ids)
    assert engine.spec_stats.num_accepted_tokens - before[1] >= num_tokens // 2
    # Streaming outputs carry several tokens where drafts were kept.
    assert any(len(o.outputs[0].delta_token_ids) > 1 for o in outputs)
    assert engine.num_steps - before[0] < num_tokens


def test_recurrent_models_refuse_speculation(tmp_path):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_heads=4, head_dim=16, n_groups=1,
                       num_hidden_layers=1, expand=2, chunk_size=16)
    torch.manual_seed(0)
    Mamba2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="recurrent"):
        _engine(tmp_path, NGRAM)


def test_cli_flag_takes_vllm_json():
    from plait.entrypoints.cli import _engine_config, parse_args

    args = parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert _engine_config(args).speculative_config == SpeculativeConfig("ngram", 2, 5, 5)


def test_server_streams_kept_drafts_and_counts_them(serving_engine, default_with_ngram, caplog):
    """A real server on an engine with n-gram speculation, the official openai client streaming a chat
    answer that repeats the prompt: the text equals the answer of an engine without speculation, /metrics
    has vLLM's spec_decode counters, moved by exactly the engine's counts, and the periodic stats lines
    (vLLM's, every log_stats_interval_s) report the throughput and the speculation."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    parser = pytest.importorskip("prometheus_client.parser")
    from conftest import idle_serving_engine

    from plait.entrypoints.llm import apply_chat_template
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = default_with_ngram
    passage = "Roses are red, violets are blue, sugar is sweet, and so are you."
    messages = [{"role": "user", "content": f"Repeat after me, word for word: {passage}"}]
    caplog.set_level(logging.INFO, logger="plait.entrypoints.stat_logger")
    config = ServerConfig(log_level="warning", log_stats_interval_s=0.05)
    with BackgroundServer(OpenAIServer(engine, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=240)
        model = client.models.list().data[0].id
        drafts_before = engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                                temperature=0.0, stream=True,
                                                stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        text = "".join(pieces)
        metrics = {}
        for family in parser.text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            for s in family.samples:
                metrics[(s.name, s.labels.get("position"))] = s.value
    drafted = engine.spec_stats.num_draft_tokens - drafts_before[0]
    accepted = engine.spec_stats.num_accepted_tokens - drafts_before[1]
    assert accepted > 0
    spec = engine.spec_stats
    assert metrics[("vllm:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    assert metrics[("vllm:spec_decode_num_accepted_tokens_total", None)] == spec.num_accepted_tokens
    assert metrics[("vllm:spec_decode_num_drafts_total", None)] == spec.num_drafts
    per_position = [metrics[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(3)]
    assert sum(per_position) == engine.spec_stats.num_accepted_tokens and drafted > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "plait.entrypoints.stat_logger"]
    throughput = [float(m.split("Avg generation throughput: ")[1].split()[0]) for m in lines
                  if m.startswith("Avg prompt throughput")]
    assert throughput and max(throughput) > 0
    assert any(m.startswith("SpecDecoding metrics: Mean acceptance length: ") for m in lines)
    # The same answer without speculation (the shared serving engine, run directly while no server holds it).
    plain = idle_serving_engine(serving_engine)
    prompt = apply_chat_template(plain.tokenizer, messages)
    plain.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24), request_id="spec-reference")
    want = None
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished:
                want = out.outputs[0]
    assert text == want.text and usage.completion_tokens == len(want.token_ids)


def test_stat_logger_reports_each_interval_and_stays_quiet_when_idle(caplog):
    """vLLM's periodic lines from the deltas of one interval; nothing while the engine idles."""
    from plait.entrypoints.async_engine import EngineStats
    from plait.entrypoints.stat_logger import StatLogger, TokenTotals

    now = EngineStats(spec_num_drafts=0, spec_accepted_per_position=(0, 0))
    totals = TokenTotals()
    stat_logger = StatLogger(lambda: now, totals)
    caplog.set_level(logging.INFO, logger="plait.entrypoints.stat_logger")
    assert not stat_logger.log(10.0) and not caplog.records
    totals.prompt, totals.generation = 1000, 50
    now = EngineStats(num_running=2, kv_usage=0.125, prefix_cache_queries=400, prefix_cache_hits=100,
                      spec_num_drafts=10, spec_num_draft_tokens=20, spec_num_accepted_tokens=15,
                      spec_accepted_per_position=(9, 6))
    assert stat_logger.log(10.0)
    assert [r.getMessage() for r in caplog.records] == [
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 25.0%",
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.50 tokens/s, Drafted "
        "throughput: 2.00 tokens/s, Accepted: 15 tokens, Drafted: 20 tokens, Per-position acceptance rate: "
        "0.900, 0.600, Avg Draft acceptance rate: 75.0%",
    ]
    now = EngineStats(spec_num_drafts=10, spec_num_draft_tokens=20, spec_num_accepted_tokens=15,
                      spec_accepted_per_position=(9, 6))
    assert not stat_logger.log(10.0)  # idle again: the totals did not move
