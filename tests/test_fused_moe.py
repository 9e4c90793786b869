"""fused_moe (Triton grouped GEMMs for a sparse MoE block's experts) vs its torch reference, and moe_align."""

# Unmarked tests use tiny shapes (E=4, k=2, H=64, I=32): through the Triton interpreter on CPU, compiled on
# a GPU when there is one. `gpu` tests use Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes in bf16, and
# Qwen3-30B-A3B's with block-wise FP8 experts.

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import capture_cuda_graph

triton = pytest.importorskip("triton")

from plait.kernels import fused_moe as fm  # noqa: E402
from plait.kernels.fused_moe import MoeConfig, fused_moe, fused_moe_ref, moe_align, moe_config  # noqa: E402
from plait.layers.fp8_block import dequantize_blocks, quantize_blocks, quantize_groups  # noqa: E402
from plait.layers.moe import LocalExperts  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
BF16 = torch.bfloat16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
E, K, H, INTER = 4, 2, 64, 32  # experts, slots a token, hidden, intermediate

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

# fp32: the kernel and the reference sum the same products in different orders (and the kernel multiplies
# the routing weight before rounding, sums slots in another order): a few fp32 roundings of the output's
# scale, ~1e-7 relative; 1e-5 leaves room yet catches any wrong row, expert or weight.
FP32_REL_TOL = 1e-5
# fp16 / bf16, in units of the dtype's eps times the output's largest magnitude. Each side is within about
# one such unit of the exact result: a wrong rounding of gate or up moves silu's output by an ulp of their
# scale, and the down projection sums I such errors of random sign against weights of ~1/sqrt(I), so they
# reach the output at about an ulp of its scale; the slot outputs and their sum add an ulp or less each
# (measured at these shapes: up to 1.6 units each side vs fp64, 1.6 between them). Three units apart.
HALF_REL_ULPS = 3
# The interpreter casts fp32 -> bf16 by truncation, not round-to-nearest-even (triton 3.6 interpreter.py,
# _convert_float): each of the kernel's roundings may land a whole ulp off, always toward zero, so its
# errors no longer cancel; measured up to 4.9 units against the reference where round-to-nearest gives 1.6
# (test_fused_moe_rounds_where_the_reference_does checks that this is the truncation and nothing else).
BF16_TRUNCATION_REL_ULPS = 0 if ON_GPU else 3


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, INTER] scaled so that every activation is O(1)."""
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, seed=seed, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, seed=seed + 1, scale=inter**-0.5)
    return w13, w2


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64): softmax of random logits, its top k, renormalised."""
    logits = randn(num_tokens, num_experts, dtype=torch.float32, seed=seed, scale=2.0)
    weights, ids = torch.topk(F.softmax(logits, dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def assert_close_to_ref(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        units, allowed = torch.finfo(torch.float32).eps, FP32_REL_TOL / torch.finfo(torch.float32).eps
    else:
        units = torch.finfo(want.dtype).eps
        allowed = HALF_REL_ULPS + (BF16_TRUNCATION_REL_ULPS if want.dtype == BF16 else 0)
    scale = want.double().abs().max().item() * units
    worst = (got.double() - want.double()).abs().max().item() / scale
    assert worst <= allowed, f"{worst:.2f} units of eps x max|out| apart (allowed {allowed})"


# -- moe_align ---------------------------------------------------------------------------------------------

def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, dropped: bool = False) -> None:
    """moe_align's invariants; dropped: ids equal to num_experts (experts held elsewhere) are in no group."""
    align = moe_align(ids, num_experts, block_m, dropped=dropped)
    flat = ids.reshape(-1).long().cpu()
    n = flat.numel()
    sorted_ids = align.sorted_ids.cpu()
    expert_ids = align.expert_ids.cpu()
    num_padded = int(align.num_padded.item())
    assert sorted_ids.dtype == expert_ids.dtype == align.num_padded.dtype == torch.int32
    assert sorted_ids.numel() == fm.max_padded(n, num_experts, block_m) == expert_ids.numel() * block_m
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    sentinel = fm.pad_entry(*ids.shape)
    assert sentinel == n
    # Every entry of a held expert exactly once, all of them before num_padded; padding is the sentinel.
    used = sorted_ids[:num_padded]
    real = used[used != sentinel]
    assert sorted(real.tolist()) == torch.nonzero(flat < num_experts).flatten().tolist()
    assert bool((sorted_ids[num_padded:] == sentinel).all())
    # Each block's real entries belong to its expert; experts' groups come in increasing order.
    blocks = used.view(-1, block_m)
    block_experts = expert_ids[: blocks.shape[0]]
    for b, block in enumerate(blocks):
        mine = block[block != sentinel]
        assert bool((flat[mine.long()] == block_experts[b]).all())
        # Padding only at a group's end: a block holds its real entries first.
        assert bool((block[: mine.numel()] != sentinel).all())
    assert bool((block_experts[1:] >= block_experts[:-1]).all())
    assert bool(((expert_ids >= 0) & (expert_ids < num_experts)).all())
    for e in range(num_experts):
        pos = torch.nonzero(flat[real.long()] == e).flatten()
        entries = real[pos]
        assert entries.numel() == counts[e]
        if entries.numel():
            # Each group starts on a block boundary, holds its entries in increasing (token-major) order,
            # and takes exactly ceil(count / block_m) blocks.
            first = int(torch.nonzero(used == entries[0]).item())
            assert first % block_m == 0
            assert bool((entries[1:] > entries[:-1]).all())
            assert int((block_experts == e).sum()) == -(-int(counts[e]) // block_m)
        else:
            assert not bool((block_experts == e).any())


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("case", ["random", "one_expert", "all_slots_same", "unused_expert", "k1", "e1"])
def test_moe_align_properties(case, block_m):
    t = 13
    if case == "random":
        ids = routing(t, 8, 3, seed=1)[1]
        num_experts = 8
    elif case == "one_expert":  # every token picks expert 2 (and expert 0 as its second)
        ids = torch.tensor([[2, 0]] * t, device=DEVICE)
        num_experts = 5
    elif case == "all_slots_same":  # duplicates in a token's own slots
        ids = torch.full((t, 3), 1, device=DEVICE)
        num_experts = 4
    elif case == "unused_expert":
        ids = routing(t, 3, 2, seed=2)[1] * 2  # experts 0, 2, 4 of 6: 1, 3, 5 unused
        num_experts = 6
    elif case == "k1":
        ids = routing(t, 4, 1, seed=3)[1]
        num_experts = 4
    else:
        ids = torch.zeros((t, 1), dtype=torch.int64, device=DEVICE)
        num_experts = 1
    check_alignment(ids, num_experts, block_m)
    check_alignment(ids.to(torch.int32), num_experts, block_m)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("case", ["some_elsewhere", "all_elsewhere", "none_elsewhere"])
def test_moe_align_leaves_dropped_entries_out(case, block_m):
    """Expert parallelism: a rank holding experts 2..4 of 8 maps the routed ids to its own (0..2) and those
    of experts held elsewhere to 3, the dropped id; moe_align groups the held ones as ever and leaves the
    dropped ones out of sorted_ids altogether."""
    held = LocalExperts(first=2, count=3, total=8)
    ids = routing(13, 8, 3, seed=4)[1]
    if case == "all_elsewhere":
        ids = ids % 2  # experts 0 and 1 only
    elif case == "none_elsewhere":
        ids = ids % 3 + 2
    local = held.local_ids(ids)
    assert local.dtype == ids.dtype
    assert torch.equal(local, torch.where((ids >= 2) & (ids < 5), ids - 2, 3))
    check_alignment(local, held.count, block_m, dropped=True)
    check_alignment(local.to(torch.int32), held.count, block_m, dropped=True)


# -- fused_moe vs reference --------------------------------------------------------------------------------

def run_both(x, w13, w2, weights, ids, config=None, gemv=None):
    got = fused_moe(x, w13, w2, weights, ids, config=config, gemv=gemv)
    return got, fused_moe_ref(x, w13, w2, weights, ids)


# Both paths: the alignment-free GEMV (auto up to GEMV_MAX_ENTRIES) and the grouped GEMM.
PATHS = {"auto": None, "gemv": True, "grouped": False}
# A GEMV program is one entry (token x slot) and one column tile: no tile spans entries, so the count of
# tokens crosses no boundary of it, and a few of them reach all its code. The interpreter runs each program
# in Python, an entry of the GEMV costing about what a 16-entry block of the grouped GEMM does; so the GEMV
# runs at up to GEMV_TOKENS tokens, and 33 tokens (66 entries: experts of several 16-entry blocks, the last
# ragged) and other counts that size the grouped GEMM's blocks are the grouped GEMM's alone.
GEMV_TOKENS = 5


def sizes(counts: tuple[int, ...], paths=("gemv", "grouped")) -> list[tuple[str, int]]:
    """(path, tokens) pairs: each path at each count, the GEMV (and auto, the GEMV at these counts) only at
    those up to GEMV_TOKENS."""
    return [(path, t) for path in paths for t in counts if path == "grouped" or t <= GEMV_TOKENS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path, t", sizes((1, 5, 33), sorted(PATHS)))
def test_fused_moe_matches_ref(dtype, t, path):
    w13, w2 = experts(E, H, INTER, dtype, seed=10)
    x = randn(t, H, dtype=dtype, seed=12)
    weights, ids = routing(t, E, K, seed=13)
    assert_close_to_ref(*run_both(x, w13, w2, weights, ids, gemv=PATHS[path]))


# Each shape with renormalisation on or off, both where top_k = E (every expert chosen) and at 128 experts.
@pytest.mark.parametrize("num_experts, top_k, renormalize", [
    (6, 2, True), (60, 4, False), (8, 8, False), (8, 8, True), (128, 8, False), (128, 8, True),
    (5, 1, False)])
def test_moe_route_kernel_matches_the_torch_router(renormalize, num_experts, top_k):
    from plait.layers.moe import route

    logits = randn(37, num_experts, dtype=torch.float32, seed=60) * 3
    logits[3, :] = 0.5  # all experts tied: the lowest ids first
    got_w, got_i = fm.moe_route(logits, top_k, renormalize)
    want_w, want_i = route(logits, top_k, renormalize)
    assert got_i.dtype == torch.int32 and got_w.dtype == torch.float32
    # Descending probability (the slot order is the order of the slot sum); torch.topk leaves the order of
    # equal values unspecified, the kernel takes the lowest ids first.
    untied = torch.arange(37) != 3
    assert torch.equal(got_i.long()[untied], want_i[untied])
    assert got_i[3].tolist() == list(range(top_k))
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    # Router logits in the model's dtype (bf16 ties are common: compare with the kernel on their fp32 values).
    bf16 = logits.to(BF16)
    assert all(torch.equal(a, b) for a, b in zip(fm.moe_route(bf16, top_k, renormalize),
                                                 fm.moe_route(bf16.float(), top_k, renormalize)))
    empty_w, empty_i = fm.moe_route(logits[:0], top_k, renormalize)
    assert empty_w.shape == empty_i.shape == (0, top_k)


# DeepSeek's and GLM's routers, by model: (noaux_tc, experts, top_k, n_group, topk_group, renormalize, scale).
GROUPED_ROUTERS = {
    "v2_lite_greedy": (False, 64, 6, 1, 1, False, 1.0),  # DeepSeek-V2-Lite: softmax greedy
    "v2_group_limited": (False, 160, 6, 8, 3, False, 16.0),  # DeepSeek-V2: groups of 20 (padded to 32)
    "v3": (True, 256, 8, 8, 4, True, 2.5),
    "glm45_air": (True, 128, 8, 1, 1, True, 1.0),
    "moonlight": (True, 64, 6, 1, 1, True, 2.446),
    "nemotron_h": (True, 128, 6, 1, 1, True, 2.5),
    "odd_groups": (True, 72, 5, 6, 3, False, 1.0),  # 6 groups of 12: both dimensions padded
    "odd_softmax": (False, 100, 3, 1, 1, True, 1.0),
}
# The kernels' weights against the references': exp, the softmax's sum and the renormalising sum in other
# orders or implementations (numpy's under the interpreter) put them up to 3 fp32 eps apart (measured over
# 200 random rows a model); 1e-6 (8 eps) leaves room yet catches any wrong score, renormalisation or scale.
ROUTE_REL_TOL = 1e-6
ROUTER_TOKENS = 6  # the crafted rows (below), then random ones
TIED_ROW, GROUPS_ROW, DEEP_ROW = 0, 1, 2
# The DEEP_ROW's logits, about this: sigmoid scores ~4e-18, whose sum (~3e-17) the renormalisation's 1e-20
# guard moves by ~3e-4 of itself (the kernel must add it too).
DEEP_LOGIT = -40.0
# Logits of the GROUPS_ROW (grouped routers): group 0 holds the single best expert and nothing else; every
# other group two experts a little below it. Scored by its best (group-limited greedy) group 0 is kept; by its
# best two (noaux_tc: sigmoid(4) + sigmoid(-4) = 1.0 against 2 sigmoid(1.3) = 1.57 or more) it is dropped.
# The row's random logits, scaled down, are added to untie its experts.
LOW_LOGIT, BEST_LOGIT, PAIR_LOGIT, PAIR_STEP, UNTIE = -4.0, 4.0, 2.0, 0.1, 0.01


def grouped_router_logits(num_tokens: int, num_experts: int, n_group: int, seed: int) -> torch.Tensor:
    # -> [T, E] fp32: a row of ties, the GROUPS_ROW, the DEEP_ROW, random rows
    logits = randn(max(num_tokens, DEEP_ROW + 1), num_experts, dtype=torch.float32, seed=seed, scale=3.0)
    logits[TIED_ROW] = 0.5
    logits[DEEP_ROW] = DEEP_LOGIT + logits[DEEP_ROW] * UNTIE
    if n_group > 1:
        per_group = num_experts // n_group
        crafted = torch.full((num_experts,), LOW_LOGIT, device=logits.device)
        crafted[0] = BEST_LOGIT
        for g in range(1, n_group):
            crafted[g * per_group:g * per_group + 2] = PAIR_LOGIT - PAIR_STEP * g
        logits[GROUPS_ROW] = crafted + logits[GROUPS_ROW] * UNTIE
    return logits[:num_tokens]


Routing = tuple[torch.Tensor, torch.Tensor]  # (weights [T, k] fp32, ids [T, k])


def grouped_routings(model: str, logits: torch.Tensor, bias: torch.Tensor
                     ) -> tuple[Routing, Routing, torch.Tensor]:
    """(the kernel's routing, the reference's, the scores the experts are chosen by [T, E])."""
    from plait.layers.moe import route_group_limited, route_noaux_tc

    noaux_tc, _, top_k, n_group, topk_group, renormalize, scale = GROUPED_ROUTERS[model]
    if noaux_tc:
        args = (top_k, renormalize, bias, n_group, topk_group, scale)
        return fm.moe_route_noaux_tc(logits, *args), route_noaux_tc(logits, *args), logits.sigmoid() + bias
    args = (top_k, renormalize, n_group, topk_group, scale)
    return (fm.moe_route_group_limited(logits, *args), route_group_limited(logits, *args),
            logits.softmax(dim=-1))


def assert_same_experts(got: Routing, want: Routing, rows: torch.Tensor) -> None:
    """The same experts on ``rows`` (as sets: the references' top-k is unsorted) and, by id, their weights
    (on every row: tied experts have the same weights)."""
    (got_w, got_i), (want_w, want_i) = got, want
    got_sorted, got_order = got_i.long().sort(dim=-1)
    want_sorted, want_order = want_i.sort(dim=-1)
    assert torch.equal(got_sorted[rows], want_sorted[rows])
    torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, want_order), rtol=ROUTE_REL_TOL,
                               atol=0)


@pytest.mark.parametrize("num_tokens", [0, 1, ROUTER_TOKENS])
@pytest.mark.parametrize("model", sorted(GROUPED_ROUTERS))
def test_grouped_route_kernels_match_the_torch_routers(model, num_tokens):
    """moe_route_group_limited / moe_route_noaux_tc against route_group_limited / route_noaux_tc: the same
    experts, in descending order of choice, with the same weights; a row of ties takes the lowest ids
    (torch.topk's order among equals is its own)."""
    noaux_tc, num_experts, top_k, n_group, _, _, _ = GROUPED_ROUTERS[model]
    logits = grouped_router_logits(num_tokens, num_experts, n_group, seed=61)
    bias = randn(num_experts, dtype=torch.float32, seed=62, scale=0.01)  # moves near-equal choices only
    got, want, choice = grouped_routings(model, logits, bias)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
    assert got[0].shape == got[1].shape == (num_tokens, top_k)
    # Slots in descending order of choice (the slot sum's order).
    assert (choice.gather(1, got[1].long()).diff(dim=-1) <= 0).all()
    # The TIED_ROW ties every softmax score; noaux_tc's bias unties its choice.
    untied = torch.ones(num_tokens, dtype=torch.bool) if noaux_tc else torch.arange(num_tokens) != TIED_ROW
    assert_same_experts(got, want, untied)
    if num_tokens > GROUPS_ROW and n_group > 1:  # the crafted row: the group score decided
        assert (0 in got[1][GROUPS_ROW].tolist()) != noaux_tc
    if num_tokens > TIED_ROW:  # every choice equal (a flat bias): the lowest ids
        flat = torch.zeros_like(bias)
        got, want, _ = grouped_routings(model, logits[TIED_ROW:TIED_ROW + 1], flat)
        assert got[1][0].tolist() == list(range(top_k))
        assert_same_experts(got, want, torch.tensor([False]))


@pytest.mark.parametrize("noaux_tc", [False, True])
def test_routers_take_the_route_kernel_on_the_kernels_devices(monkeypatch, noaux_tc):
    """SoftmaxGroupRouter / NoAuxTcRouter on a 16-bit input: the kernel path (int32 ids) chooses the torch
    path's experts with its weights; both keep the router's fp32 weight in a bf16 module."""
    from plait.kernels import dispatch
    from plait.layers.moe import NoAuxTcRouter, SoftmaxGroupRouter

    hidden, num_experts, top_k, n_group, topk_group = 32, 64, 6, 8, 3
    kind = NoAuxTcRouter if noaux_tc else SoftmaxGroupRouter
    router = kind(hidden, num_experts, top_k, True, n_group, topk_group, 2.5).to(DEVICE, BF16)
    assert router.weight.dtype == torch.float32
    with torch.no_grad():
        router.weight.copy_(randn(num_experts, hidden, dtype=BF16, seed=63, scale=0.5))  # a bf16 checkpoint's
        if noaux_tc:
            router.e_score_correction_bias.copy_(randn(num_experts, dtype=torch.float32, seed=64, scale=0.1))
    x = randn(7, hidden, dtype=BF16, seed=65)
    routed = {}
    for kernels in (False, True):
        monkeypatch.setattr(dispatch, "_enabled", kernels)  # off: the torch path, on a GPU too
        monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels and not ON_GPU)
        with torch.no_grad():
            routed[kernels] = router(x)
    assert routed[False][1].dtype == torch.int64 and routed[True][1].dtype == torch.int32  # the paths taken
    assert_same_experts(routed[True], routed[False], torch.ones(len(x), dtype=torch.bool))


# Each routing once, in fp32 or bf16 by turns (both dtypes' roundings are test_fused_moe_matches_ref's), on
# each path: the GEMV at GEMV_TOKENS, the grouped GEMM at 33 tokens (an expert that takes every token: three
# blocks, the last ragged; the same expert twice: five).
@pytest.mark.parametrize(("case", "dtype"), [
    ("one_expert", torch.float32), ("same_expert_twice", BF16), ("k1", torch.float32), ("e1", BF16),
    ("int32_ids", torch.float32), ("int32_ids", BF16)])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_adversarial_routings(dtype, case, path):
    t = GEMV_TOKENS if path == "gemv" else 33
    num_experts, top_k = (1, 1) if case == "e1" else (E, 1 if case == "k1" else K)
    w13, w2 = experts(num_experts, H, INTER, dtype, seed=14)
    x = randn(t, H, dtype=dtype, seed=16)
    weights, ids = routing(t, num_experts, top_k, seed=17)
    if case == "one_expert":  # all tokens on expert 3 (slot 0) and expert 1 (slot 1): 0 and 2 idle
        ids = torch.tensor([[3, 1]] * t, device=DEVICE)
    elif case == "same_expert_twice":
        ids = torch.full((t, top_k), 2, device=DEVICE)
    elif case == "int32_ids":
        ids = ids.to(torch.int32)
    got, want = run_both(x, w13, w2, weights, ids, gemv=PATHS[path])
    assert_close_to_ref(got, want)
    if case == "int32_ids":
        assert torch.equal(got, fused_moe(x, w13, w2, weights, ids.long(), gemv=PATHS[path]))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("config", [
    MoeConfig(block_m=32, block_n=16, block_k=16, group_m=4, num_stages=1),
    MoeConfig(block_m=16, block_n=64, block_k=64, group_m=2, num_stages=1),
])
def test_fused_moe_configs_and_ragged_sizes(dtype, config):
    # H=48, I=40: K steps past the end (masked loads), column tiles past N (masked stores, re-read rows).
    hidden, inter, t = 48, 40, 21
    w13, w2 = experts(E, hidden, inter, dtype, seed=18)
    x = randn(t, hidden, dtype=dtype, seed=20)
    weights, ids = routing(t, E, K, seed=21)
    assert_close_to_ref(*run_both(x, w13, w2, weights, ids, config=config))


def test_fused_moe_strided_x_and_empty_batch():
    w13, w2 = experts(E, H, INTER, torch.float32, seed=22)
    wide = randn(7, 2 * H, dtype=torch.float32, seed=24)
    x = wide[:, :H]  # rows strided, as a slice of a fused projection's output would be
    weights, ids = routing(7, E, K, seed=25)
    assert_close_to_ref(*run_both(x, w13, w2, weights, ids))
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, H) and empty.dtype == torch.float32


