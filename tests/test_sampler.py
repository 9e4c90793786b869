"""Tests for the batched sampler: greedy, filters, seeding, distribution, penalties, logprobs, min_tokens."""

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from plait.runner.sampler import ARGMAX_FEW_ROWS, Sampler, SamplingRow, argmax_rows, unpack_token_bitmask
from plait.sampling_params import LOGPROBS_MODES, SamplingParams

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_logits(seed: int, rows: int, vocab: int, scale: float = 3.0, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Drawn on the CPU for reproducibility, then moved, so the suite also runs under set_default_device.
    logits = torch.randn(rows, vocab, generator=gen, device="cpu").to(torch.get_default_device()) * scale
    if ties:
        # Coarse rounding creates many exactly equal logits, including tied maxima.
        logits = torch.round(logits)
    return logits


def row(output: list[int] | None = None, prompt: list[int] | None = None, eos: int | None = None, **kw):
    return SamplingRow(SamplingParams(**kw), prompt or [], output or [], () if eos is None else {eos})


logits_cases = st.tuples(
    st.integers(0, 2**31 - 1), st.integers(2, 60), st.floats(0.1, 20.0), st.booleans()
).map(lambda t: make_logits(t[0], 1, t[1], t[2], t[3])[0])


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = make_logits(0, 16, 1000, ties=True).to(dtype)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_slow_path_matches_fast_path() -> None:
    logits = make_logits(1, 8, 500, ties=True)
    fast = Sampler()(logits, [row(temperature=0.0) for _ in range(8)]).token_ids
    # logprobs force the general path; min_tokens without an EOS id changes nothing.
    slow = Sampler()(logits, [row(temperature=0.0, logprobs=2, min_tokens=1) for _ in range(8)]).token_ids
    assert fast == slow == logits.argmax(dim=-1).tolist()


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0]])
    assert Sampler()(logits, [row(temperature=0.0)]).token_ids == [1]
    assert Sampler()(logits, [row(temperature=0.0, logprobs=1)]).token_ids == [1]


@FAST
@given(logits=logits_cases, temperature=st.floats(1e-3, 50.0), seed=st.integers(0, 2**40))
def test_top_k_one_equals_greedy(logits: torch.Tensor, temperature: float, seed: int) -> None:
    batch = logits.expand(4, -1).contiguous()
    rows = [row(temperature=temperature, top_k=1, seed=seed + i if i % 2 else None) for i in range(4)]
    expected = int(logits.argmax())
    assert Sampler()(batch, rows).token_ids == [expected] * 4


def test_mixed_greedy_and_random_batch() -> None:
    logits = make_logits(2, 6, 300)
    rows = [
        row(temperature=0.0),
        row(temperature=1.0, seed=3),
        row(temperature=0.0, logprobs=1),
        row(temperature=0.9, top_p=0.8),
        row(temperature=0.0, presence_penalty=0.1),
        row(temperature=2.0, top_k=5),
    ]
    out = Sampler()(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    for i in (0, 2, 4):  # presence penalty on an empty output changes nothing
        assert out.token_ids[i] == argmax[i]
    assert out.token_ids[5] in torch.topk(logits[5] / 2.0, 5).indices.tolist()
    assert all(0 <= t < 300 for t in out.token_ids)


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 5), [row()])


# --------------------------------------------------------------------------- filtering


def allowed_ids(logits: torch.Tensor, p: SamplingParams, tol: float = 1e-4) -> set[int]:
    """Reference top-k -> top-p -> min-p in float64, lenient by tol at the boundaries."""
    x = logits.double() / p.temperature
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))
    keep = order[: p.top_k] if p.top_k else order
    probs = torch.softmax(x[keep], dim=0).tolist()
    mass, kept_p = 0.0, []
    for pos, (tok, pr) in enumerate(zip(keep, probs, strict=True)):
        if pos == 0 or p.top_p >= 1.0 or mass < p.top_p + tol:
            kept_p.append(tok)
        mass += pr
    probs = torch.softmax(x[kept_p], dim=0)
    threshold = p.min_p * probs.max().item()
    return {t for t, pr in zip(kept_p, probs.tolist(), strict=True) if pr >= threshold - tol}


@FAST
@given(
    logits=logits_cases,
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3, 0.9]),
    seed=st.integers(0, 2**31 - 1),
)
def test_filters_never_sample_removed_tokens(logits, temperature, top_k, top_p, min_p, seed) -> None:
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed = allowed_ids(logits, SamplingParams(**kw))
    n = 64
    torch.manual_seed(seed)
    # Half the rows use per-request generators, half the default one.
    rows = [row(seed=seed + i if i % 2 else None, **kw) for i in range(n)]
    out = Sampler()(logits.expand(n, -1).contiguous(), rows)
    assert set(out.token_ids) <= allowed


def test_top_k_keeps_exactly_k_with_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]])
    n = 400
    torch.manual_seed(0)
    out = Sampler()(logits.expand(n, -1).contiguous(), [row(top_k=2) for _ in range(n)])
    # Ties are ranked by id, so the two kept tokens are 1 and 2.
    assert set(out.token_ids) == {1, 2}


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"), [(4, 0.5, {1, 3}), (0, 0.5, {1, 3, 4}), (5, 1.0, None)]
)
def test_ties_resolve_toward_lower_ids(top_k: int, top_p: float, expected: set[int] | None) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, 3.0, 3.0]])
    n = 400
    torch.manual_seed(0)
    rows = [row(top_k=top_k, top_p=top_p) for _ in range(n)]
    out = set(Sampler()(logits.expand(n, -1).contiguous(), rows).token_ids)
    # top_k=4 keeps tied ids 1, 3, 4, 5 (mass 1/4 each), so top_p=0.5 keeps 1 and 3; without top_k each
    # of the five tied ids has 0.2 and three are needed. top_k=5 keeps all five 3.0s and not id 2.
    assert out == (expected or {1, 3, 4, 5, 6})


