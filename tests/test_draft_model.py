"""Draft-model speculative decoding: a second model drafts, the target verifies. A kept draft is the token the
target would have produced anyway, so every output, greedy or seeded, equals the output without speculation,
whatever the draft model is; a draft that is the target itself is kept almost always, so the answer takes
fewer target steps."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, random_prompts
from test_speculative import MAX_TOKENS, MIXED_PARAMS, _assert_same, _engine, _generate, _generate_aborting

from plait.config import EngineConfig, SpeculativeConfig
from plait.engine.draft_model import DraftModelDrafter
from plait.engine.drafter import PENDING_DRAFT_ID
from plait.engine.engine import LLMEngine
from plait.engine.kv_cache import KVCacheManager
from plait.loader.source import default_model_path
from plait.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# A target KV cache of 8-token blocks too small for _prompts() all at once (the longest needs 17 blocks).
NUM_SMALL_KV_BLOCKS = 24


def _draft(model, k: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def _prompts() -> list[list[int]]:
    """Short and long prompts arriving one a step: the longest is over twice the token budget (48), so the
    draft model catches up on it over several forwards while other rows decode."""
    return random_prompts(5, 3, 40, seed=21) + random_prompts(1, 110, 110, seed=22)


@pytest.fixture(scope="module")
def plain_engine(tiny_llama):
    return _engine(tiny_llama, None)


@pytest.fixture(scope="module")
def greedy_want(plain_engine):
    steps = plain_engine.num_steps
    want = _generate(plain_engine, _prompts(), [GREEDY] * len(_prompts()))
    return want, plain_engine.num_steps - steps


def test_the_target_as_its_own_draft_keeps_nearly_every_draft(tiny_llama, greedy_want):
    """The draft computes the target's own greedy choices: outputs unchanged, nearly every draft kept (a
    fp32 near-tie computed in another batch may still fork one), and the answers take far fewer steps."""
    want, plain_steps = greedy_want
    spec = _engine(tiny_llama, _draft(tiny_llama))
    assert isinstance(spec.drafter, DraftModelDrafter)
    _assert_same(_generate(spec, _prompts(), [GREEDY] * len(_prompts())), want)
    stats = spec.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert spec.num_steps < 0.6 * plain_steps
    # k forwards of the draft model a drafting step: one catching up (several for the long prompt), k - 1
    # one-token ones.
    assert spec.drafter.num_forwards >= 3 * stats.num_drafts / len(_prompts())


@pytest.mark.parametrize("draft", ["other_llama", "qwen3"])
def test_an_unrelated_draft_changes_no_output(tiny_llama, tiny_models, other_llama, greedy_want, draft):
    """Random drafts from another model (another Llama's weights, or another architecture of the same
    vocabulary): mostly rejected, outputs unchanged, the rejected drafts' KV overwritten in both caches. The
    draft then computes only the one token the target sampled in their place: once every prompt is in, each
    draft forward has one token a row (a decode step's shape, graphed on a GPU)."""
    want, _ = greedy_want
    model = other_llama[0] if draft == "other_llama" else tiny_models["qwen3"]
    spec = _engine(tiny_llama, _draft(model, k=4))
    _assert_same(_generate(spec, _prompts(), [GREEDY] * len(_prompts())), want)
    stats = spec.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    draft_steps = spec.drafter.runner.breakdown
    assert draft_steps.single_token_steps >= 0.8 * spec.drafter.num_forwards


def test_drafts_are_the_draft_models_greedy_continuation_of_the_known_tokens(tiny_llama, other_llama):
    """Every step's drafts, checked against the draft model run alone (a plain engine, greedy, from scratch)
    on the row's known tokens: the shadows follow the target's kept tokens, and what the draft cached for
    rejected drafts is overwritten before it is read again. With prefix caching on, no block holding a draft
    is ever findable (a later shadow could start from it, and it is rewritten once the draft is rejected)."""
    spec = _engine(tiny_llama, _draft(other_llama[0], k=3), enable_prefix_caching=True)
    draft_alone = _engine(other_llama[0], None)
    prepare, settle, checked, running = spec.drafter.prepare, spec.drafter.settle, [], []
    on_device = 0  # drafts whose last id was still on the device when proposed

    def checked_prepare(requests):
        nonlocal on_device
        prepare(requests)
        for r, shadow in spec.drafter._shadows.items():
            assert shadow.request.num_hashed_blocks * spec.config.block_size <= r.num_known_tokens
        running[:] = requests
        on_device += sum(spec.drafter.propose(r, limit=3)[-1:] == (PENDING_DRAFT_ID,) for r in requests)

    def checked_settle(plan):  # the last drafts are on the host from here on
        settle(plan)
        for r in running:
            drafts = spec.drafter.propose(r, limit=3)
            if drafts and len(checked) < 40:
                known = r.prompt_token_ids + r.output_token_ids
                rid = f"alone-{len(checked)}"
                draft_alone.add_request(known, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                                        request_id=rid)
                while draft_alone.has_unfinished_requests():
                    for out in draft_alone.step():
                        if out.finished:
                            assert list(drafts) == out.outputs[0].token_ids, (r.request_id, known)
                checked.append(r.request_id)
        running.clear()  # checked once (prepare settles a step that launched nothing, through this too)

    spec.drafter.prepare, spec.drafter.settle = checked_prepare, checked_settle
    _generate(spec, _prompts(), [GREEDY] * len(_prompts()))
    assert len(checked) == 40 and len(set(checked)) == len(_prompts())
    assert on_device >= 40


@pytest.mark.parametrize("penalties", [False, True])
def test_a_steps_draft_forwards_are_queued_back_to_back(tiny_llama, other_llama, penalties):
    """Each draft forward of a step is launched before the host waits for the one before it, whose sampled
    ids (its input) it reads on the device; the last draft forward's ids are read on the device by the step
    that verifies them, launched before the host waits for it. So the host waits with nothing queued behind
    only for a long prompt's catch-up chunks before its final one. Under penalties (each position's sampling
    counts the drafts before it, on the host) the last draft forward is waited for before the verify step."""
    k = 3
    spec = _engine(tiny_llama, _draft(other_llama[0], k=k))
    drafter = spec.drafter
    prepare, settle = drafter.prepare, drafter.settle
    draft_launch, draft_collect = drafter.runner.launch, drafter.runner.collect
    events: list[tuple[str, int]] = []
    waits = []  # per drafting step: (draft forwards, waits with nothing queued behind)

    def recording(kind, fn):
        def call(step_or_plan, *args, **kwargs):
            out = fn(step_or_plan, *args, **kwargs)
            events.append((kind, id(step_or_plan if kind == "collect" else out)))
            return out
        return call

    def recording_prepare(requests):
        events.clear()
        prepare(requests)

    def recording_settle(plan):
        settle(plan)
        launched, forwards, idle = [], 0, 0
        for kind, step in events:
            if kind == "collect":
                idle += launched[-1] == step  # nothing launched after the one waited for
            else:
                launched.append(step)
                forwards += kind == "draft"
        if forwards:
            waits.append((forwards, idle))
        events.clear()

    drafter.runner.launch = recording("draft", draft_launch)
    drafter.runner.collect = recording("collect", draft_collect)
    spec.runner.launch = recording("target", spec.runner.launch)
    drafter.prepare, drafter.settle = recording_prepare, recording_settle
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=0.5 if penalties else 0.0)
    _generate(spec, _prompts(), [params] * len(_prompts()))
    # Forwards beyond k are catch-up chunks before the last; each is waited for (a row may sample there).
    assert all(idle == forwards - k + penalties for forwards, idle in waits), waits
    assert sum(forwards == k for forwards, _ in waits) >= 0.8 * len(waits)