@pytest.mark.parametrize("path, t", [("auto", GEMV_TOKENS), ("grouped", 33)])
def test_fused_moe_is_deterministic(path, t):
    w13, w2 = experts(E, H, INTER, BF16, seed=26)
    x = randn(t, H, dtype=BF16, seed=28)
    weights, ids = routing(t, E, K, seed=29)
    gemv = PATHS[path]
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, gemv=gemv),
                       fused_moe(x, w13, w2, weights, ids, gemv=gemv))


@pytest.mark.parametrize("gemv", [True, False])
def test_fused_moe_batch_invariant_fp32(gemv):
    # Within one path: moe_config's fp32 pick does not depend on T (nor does any block_k), rows of a block
    # never mix, a GEMV program is one entry, and a token's slots are summed in slot order: so a token's
    # output is the same bits alone or in a batch. (The two paths sum K in different orders.)
    t = 9 if gemv else 33  # the grouped GEMM: 66 entries, several blocks an expert (GEMV_TOKENS)
    w13, w2 = experts(E, H, INTER, torch.float32, seed=30)
    x = randn(t, H, dtype=torch.float32, seed=32)
    weights, ids = routing(t, E, K, seed=33)
    full = fused_moe(x, w13, w2, weights, ids, gemv=gemv)
    for i in (0, t // 2, t - 1):
        alone = fused_moe(x[i : i + 1], w13, w2, weights[i : i + 1], ids[i : i + 1], gemv=gemv)
        assert torch.equal(alone[0], full[i])
    # And inside a different batch (the token last, after others with their own routing).
    others = randn(9, H, dtype=torch.float32, seed=34)
    w_o, ids_o = routing(9, E, K, seed=35)
    mixed = fused_moe(torch.cat([others, x[5:6]]), w13, w2, torch.cat([w_o, weights[5:6]]),
                      torch.cat([ids_o, ids[5:6]]), gemv=gemv)
    assert torch.equal(mixed[-1], full[5])


def emulated(x, w13, w2, weights, ids, rnd):
    """fused_moe's arithmetic in torch, fp32 between the roundings that ``rnd`` (fp32 -> dtype -> fp32)
    makes where the kernel rounds: gate and up, silu, their product, each slot's weighted output, the sum."""
    inter = w2.shape[-1]
    flat = ids.reshape(-1).long()
    rows = x.float()[torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])]
    gate_up = torch.einsum("mh,mnh->mn", rows, w13.float()[flat])
    gate, up = rnd(gate_up[:, :inter]), rnd(gate_up[:, inter:])
    h = rnd(rnd(gate / (1 + torch.exp(-gate))) * up)
    y = rnd(torch.einsum("mi,mhi->mh", h, w2.float()[flat]) * weights.reshape(-1, 1))
    return rnd(y.view(*ids.shape, -1).sum(1))