# --------------------------------------------------------------------------- seeding


def test_seeded_rows_independent_of_batch() -> None:
    vocab = 200
    base = make_logits(5, 1, vocab, scale=1.0)[0]
    filters = [dict(top_p=0.95), dict(top_k=20, top_p=0.9), dict(min_p=0.1), dict(temperature=0.6)]
    seeded = [(base, row(output=[1] * k, seed=1000 + k, **filters[k])) for k in range(4)]
    alone = [Sampler()(lg[None], [r]).token_ids[0] for lg, r in seeded]

    rng = random.Random(0)
    others = make_logits(6, 6, vocab, scale=1.0)
    other_filters = [dict(top_k=7), dict(top_p=0.5), dict(temperature=0.0), dict(), dict(min_p=0.2), dict()]
    for trial in range(5):
        # The other rows change which code paths run (e.g. a top-p row without top-k forces a full
        # sort), but a seeded row's token must not change.
        entries = list(seeded) + [
            (others[i], row(seed=None if i % 2 else 77 + trial, **{"temperature": 1.3, **other_filters[i]}))
            for i in range(6)
        ]
        order = list(range(len(entries)))
        rng.shuffle(order)
        logits = torch.stack([entries[i][0] for i in order])
        out = Sampler()(logits, [entries[i][1] for i in order]).token_ids
        got = {order[j]: out[j] for j in range(len(order))}
        assert [got[k] for k in range(4)] == alone


def test_seed_stream_depends_on_seed_and_position_only() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the token is determined by the noise alone

    def sample(out_len: int, seed: int) -> int:
        return Sampler()(logits, [row(output=[0] * out_len, seed=seed)]).token_ids[0]

    # Reproducible (recompute after preemption gives the same token) ...
    assert [sample(k, 7) for k in range(10)] == [sample(k, 7) for k in range(10)]
    # ... and different positions / seeds draw different noise.
    assert len({sample(k, 7) for k in range(10)}) > 5
    assert len({sample(3, s) for s in range(10)}) > 5


def test_unseeded_rows_follow_the_engine_seed() -> None:
    logits = torch.zeros(8, 1000)  # uniform: the tokens are the noise's alone

    def steps(sampler: Sampler) -> list[list[int]]:
        return [sampler(logits, [row() for _ in range(8)]).token_ids for _ in range(3)]

    torch.manual_seed(1)
    a = steps(Sampler(seed=123))
    torch.manual_seed(2)  # torch's global RNG no longer matters
    assert steps(Sampler(seed=123)) == a
    assert len({tuple(t) for t in a}) == 3  # each step draws on from where the last one stopped
    # Another seed, another stream: 24 draws from 1000 ids cannot all agree by chance.
    assert steps(Sampler(seed=124)) != a


def test_seeded_rows_ignore_the_engine_seed() -> None:
    logits = make_logits(3, 4, 1000, scale=0.5)
    rows = [row(seed=10 + i, top_p=0.9) for i in range(4)]
    assert Sampler(seed=1)(logits, rows).token_ids == Sampler(seed=2)(logits, rows).token_ids


# --------------------------------------------------------------------------- distribution


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


# df <= 5; chi2 critical value at p = 1e-4 is ~25.7. Loose, and the seeds are fixed.
CHI2_BOUND = 30.0


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded: bool) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    temperature = 0.8
    n = 3000 if seeded else 30000
    torch.manual_seed(0)
    rows = [row(temperature=temperature, seed=i if seeded else None) for i in range(n)]
    out = Sampler()(logits.expand(n, -1).contiguous(), rows).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=6).tolist()
    probs = torch.softmax(logits / temperature, dim=0).tolist()
    assert chi_square(counts, probs) < CHI2_BOUND, (counts, probs)


def test_top_k_top_p_renormalise() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    n = 20000
    torch.manual_seed(1)
    out = Sampler()(logits.expand(n, -1).contiguous(), [row(top_k=4, top_p=0.8) for _ in range(n)]).token_ids
    top4 = torch.softmax(logits[:4], dim=0)
    # Over the top-4 ids (0.47, 0.29, 0.17, 0.06) the first three are needed to reach 0.8, so top-p
    # then drops id 3, and the survivors are sampled with renormalised probabilities.
    assert top4[:2].sum() < 0.8 <= top4[:3].sum()
    counts = torch.bincount(torch.tensor(out), minlength=6).tolist()
    assert counts[3:] == [0, 0, 0]
    kept = torch.softmax(logits[:3], dim=0)
    assert chi_square(counts[:3], kept.tolist()) < CHI2_BOUND, counts


# --------------------------------------------------------------------------- penalties


def penalised_value(
    logit: float, prompt_hit: bool, count: int, rep: float, freq: float, pres: float
) -> float:
    """vLLM's definition: repetition on prompt+output, then frequency/presence on output counts."""
    if prompt_hit or count:
        logit = logit / rep if logit > 0 else logit * rep
    return logit - freq * count - pres * (count > 0)


PENALTY_CASES = [
    # (logit, in prompt, count in output, repetition, frequency, presence)
    (2.0, True, 0, 1.5, 0.0, 0.0),
    (-1.0, True, 0, 1.5, 0.0, 0.0),
    (2.0, False, 2, 1.2, 0.0, 0.0),
    (2.0, True, 0, 1.0, 0.7, 0.9),  # frequency/presence ignore the prompt
    (2.0, False, 3, 1.0, 0.4, 0.0),
    (2.0, False, 3, 1.0, 0.0, 0.5),
    (1.0, True, 2, 1.3, 0.25, 0.5),
    (-0.5, False, 1, 0.8, -0.3, -1.0),  # repetition < 1 and negative penalties push the token up
    (0.0, True, 1, 2.0, 0.1, 0.1),
]