def test_seeded_sampling_penalties_and_stops_are_unchanged(tiny_llama, plain_engine):
    """Sampled rows keep a draft only where their own seeded draw picks it: each position samples with the
    draw it would have had, after the drafts before it as outputs (penalties count them)."""
    prompts = random_prompts(len(MIXED_PARAMS), 4, 30, seed=23)
    params = list(MIXED_PARAMS)
    want = _generate(plain_engine, prompts, params)
    spec = _engine(tiny_llama, _draft(tiny_llama, k=2))
    _assert_same(_generate(spec, prompts, params), want)
    assert spec.spec_stats.num_accepted_tokens > 0


def test_a_full_draft_cache_drafts_less_and_changes_nothing(tiny_llama, greedy_want):
    """With room in the draft's cache for about two requests, the rest decode without drafts until blocks
    come back; outputs are unchanged and the cache ends empty."""
    want, _ = greedy_want
    spec = _engine(tiny_llama, _draft(tiny_llama))
    drafter = spec.drafter
    drafter.kv_cache = KVCacheManager(16, spec.config.block_size)  # 15 usable blocks of 8 tokens
    proposals = []
    propose = drafter.propose

    def spy(request, limit):
        drafts = propose(request, limit)
        proposals.append(bool(drafts))
        return drafts

    drafter.propose = spy
    _assert_same(_generate(spec, _prompts(), [GREEDY] * len(_prompts())), want)
    assert True in proposals and False in proposals
    assert drafter.is_clean()