def truncated_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 by truncation (the interpreter's cast): the low 16 bits cleared."""
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize("path, t", [("auto", GEMV_TOKENS), ("grouped", 33)])
def test_fused_moe_rounds_where_the_reference_does(dtype, t, path):
    """The kernel rounds to the dtype at exactly the documented points (with the interpreter's truncating
    bf16 casts off the GPU), on either path: against an emulation of those roundings only the order of the
    fp32 sums differs, which may flip a rounding of gate or up: within one unit of eps x max|out|."""
    w13, w2 = experts(E, H, INTER, dtype, seed=10)
    x = randn(t, H, dtype=dtype, seed=12)
    weights, ids = routing(t, E, K, seed=13)
    truncating = dtype == BF16 and not ON_GPU
    want = emulated(x, w13, w2, weights, ids, truncated_bf16 if truncating else lambda v: v.to(dtype).float())
    err = (fused_moe(x, w13, w2, weights, ids, gemv=PATHS[path]).float() - want).abs().max().item()
    assert err <= torch.finfo(dtype).eps * want.abs().max().item()


def test_fused_moe_ref_is_transformers_mixtral_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"  # the per-expert loop, not a grouped-mm kernel
    for dtype in (torch.float32, BF16):
        module = MixtralExperts(cfg).to(dtype)
        w13, w2 = experts(E, H, INTER, dtype, seed=36)
        x = randn(9, H, dtype=dtype, seed=38).cpu()
        weights, ids = routing(9, E, K, seed=39)
        with torch.no_grad():
            module.gate_up_proj.copy_(w13.cpu())
            module.down_proj.copy_(w2.cpu())
            want = module(x, ids.cpu(), weights.cpu())
        assert torch.equal(fused_moe_ref(x, w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()), want)


def test_moe_config_heuristic():
    qwen = dict(top_k=8, num_experts=128, hidden=2048, intermediate=768)
    decode, prompt = moe_config(1, dtype=BF16, **qwen), moe_config(4096, dtype=BF16, **qwen)
    assert decode.block_m == fm.DECODE_BLOCK_M and prompt.block_m == fm.PROMPT_BLOCK_M
    # The same K steps at every batch size and dtype choice (batch invariance of the K loop).
    for dtype in DTYPES:
        assert len({moe_config(t, dtype=dtype, **qwen).block_k for t in (1, 8, 64, 256, 4096, 65536)}) == 1
    assert moe_config(4096, dtype=torch.float32, **qwen) == moe_config(1, dtype=torch.float32, **qwen)
    cpu = moe_config(4096, dtype=BF16, on_cuda=False, **qwen)
    assert cpu.block_m * cpu.block_n * cpu.block_k <= fm.CPU_BLOCK_M * fm.CPU_BLOCK_N * fm.CPU_BLOCK_K
    assert fm.max_padded(8, 128, 16) == 128  # a decode token's 8 entries: at most 8 groups of one block


@pytest.mark.parametrize("bad", ["x_1d", "h_mismatch", "w2_shape", "odd_w13", "dtype_mix", "int_x",
                                 "ids_float", "ids_int16", "weights_bf16", "weights_shape", "tokens"])
def test_fused_moe_rejects_bad_arguments(bad):
    w13, w2 = experts(E, H, INTER, torch.float32, seed=40)
    x = randn(3, H, dtype=torch.float32, seed=42)
    weights, ids = routing(3, E, K, seed=43)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    args.update({
        "x_1d": dict(x=x[0]), "h_mismatch": dict(x=x[:, :-1]), "w2_shape": dict(w2=w2[:, :, :-1]),
        "odd_w13": dict(w13=w13[:, :-1]), "dtype_mix": dict(w2=w2.to(BF16)), "int_x": dict(x=x.long()),
        "ids_float": dict(topk_ids=ids.float()), "ids_int16": dict(topk_ids=ids.to(torch.int16)),
        "weights_bf16": dict(topk_weights=weights.to(BF16)),
        "weights_shape": dict(topk_weights=weights[:, :1]),
        "tokens": dict(topk_ids=ids[:2], topk_weights=weights[:2]),
    }[bad])
    with pytest.raises(ValueError):
        fused_moe(**args)
    with pytest.raises(ValueError):
        fused_moe_ref(**args)


# -- block-wise FP8 experts -------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_BLOCK = (32, 32)
FP8_INTER = 64  # a multiple of the block's rows (32), as w13's up half must start on a tile row
# The kernel and the FP8 reference quantise x and h bit for bit alike and round to the dtype at the same
# points, so (but for the interpreter's bf16 casts) they differ by the order of their fp32 sums only: in
# fp32 a few roundings of the output's scale (measured up to 4.4 units of eps x max|out| at these shapes),
# in bf16 at most a flipped rounding of a slot output or of the sum (under a unit each; 0 measured).
FP8_FP32_ULPS = 16
FP8_HALF_ULPS = 2
# The interpreter truncates fp32 -> bf16 (see BF16_TRUNCATION_REL_ULPS), and h's values then go through the
# FP8 quantisation: a truncated h element may land on the neighbouring FP8 code or move its group's scale,
# which moves the output by more than the truncation itself (up to 6.9 units against the reference in an
# emulation over 100 seeds at these shapes). Against an emulation that truncates where the interpreter does,
# the kernel matches to the bit here (test_fused_moe_fp8_matches_ref checks it within FP8_HALF_ULPS).
FP8_BF16_TRUNCATION_REL_ULPS = 0 if ON_GPU else 8
# Where two computations sum in different fp32 orders, an h element within an ulp or so of an FP8 rounding
# boundary may round to the neighbouring code on one side only, and its token's row then moves by one FP8
# step of that element through w2: fused_moe_ref against emulated_fp8 (per-expert F.linear against per-entry
# einsum) at T=33 in fp32 showed this in 5 of 60 seeded cases, in 1-2 rows, by up to 3.6e-3 of max|out|
# (in bf16 under half a unit). So up to FP8_FLIP_ROWS rows (never more than a quarter of them) may miss the
# tight bound by such a step, within FP8_FLIP_REL_TOL x max|out|; a wrong tile, scale, expert or mask moves
# every row by more (the interpreter's kernel cases here show none).
FP8_FLIP_ROWS = 2
FP8_FLIP_REL_TOL = 1e-2


def fp8_experts(num_experts: int, hidden: int, inter: int, block: tuple[int, int], seed: int,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random experts (``experts``, values in ``dtype``) quantised tile by tile per expert: w13, w2 FP8 codes
    and their scales w13_scale [E, 2I / bn, cdiv(H, bk)], w2_scale [E, cdiv(H, bn), cdiv(I, bk)]."""
    w13, w2 = experts(num_experts, hidden, inter, dtype, seed=seed)
    q13 = [quantize_blocks(w, block) for w in w13]
    q2 = [quantize_blocks(w, block) for w in w2]
    return dict(w13=torch.stack([c for c, _ in q13]), w13_scale=torch.stack([sc for _, sc in q13]),
                w2=torch.stack([c for c, _ in q2]), w2_scale=torch.stack([sc for _, sc in q2]))


def group_dequantized(v: torch.Tensor, group: int) -> torch.Tensor:
    codes, scale = quantize_groups(v, group)
    return codes.float() * scale.repeat_interleave(group, dim=1)[:, : v.shape[1]]


def emulated_fp8(x, w, block, weights, ids, rnd):
    """The FP8 steps 1-4 (fused_moe_ref's docstring) written out per entry, vectorised: fp32 between the
    roundings ``rnd`` makes (gate and up, silu, their product, each slot's weighted output, the sum)."""
    inter, bk = w["w2"].shape[-1], block[1]
    w13, w2 = (torch.stack([dequantize_blocks(c, sc, block, torch.float32) for c, sc in zip(w[name],
                                                                                           w[f"{name}_scale"])])
               for name in ("w13", "w2"))
    flat = ids.reshape(-1).long()
    xq = group_dequantized(x, bk)  # 1. x per token and bk-group
    rows = xq[torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])]
    gate_up = torch.einsum("mh,mnh->mn", rows, w13[flat])  # 2.
    gate, up = rnd(gate_up[:, :inter]), rnd(gate_up[:, inter:])
    h = rnd(rnd(gate / (1 + torch.exp(-gate))) * up)
    hq = group_dequantized(h, bk)  # 3. h per entry row and bk-group
    y = rnd(torch.einsum("mi,mhi->mh", hq, w2[flat]) * weights.reshape(-1, 1))  # 4.
    return rnd(y.view(*ids.shape, -1).sum(1))


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, allowed: float) -> None:
    """got within ``allowed`` units of eps(dtype) x max|want| of want, but for FP8_FLIP_ROWS token rows (at
    most a quarter) within FP8_FLIP_REL_TOL x max|want|."""
    assert got.dtype == want.dtype and got.shape == want.shape
    peak = want.double().abs().max().item()
    unit = torch.finfo(want.dtype).eps * peak
    row_err = (got.double() - want.double()).abs().amax(dim=1)
    over = row_err > allowed * unit
    worst = row_err.max().item() / unit
    assert int(over.sum()) <= min(FP8_FLIP_ROWS, got.shape[0] // 4), (
        f"{int(over.sum())} rows over {allowed} units of eps x max|out| (worst {worst:.2f})")
    assert bool((row_err[over] <= FP8_FLIP_REL_TOL * peak).all()), f"a row {worst:.2f} units apart"


def fp8_rounding(dtype: torch.dtype):
    """fp32 -> dtype -> fp32 as the kernel rounds on this machine (the interpreter truncates to bf16)."""
    if dtype == BF16 and not ON_GPU:
        return truncated_bf16
    return lambda v: v.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("path, t", sizes((1, 5, 33)))
def test_fused_moe_fp8_matches_ref(dtype, t, path):
    gemv = path == "gemv"
    w = fp8_experts(E, H, FP8_INTER, FP8_BLOCK, seed=70)
    x = randn(t, H, dtype=dtype, seed=72)
    weights, ids = routing(t, E, K, seed=73)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, gemv=gemv, **fp8_kw(w, FP8_BLOCK))
    want = fused_moe_ref(x, w["w13"], w["w2"], weights, ids, **fp8_kw(w, FP8_BLOCK))
    if dtype == torch.float32:
        assert_fp8_close(got, want, FP8_FP32_ULPS)
    else:
        assert_fp8_close(got, want, FP8_HALF_ULPS + FP8_BF16_TRUNCATION_REL_ULPS)
        # The truncation is all there is to the rest: the kernel rounds where the reference does.
        emulated = emulated_fp8(x, w, FP8_BLOCK, weights, ids, fp8_rounding(dtype)).to(dtype)
        assert_fp8_close(got, emulated, FP8_HALF_ULPS)