@pytest.mark.parametrize("case", PENALTY_CASES)
def test_penalties_follow_vllm(case: tuple) -> None:
    logit, prompt_hit, count, rep, freq, pres = case
    expected = penalised_value(logit, prompt_hit, count, rep, freq, pres)
    target, probe, vocab = 3, 7, 10
    prompt = [target, 0] if prompt_hit else [0]
    output = [target] * count + [1]
    params = dict(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    for delta, winner in ((-1e-3, target), (1e-3, probe)):
        logits = torch.full((1, vocab), -50.0)
        logits[0, target] = logit
        # The probe token is in neither prompt nor output, so it is not penalised.
        logits[0, probe] = expected + delta
        out = Sampler()(logits, [row(output=output, prompt=prompt, **params)])
        assert out.token_ids == [winner], (case, expected, delta)


def test_penalties_are_per_row() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [row(output=[0], temperature=0.0, presence_penalty=2.0), row(output=[0], temperature=0.0)]
    assert Sampler()(logits, rows).token_ids == [1, 0]


def test_penalties_count_each_rows_own_outputs_of_any_length() -> None:
    """Rows' outputs of different lengths (one empty, one a tuple) are padded into one batch: each row's
    frequency penalty counts its own ids only, the padding none."""
    from plait.runner.sampler import _pad

    assert _pad([[1, 2, 3], [], (4,)], 9).tolist() == [[1, 2, 3], [9, 9, 9], [4, 9, 9]]
    assert _pad([], 9).shape == (0, 0) and _pad([[], []], 9).shape == (2, 0)
    logits = torch.zeros(3, 6)
    logits[:, 5] = -2.5  # the runner-up every row falls back to
    outputs = [[0, 0, 0], [], (0, 1)]
    rows = [row(output=o, temperature=0.0, frequency_penalty=1.0) for o in outputs]
    # Row 0 penalises token 0 (3x): token 1 is first of the untouched; row 1 nothing: token 0; row 2 tokens 0
    # and 1: token 2. Counts leaking across rows or from the padding would move these.
    assert Sampler()(logits, rows).token_ids == [1, 0, 2]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax() -> None:
    logits = make_logits(9, 4, 50)
    rows = [
        row(temperature=0.7, logprobs=5, repetition_penalty=1.5, prompt=[1, 2], seed=1),
        row(temperature=0.0, logprobs=0),
        row(temperature=1.0),
        row(temperature=1.3, logprobs=20, top_k=3, frequency_penalty=1.0, output=[4, 4]),
    ]
    out = Sampler()(logits.to(torch.bfloat16), rows)
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    assert out.logprobs[2] is None
    for i, n in ((0, 5), (1, 0), (3, 20)):
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.token_ids[i]
        assert lp.token_logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert len(lp.top_ids) == len(lp.top_logprobs) == n
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
        if n:
            assert set(lp.top_ids) == set(torch.topk(ref[i], n).indices.tolist())
        assert lp.rank == int((ref[i] >= ref[i, tok]).sum())
    assert out.logprobs[1].rank == 1  # greedy token is the most likely one


def test_logprobs_sum_to_one() -> None:
    logits = make_logits(10, 1, 20)
    lp = Sampler()(logits, [row(logprobs=20)]).logprobs[0]
    assert math.isclose(sum(math.exp(v) for v in lp.top_logprobs), 1.0, rel_tol=1e-5)


# --------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(temperature: float) -> None:
    eos, stop_id, vocab = 5, 6, 10
    logits = torch.zeros(1, vocab)
    logits[0, eos] = 30.0
    logits[0, stop_id] = 29.0
    logits[0, 2] = 1.0
    kw = dict(temperature=temperature, min_tokens=3, stop_token_ids=[stop_id], max_tokens=10, seed=0)
    before = Sampler()(logits, [row(output=[1, 1], eos=eos, **kw)]).token_ids[0]
    assert before not in (eos, stop_id)
    if temperature == 0.0:
        assert before == 2
    assert Sampler()(logits, [row(output=[1, 1, 1], eos=eos, **kw)]).token_ids == [eos]


def test_min_tokens_with_ignore_eos_leaves_eos_alone() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 5] = 30.0
    r = row(output=[], eos=5, temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler()(logits, [r]).token_ids == [5]


def test_min_tokens_batch_only_masks_short_rows() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 5] = 30.0
    rows = [row(output=[1], eos=5, temperature=0.0, min_tokens=2), row(output=[1, 1], eos=5, temperature=0.0)]
    out = Sampler()(logits, rows).token_ids
    assert out[0] != 5 and out[1] == 5


def test_min_tokens_blocks_every_eos_id() -> None:
    logits = torch.zeros(1, 10)
    logits[0, [5, 7]] = torch.tensor([30.0, 29.0])  # e.g. <|endoftext|> and <|im_end|>
    r = SamplingRow(SamplingParams(temperature=0.0, min_tokens=1), [], [], frozenset({5, 7}))
    assert Sampler()(logits, [r]).token_ids == [0]


# --------------------------------------------------------------------------- logit_bias, allowed_token_ids