def test_draft_context_shorter_than_the_target_stops_drafting_at_its_end(tiny_llama, greedy_want):
    """A draft max_model_len of 64: rows whose drafts would pass it decode without drafts."""
    want, _ = greedy_want
    spec = _engine(tiny_llama, {**_draft(tiny_llama), "max_model_len": 64})
    assert spec.drafter.max_len == 64
    _assert_same(_generate(spec, _prompts(), [GREEDY] * len(_prompts())), want)
    assert spec.spec_stats.num_draft_tokens > 0


# -- the config ----------------------------------------------------------------------------------


def test_speculative_config_takes_vllm_draft_model_forms(tiny_llama):
    inferred = SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": 5})
    assert (inferred.method, inferred.model) == ("draft_model", "draft")
    named = EngineConfig(speculative_config='{"method": "draft_model", "model": "d", '
                                            '"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1, '
                                            '"max_model_len": 128}')
    assert named.speculative_config == SpeculativeConfig("draft_model", 2, 5, 5, "d", 128, 1)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).method == "ngram"


@pytest.mark.parametrize("value, knobs, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "needs \"model\""),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, {}, "for the methods with a model"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, {}, "must be 1"),
    ({"model": "d", "num_speculative_tokens": 2, "max_model_len": 0}, {}, "max_model_len must be >= 1"),
    ({"model": "d", "num_speculative_tokens": 2}, {"tensor_parallel_size": 2}, "tensor parallelism"),
    ({"model": "d", "num_speculative_tokens": 2}, {"enable_sleep_mode": True}, "sleep"),
])
def test_bad_draft_model_configs_are_refused_by_name(value, knobs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value, **knobs)


def test_a_recurrent_draft_model_is_refused(tiny_llama, tmp_path):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_heads=4, head_dim=16, n_groups=1,
                       num_hidden_layers=1, expand=2, chunk_size=16)
    Mamba2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="causal attention-only"):
        _engine(tiny_llama, _draft(tmp_path))


# -- the default model, offline and served -----------------------------------------------------------


@pytest.fixture(scope="module")
def default_drafting_itself() -> LLMEngine:
    """The default model (a GGUF file) with itself as the draft model: the draft's choices are the target's,
    so nearly all are kept; what a well-matched small draft does for a large target, at its best."""
    draft = {"model": str(default_model_path()), "num_speculative_tokens": 4}
    return LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=draft))