def fp8_kw(w: dict[str, torch.Tensor], block: tuple[int, int]) -> dict:
    return dict(w13_scale=w["w13_scale"], w2_scale=w["w2_scale"], block=block)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_fp8_ragged_blocks_and_strided_scales(dtype, path):
    # Block (32, 64), H=80, I=96: GEMM 1's last K block has 16 of 64 columns and GEMM 2's 32 (masked
    # loads; their input groups and weight tiles partial), w2's last tile row has 16 of 32 rows (column
    # tiles past N). The scales come as non-contiguous views (the kernels take their strides), and the
    # grouped path's config asks for 64 columns a program (capped to the 32-row tiles).
    block, hidden, inter = (32, 64), 80, 96
    t = GEMV_TOKENS if path == "gemv" else 9
    w = fp8_experts(E, hidden, inter, block, seed=74)
    w = {**w, **{name: w[name].transpose(1, 2).contiguous().transpose(1, 2) for name in ("w13_scale",
                                                                                          "w2_scale")}}
    assert not w["w13_scale"].is_contiguous()
    x = randn(t, hidden, dtype=dtype, seed=76)
    weights, ids = routing(t, E, K, seed=77)
    config = MoeConfig(block_m=16, block_n=64, block_k=64, group_m=2, num_stages=1)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, config=None if path == "gemv" else config,
                    gemv=path == "gemv", **fp8_kw(w, block))
    want = emulated_fp8(x, w, block, weights, ids, fp8_rounding(dtype)).to(dtype)
    assert_fp8_close(got, want, FP8_FP32_ULPS if dtype == torch.float32 else FP8_HALF_ULPS)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_moe_ref_fp8_is_steps_1_to_4(dtype):
    """The FP8 reference (HF's loop) is the written-out steps 1-4 with torch's roundings: only the order of
    the fp32 sums differs (F.linear per expert against einsum per entry)."""
    w = fp8_experts(E, H, FP8_INTER, FP8_BLOCK, seed=78, dtype=dtype)
    x = randn(21, H, dtype=dtype, seed=80)
    weights, ids = routing(21, E, K, seed=81)
    got = fused_moe_ref(x, w["w13"], w["w2"], weights, ids, **fp8_kw(w, FP8_BLOCK))
    want = emulated_fp8(x, w, FP8_BLOCK, weights, ids, lambda v: v.to(dtype).float()).to(dtype)
    assert_fp8_close(got, want, FP8_FP32_ULPS if dtype == torch.float32 else FP8_HALF_ULPS)


@pytest.mark.parametrize("bad", ["inter_off_tiles", "no_w13_scale", "no_w2_scale", "no_block",
                                 "w13_scale_shape", "w2_scale_shape", "scale_bf16", "scale_fp64",
                                 "block_not_pow2", "block_small", "half_fp8", "scales_for_bf16"])
def test_fused_moe_fp8_rejects_bad_arguments(bad):
    w = fp8_experts(E, H, FP8_INTER, FP8_BLOCK, seed=82)
    x = randn(3, H, dtype=torch.float32, seed=84)
    weights, ids = routing(3, E, K, seed=85)
    args = dict(x=x, topk_weights=weights, topk_ids=ids, block=FP8_BLOCK, **w)
    if bad == "inter_off_tiles":  # I = 48: the up half would start mid tile row
        args.update(fp8_experts(E, H, 48, FP8_BLOCK, seed=82))
    elif bad == "scales_for_bf16":
        args.update(zip(("w13", "w2"), experts(E, H, FP8_INTER, BF16, seed=82)), x=x.to(BF16))
    else:
        args.update({
            "no_w13_scale": dict(w13_scale=None), "no_w2_scale": dict(w2_scale=None),
            "no_block": dict(block=None), "w13_scale_shape": dict(w13_scale=w["w13_scale"][:, :-1]),
            "w2_scale_shape": dict(w2_scale=w["w2_scale"][:-1]),
            "scale_bf16": dict(w13_scale=w["w13_scale"].to(BF16)),
            "scale_fp64": dict(w2_scale=w["w2_scale"].double()),
            "block_not_pow2": dict(block=(32, 48)), "block_small": dict(block=(16, 16)),
            "half_fp8": dict(w2=w["w2"].float()),
        }[bad])
    with pytest.raises(ValueError):
        fused_moe(**args)
    with pytest.raises(ValueError):
        fused_moe_ref(**args)


# -- gpt-oss experts: biases and swiglu_oai -----------------------------------------------------------------

OAI_ALPHA, OAI_LIMIT = fm.GPT_OSS_SWIGLU_ALPHA, fm.GPT_OSS_SWIGLU_LIMIT
# Inputs this many times larger than `experts` assumes: gate and up then have a spread of ~4, so that a few
# percent of them pass +-OAI_LIMIT and the clamps bind (gpt_oss_case checks that they do).
OAI_X_SCALE = 4.0
# The interpreter's truncating bf16 casts (BF16_TRUNCATION_REL_ULPS) at swiglu_oai's six roundings of each
# h element (against silu's two) and the down projection's three: a torch emulation that truncates where the
# kernel does (the kernel matches it to the bit here) lands up to 5.5 units from the reference over 200
# seeds at these shapes, where round-to-nearest gives 0.13.
OAI_BF16_TRUNCATION_REL_ULPS = 0 if ON_GPU else 5
# In 16-bit dtypes, the share of output elements that may differ at all from an emulation that rounds where
# the kernel does: the order of the fp32 sums may flip a rounding (measured: at most 0.25% of them over 24
# seeds at these shapes, none in bf16), while leaving out any one of swiglu_oai's or the biases' roundings
# changes 1.6% (alpha * gate, fp16) to 58% (the first matmul's, bf16) of them. A bound on the largest
# difference alone (one unit of eps x max|out|) would not see a missing rounding: each moves the output by
# less than that.
OAI_ROUNDING_MISMATCH_FRACTION = 0.01


def gpt_oss_case(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, ...]:
    """x, w13, w2, w13_bias [E, 2I], w2_bias [E, H], weights, ids: gpt-oss-like experts whose gate and up
    values pass +-OAI_LIMIT (checked here, so that every test of them exercises the clamps)."""
    w13, w2 = experts(num_experts, hidden, inter, dtype, seed=seed)
    x = randn(num_tokens, hidden, dtype=dtype, seed=seed + 2, scale=OAI_X_SCALE)
    b13 = randn(num_experts, 2 * inter, dtype=dtype, seed=seed + 3)
    b2 = randn(num_experts, hidden, dtype=dtype, seed=seed + 4)
    weights, ids = routing(num_tokens, num_experts, top_k, seed=seed + 5)
    gate_up = torch.einsum("th,tkih->tki", x.float(), w13.float()[ids]) + b13.float()[ids]  # [T, k, 2I]
    gate, up = gate_up.split(inter, dim=-1)
    assert bool((gate > OAI_LIMIT).any() & (up > OAI_LIMIT).any() & (up < -OAI_LIMIT).any())
    return x, w13, w2, b13, b2, weights, ids


def oai_kw(b13: torch.Tensor | None, b2: torch.Tensor | None, activation: str = fm.SWIGLU_OAI) -> dict:
    return dict(w13_bias=b13, w2_bias=b2, activation=activation)


def emulated_gpt_oss(x, w13, w2, b13, b2, weights, ids, rnd):
    """fused_moe's arithmetic with biases and swiglu_oai in torch: fp32 between the roundings ``rnd`` makes
    where the kernel rounds (GptOssExperts' in x's dtype: each matmul and its bias sum, alpha * gate, the
    sigmoid, gate times it, up + 1, the product; the weighted slot output; the slot sum)."""
    inter = w2.shape[-1]
    flat = ids.reshape(-1).long()
    rows = x.float()[torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])]
    gate_up = rnd(torch.einsum("mh,mnh->mn", rows, w13.float()[flat])) + b13.float()[flat]
    gate = rnd(gate_up[:, :inter]).clamp(max=OAI_LIMIT)
    up = rnd(gate_up[:, inter:]).clamp(-OAI_LIMIT, OAI_LIMIT)
    h = rnd(rnd(up + 1) * rnd(gate * rnd(torch.sigmoid(rnd(gate * OAI_ALPHA)))))
    out = rnd(rnd(torch.einsum("mi,mhi->mh", h, w2.float()[flat])) + b2.float()[flat])
    y = rnd(out * weights.reshape(-1, 1))
    return rnd(y.view(*ids.shape, -1).sum(1))


def assert_gpt_oss_close(got: torch.Tensor, case: tuple[torch.Tensor, ...]) -> None:
    """got (fused_moe of case) against fused_moe_ref within assert_close_to_ref's tolerances (and the
    interpreter's truncation at swiglu_oai's roundings); in 16-bit dtypes also against emulated_gpt_oss,
    which rounds where the kernel does: only the order of fp32 sums differs, which may flip a rounding, so
    within one unit of eps x max|out| and equal but for OAI_ROUNDING_MISMATCH_FRACTION of the elements."""
    x, w13, w2, b13, b2, weights, ids = case
    want = fused_moe_ref(x, w13, w2, weights, ids, **oai_kw(b13, b2))
    if x.dtype == BF16:  # the truncation's share, on top of assert_close_to_ref's own
        units = torch.finfo(BF16).eps * want.double().abs().max().item()
        err = (got.double() - want.double()).abs().max().item() / units
        assert err <= HALF_REL_ULPS + OAI_BF16_TRUNCATION_REL_ULPS + BF16_TRUNCATION_REL_ULPS, f"{err:.2f}"
    else:
        assert_close_to_ref(got, want)
    if x.dtype != torch.float32:
        rnd = truncated_bf16 if x.dtype == BF16 and not ON_GPU else (lambda v: v.to(x.dtype).float())
        emulated = emulated_gpt_oss(x, w13, w2, b13, b2, weights, ids, rnd)
        err = (got.float() - emulated).abs().max().item()
        assert err <= torch.finfo(x.dtype).eps * emulated.abs().max().item()
        assert_rounded_alike(got, emulated)


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    differ = (got.float() != want.float()).float().mean().item()
    assert differ <= OAI_ROUNDING_MISMATCH_FRACTION, f"{differ:.1%} of the elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_gpt_oss_experts_match_ref(dtype, path):
    # H=48, I=40 (as test_fused_moe_configs_and_ragged_sizes): masked K steps, column tiles past N, and the
    # up half's bias and rows starting mid tile.
    case = gpt_oss_case(9, E, K, 48, 40, dtype, seed=90)
    x, w13, w2, b13, b2, weights, ids = case
    assert_gpt_oss_close(fused_moe(x, w13, w2, weights, ids, gemv=path == "gemv", **oai_kw(b13, b2)), case)


@pytest.mark.parametrize("case", ["one_expert", "same_expert_twice", "k1", "e1", "int32_ids"])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_gpt_oss_adversarial_routings(case, path):
    # 17 tokens: a lone expert gets two 16-row blocks on the grouped path (CPU_BLOCK_M), one of them ragged.
    t = GEMV_TOKENS if path == "gemv" else 17
    num_experts, top_k = (1, 1) if case == "e1" else (E, 1 if case == "k1" else K)
    x, w13, w2, b13, b2, weights, ids = gpt_oss_case(t, num_experts, top_k, 48, 40, BF16, seed=92)
    if case == "one_expert":  # all tokens on expert 3 (slot 0) and expert 1 (slot 1): 0 and 2 idle
        ids = torch.tensor([[3, 1]] * t, device=DEVICE)
    elif case == "same_expert_twice":
        ids = torch.full((t, top_k), 2, device=DEVICE)
    elif case == "int32_ids":
        ids = ids.to(torch.int32)
    got = fused_moe(x, w13, w2, weights, ids, gemv=path == "gemv", **oai_kw(b13, b2))
    assert_gpt_oss_close(got, (x, w13, w2, b13, b2, weights, ids))


@pytest.mark.parametrize("combo", ["silu_with_biases", "swiglu_oai_without_biases", "w2_bias_only"])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_biases_and_activation_apart(combo, path):
    """Biases and the activation are independent: each alone (fp32, where any slip shows) against the
    reference."""
    x, w13, w2, b13, b2, weights, ids = gpt_oss_case(9, E, K, 48, 40, torch.float32, seed=94)
    kw = {"silu_with_biases": oai_kw(b13, b2, fm.SILU), "swiglu_oai_without_biases": oai_kw(None, None),
          "w2_bias_only": oai_kw(None, b2)}[combo]
    got = fused_moe(x, w13, w2, weights, ids, gemv=path == "gemv", **kw)
    assert_close_to_ref(got, fused_moe_ref(x, w13, w2, weights, ids, **kw))