class CallCounter(TorchFunctionMode):
    """Counts the torch calls (each a kernel launch or more on a device) made inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_plus_100_makes_greedy_pick_it(dtype: torch.dtype) -> None:
    logits = make_logits(20, 4, 1000).to(dtype)
    target = int(logits[2].argmin())  # the least likely id of row 2
    rows = [row(temperature=0.0) for _ in range(4)]
    rows[2] = row(temperature=0.0, logit_bias={target: 100.0})
    out = Sampler()(logits, rows).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert out == [argmax[0], argmax[1], target, argmax[3]]


def test_logit_bias_minus_100_bans_the_argmax() -> None:
    logits = torch.zeros(1, 50)
    logits[0, 7] = 10.0  # e^10 times as likely as any other id
    banned = {7: -100.0}
    greedy = Sampler()(logits, [row(temperature=0.0, logit_bias=banned)]).token_ids
    assert greedy == [0]  # the first of the ties left
    n = 2000
    draws = Sampler(seed=3)(logits.expand(n, -1).contiguous(), [row(logit_bias=banned) for _ in range(n)])
    assert 7 not in draws.token_ids
    unbiased = Sampler(seed=3)(logits.expand(n, -1).contiguous(), [row() for _ in range(n)]).token_ids
    assert unbiased.count(7) > n // 2  # without the bias it is the usual pick


def test_logit_bias_shifts_the_distribution_by_exp_bias() -> None:
    logits = torch.tensor([1.0, 0.0, 0.5, -1.0])
    bias = {1: 2.0, 3: -0.5}
    n = 20000
    rows = [row(logit_bias=bias, temperature=0.9) for _ in range(n)]
    out = Sampler()(logits.expand(n, -1).contiguous(), rows)
    biased = logits + torch.tensor([0.0, 2.0, 0.0, -0.5])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).tolist()
    assert chi_square(counts, torch.softmax(biased / 0.9, dim=0).tolist()) < CHI2_BOUND, counts


@pytest.mark.parametrize("seeded", [False, True])
def test_allowed_token_ids_restrict_random_sampling(seeded: bool) -> None:
    vocab, n = 1000, 2000
    logits = make_logits(21, 1, vocab)[0]
    allowed = [3, 17, 500, 999]
    rows = [row(allowed_token_ids=allowed, top_p=0.99, seed=i if seeded else None) for i in range(n)]
    out = Sampler(seed=4)(logits.expand(n, -1).contiguous(), rows).token_ids
    assert set(out) <= set(allowed)
    counts = [out.count(t) for t in allowed]
    kept = torch.softmax(logits[allowed], dim=0).tolist()
    assert all(c > 0 for c, p in zip(counts, kept, strict=True) if p > 0.01), (counts, kept)


def test_allowed_token_ids_pick_the_best_allowed_id_greedily() -> None:
    logits = make_logits(22, 3, 300)
    allowed = [[5, 6, 7], [int(logits[1].argmax())], [0, 299]]
    out = Sampler()(logits, [row(temperature=0.0, allowed_token_ids=a) for a in allowed]).token_ids
    assert out == [a[int(logits[i, a].argmax())] for i, a in enumerate(allowed)]


def test_allowed_token_ids_and_logit_bias_together() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 4] = 5.0
    # The bias may lift an allowed id above the others, but never brings back a disallowed one.
    r = row(temperature=0.0, allowed_token_ids=[1, 2], logit_bias={2: 1.0, 4: 100.0})
    assert Sampler()(logits, [r]).token_ids == [2]


def test_logprobs_stay_raw_under_bias_and_allowed_ids() -> None:
    """As vLLM's default logprobs_mode (raw_logprobs): the model's own distribution, before any processing."""
    logits = make_logits(23, 2, 40)
    rows = [row(temperature=0.0, logprobs=3, logit_bias={11: 100.0}),
            row(temperature=0.8, logprobs=3, allowed_token_ids=[2, 9], seed=1)]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0] == 11 and out.token_ids[1] in (2, 9)
    for i in range(2):
        lp = out.logprobs[i]
        assert lp.token_logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
        assert lp.top_ids == torch.topk(ref[i], 3).indices.tolist()


def _pack_bitmask(allowed: torch.Tensor) -> np.ndarray:
    """[V] bool -> int32 words as llguidance packs them: bit t % 32 of word t // 32."""
    padded = np.zeros(-(-allowed.shape[0] // 32) * 32, dtype=np.uint8)
    padded[: allowed.shape[0]] = allowed.numpy()
    return np.packbits(padded, bitorder="little").view(np.int32)


def _bitmask_reference(mask: np.ndarray, width: int) -> torch.Tensor:
    """Which of ``width`` ids a packed mask allows, bit by bit in Python ints (none past its words)."""
    words = [int(w) & 0xFFFFFFFF for w in mask]
    return torch.tensor([t // 32 < len(words) and bool(words[t // 32] >> (t % 32) & 1) for t in range(width)])


def test_token_bitmask_masks_as_a_plain_torch_reference() -> None:
    """A grammar's packed mask leaves -inf wherever its bit is 0 and past its words (logits rows wider than
    the tokenizer's vocabulary), for greedy, sampled and seeded rows, and changes no other row."""
    vocab, width, n = 70, 100, 400  # 3 words of mask for 70 ids; ids 70-99 exist only in the logits
    gen = torch.Generator().manual_seed(31)
    allowed = torch.rand(3, vocab, generator=gen) < 0.3
    allowed[0, 31] = allowed[1, 63] = True  # the sign bit of a word
    allowed[2, 69] = True
    masks = [_pack_bitmask(a) for a in allowed]
    assert masks[0][0] < 0 and masks[1][1] < 0
    reference = torch.stack([_bitmask_reference(m, width) for m in masks])
    assert torch.equal(reference[:, :vocab], allowed) and not reference[:, vocab:].any()
    assert torch.equal(unpack_token_bitmask(torch.from_numpy(np.stack(masks)), width), reference)
    assert torch.equal(unpack_token_bitmask(torch.from_numpy(np.stack(masks)), 40), reference[:, :40])

    logits = make_logits(32, 4, width)
    logits[:, vocab:] += 100.0  # ids past the vocabulary would win everywhere if left in
    rows = [row(temperature=0.0, logprobs=1 if i == 1 else None) for i in range(4)]
    for r, m in zip(rows, masks, strict=False):
        r.token_bitmask = m
    out = Sampler()(logits, rows)
    expected = logits[:3].masked_fill(~reference, float("-inf")).argmax(dim=-1).tolist()
    assert out.token_ids == expected + [int(logits[3].argmax())]  # the row without a mask is untouched
    raw = torch.log_softmax(logits[1], dim=-1)[expected[1]].item()  # logprobs stay raw
    assert out.logprobs[1].token_logprob == pytest.approx(raw)

    for seeded in (False, True):
        sampled = [row(temperature=1.0, top_p=0.99, seed=i if seeded else None) for i in range(n)]
        for r in sampled:
            r.token_bitmask = masks[2]
        ids = Sampler(seed=5)(logits[2:3].expand(n, -1).contiguous(), sampled).token_ids
        assert set(ids) <= set(reference[2].nonzero().flatten().tolist()) and len(set(ids)) > 1


def _mixed_rows(trial: int) -> list[SamplingRow]:
    """Rows of every kind, none using logit_bias or allowed_token_ids."""
    kinds = [dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(top_p=0.9), dict(seed=5 + trial),
             dict(top_k=20, min_p=0.05, seed=9), dict(temperature=0.7, presence_penalty=0.5, logprobs=1),
             dict(min_tokens=2), dict()]
    return [row(output=[1, 2], eos=3, **kw) for kw in kinds]


def test_rows_without_bias_or_allowed_ids_are_unchanged_beside_rows_with_them() -> None:
    vocab = 500
    for trial in range(3):
        logits = make_logits(24 + trial, 12, vocab)
        plain = _mixed_rows(trial) + _mixed_rows(trial)[:4]
        using = _mixed_rows(trial) + [
            row(temperature=0.0, logit_bias={1: 50.0}), row(allowed_token_ids=[4, 5], logprobs=1),
            row(seed=3, logit_bias={2: -3.0, 8: 4.0}, allowed_token_ids=list(range(0, vocab, 3))),
            row(temperature=0.0, logprobs=2, allowed_token_ids=[7]),
        ]
        before = Sampler(seed=trial)(logits, plain)
        after = Sampler(seed=trial)(logits, using)
        assert after.token_ids[:8] == before.token_ids[:8]
        assert after.logprobs[:8] == before.logprobs[:8]
        assert after.token_ids[8] == 1 and after.token_ids[9] in (4, 5) and after.token_ids[11] == 7


def test_seeded_rows_with_bias_are_independent_of_their_batch() -> None:
    vocab = 300
    base = make_logits(25, 1, vocab, scale=1.0)
    seeded = row(output=[1] * 3, seed=42, top_p=0.95, logit_bias={5: 2.0, 6: -1.0},
                 allowed_token_ids=list(range(100)))
    alone = Sampler()(base, [seeded]).token_ids[0]
    others = make_logits(26, 5, vocab, scale=1.0)
    for position in range(6):
        logits = torch.cat([others[:position], base, others[position:]])
        rows = [row(temperature=1.2, logit_bias={position: 3.0}) for _ in range(5)]
        rows.insert(position, seeded)
        assert Sampler(seed=position)(logits, rows).token_ids[position] == alone


def test_launches_do_not_grow_with_the_rows_using_bias_or_allowed_ids() -> None:
    """Each feature is one scatter over (rows x ids) built on the host, not a loop of launches per row;
    batches that use neither make none of those calls."""
    logits = make_logits(27, 16, 200)

    def calls(rows: list[SamplingRow]) -> Counter[str]:
        with CallCounter() as counter:
            Sampler()(logits, rows)
        return counter.calls

    one = [row(logit_bias={1: 5.0}, allowed_token_ids=[1, 2, 3])] + [row() for _ in range(15)]
    every = [row(logit_bias={i: 5.0, i + 1: -2.0}, allowed_token_ids=list(range(i, 2 * i + 5)))
             for i in range(16)]
    assert calls(one) == calls(every)
    plain = calls([row() for _ in range(16)])
    assert not {"index_put_", "index_fill_", "pin_memory"} & set(plain)


# --------------------------------------------------------------------------- no host waits (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_never_makes_the_host_wait_for_the_gpu() -> None:
    """Every sampling feature but logprobs (whose values the host reads) launches without a host sync:
    a copy from pageable memory would wait for the forward pass queued before it, and the host could not
    prepare the next step meanwhile (overlap lost for every step that samples)."""
    vocab = 4096
    rows = [
        row(temperature=0.0), row(temperature=0.8), row(temperature=1.0, top_k=20), row(top_p=0.9),
        row(min_p=0.05), row(temperature=0.7, seed=5),
        row(output=[3, 4, 4], prompt=[1, 2], presence_penalty=0.5, frequency_penalty=0.3,
            repetition_penalty=1.2),
        row(min_tokens=4, eos=2, stop_token_ids=[7]), row(logit_bias={9: 5.0}), row(allowed_token_ids=[1, 2]),
        row(temperature=0.9),
    ]
    rows[-1].token_bitmask = _pack_bitmask(torch.arange(vocab - 100) % 3 == 0)  # a grammar's, narrower
    rows[1].banned_now = [5, 6]  # bad words' last tokens
    logits = make_logits(0, len(rows), vocab).cuda()
    sampler = Sampler()
    sampler.sample(logits, rows)  # warm up (allocators, generators), outside the check
    torch.cuda._sleep(50_000_000)  # work queued ahead, as the forward pass is when the sampler runs
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, _ = sampler.sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.shape == (len(rows),) and bool((ids < vocab).all())


# --------------------------------------------------------------------------- the race kernel (Triton)

HAS_CUDA = torch.cuda.is_available()
RACE_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA,
                                                                                  reason="needs CUDA")])]