def test_default_model_answers_as_without_speculation_in_fewer_steps(serving_engine, default_drafting_itself):
    prompt = "The three largest rivers of Europe are"
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = {}
    for name, engine in (("plain", serving_engine), ("spec", default_drafting_itself)):
        steps = engine.num_steps
        engine.add_request(prompt, params, request_id=f"rivers-{name}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[name] = (out.outputs[0].token_ids, out.outputs[0].text, engine.num_steps - steps)
    assert outputs["spec"][:2] == outputs["plain"][:2]
    assert outputs["spec"][2] < outputs["plain"][2] / 2
    assert default_drafting_itself.is_idle_and_clean()


def test_cli_flag_takes_a_draft_model():
    from plait.entrypoints.cli import _engine_config, parse_args

    args = parse_args(["serve", "--speculative-config", '{"model": "d.gguf", "num_speculative_tokens": 3}'])
    assert _engine_config(args).speculative_config == SpeculativeConfig("draft_model", 3, 5, 5, "d.gguf")


def test_server_streams_a_draft_models_kept_tokens(serving_engine, default_drafting_itself):
    """A real server on the self-drafting engine, the official openai client streaming a completion: the
    text is the answer without speculation, chunks carry several kept tokens, /metrics counts the drafts."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    parser = pytest.importorskip("prometheus_client.parser")
    from conftest import idle_serving_engine

    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = default_drafting_itself
    prompt = "A short list of fruits: apples, pears,"
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=240)
        model = client.models.list().data[0].id
        chunks = [c.choices[0].text for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0.0, stream=True) if c.choices]
        metrics = {s.name: s.value for family in parser.text_string_to_metric_families(
            httpx.get(f"{url}/metrics").text) for s in family.samples}
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == engine.spec_stats.num_accepted_tokens > 0
    assert len([c for c in chunks if c]) < 24
    plain = idle_serving_engine(serving_engine)
    plain.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24), request_id="draft-reference")
    want = None
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished:
                want = out.outputs[0].text
    assert "".join(chunks) == want


# -- the target under pressure, and a draft of another vocabulary -------------------------------------


def test_preemptions_and_the_prefix_cache_leave_outputs_unchanged(tiny_llama, other_llama, greedy_want):
    """A target cache so small that requests are preempted (recomputed later) while they draft, with prefix
    caching on: the shadows keep their own cache through it, outputs are unchanged and both caches end
    empty."""
    want, _ = greedy_want
    spec = _engine(tiny_llama, _draft(other_llama[0]), num_kv_blocks=NUM_SMALL_KV_BLOCKS,
                   enable_prefix_caching=True)
    spec.record_timeline = True
    _assert_same(_generate(spec, _prompts(), [GREEDY] * len(_prompts())), want)
    assert sum(s.num_preempted for s in spec.timeline) > 0, "the test did not force a preemption"
    assert spec.spec_stats.num_draft_tokens > 0 and spec.drafter.is_clean()


def test_a_draft_with_a_larger_vocabulary_proposes_only_target_ids(tiny_llama, tmp_path, greedy_want):
    """A draft whose vocabulary is larger than the target's (as Qwen's sizes differ): its ids past the
    target's end are never proposed, the drafts before them are, and outputs are unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4 * TINY_VOCAB, max_position_embeddings=512)
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    want, _ = greedy_want
    spec = _engine(tiny_llama, _draft(tmp_path))
    proposed = []
    propose = spec.drafter.propose
    spec.drafter.propose = lambda request, limit: proposed.append(propose(request, limit)) or proposed[-1]
    _assert_same(_generate(spec, _prompts(), [GREEDY] * len(_prompts())), want)
    assert all(t < TINY_VOCAB for drafts in proposed for t in drafts)
    assert any(len(d) < 3 for d in proposed) and any(d for d in proposed)


def test_the_draft_cache_serves_a_shared_prefix_once(tiny_llama, other_llama):
    """With prefix caching on (the target's setting), a shadow starts from the blocks earlier shadows filled
    with the same tokens (not those of shadows starting in the same step: as the target's cache, blocks are
    found once computed): three requests after a first that shares their long prefix make the draft compute
    it once, and outputs are those without speculation."""
    prefix = random_prompts(1, 96, 96, seed=41)[0]
    first, *later = [prefix + tail for tail in random_prompts(4, 3, 9, seed=42)]
    plain = _engine(tiny_llama, None)
    want = [_generate(plain, [first], [GREEDY]), _generate(plain, later, [GREEDY] * 3)]
    computed = {}
    for caching in (False, True):
        spec = _engine(tiny_llama, _draft(other_llama[0]), enable_prefix_caching=caching)
        _assert_same(_generate(spec, [first], [GREEDY]), want[0])
        _assert_same(_generate(spec, later, [GREEDY] * 3), want[1])
        assert spec.drafter.is_clean()
        computed[caching] = spec.drafter.num_tokens_computed
    # Each later request's shadow finds the 96-token prefix's 12 blocks cached: 3 x 96 tokens fewer.
    assert computed[False] - computed[True] == 3 * 96


@pytest.mark.parametrize("step", [1, 3, 6])
def test_aborts_while_drafting_leave_the_other_outputs_unchanged(tiny_llama, other_llama, greedy_want, step):
    """Requests aborted between steps while they draft (the long prompt's shadow still catching up, rows with
    drafts under verification): the other requests' outputs are those without speculation, and the aborted
    ones' shadows and draft blocks are gone once they are."""
    want, _ = greedy_want
    spec = _engine(tiny_llama, _draft(other_llama[0]))
    aborts = {step: "r-1", step + 1: "r-5", step + 2: "r-3"}  # r-5 is the long prompt
    done = _generate_aborting(spec, _prompts(), GREEDY, aborts)
    assert spec.is_idle_and_clean() and spec.drafter.is_clean()
    assert set(done) == set(want) - {1, 3, 5}  # an aborted request has no output after its abort
    _assert_same(done, {i: w for i, w in want.items() if i in done})
    assert spec.spec_stats.num_draft_tokens > 0