def test_fused_moe_swiglu_oai_takes_its_alpha_and_limit():
    x, w13, w2, b13, b2, weights, ids = gpt_oss_case(5, E, K, 48, 40, torch.float32, seed=96)
    kw = dict(oai_kw(b13, b2), swiglu_alpha=1.25, swiglu_limit=3.5)
    want = fused_moe_ref(x, w13, w2, weights, ids, **kw)
    assert_close_to_ref(fused_moe(x, w13, w2, weights, ids, gemv=True, **kw), want)
    default = fused_moe_ref(x, w13, w2, weights, ids, **oai_kw(b13, b2))
    assert (want - default).abs().max() > 0.1 * default.abs().max()


def gpt_oss_hf_experts(w13, w2, b13, b2):
    """transformers' GptOssExperts (eager loop) holding these experts in its own layout: gate_up_proj
    [E, H, 2I] with gate and up columns interleaved (gate of unit j at 2j, its up at 2j + 1)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    num_experts, hidden, inter = w2.shape
    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                       num_experts_per_tok=K, swiglu_alpha=OAI_ALPHA, swiglu_limit=OAI_LIMIT)
    cfg._experts_implementation = "eager"  # the per-expert loop, not a grouped-mm kernel
    module = GptOssExperts(cfg).to(w13.dtype)
    gate_up = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).flatten(1, 2)  # rows g0, u0, g1, u1 ...
    gate_up_bias = torch.stack([b13[:, :inter], b13[:, inter:]], dim=2).flatten(1, 2)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up.transpose(1, 2))
        module.gate_up_proj_bias.copy_(gate_up_bias)
        module.down_proj.copy_(w2.transpose(1, 2))
        module.down_proj_bias.copy_(b2)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_moe_ref_is_transformers_gpt_oss_experts(dtype):
    """fused_moe_ref with biases and swiglu_oai on de-interleaved experts is GptOssExperts: the same
    operations up to the order of the matmuls' sums (F.linear on [2I, H] rows vs `x @ W` on [H, 2I]
    columns). In fp32 a few fp32 roundings of the output's scale apart; a wrong column, clamp or bias is far
    off. In bf16 each op rounded alike (equal to the bit at these shapes): a flipped rounding at most."""
    case = gpt_oss_case(9, E, K, H, INTER, dtype, seed=98)
    x, w13, w2, b13, b2, weights, ids = (t.cpu() for t in case)
    module = gpt_oss_hf_experts(w13, w2, b13, b2)
    with torch.no_grad():
        want = module(x, ids, weights)
    got = fused_moe_ref(x, w13, w2, weights, ids, **oai_kw(b13, b2))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    else:
        assert (got.float() - want.float()).abs().max() <= torch.finfo(dtype).eps * want.float().abs().max()
        assert_rounded_alike(got, want)


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_moe_layer_with_biases_is_the_ref(monkeypatch, kernels):
    """FusedMoE(bias=True, activation=swiglu_oai): the torch path is fused_moe_ref of its parameters with
    route's routing, to the bit; the Triton path (the interpreter on CPU) within the kernel's tolerances."""
    from plait.kernels import dispatch
    from plait.layers.moe import FusedMoE, route

    monkeypatch.setattr(dispatch, "_enabled", kernels)  # off: the torch path, on a GPU too
    monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels and not ON_GPU)
    dtype = BF16 if kernels else torch.float32
    x, w13, w2, b13, b2, _, _ = gpt_oss_case(7, E, K, H, INTER, dtype, seed=100)
    layer = FusedMoE(E, K, H, INTER, renormalize=True, activation=fm.SWIGLU_OAI, bias=True).to(DEVICE, dtype)
    assert layer.gate_up_bias.shape == (E, 2 * INTER) and layer.down_bias.shape == (E, H)
    assert "activation=swiglu_oai" in repr(layer) and "bias=True" in repr(layer)
    for param, value in zip((layer.gate_up_proj, layer.down_proj, layer.gate_up_bias, layer.down_bias),
                            (w13, w2, b13, b2)):
        param.data.copy_(value)
    logits = randn(7, E, dtype=torch.float32, seed=102, scale=2.0)
    weights, ids = route(logits, K, renormalize=True)
    with torch.no_grad():
        got = layer(x, logits)
    if kernels:
        assert_gpt_oss_close(got, (x, w13, w2, b13, b2, weights, ids))
    else:
        assert torch.equal(got, fused_moe_ref(x, w13, w2, weights, ids, **oai_kw(b13, b2)))


@pytest.mark.parametrize("bad", ["activation", "w13_bias_shape", "w2_bias_shape", "bias_dtype",
                                 "fp8_bias", "fp8_swiglu_oai"])
def test_fused_moe_rejects_bad_gpt_oss_arguments(bad):
    w13, w2 = experts(E, H, INTER, torch.float32, seed=104)
    x = randn(3, H, dtype=torch.float32, seed=106)
    weights, ids = routing(3, E, K, seed=107)
    b13, b2 = torch.zeros(E, 2 * INTER, device=DEVICE), torch.zeros(E, H, device=DEVICE)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    if bad.startswith("fp8"):
        w = fp8_experts(E, H, FP8_INTER, FP8_BLOCK, seed=104)
        b13 = torch.zeros(E, 2 * FP8_INTER, device=DEVICE)
        args.update(fp8_kw(w, FP8_BLOCK), w13=w["w13"], w2=w["w2"])
    args.update({
        "activation": dict(activation="gelu"), "w13_bias_shape": dict(w13_bias=b13[:, :INTER]),
        "w2_bias_shape": dict(w2_bias=b2[:, :-1]), "bias_dtype": dict(w2_bias=b2.to(BF16)),
        "fp8_bias": dict(w13_bias=b13), "fp8_swiglu_oai": dict(activation=fm.SWIGLU_OAI),
    }[bad])
    with pytest.raises(ValueError):
        fused_moe(**args)
    with pytest.raises(ValueError):
        fused_moe_ref(**args)


def test_fused_moe_layer_refuses_what_it_cannot_run():
    from plait.layers.moe import FusedMoE

    with pytest.raises(ValueError):
        FusedMoE(E, K, H, INTER, renormalize=True, activation="gelu")
    for kw in (dict(bias=True), dict(activation=fm.SWIGLU_OAI)):
        with pytest.raises(ValueError):
            FusedMoE(E, K, H, FP8_INTER, renormalize=True, **kw).quantize_fp8(FP8_BLOCK)


# -- relu2_no_mul: NemotronH's ungated experts ------------------------------------------------------------

# Inputs scaled so that about half of each expert's up values are negative (relu's zeros) and the rest O(1).
RELU2_X_SCALE = 2.0


def relu2_case(num_tokens: int, dtype: torch.dtype, seed: int, inter: int = INTER, hidden: int = H
               ) -> tuple[torch.Tensor, ...]:
    """x, w13 [E, I, H] (the up rows alone), w2 [E, H, I], weights, ids."""
    w13 = randn(E, inter, hidden, dtype=dtype, seed=seed, scale=hidden**-0.5)
    w2 = randn(E, hidden, inter, dtype=dtype, seed=seed + 1, scale=inter**-0.5)
    x = randn(num_tokens, hidden, dtype=dtype, seed=seed + 2, scale=RELU2_X_SCALE)
    weights, ids = routing(num_tokens, E, K, seed=seed + 3)
    return x, w13, w2, weights, ids


RELU2 = dict(activation=fm.RELU2_NO_MUL)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("path, t", sizes((5, 33)))
def test_fused_moe_relu2_no_mul_matches_ref(dtype, t, path):
    """Ungated experts (w13 the up rows alone): both kernel paths against the reference; I = 40 and H = 48,
    not multiples of the tiles."""
    x, w13, w2, weights, ids = relu2_case(t, dtype, seed=120, inter=40, hidden=48)
    got = fused_moe(x, w13, w2, weights, ids, gemv=path == "gemv", **RELU2)
    want = fused_moe_ref(x, w13, w2, weights, ids, **RELU2)
    assert_close_to_ref(got, want)


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_relu2_no_mul_with_biases(path):
    """Ungated experts with biases (w13_bias [E, I]): each added in its epilogue, fp32."""
    x, w13, w2, weights, ids = relu2_case(9, torch.float32, seed=124)
    b13, b2 = randn(E, INTER, dtype=torch.float32, seed=126), randn(E, H, dtype=torch.float32, seed=127)
    kw = dict(RELU2, w13_bias=b13, w2_bias=b2)
    want = fused_moe_ref(x, w13, w2, weights, ids, **kw)
    assert_close_to_ref(fused_moe(x, w13, w2, weights, ids, gemv=path == "gemv", **kw), want)
    assert (want - fused_moe_ref(x, w13, w2, weights, ids, **RELU2)).abs().max() > 0.1


def nemotron_h_hf_experts(w13: torch.Tensor, w2: torch.Tensor):
    """transformers' NemotronHExperts (its eager loop) holding these experts: up_proj [E, I, H] and down_proj
    [E, H, I], as its layout is plait's."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    num_experts, hidden, inter = w2.shape
    cfg = NemotronHConfig(hidden_size=hidden, n_routed_experts=num_experts, moe_intermediate_size=inter,
                          num_experts_per_tok=K, mlp_hidden_act="relu2")
    cfg._experts_implementation = "eager"
    module = NemotronHExperts(cfg).to(w13.dtype)
    with torch.no_grad():
        module.up_proj.copy_(w13)
        module.down_proj.copy_(w2)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_moe_ref_is_transformers_nemotron_h_experts(dtype):
    """fused_moe_ref with relu2_no_mul is NemotronHExperts: the same ops (up, relu, square, down, times the
    routing weight); transformers sums the slots in fp32 where the reference sums in x's dtype: equal in fp32
    up to the order of sums, within a rounding of the output in bf16."""
    x, w13, w2, weights, ids = (t.cpu() for t in relu2_case(9, dtype, seed=128))
    with torch.no_grad():
        want = nemotron_h_hf_experts(w13, w2)(x, ids, weights)
    got = fused_moe_ref(x, w13, w2, weights, ids, **RELU2)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    else:
        bound = 2 * torch.finfo(dtype).eps * want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= bound


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_moe_layer_of_relu2_experts_loads_and_runs(monkeypatch, kernels):
    """FusedMoE(activation=relu2_no_mul): gate_up_proj [E, I, H] takes each expert's up_proj (the Hub's
    per-expert tensors) or transformers 5's stacked up_proj whole; a gate_proj is no tensor of it, a missing
    expert is refused; it runs as the reference (the kernels: within their tolerances)."""
    from plait.kernels import dispatch
    from plait.layers.moe import FusedMoE, route

    monkeypatch.setattr(dispatch, "_enabled", kernels)
    monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels and not ON_GPU)
    x, w13, w2, _, _ = relu2_case(7, torch.float32, seed=130)
    per_expert, stacked = (FusedMoE(E, K, H, INTER, renormalize=True, **RELU2).to(DEVICE) for _ in range(2))
    assert per_expert.gate_up_proj.shape == (E, INTER, H) and "activation=relu2_no_mul" in repr(per_expert)
    for e in range(E):
        per_expert.load_expert(e, "up_proj", w13[e])
        per_expert.load_expert(e, "down_proj", w2[e])
        stacked.load_stacked("gate_up_proj", e, w13[e])
        stacked.load_stacked("down_proj", e, w2[e])
    per_expert.check_loaded()
    assert torch.equal(per_expert.gate_up_proj, w13) and torch.equal(stacked.gate_up_proj, w13)
    with pytest.raises(ValueError, match="no expert tensor 0.gate_proj"):
        per_expert.load_expert(0, "gate_proj", w13[0])
    partial = FusedMoE(E, K, H, INTER, renormalize=True, **RELU2).to(DEVICE)
    partial.load_expert(0, "up_proj", w13[0])
    with pytest.raises(ValueError, match="missing"):
        partial.check_loaded()
    logits = randn(7, E, dtype=torch.float32, seed=132, scale=2.0)
    weights, ids = route(logits, K, renormalize=True)
    with torch.no_grad():
        got = per_expert(x, logits)
    want = fused_moe_ref(x, w13, w2, weights, ids, **RELU2)
    if kernels:
        assert_close_to_ref(got, want)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_local_experts_of_relu2_experts(poisoned_empty, path):
    """Expert parallelism with ungated experts, fp32: the two ranks add up to the whole."""
    x, w13, w2, weights, ids = relu2_case(GEMV_TOKENS if path == "gemv" else 21, torch.float32, seed=134)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, **RELU2)
    assert_ranks_sum_to_the_whole(args, gemv=path == "gemv")