def _race_case(seed: int, rows: int, vocab: int, device: str):
    """Logits with the awkward cases in fixed rows: tied maxima, a masked (-inf) stretch, coarse values
    with many ties at the top-k and top-p cuts, a near-flat row; the filters drawn per row."""
    from plait.runner.sampler import NO_TOP_K_KTH, NO_TOP_K_ROOM, top_k_cut

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * (0.5 + 4 * torch.rand(rows, 1, generator=g))
    z[0, :5] = z[0].max() + 1
    z[1, vocab // 10: vocab // 3] = float("-inf")
    z[2] = torch.round(z[2])
    z[3] *= 0.01
    keys = torch.randint(0, 2**32, (rows - 1, 2), generator=g)
    ks = torch.randint(1, 64, (rows,), generator=g)
    ks[4] = vocab
    kth, room = top_k_cut(z, ks, int(ks.max()))
    kth[5], room[5] = NO_TOP_K_KTH, NO_TOP_K_ROOM
    top_p = torch.rand(rows, generator=g) * 0.95 + 0.04
    top_p[6] = 1.0
    min_p = torch.rand(rows, generator=g) * 0.3
    min_p[7] = 0.0
    sampled = torch.tensor([i for i in range(rows) if i != 8])  # row 8 is left alone (a greedy row)
    to = (lambda t: t.to(device))
    return to(z), to(keys), to(sampled), (to(kth), to(room)), to(top_p), to(min_p)


def _noise(z: torch.Tensor, sampled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The noise race_sample hashes from ``keys``, as the torch reference reads it."""
    from plait.runner.sampler import hashed_exponential_ref

    noise = torch.full_like(z, float("nan"))  # rows outside `sampled` must never be read
    hashed_exponential_ref(noise, sampled, keys)
    return noise


FILTERS = [(), ("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p"), ("top_p", "min_p"),
           ("top_k", "top_p", "min_p")]


@pytest.mark.parametrize("device", RACE_DEVICES)
@pytest.mark.parametrize("filters", FILTERS, ids="+".join)
def test_race_kernel_matches_the_sorting_reference(device: str, filters: tuple[str, ...]) -> None:
    """The sort-free race picks exactly the id the sort-based torch reference picks, for every filter mix,
    with ties at the cuts, masked ids, top_k = vocab and rows whose filters are off."""
    pytest.importorskip("triton")
    from plait.kernels.sampling import race_sample
    from plait.runner.sampler import race_sample_ref

    for seed in range(3):
        z, keys, sampled, top_k, top_p, min_p = _race_case(seed, 12, 1000, device)
        args = dict(top_k=top_k if "top_k" in filters else None, top_p=top_p if "top_p" in filters else None,
                    min_p=min_p if "min_p" in filters else None)
        got = torch.full((12,), -1, dtype=torch.long, device=device)
        want = got.clone()
        race_sample(z, keys, sampled, got, **args)
        race_sample_ref(z, _noise(z, sampled, keys), sampled, want, **args)
        assert torch.equal(got, want), f"seed {seed}: {got.tolist()} != {want.tolist()}"
        assert got[8] == -1, "a row outside `rows` was written"


def test_sampler_kernel_path_matches_its_torch_path(monkeypatch) -> None:
    """The whole sampler, routed through the race kernel (the CPU interpreter here, CUDA on a GPU), draws
    the same ids as its torch path for a batch mixing greedy, temperature, every filter and seeds."""
    pytest.importorskip("triton")
    from plait.kernels import dispatch

    rows = [row(temperature=0.0), row(temperature=0.7), row(temperature=1.0, top_k=5), row(top_p=0.8),
            row(min_p=0.1), row(top_k=40, top_p=0.9, min_p=0.02, seed=3), row(temperature=1.3, seed=11),
            row(temperature=0.9, top_p=0.5, logit_bias={7: 2.0})]
    logits = make_logits(5, len(rows), 500, ties=True)
    draws = {}
    for kernel in (False, True):
        monkeypatch.setattr(dispatch, "_cpu_interpreter", kernel and not HAS_CUDA)
        dispatch.set_triton_enabled(kernel)
        try:
            device = "cuda" if HAS_CUDA else "cpu"
            draws[kernel] = Sampler(seed=1).sample(logits.to(device), rows)[0].tolist()
        finally:
            dispatch.set_triton_enabled(True)
    assert draws[True] == draws[False]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # near-flat (many rejection rounds) to peaked
def test_gpu_race_kernel_matches_the_reference_at_a_real_vocabulary(scale: float) -> None:
    """Qwen's 151,936-id vocabulary, 64 rows, every filter: the same ids as the sorting reference."""
    from plait.kernels.sampling import race_sample
    from plait.runner.sampler import race_sample_ref

    z, keys, sampled, top_k, top_p, min_p = _race_case(0, 64, 151_936, "cuda")
    z *= scale
    noise = _noise(z, sampled, keys)
    for args in (dict(top_p=top_p), dict(top_k=top_k, top_p=top_p, min_p=min_p), dict(min_p=min_p)):
        if "top_k" in args:  # recomputed for the scaled logits
            from plait.runner.sampler import top_k_cut
            ks = torch.randint(1, 64, (64,), generator=torch.Generator().manual_seed(1)).cuda()
            args["top_k"] = top_k_cut(z, ks, 64)
        got = torch.full((64,), -1, dtype=torch.long, device="cuda")
        want = got.clone()
        race_sample(z, keys, sampled, got, **args)
        race_sample_ref(z, noise, sampled, want, **args)
        assert torch.equal(got, want), f"{list(args)}: {(got != want).sum()} rows differ"


@pytest.mark.parametrize("device", RACE_DEVICES)
def test_hashed_noise_looks_exponential_and_the_kernel_draws_the_same(device: str) -> None:
    """The Exp(1) draws hashed from (key, token id) look like Exp(1), keys one apart give unrelated
    streams, and the race kernel draws the same ones as the torch twin: over flat logits the race picks
    each row's smallest draw."""
    pytest.importorskip("triton")
    from plait.kernels.sampling import race_sample

    vocab = 20_000
    keys = torch.tensor([[0, 0], [2**32 - 1, 2**32 - 1], [12345, 678], [12346, 678]], device=device)
    rows = torch.tensor([4, 0, 2, 3], device=device)
    z = torch.zeros(5, vocab, device=device)
    draws = _noise(z, rows, keys)[[4, 0, 2, 3]].cpu()
    assert bool((draws > 0).all())
    for d in draws:
        assert abs(d.mean().item() - 1.0) < 0.03 and abs((d > 1).float().mean().item() - math.exp(-1)) < 0.015
    assert abs(torch.corrcoef(draws[2:4])[0, 1].item()) < 0.03
    got = torch.full((5,), -1, dtype=torch.long, device=device)
    race_sample(z, keys, rows, got)
    assert got[[4, 0, 2, 3]].tolist() == draws.argmin(dim=-1).tolist() and got[1] == -1


# --------------------------------------------------------------------------- the argmax kernel (Triton)

# The kernel's device: CUDA where there is one, else the CPU through Triton's interpreter.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def _argmax_case(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """Random logits with the awkward rows planted first: a maximum tied at three ids (across chunks
    when the row has several), a row of -inf alone, one of -inf but its last id, NaN twice after +inf
    (torch ranks NaN highest), +inf twice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    inf = float("inf")
    row_plants = [
        [([vocab - 1, vocab // 2, vocab // 3], float(x.max()) + 1)],
        [(slice(None), -inf)],
        [(slice(0, vocab - 1), -inf)],
        [([0], inf), ([vocab - 1, vocab // 2], float("nan"))],
        [([vocab // 3, vocab - 1], inf)],
    ]
    for i, plants in enumerate(row_plants[:rows]):
        for cols, value in plants:
            x[i, cols] = value
    return x


def _scratch_counters(device: str, chunks: int) -> torch.Tensor:
    from plait.kernels.sampling import _argmax_scratch

    return _argmax_scratch(torch.empty(0, device=device).device, ARGMAX_FEW_ROWS, chunks)[2]


# (rows, vocab, chunk, block): the default chunks (one id, fewer ids than a chunk, a last chunk of 7),
# then small ones crossing several chunks of several tiles, the last cut short. Few programs: the
# interpreter takes ~10 ms each.
ARGMAX_CASES = [(1, 1, None, None), (5, 7, None, None), (3, 1000, None, None), (4, 1031, None, None),
                (2, 2, 32, 16), (5, 65, 32, 16), (3, 200, 32, 16), (3, 333, 64, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_kernel_is_torch_argmax(dtype: torch.dtype) -> None:
    """The one-launch argmax gives torch.argmax's ids over vocabularies of one id, odd sizes, narrower
    than a chunk or crossing many, with ties across chunks, rows of -inf, infinities and NaN."""
    pytest.importorskip("triton")
    from plait.kernels.sampling import argmax_few_rows

    for seed, (rows, vocab, chunk, block) in enumerate(ARGMAX_CASES):
        if dtype != torch.float32 and chunk is not None and vocab != 65:
            continue  # the conversion is the same in every case: one with several chunks is enough
        sizes = {} if chunk is None else dict(chunk=chunk, block=block)
        logits = _argmax_case(seed, rows, vocab).to(KERNEL_DEVICE, dtype)
        got = argmax_few_rows(logits, ARGMAX_FEW_ROWS, **sizes)
        assert torch.equal(got, logits.argmax(dim=-1)), f"{rows} x {vocab}: {got.tolist()}"
    # Rows sliced from a wider tensor (a row stride past the vocabulary).
    wide = _argmax_case(9, 4, 300).to(KERNEL_DEVICE, dtype)[1:, :250]
    assert torch.equal(argmax_few_rows(wide, ARGMAX_FEW_ROWS, chunk=64, block=16), wide.argmax(dim=-1))


def test_argmax_kernel_resets_its_counters_for_the_next_launch() -> None:
    """Launches in a row share one set of cached partials and counters (a CUDA graph replays the same
    addresses): each row's last program sets its counter back to zero, so the next launch, with other
    logits and fewer rows, still combines every row."""
    pytest.importorskip("triton")
    from plait.kernels.sampling import argmax_few_rows

    vocab, chunk, block = 120, 32, 16  # 4 chunks a row
    counters = _scratch_counters(KERNEL_DEVICE, 4)
    for seed, rows in enumerate([3, 3, 2]):
        x = _argmax_case(seed, rows, vocab).to(KERNEL_DEVICE)
        x[:, 40 * seed] = 100.0  # the maximum in another chunk each launch
        got = argmax_few_rows(x, ARGMAX_FEW_ROWS, chunk=chunk, block=block)
        assert torch.equal(got, x.argmax(dim=-1)), f"launch {seed}"
        assert _scratch_counters(KERNEL_DEVICE, 4) is counters and not bool(counters.any())


def test_argmax_kernel_at_a_sizeable_vocabulary() -> None:
    """The default chunks over SmolLM's 49,152 ids (48 chunks): the maximum tied across the first chunk's
    end, the second's start and the last chunk."""
    pytest.importorskip("triton")
    from plait.kernels.sampling import argmax_few_rows

    x = torch.randn(1, 49_152, generator=torch.Generator().manual_seed(3))
    x[0, [49_151, 1024, 1023]] = 9.0
    x = x.to(KERNEL_DEVICE)
    got = argmax_few_rows(x, ARGMAX_FEW_ROWS)
    assert got.tolist() == [1023] and torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_takes_the_kernel_for_few_rows_only(monkeypatch) -> None:
    """argmax_rows (and so greedy sampling) sends fewer than ARGMAX_FEW_ROWS rows through the kernel and
    more to torch.argmax; both give torch's first maximum."""
    pytest.importorskip("triton")
    from plait.kernels import dispatch, sampling

    monkeypatch.setattr(dispatch, "_cpu_interpreter", not HAS_CUDA)
    launches = []
    kernel = sampling.argmax_few_rows
    monkeypatch.setattr(sampling, "argmax_few_rows", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    with torch.no_grad():  # as the engine samples (inference mode): the kernels have no backward
        for rows in (1, 3, ARGMAX_FEW_ROWS - 1, ARGMAX_FEW_ROWS):
            logits = make_logits(rows, rows, 997, ties=True).to(KERNEL_DEVICE)
            launches.clear()
            assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
            assert len(launches) == (rows < ARGMAX_FEW_ROWS)
        logits = make_logits(0, 3, 300, ties=True).to(KERNEL_DEVICE)
        launches.clear()
        assert Sampler()(logits, [row(temperature=0.0)] * 3).token_ids == logits.argmax(dim=-1).tolist()
        assert launches


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@torch.no_grad()  # as the engine samples: argmax_rows keeps torch's path where autograd records
def test_gpu_argmax_kernel_at_a_real_vocabulary_and_in_a_cuda_graph() -> None:
    """Llama-3's 128,256 ids in fp32 and bf16: torch.argmax's ids eagerly, without a host sync, and from a
    captured CUDA graph replayed on new logits (the counters reset inside the graph too)."""
    from plait.kernels.sampling import argmax_few_rows

    vocab = 128_256
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 5, ARGMAX_FEW_ROWS - 1):
            logits = _argmax_case(rows, rows, vocab).to("cuda", dtype)
            assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), f"{dtype}, {rows} rows"
        torch.cuda.set_sync_debug_mode("error")
        try:
            argmax_few_rows(logits, ARGMAX_FEW_ROWS)
        finally:
            torch.cuda.set_sync_debug_mode("default")

        static = _argmax_case(0, 5, vocab).to("cuda", dtype)
        argmax_rows(static)  # compiled and its scratch allocated outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = argmax_rows(static)
        for seed in (1, 2):
            new = _argmax_case(seed, 5, vocab).to("cuda", dtype)
            new[4, 1000 * seed] = float("inf")  # +inf before the planted ones: the first wins
            static.copy_(new)
            graph.replay()
            assert torch.equal(out, new.argmax(dim=-1)), f"{dtype}, replay {seed}"


def test_banned_ids_are_never_sampled_and_bad_words_ban_their_last_token():
    """A row's banned ids (bad words it would complete) get -inf: greedy takes the next best, sampling
    never draws them; Request.banned_next_tokens bans a one-token word always and a longer word's last
    token only after the rest of it."""
    from plait.engine.request import Request

    logits = make_logits(4, 3, 50)
    top2 = logits.topk(2, dim=-1).indices
    rows = [row(temperature=0.0), row(temperature=0.0), None]
    rows[0].banned_now = [int(top2[0, 0])]
    for seed in range(20):
        rows[2] = row(temperature=1.0, seed=seed)
        rows[2].banned_now = list(range(0, 50, 2))
        ids = Sampler(seed=0).sample(logits.clone(), rows)[0].tolist()
        assert ids[0] == int(top2[0, 1]) and ids[1] == int(top2[1, 0]) and ids[2] % 2 == 1
    words = ((5,), (7, 8), (1, 2, 3))
    request = Request("r", [1, 2], SamplingParams(), max_tokens=8, bad_words_token_ids=words)
    assert request.banned_next_tokens() == [5]
    request.output_token_ids += [9, 7]
    assert request.banned_next_tokens() == [5, 8]
    request.output_token_ids += [1, 2]
    assert request.banned_next_tokens() == [3, 5]  # the prompt's own 1, 2 never counted: outputs only
    assert request.needs_last_token and not Request("q", [1], SamplingParams(), max_tokens=1,
                                                    bad_words_token_ids=((5,),)).needs_last_token



# --------------------------------------------------------------------------- logprobs_mode


def _one_draw(mode: str, logits: torch.Tensor, rows: list[SamplingRow]):
    return Sampler(seed=3, logprobs_mode=mode)(logits.clone(), rows)


def test_logprobs_modes_read_the_raw_or_the_drawn_from_logits_as_vllm():
    """vLLM's logprobs_mode: raw_* from the model's logits, processed_* from those the token was drawn from
    (a sampled row's after its logit bias, temperature and top-k cut, cut ids at -inf; a greedy row's after
    its bias only); *_logits the values themselves. The tokens drawn do not depend on the mode."""
    logits = make_logits(11, 2, 50)
    bias = {7: 4.0}
    rows = [row(temperature=0.5, top_k=3, logprobs=5, logit_bias=bias, seed=1),
            row(temperature=0.0, logprobs=4, logit_bias=bias)]
    outs = {mode: _one_draw(mode, logits, rows) for mode in LOGPROBS_MODES}
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1
    biased = logits.clone()
    biased[:, 7] += 4.0
    scaled = biased[0] / 0.5
    cut = torch.full_like(scaled, float("-inf"))
    top3 = scaled.topk(3).indices
    cut[top3] = scaled[top3]
    want = {"raw_logits": (logits[0], logits[1]),
            "raw_logprobs": (logits[0].log_softmax(-1), logits[1].log_softmax(-1)),
            "processed_logits": (cut, biased[1]),
            "processed_logprobs": (cut.log_softmax(-1), biased[1].log_softmax(-1))}
    for mode, out in outs.items():
        for k, (lp, values) in enumerate(zip(out.logprobs, want[mode], strict=True)):
            token = out.token_ids[k]
            assert lp.token_logprob == pytest.approx(float(values[token]), abs=1e-5), (mode, k)
            top = values.topk(len(lp.top_ids))
            assert lp.top_ids[:3] == top.indices[:3].tolist(), (mode, k)
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5), (mode, k)
            assert lp.rank == int((values >= values[token]).sum()), (mode, k)
    processed = outs["processed_logprobs"].logprobs[0]
    assert processed.top_logprobs[3:] == [float("-inf")] * 2  # cut by top-k 3
    assert outs["processed_logprobs"].token_ids[0] in top3.tolist()


def test_an_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="logits")