def test_relu2_experts_refuse_what_is_not_implemented():
    """FP8, MXFP4 and integer experts with relu2_no_mul are refused by name (the layer and the kernels), as
    is a w13 of gate and up rows (or any row count that does not match w2)."""
    from plait.layers.moe import FusedMoE
    from plait.layers.wna16 import WNA16Spec

    for quantize in (lambda m: m.quantize_fp8(FP8_BLOCK), lambda m: m.use_mxfp4(),
                     lambda m: m.use_integer(WNA16Spec("gptq", 4, 32, zero_offset=1))):
        with pytest.raises(ValueError, match="relu2_no_mul"):
            quantize(FusedMoE(E, K, H, FP8_INTER, renormalize=True, **RELU2))
    w = fp8_experts(E, H, FP8_INTER, FP8_BLOCK, seed=136)
    weights, ids = routing(3, E, K, seed=137)
    fp8 = dict(x=randn(3, H, dtype=torch.float32, seed=138), w13=w["w13"][:, :FP8_INTER], w2=w["w2"],
               topk_weights=weights, topk_ids=ids, **fp8_kw(w, FP8_BLOCK), **RELU2)
    x, w13, w2, weights, ids = relu2_case(3, torch.float32, seed=139)
    gated_rows = dict(x=x, w13=torch.cat([w13, w13], dim=1), w2=w2, topk_weights=weights, topk_ids=ids,
                      **RELU2)
    for args in (fp8, gated_rows):
        for run in (fused_moe, fused_moe_ref):
            with pytest.raises(ValueError):
                run(**args)


# -- expert parallelism: a rank's experts alone ------------------------------------------------------------

# fused_moe's arguments with one row per expert: a rank holding some experts has their rows alone.
PER_EXPERT_ARGS = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")


def rank_args(args: dict, rank: int, ranks: int = 2) -> dict:
    """fused_moe's keyword arguments ``args`` as rank ``rank`` of ``ranks`` has them under expert
    parallelism: its E / ranks experts' rows of every per-expert tensor, the global routing, and
    local_experts saying which experts it holds."""
    total = args["w13"].shape[0]
    held = LocalExperts(rank * total // ranks, total // ranks, total)
    mine = slice(held.first, held.first + held.count)
    rows = {name: args[name][mine] for name in PER_EXPERT_ARGS if args.get(name) is not None}
    return args | rows | {"local_experts": held}


class _PoisonedEmpty:
    """torch, but for empty floating tensors full of NaNs: a row no kernel writes (an entry of an expert held
    elsewhere) poisons any result that reads it."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs) -> torch.Tensor:
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.fixture
def poisoned_empty(monkeypatch):
    monkeypatch.setattr(fm, "torch", _PoisonedEmpty())


def assert_ranks_sum_to_the_whole(args: dict, gemv: bool) -> list[torch.Tensor]:
    """Two ranks' fused_moe outputs (each of its own experts' entries) add up to the one with every expert,
    bit for bit: each entry's row is computed alike (rows never mix, and the tiles follow the count of all
    experts), and with k = 2 a token's two slot outputs are summed once either way, in fp32 and rounded once
    (as the kernel rounds: fp8_rounding). In fp32 the reference's two ranks add up to its whole too (to the
    order of its sums). The ranks' kernel outputs."""
    assert args["topk_ids"].shape[1] == 2
    parts = [fused_moe(**rank_args(args, rank), gemv=gemv) for rank in range(2)]
    whole = fused_moe(**args, gemv=gemv)
    assert torch.equal(fp8_rounding(whole.dtype)(parts[0].float() + parts[1].float()).to(whole.dtype), whole)
    if whole.dtype == torch.float32:
        ref_parts = [fused_moe_ref(**rank_args(args, rank)) for rank in range(2)]
        assert_close_to_ref(ref_parts[0] + ref_parts[1], fused_moe_ref(**args))
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("path, t", sizes((1, 5, 33)))
def test_fused_moe_local_experts_match_ref(poisoned_empty, dtype, t, path):
    """Two ranks of E = 4 experts: each rank's kernel output is the reference's for its two experts (entries
    routed to the other's add nothing, and nothing reads their unwritten rows: poisoned_empty; a token routed
    there alone gets zeros), and the ranks' outputs sum to the whole experts' (assert_ranks_sum_to_the_whole).
    """
    w13, w2 = experts(E, H, INTER, dtype, seed=10)
    weights, ids = routing(t, E, K, seed=13)
    ids[-1] = torch.tensor([3, 2])  # the last token: both its experts on rank 1 (a lone token: rank 0 idle)
    args = dict(x=randn(t, H, dtype=dtype, seed=12), w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    parts = assert_ranks_sum_to_the_whole(args, gemv=path == "gemv")
    for rank, got in enumerate(parts):
        want = fused_moe_ref(**rank_args(args, rank))
        if want.any():
            assert_close_to_ref(got, want)
        else:
            assert not got.any()
    assert not parts[0][-1].any() and not fused_moe_ref(**rank_args(args, 0))[-1].any()


@pytest.mark.parametrize("kind", ["fp8", "gpt_oss", "int32_ids"])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_local_experts_of_every_kind(poisoned_empty, kind, path):
    """FP8 experts (their tile scales split by expert as well), gpt-oss's (swiglu_oai, and biases: an
    expert's down bias added by its own rank alone) and moe_route's int32 ids, in fp32: the ranks add up to
    the whole (assert_ranks_sum_to_the_whole)."""
    t = GEMV_TOKENS if path == "gemv" else 21
    if kind == "fp8":
        w = fp8_experts(E, H, FP8_INTER, FP8_BLOCK, seed=70)
        weights, ids = routing(t, E, K, seed=73)
        args = dict(x=randn(t, H, dtype=torch.float32, seed=72), w13=w["w13"], w2=w["w2"],
                    topk_weights=weights, topk_ids=ids, **fp8_kw(w, FP8_BLOCK))
    else:
        x, w13, w2, b13, b2, weights, ids = gpt_oss_case(t, E, K, 48, 40, torch.float32, seed=90)
        args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
        if kind == "gpt_oss":
            args |= oai_kw(b13, b2)
        else:
            args["topk_ids"] = ids.to(torch.int32)
    assert_ranks_sum_to_the_whole(args, gemv=path == "gemv")


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_moe_layers_of_two_ranks_sum_to_the_whole_layer(monkeypatch, kernels):
    """FusedMoE(expert_range=...): its stacks (and biases) hold its experts alone, its router's logits cover
    them all; two layers holding experts 0..1 and 2..3 add up to the layer holding the four, on the torch
    path and the kernels' (the interpreter on CPU)."""
    from plait.kernels import dispatch
    from plait.layers.moe import FusedMoE

    monkeypatch.setattr(dispatch, "_enabled", kernels)
    monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels and not ON_GPU)
    x, w13, w2, b13, b2, _, _ = gpt_oss_case(7, E, K, H, INTER, torch.float32, seed=100)
    kw = dict(renormalize=True, activation=fm.SWIGLU_OAI, bias=True)
    whole = FusedMoE(E, K, H, INTER, **kw).to(DEVICE)
    ranks = [FusedMoE(E, K, H, INTER, expert_range=(first, first + 2), **kw).to(DEVICE) for first in (0, 2)]
    assert ranks[1].gate_up_proj.shape == (2, 2 * INTER, H) and ranks[1].down_bias.shape == (2, H)
    assert ranks[1].num_experts == 2 and "experts=2..3 of 4" in repr(ranks[1])
    with torch.no_grad():
        values = dict(gate_up_proj=w13, down_proj=w2, gate_up_bias=b13, down_bias=b2)
        for layer, experts_of in ((whole, slice(0, E)), (ranks[0], slice(0, 2)), (ranks[1], slice(2, E))):
            for name, value in values.items():
                getattr(layer, name).copy_(value[experts_of])
        logits = randn(7, E, dtype=torch.float32, seed=102, scale=2.0)
        assert_close_to_ref(ranks[0](x, logits) + ranks[1](x, logits), whole(x, logits))
    for bad in ((2, 2), (3, 5), (-1, 2)):
        with pytest.raises(ValueError, match="not a range of whole experts"):
            FusedMoE(E, K, H, INTER, expert_range=bad, **kw)


def test_fused_moe_refuses_local_experts_of_another_count():
    w13, w2 = experts(E, H, INTER, torch.float32, seed=40)
    weights, ids = routing(3, E, K, seed=43)
    args = dict(x=randn(3, H, dtype=torch.float32, seed=42), w13=w13[:2], w2=w2[:2], topk_weights=weights,
                topk_ids=ids, local_experts=LocalExperts(0, 3, E))
    for run in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError, match="local_experts holds 3 experts, w13 2"):
            run(**args)


# -- real shapes (GPU) -------------------------------------------------------------------------------------

MODELS = {
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768),
    "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, inter=14336),
}


@pytest.fixture(scope="module")
def real_experts():
    """model -> (w13, w2) in bf16 and their fp32 copies: drawn once a module (Mixtral's are 2.8 GB)."""
    cache: dict[str, tuple[torch.Tensor, ...]] = {}

    def get(model: str) -> tuple[torch.Tensor, ...]:
        if model not in cache:
            cache.clear()  # one model's weights at a time
            c = MODELS[model]
            w13, w2 = experts(c["experts"], c["hidden"], c["inter"], BF16, seed=50)
            cache[model] = (w13, w2, w13.float(), w2.float())
        return cache[model]

    return get


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("t", [1, 4, 37, 256, 2048])
def test_gpu_fused_moe_real_shapes(real_experts, model, t):
    c = MODELS[model]
    w13, w2, w13_32, w2_32 = real_experts(model)
    x = randn(t, c["hidden"], dtype=BF16, seed=52)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=53)
    got = fused_moe(x, w13, w2, weights, ids)
    want = fused_moe_ref(x.float(), w13_32, w2_32, weights, ids)
    # Against fp32 arithmetic on the same bf16 values, the kernel's bf16 roundings (gate, up, silu, their
    # product, each slot's output, the sum) each err by up to 2^-8 relative; through the down projection's
    # sum of I terms of random sign they reach the output at about 2^-8 of its RMS, while its largest value
    # is 3.4-6 RMS. A torch emulation of these roundings (`emulated`) lands 0.4-0.6% of the largest value
    # from fp32 at these shapes; 2e-2 (~2.5 bf16 ulps of it) leaves 3x room for the tensor cores' order of
    # summation, and a dropped slot, a wrong expert or a lost K tile misses it by far.
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max error {err:.3g} vs max |out| {want.abs().max():.3g}"
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids))  # deterministic: no atomics


def assert_replays_new_routing(run, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                               new_x: torch.Tensor, num_experts: int, top_k: int, seed: int) -> None:
    """run() captured in a CUDA graph, then new inputs and a new routing (other experts, half the tokens
    sharing expert 5: a token may now hold it twice, which is allowed) written in place: the replay's output
    is run()'s on them."""
    graph, graphed = capture_cuda_graph(run)
    x.copy_(new_x)
    new_weights, new_ids = routing(len(x), num_experts, top_k, seed=seed)
    new_ids[: len(x) // 2, 0] = 5
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, run())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [8, 37])  # 64 entries: the GEMV path; 296: the grouped GEMM
def test_gpu_fused_moe_replays_in_a_cuda_graph(real_experts, t):
    c = MODELS["qwen3-30b-a3b"]
    w13, w2, _, _ = real_experts("qwen3-30b-a3b")
    x = randn(t, c["hidden"], dtype=BF16, seed=54)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=55)
    assert_replays_new_routing(lambda: fused_moe(x, w13, w2, weights, ids), x, weights, ids,
                               randn(t, c["hidden"], dtype=BF16, seed=56), c["experts"], c["top_k"], seed=57)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [8, 37])  # 64 entries: the GEMV path; 296: the grouped GEMM
def test_gpu_fused_moe_local_experts_replay_in_a_cuda_graph(real_experts, t):
    """Expert parallelism at Qwen3-30B-A3B's shapes, a rank holding experts 64..127 of 128: the ids' mapping,
    the alignment leaving out the dropped entries and the kernels' skips replay in a CUDA graph (a new
    routing written in place, half the tokens' experts all on the other rank: zeros), and the two ranks'
    outputs add up to the whole experts' to bf16 rounding (each rank's own rounding of its slots' sum)."""
    c = MODELS["qwen3-30b-a3b"]
    w13, w2, _, _ = real_experts("qwen3-30b-a3b")
    half = c["experts"] // 2
    x = randn(t, c["hidden"], dtype=BF16, seed=54)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=55)
    rank = [lambda first=first: fused_moe(x, w13[first:first + half], w2[first:first + half], weights, ids,
                                          local_experts=LocalExperts(first, half, c["experts"]))
            for first in (0, half)]
    graph, graphed = capture_cuda_graph(rank[1])
    x.copy_(randn(t, c["hidden"], dtype=BF16, seed=56))
    new_weights, new_ids = routing(t, c["experts"], c["top_k"], seed=57)
    new_ids[: t // 2] = torch.arange(c["top_k"], device=DEVICE)  # experts 0..7: rank 0's alone
    new_ids[t // 2:, 0] = half  # the others' first slot on rank 1's first expert (maybe twice: allowed)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, rank[1]())
    assert not graphed[: t // 2].any() and graphed[t // 2:].abs().amax(dim=1).min() > 0
    whole = fused_moe(x, w13, w2, weights, ids).float()
    err = (rank[0]().float() + graphed.float() - whole).abs().max().item()
    assert err <= 1e-2 * whole.abs().max().item()


QWEN_FP8_BLOCK = (128, 128)  # Qwen3-30B-A3B-FP8's weight_block_size


@pytest.fixture(scope="module")
def qwen_fp8_experts(real_experts):
    """Qwen3-30B-A3B's random bf16 experts (real_experts) quantised tile by tile per expert: drawn once."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get() -> dict[str, torch.Tensor]:
        if not cache:
            w13, w2, _, _ = real_experts("qwen3-30b-a3b")
            q13 = [quantize_blocks(w, QWEN_FP8_BLOCK) for w in w13]
            q2 = [quantize_blocks(w, QWEN_FP8_BLOCK) for w in w2]
            cache.update(w13=torch.stack([c for c, _ in q13]), w13_scale=torch.stack([sc for _, sc in q13]),
                         w2=torch.stack([c for c, _ in q2]), w2_scale=torch.stack([sc for _, sc in q2]))
        return cache

    return get


def _qwen_fp8_case(qwen_fp8_experts, t: int, seed: int) -> tuple:
    """Qwen3-30B-A3B's shape, its FP8 experts and kernel arguments, and t tokens' inputs and routing."""
    c = MODELS["qwen3-30b-a3b"]
    w = qwen_fp8_experts()
    x = randn(t, c["hidden"], dtype=BF16, seed=seed)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=seed + 1)
    return c, w, fp8_kw(w, QWEN_FP8_BLOCK), x, weights, ids


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 4, 37, 256, 2048])
def test_gpu_fused_moe_fp8_real_shapes(qwen_fp8_experts, t):
    c, w, kw, x, weights, ids = _qwen_fp8_case(qwen_fp8_experts, t, seed=58)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, **kw)
    # The FP8 reference: fp32 arithmetic on the same quantised x, h and weights, rounded to bf16 where the
    # kernel rounds. What differs is the order of the fp32 sums and the FP8 tensor cores' accumulation
    # (Hopper's FP8 MMA keeps fewer bits than fp32; the kernel promotes into fp32 every 64 K elements), so
    # an fp32 gate, up or y may land a rounding apart: that bf16 ulp, and the FP8 step of h it may cause,
    # reach the output as at most about one bf16 ulp of its largest value. A torch emulation at these
    # shapes (T = 37, 256) with fp32 results perturbed by 2^-16 of their RMS (reordering) lands 5.4e-3 of
    # max|out| from the unperturbed one, with a pessimistic 2^-11 (imprecise accumulation) 1.1-1.3e-2;
    # 2e-2 (2.5 bf16 ulps of max|out|) leaves room over that, and a wrong expert, tile scale or K block
    # misses it by far. (Against the reference on fp32 x, no bf16 roundings at all, the emulation is
    # 2.1-2.4e-2 apart: h's bf16 rounding changes its FP8 codes; hence the like-for-like reference.)
    want = fused_moe_ref(x, w["w13"], w["w2"], weights, ids, **kw).float()
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max error {err:.3g} vs max |out| {want.abs().max():.3g}"
    assert torch.equal(got, fused_moe(x, w["w13"], w["w2"], weights, ids, **kw))  # deterministic
    if t * c["top_k"] <= fm.GEMV_MAX_ENTRIES:  # the grouped GEMM too at decode sizes
        grouped = fused_moe(x, w["w13"], w["w2"], weights, ids, gemv=False, **kw).float()
        assert (grouped - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [8, 37])  # 64 entries: the GEMV path; 296: the grouped GEMM
def test_gpu_fused_moe_fp8_replays_in_a_cuda_graph(qwen_fp8_experts, t):
    c, w, kw, x, weights, ids = _qwen_fp8_case(qwen_fp8_experts, t, seed=62)
    # New inputs three times larger: new activation scales.
    assert_replays_new_routing(lambda: fused_moe(x, w["w13"], w["w2"], weights, ids, **kw), x, weights, ids,
                               randn(t, c["hidden"], dtype=BF16, seed=64) * 3, c["experts"], c["top_k"],
                               seed=65)


# gpt-oss-20b's experts: 32 of width 2880 on a 2880-wide stream, 4 a token (16-bit here; its checkpoints
# hold them in MXFP4, which tests/test_mxfp4_moe.py covers).
GPT_OSS_20B = dict(experts=32, top_k=4, hidden=2880, inter=2880)


@pytest.fixture(scope="module")
def gpt_oss_20b_experts():
    """(w13, w2, w13_bias, w2_bias) in bf16 and their fp32 copies, drawn once a module."""
    c = GPT_OSS_20B
    w13, w2 = experts(c["experts"], c["hidden"], c["inter"], BF16, seed=110)
    b13 = randn(c["experts"], 2 * c["inter"], dtype=BF16, seed=112)
    b2 = randn(c["experts"], c["hidden"], dtype=BF16, seed=113)
    bf16 = (w13, w2, b13, b2)
    return bf16, tuple(t.float() for t in bf16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 7, 64, 300])  # 4, 28 entries: GEMV; 256, 1200: the grouped GEMM
def test_gpu_fused_moe_gpt_oss_20b_shapes(gpt_oss_20b_experts, t):
    c = GPT_OSS_20B
    (w13, w2, b13, b2), (w13_32, w2_32, b13_32, b2_32) = gpt_oss_20b_experts
    x = randn(t, c["hidden"], dtype=BF16, seed=114, scale=OAI_X_SCALE)  # gate and up past +-7 (below)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=115)
    got = fused_moe(x, w13, w2, weights, ids, **oai_kw(b13, b2))
    # Against the bf16 reference (GptOssExperts' roundings, cuBLAS's sums): the kernel rounds where it does,
    # but sums the slots in fp32 where the reference adds them into the output in bf16 expert by expert
    # (measured 0.47-0.86 units of eps x max|out| apart over 3 seeds at each T, H200).
    assert_close_to_ref(got, fused_moe_ref(x, w13, w2, weights, ids, **oai_kw(b13, b2)))
    # Against fp32 arithmetic on the same bf16 values: the kernel's bf16 roundings (see
    # test_gpu_fused_moe_real_shapes; swiglu_oai makes six of each h element where silu makes two) err by
    # up to 2^-8 relative each; measured 5.1-7.5e-3 of max|out| at these shapes (the bf16 reference itself
    # 6.5e-3 to 1.1e-2). 2e-2 leaves room; a dropped bias, clamp or slot misses it by far.
    want = fused_moe_ref(x.float(), w13_32, w2_32, weights, ids, **oai_kw(b13_32, b2_32))
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max error {err:.3g} vs max |out| {want.abs().max():.3g}"
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids, **oai_kw(b13, b2)))  # deterministic
    if t * c["top_k"] <= fm.GEMV_MAX_ENTRIES:  # the grouped GEMM too at decode sizes
        grouped = fused_moe(x, w13, w2, weights, ids, gemv=False, **oai_kw(b13, b2))
        assert (grouped.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    # The clamps bound: some of the first slots' gate and up values passed the limit.
    first = ids[:, 0]
    gate_up = torch.cat([F.linear(x[first == e].float(), w13_32[e], b13_32[e]) for e in first.unique()])
    gate, up = gate_up.split(c["inter"], dim=-1)
    assert bool((gate > OAI_LIMIT).any() & (up.abs() > OAI_LIMIT).any())


# Nemotron 3 Nano 30B-A3B's routed experts: 128 ungated relu^2 experts of width 1856 on a 2688-wide stream,
# 6 a token (its config.json: n_routed_experts, moe_intermediate_size, hidden_size, num_experts_per_tok).
NEMOTRON_3_NANO = dict(experts=128, top_k=6, hidden=2688, inter=1856)


@pytest.fixture(scope="module")
def nemotron_experts():
    """(w13 [E, I, H] the up rows alone, w2 [E, H, I]) in bf16 and their fp32 copies, drawn once a module."""
    c = NEMOTRON_3_NANO
    w13 = randn(c["experts"], c["inter"], c["hidden"], dtype=BF16, seed=140, scale=c["hidden"] ** -0.5)
    w2 = randn(c["experts"], c["hidden"], c["inter"], dtype=BF16, seed=141, scale=c["inter"] ** -0.5)
    return (w13, w2), (w13.float(), w2.float())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 7, 64, 300])  # 6, 42 entries: GEMV; 384, 1800: the grouped GEMM
def test_gpu_fused_moe_relu2_no_mul_real_shapes(nemotron_experts, t):
    """The ungated kernels (GATED false) compiled at a real model's shapes: I = 1856 is not a multiple of
    the 128-wide tiles, so the last up tile is partial."""
    c = NEMOTRON_3_NANO
    (w13, w2), (w13_32, w2_32) = nemotron_experts
    x = randn(t, c["hidden"], dtype=BF16, seed=142, scale=RELU2_X_SCALE)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=143)
    got = fused_moe(x, w13, w2, weights, ids, **RELU2)
    assert_close_to_ref(got, fused_moe_ref(x, w13, w2, weights, ids, **RELU2))
    # Against fp32 arithmetic on the same bf16 values: relu^2 rounds h once where silu * up rounds it
    # three times, so the 2e-2 of test_gpu_fused_moe_real_shapes holds with room; a lost tile or slot
    # misses it by far.
    want = fused_moe_ref(x.float(), w13_32, w2_32, weights, ids, **RELU2)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max error {err:.3g} vs max |out| {want.abs().max():.3g}"
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids, **RELU2))  # deterministic
    if t * c["top_k"] <= fm.GEMV_MAX_ENTRIES:  # the grouped GEMM too at decode sizes
        grouped = fused_moe(x, w13, w2, weights, ids, gemv=False, **RELU2).float()
        assert (grouped - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [8, 64])  # 48 entries: the GEMV path; 384: the grouped GEMM
def test_gpu_fused_moe_relu2_no_mul_replays_in_a_cuda_graph(nemotron_experts, t):
    c = NEMOTRON_3_NANO
    (w13, w2), _ = nemotron_experts
    x = randn(t, c["hidden"], dtype=BF16, seed=144, scale=RELU2_X_SCALE)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=145)
    assert_replays_new_routing(lambda: fused_moe(x, w13, w2, weights, ids, **RELU2), x, weights, ids,
                               randn(t, c["hidden"], dtype=BF16, seed=146, scale=RELU2_X_SCALE),
                               c["experts"], c["top_k"], seed=147)


# -- integer experts (GPTQ / AWQ / compressed-tensors: W4A16, W8A16) -----------------------------------------
# Six experts of H = I = 64 (128 where the groups are of 128: the smallest every group size divides), as
# small as the interpreter's time asks.
INT_E, INT_SIZE, INT_LARGE_GROUP = 6, 64, 128


def int_size(group: int) -> int:
    return INT_LARGE_GROUP if group == INT_LARGE_GROUP else INT_SIZE


def int_experts(bits: int, group: int, seed: int, num_experts: int = INT_E, hidden: int | None = None,
                inter: int | None = None, scale_dtype: torch.dtype = torch.float16) -> tuple[dict, dict]:
    """Random experts quantised round-to-nearest (asymmetric, as AWQ's): fused_moe's integer keywords
    (w13 [E, H / pack, 2I], w2 [E, I / pack, H] and their scales, zeros, bits) and, as w13 / w2, the
    weights they stand for ([E, 2I, H], [E, H, I]) in each dtype (dtype -> (w13, w2))."""
    from plait.layers.wna16 import WNA16Spec, dequantize, pack_rows, quantize_rtn

    hidden, inter = hidden or int_size(group), inter or int_size(group)
    spec = WNA16Spec("gptq", bits, group, sym=False)
    stacks = []
    for n, k, s in ((2 * inter, hidden, seed), (hidden, inter, seed + 1)):
        w = randn(num_experts, n, k, dtype=torch.float32, seed=s, scale=k**-0.5)
        parts = [quantize_rtn(w[e], spec, scale_dtype) for e in range(num_experts)]
        codes, scales, zeros = zip(*parts, strict=True)
        stacks.append((torch.stack([pack_rows(c, bits) for c in codes]), torch.stack(scales),
                       torch.stack(zeros).to(torch.uint8)))
    (w13, s13, z13), (w2, s2, z2) = stacks
    kwargs = dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=z2, bits=bits)

    def dense(codes, scales, zeros, dtype):
        return torch.stack([dequantize(c, s, z, bits, dtype) for c, s, z in zip(codes, scales, zeros)])

    weights = {dtype: (dense(w13, s13, z13, dtype), dense(w2, s2, z2, dtype)) for dtype in DTYPES}
    return kwargs, weights


def run_int(x, kwargs, weights, ids, local_experts=None, **knobs):
    """(fused_moe, fused_moe_ref) of int_experts' keywords; knobs: fused_moe's alone (gemv, config)."""
    kw = dict(kwargs, local_experts=local_experts)
    w13, w2 = kw.pop("w13"), kw.pop("w2")
    return fused_moe(x, w13, w2, weights, ids, **kw, **knobs), fused_moe_ref(x, w13, w2, weights, ids, **kw)


# (bits, group size (0: one group spanning K), top_k, tokens, dtype): every bit width, group size and top-k
# the brief's checkpoints use, odd token counts, each dtype.
INT_CASES = [(4, 32, 2, 1, BF16), (4, 64, 4, 5, BF16), (4, 128, 2, 9, torch.float16), (8, 0, 4, 3, BF16),
             (8, 128, 2, 7, torch.float32), (4, 0, 4, 3, torch.float16), (8, 32, 2, 5, torch.float16)]


@pytest.mark.parametrize("case", INT_CASES, ids=str)
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_int_matches_ref(case, path):
    bits, group, top_k, t, dtype = case
    t = min(t, GEMV_TOKENS) if path == "gemv" else t
    kwargs, _ = int_experts(bits, group, seed=70)
    x = randn(t, int_size(group), dtype=dtype, seed=72)
    weights, ids = routing(t, INT_E, top_k, seed=73)
    assert_close_to_ref(*run_int(x, kwargs, weights, ids, gemv=PATHS[path]))


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_int_groups_narrower_than_the_k_step(bits):
    """K steps of 64 over groups of 32 (the GPU's BLOCK_K_16BIT over GPTQ's smallest groups): each word row
    takes its own group's scales and zeros."""
    kwargs, _ = int_experts(bits, 32, seed=86)
    x = randn(7, INT_SIZE, dtype=BF16, seed=87)
    weights, ids = routing(7, INT_E, 2, seed=88)
    wide_k = MoeConfig(fm.CPU_BLOCK_M, fm.CPU_BLOCK_N, 2 * fm.CPU_BLOCK_K, group_m=1, num_stages=1)
    assert_close_to_ref(*run_int(x, kwargs, weights, ids, config=wide_k, gemv=False))


@pytest.mark.parametrize("bits,group,dtype", [(4, 32, BF16), (8, 0, BF16), (4, 64, torch.float16),
                                              (8, 128, torch.float32)])
def test_fused_moe_int_is_the_16_bit_kernel_on_its_weights(bits, group, dtype):
    """The grouped GEMM dequantises each K step to plait.layers.wna16.dequantize's weights bit for bit
    (fp16: in fp16 arithmetic, HALF), so with the same tiles it is the 16-bit kernel on those weights,
    bit for bit; the GEMV sums its fp32 lanes K-major, so there only the order of the sums differs."""
    kwargs, dense = int_experts(bits, group, seed=74)
    w13, w2 = dense[dtype]
    t = 13  # ragged blocks of several experts
    x = randn(t, int_size(group), dtype=dtype, seed=75)
    weights, ids = routing(t, INT_E, 2, seed=76)
    got, _ = run_int(x, kwargs, weights, ids, gemv=False)
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids, gemv=False))
    got, _ = run_int(x[:3], kwargs, weights[:3], ids[:3], gemv=True)
    assert_close_to_ref(got, fused_moe(x[:3], w13, w2, weights[:3], ids[:3], gemv=True))


def test_fused_moe_int_with_local_experts_matches_ref():
    """Expert parallelism's dropped entries (experts held elsewhere) on the integer paths too."""
    kwargs, _ = int_experts(4, 32, seed=77)
    half = INT_E // 2
    local = {k: v[half:] if torch.is_tensor(v) else v for k, v in kwargs.items()}
    x = randn(5, INT_SIZE, dtype=BF16, seed=78)
    weights, ids = routing(5, INT_E, 2, seed=79)
    for gemv in (True, False):
        got, want = run_int(x, local, weights, ids, gemv=gemv, local_experts=LocalExperts(half, half, INT_E))
        assert_close_to_ref(got, want)


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_moe_layer_with_integer_experts_is_the_ref(monkeypatch, kernels):
    """FusedMoE.use_integer, loaded per expert as GPTQ tensors: the torch path is fused_moe_ref of its
    stacks with route's routing, to the bit; the Triton path (the interpreter on CPU) within the kernels'
    tolerances; the stacks are int_experts' (WNA16Linear's layout, stacked)."""
    from plait.kernels import dispatch
    from plait.layers.moe import FusedMoE, route
    from plait.layers.wna16 import WNA16Spec, pack_columns

    monkeypatch.setattr(dispatch, "_enabled", kernels)  # off: the torch path, on a GPU too
    monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels and not ON_GPU)
    dtype = BF16 if kernels else torch.float32
    kwargs, _ = int_experts(4, 32, seed=89)
    spec = WNA16Spec("gptq", 4, 32, sym=False, zero_offset=1)
    layer = FusedMoE(INT_E, 2, INT_SIZE, INT_SIZE, renormalize=True).to(DEVICE, dtype)
    layer.use_integer(spec)
    for e in range(INT_E):  # each projection's GPTQ tensors: its columns of the stacks
        for projection, (stacked, shard) in {"gate_proj": ("w13", 0), "up_proj": ("w13", 1),
                                              "down_proj": ("w2", 0)}.items():
            cols = slice(shard * INT_SIZE, (shard + 1) * INT_SIZE)
            zeros = kwargs[f"{stacked}_zeros"][e][:, cols].to(torch.int32) - 1  # stored less one
            tensors = {"qweight": kwargs[stacked][e][:, cols],
                       "scales": kwargs[f"{stacked}_scale"][e][:, cols],
                       "qzeros": pack_columns(zeros & 0xF, 4)}  # GPTQ's 4-bit fields: -1 wraps to 15
            for name, tensor in tensors.items():
                layer.load_expert(e, projection, tensor, name)
    layer.check_loaded()
    assert "gptq 4-bit (groups of 32)" in repr(layer)
    for ours, theirs in ((layer.gate_up_proj, "w13"), (layer.down_zeros, "w2_zeros"),
                         (layer.gate_up_scale, "w13_scale")):
        assert torch.equal(ours, kwargs[theirs].to(ours.dtype))
    x = randn(7, INT_SIZE, dtype=dtype, seed=90)
    logits = randn(7, INT_E, dtype=torch.float32, seed=91, scale=2.0)
    weights, ids = route(logits, 2, renormalize=True)
    with torch.no_grad():
        got = layer(x, logits)
    kw = dict(kwargs)
    want = fused_moe_ref(x, kw.pop("w13"), kw.pop("w2"), weights, ids, **kw)
    if kernels:
        assert_close_to_ref(got, want)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad", ["bits", "zeros", "zeros_shape", "group", "block", "bias", "activation",
                                 "float_with_zeros"])
def test_fused_moe_int_rejects_bad_arguments(bad):
    kwargs, dense = int_experts(4, 32, seed=80, num_experts=2, hidden=64, inter=32)
    x = randn(3, 64, dtype=BF16, seed=81)
    weights, ids = routing(3, 2, 1, seed=82)
    kw, extra = dict(kwargs), {}
    if bad == "bits":
        kw["bits"] = 3
    elif bad == "zeros":
        kw["w2_zeros"] = None
    elif bad == "zeros_shape":
        kw["w13_zeros"] = kw["w13_zeros"][:, :1]
    elif bad == "group":  # 64 inputs in 3 groups
        kw["w13_scale"] = kw["w13_zeros"] = torch.zeros(2, 3, 64)
    elif bad == "block":
        extra = dict(block=(32, 32))
    elif bad == "bias":
        extra = dict(w13_bias=torch.zeros(2, 64, dtype=BF16, device=DEVICE))
    elif bad == "activation":
        extra = dict(activation="swiglu_oai")
    else:
        kw["w13"], kw["w2"] = (w.to(BF16) for w in dense[BF16])
    w13, w2 = kw.pop("w13"), kw.pop("w2")
    for run in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError):
            run(x, w13, w2, weights, ids, **kw, **extra)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 7, 256])  # 8 and 56 entries: the GEMV path; 2,048: the grouped GEMM
def test_gpu_fused_moe_int4_qwen3_30b_a3b_shapes(t):
    """Qwen3-30B-A3B-GPTQ-Int4's experts (128 of hidden 2,048 and width 768, top-8, 4-bit codes in groups of
    128, fp16 scales) in bf16, compiled: within test_gpu_fused_moe_real_shapes' bound of fp32 arithmetic on
    the weights they stand for, deterministic, and within the 16-bit kernel's roundings of it on those
    weights in bf16 (bit for bit in the interpreter, test_fused_moe_int_is_the_16_bit_kernel_on_its_weights;
    compiled, the integer GEMM's tiles sum K in another order: on an H200 at 256 tokens not bit for bit)."""
    c = MODELS["qwen3-30b-a3b"]
    kwargs, dense = int_experts(4, 128, seed=83, num_experts=c["experts"], hidden=c["hidden"],
                                inter=c["inter"])
    x = randn(t, c["hidden"], dtype=BF16, seed=84)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=85)
    got, _ = run_int(x, kwargs, weights, ids)
    want = fused_moe_ref(x.float(), *dense[torch.float32], weights, ids)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max error {err:.3g} vs max |out| {want.abs().max():.3g}"
    assert torch.equal(got, run_int(x, kwargs, weights, ids)[0])  # deterministic: no atomics
    sixteen_bit = fused_moe(x, *dense[BF16], weights, ids)
    err = (got.float() - sixteen_bit.float()).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item()
