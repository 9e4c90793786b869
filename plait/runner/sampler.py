"""Batched, device-agnostic token sampler (allowed tokens, logit bias, penalties, greedy, temperature,
top-k/top-p/min-p, logprobs)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plait.kernels.dispatch import use_triton
from plait.logits_processor import LogitsProcessor, apply_logits_processors
from plait.sampling_params import (
    LOGITS_MODES,
    LOGPROBS_MODES,
    PROCESSED_LOGITS,
    PROCESSED_LOGPROBS,
    RAW_LOGPROBS,
    TOP_K_DISABLED,
    SamplingParams,
)

_MASK64 = (1 << 64) - 1
# splitmix64 constants: a cheap, well-mixed 64-bit hash so (seed, step) pairs give unrelated streams.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Mixed into the engine seed to key unseeded rows' noise (any constant apart from small positions).
_ENGINE_STREAM = 0x5EED5EED5EED5EED


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


# torch's CUDA argmax reduces each row in one thread block: one 128,256-wide row took 37 us on an H200,
# 0.8% of a batch-1 Llama-8B token. Batches of fewer rows than this go through one Triton launch that
# spreads each row over many programs; more rows fill the GPU a row a block.
ARGMAX_FEW_ROWS = 32


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) (its reference): the first maximum of each row, NaN above all; few rows on
    CUDA in one Triton launch (plait.kernels.sampling.argmax_few_rows)."""
    # logits: [S, V] -> [S] int64
    rows, vocab = logits.shape
    if 0 < rows < ARGMAX_FEW_ROWS and vocab > 0 and logits.stride(1) == 1 and use_triton(logits):
        from plait.kernels.sampling import argmax_few_rows
        return argmax_few_rows(logits, ARGMAX_FEW_ROWS)
    return logits.argmax(dim=-1)


def step_seed(seed: int, step: int) -> int:
    """Generator seed for a seeded request at a given output position (independent of batch layout)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


@dataclass
class SamplingRow:
    """One request that samples a token this step, in batch (logits row) order.

    eos_token_ids: the model's EOS ids (tokenizer EOS plus generation-config EOS ids), needed so that
    min_tokens can block them. Together with params.stop_token_ids they are masked while
    num_output_tokens < params.min_tokens, unless params.ignore_eos (as vLLM: ignored EOS ids are
    not stop tokens, so they need no blocking).
    The ids of params.logit_bias and params.allowed_token_ids index the logits row as they are: the engine
    has checked them against the vocabulary when the request was added.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far whose ids are on the host
    eos_token_ids: Collection[int] = ()
    # Outputs generated so far, including those still on the device (overlapped steps); None means
    # len(output_token_ids). min_tokens and seeded draws depend on this count only; penalties need
    # the ids themselves, so the engine never overlaps a step whose rows use them.
    num_output_tokens: int | None = None
    # This step's own allowed ids (a guided choice's continuations), instead of params.allowed_token_ids.
    allowed_now: Sequence[int] | None = None
    # The ids a structured output's grammar allows this step, one bit each (int32 [ceil(V / 32)], bit
    # t % 32 of word t // 32): set by the model runner from Request.grammar (plait/engine/grammar.py).
    # Ids past the mask's width (logits rows may be wider than the tokenizer's vocabulary) are disallowed.
    token_bitmask: np.ndarray | None = None
    # Ids this step must not sample (the last tokens of bad words the output would complete): set by the
    # model runner from Request.banned_next_tokens.
    banned_now: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.num_output_tokens is None:
            self.num_output_tokens = len(self.output_token_ids)

    def allowed_token_ids(self) -> Sequence[int] | None:
        """The ids this row may sample (None: any); SamplingParams never sets both sources."""
        return self.allowed_now if self.allowed_now is not None else self.params.allowed_token_ids


@dataclass
class Logprobs:
    """Logprobs of one sampled token, as the sampler's logprobs_mode says (by default from the raw model
    logits, before allowed-token masks, logit bias, penalties and temperature, as vLLM's default)."""

    token_logprob: float
    top_ids: list[int]  # params.logprobs most likely ids, most likely first
    top_logprobs: list[float]
    rank: int  # 1-based rank of the sampled token (number of ids with logprob >= its logprob)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # None where params.logprobs is None


def needs_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def host_to_device(values: Sequence[object] | torch.Tensor, dtype: torch.dtype, device: torch.device
                   ) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on ``device`` without making the host wait.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and then waits for all the work
    queued before it, the forward pass included: a step that samples would hold the host until the GPU
    is idle, and the next step could not be prepared meanwhile. On CUDA the values go through pinned
    memory and a non-blocking copy instead (the caching host allocator keeps the buffer until the copy
    is done). Every per-step host-to-device copy of the sampler goes through here."""
    host = torch.as_tensor(values, dtype=dtype, device="cpu")  # on the host whatever the default device
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# A token bitmask's word holds this many ids (llguidance's layout, which plait.engine.grammar fills: bit
# t % 32 of word t // 32).
BITMASK_WORD_BITS = 32


def unpack_token_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Packed int32 bitmasks as booleans over ``width`` ids, on their device; ids past the masks' bits
    are False (a logits row may be wider than the tokenizer's vocabulary)."""
    # bitmask: [R, W] int32 -> [R, width] bool
    shifts = torch.arange(BITMASK_WORD_BITS, dtype=torch.int32, device=bitmask.device)
    # The sign bit shifts in ones on the right, which "& 1" drops: every bit reads true to its word.
    bits = ((bitmask[:, :, None] >> shifts) & 1).view(bitmask.shape[0], -1).bool()  # [R, W * 32]
    if bits.shape[1] >= width:
        return bits[:, :width]
    allowed = bits.new_zeros(bitmask.shape[0], width)
    allowed[:, : bits.shape[1]] = bits
    return allowed


def _pad(seqs: list[Sequence[int]], pad: int) -> torch.Tensor:
    """[len(seqs), longest] int64 on the host, each row ``pad``-filled past its sequence. Built by numpy from
    one flat pass over the ids: penalties send every row's outputs each step, and nested lists through
    torch.tensor took ~2 ms for 256 rows of ~64 ids (~8 ms at 512) on the step's critical path."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    width = int(lengths.max()) if len(seqs) else 0
    out = np.full((len(seqs), width), pad, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    out[np.arange(width)[None, :] < lengths[:, None]] = flat  # row-major: each row's ids in order
    return torch.from_numpy(out)


def _bin_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    # Padding uses id == vocab, which lands in an extra bin that is sliced off.
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]


# kth and room of a row without top-k in a batch where other rows have it: every id is kept.
NO_TOP_K_KTH = float("-inf")
NO_TOP_K_ROOM = 2**31 - 1


def race_sample_ref(z: torch.Tensor, noise: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                    top_k: tuple[torch.Tensor, torch.Tensor] | None = None, top_p: torch.Tensor | None = None,
                    min_p: torch.Tensor | None = None) -> None:
    """race_sample in torch: the filtered logits, softmax, race."""
    if rows.numel() == 0:
        return
    probs = torch.softmax(filtered_logits(z, rows, top_k, top_p, min_p), dim=-1)
    out.index_copy_(0, rows, probs.div_(noise.index_select(0, rows)).argmax(dim=-1))


def filtered_logits(z: torch.Tensor, rows: torch.Tensor,
                    top_k: tuple[torch.Tensor, torch.Tensor] | None = None, top_p: torch.Tensor | None = None,
                    min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The ``rows`` of z with each filter's cut masked by -inf in vLLM's order (top-k, top-p by a stable
    sort, min-p): the logits race_sample draws from."""
    # z: [R, V] fp32; rows: [S] int64 -> [S, V]
    x = z.index_select(0, rows)
    if top_k is not None:
        kth, room = (t.index_select(0, rows)[:, None] for t in top_k)
        tied = x == kth
        # int32 halves the memory traffic of the vocab-wide cumsum.
        keep = (x > kth) | (tied & (torch.cumsum(tied, dim=-1, dtype=torch.int32) <= room))
        x.masked_fill_(~keep, float("-inf"))
    if top_p is not None:
        p = top_p.index_select(0, rows)[:, None]
        vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(vals, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = (mass_before >= p) & (p < 1.0)
        drop[:, 0] = False
        x.scatter_(1, ids, vals.masked_fill_(drop, float("-inf")))
    if min_p is not None:
        probs = torch.softmax(x, dim=-1)
        x.masked_fill_(probs < min_p.index_select(0, rows)[:, None] * probs.amax(dim=-1, keepdim=True),
                       float("-inf"))
    return x


def top_k_cut(z: torch.Tensor, ks: torch.Tensor, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k-th largest logit and how many ids equal to it top-k keeps (the lowest ids first)."""
    # z: [R, V]; ks: [R] int64 in [1, max_k], max_k <= V -> kth: [R] fp32, room: [R] int32
    vals = torch.topk(z, max_k, dim=-1).values  # sorted, largest first
    kth = vals.gather(1, ks[:, None] - 1)
    above = ((vals > kth) & (torch.arange(max_k, device=z.device) < ks[:, None])).sum(dim=-1)
    return kth.squeeze(1), (ks - above).to(torch.int32)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) in int64 without overflowing it: 16-bit halves of x."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hashed_exponential_ref(noise: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
    """noise[rows[j]] = the Exp(1) draws race_sample hashes from keys[j] and the token ids, in torch (the
    same 32-bit arithmetic, in int64)."""
    # noise: [R, V] fp32; rows: [S] int64; keys: [S, 2] int64 in [0, 2**32)
    if rows.numel() == 0:
        return
    ids = torch.arange(noise.shape[1], device=noise.device)
    h = _mix32(_mix32(ids[None, :] ^ keys[:, :1]) ^ keys[:, 1:])  # [S, V]
    u = ((h >> 8) + 1).float() * (1.0 / 16777216.0)
    # -log(1) = 0 would make p / e infinite.
    noise.index_copy_(0, rows, (-torch.log(u)).clamp_min_(torch.finfo(torch.float32).tiny))


def logprob_table(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, max_n: int) -> torch.Tensor:
    """Per row, on the device: the token's logprob, its rank, the max_n best logprobs and their ids, packed
    so that one device-to-host copy carries them all (fp32 holds ids and ranks exactly below 2**24)."""
    # raw_logprobs: [N, V] fp32; token_ids: [N] -> [N, 2 + 2 * max_n]
    token_lp = raw_logprobs.gather(1, token_ids[:, None])
    ranks = (raw_logprobs >= token_lp).sum(dim=-1)
    top_lp, top_ids = torch.topk(raw_logprobs, max_n, dim=-1, sorted=True)
    return torch.cat([token_lp, ranks[:, None].float(), top_lp, top_ids.float()], dim=1)


def unpack_logprobs(row: list[float], n: int, max_n: int) -> Logprobs:
    """One row of logprob_table (as a host list), keeping the n best of its max_n."""
    return Logprobs(token_logprob=row[0], top_ids=[int(t) for t in row[2 + max_n: 2 + max_n + n]],
                    top_logprobs=row[2: 2 + n], rank=int(row[1]))


class Sampler:
    """Samples one token per row. Only the final ids (and requested logprobs) are copied to the host."""

    def __init__(self, seed: int = 0, logprobs_mode: str = RAW_LOGPROBS) -> None:
        """seed: the engine seed, which the draws of rows without their own seed follow; logprobs_mode: what
        logprobs hold (LOGPROBS_MODES)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{logprobs_mode!r}")
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        # Custom logits processors (EngineConfig.logits_processors), built and set by the engine.
        self.logits_processors: list[LogitsProcessor] = []
        # Rows without a seed key their noise on the engine seed and a count of such draws: the tokens
        # follow from the seed and the order of the steps, never from torch's global RNG, which anything
        # in the process may draw from or reseed. The stream's key is mixed apart from step_seed(seed, n),
        # so it does not repeat a request whose own seed equals the engine's.
        self._stream_key = _splitmix64(_splitmix64(seed & _MASK64) ^ _ENGINE_STREAM)
        self._unseeded_draws = itertools.count()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample and bring the ids to the host."""
        token_ids, logprobs = self.sample(logits, rows)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, list[Logprobs | None]]:
        """Sample without waiting for the device: ids stay a device tensor [len(rows)] (int64).
        Logprobs, when any row asks for them, are copied to the host (a sync)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return torch.zeros(0, dtype=torch.long, device=logits.device), []
        params = [r.params for r in rows]
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        min_tokens_rows = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
        penalty_rows = [i for i, p in enumerate(params) if needs_penalties(p)]
        allowed_rows = [i for i, r in enumerate(rows) if r.allowed_token_ids() is not None]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias is not None]
        grammar_rows = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_now or ()]
        all_greedy = all(p.is_greedy for p in params)
        processors = self._active_processors(params, all_greedy)
        changes_logits = (min_tokens_rows or penalty_rows or allowed_rows or bias_rows or grammar_rows
                          or banned or processors)

        if all_greedy and not want_logprobs and not changes_logits:
            # Fast path: argmax is exact in any float dtype, so no fp32 copy is needed.
            return argmax_rows(logits), [None] * len(rows)

        device = logits.device
        mode = self.logprobs_mode
        processed = mode in (PROCESSED_LOGPROBS, PROCESSED_LOGITS)
        logprob_values = None  # [len(want_logprobs), vocab]: what the logprobs are read from
        lp_idx = host_to_device(want_logprobs, torch.long, device) if want_logprobs else None
        if lp_idx is not None and not processed:
            # Raw: from the model's logits, before the allowed-token mask, logit bias, penalties and
            # temperature below.
            logprob_values = logits.index_select(0, lp_idx).float()

        logits = logits.to(torch.float32, copy=True)
        # vLLM's order: the allowed-token mask, then the processors that can change the argmax (min
        # tokens, logit bias), then penalties; so greedy rows (argmax below) see all of them too.
        if allowed_rows:
            self._mask_disallowed_tokens(logits, rows, allowed_rows)
        if grammar_rows:
            self._mask_by_bitmask(logits, rows, grammar_rows)
        if banned:
            self._ban(logits, banned)
        if bias_rows:
            self._add_logit_bias(logits, rows, bias_rows)
        if min_tokens_rows:
            self._mask_stop_tokens(logits, rows, min_tokens_rows)
        if processors:
            logits = apply_logits_processors(processors, logits, rows)
        if penalty_rows:
            self._apply_penalties(logits, rows, penalty_rows)

        if all_greedy:
            token_ids = argmax_rows(logits)
            if lp_idx is not None and processed:
                logprob_values = logits.index_select(0, lp_idx)
        else:
            token_ids, drawn_from = self._sample(logits, rows, want_logprobs if processed else [])
            if drawn_from is not None:
                logprob_values = drawn_from

        logprobs: list[Logprobs | None] = [None] * len(rows)
        if logprob_values is not None:
            if mode not in LOGITS_MODES:
                logprob_values = torch.log_softmax(logprob_values, dim=-1)
            self._gather_logprobs(logprob_values, token_ids, rows, want_logprobs, logprobs)
        return token_ids, logprobs

    def _active_processors(self, params: list[SamplingParams], all_greedy: bool) -> list[LogitsProcessor]:
        """The custom processors this step runs: those that apply to one of its rows at least, but the
        argmax-invariant ones in a step whose rows are all greedy."""
        return [p for p in self.logits_processors
                if not (all_greedy and p.is_argmax_invariant()) and any(p.applies_to(q) for q in params)]

    @staticmethod
    def _mask_disallowed_tokens(logits: torch.Tensor, rows: list[SamplingRow], row_ids: list[int]) -> None:
        """-inf everywhere in ``row_ids`` but at each row's allowed_token_ids: save those logits, fill the
        rows, put them back (three launches and one copy to the device, however many rows)."""
        r_idx: list[int] = []
        t_idx: list[int] = []
        for i in row_ids:
            ids = rows[i].allowed_token_ids() or ()
            r_idx += [i] * len(ids)
            t_idx += ids
        n = len(r_idx)
        flat = host_to_device(r_idx + t_idx + row_ids, torch.long, logits.device)
        idx = (flat[:n], flat[n : 2 * n])
        kept = logits[idx]
        logits.index_fill_(0, flat[2 * n :], float("-inf"))
        logits.index_put_(idx, kept)

    @staticmethod
    def _mask_by_bitmask(logits: torch.Tensor, rows: list[SamplingRow], row_ids: list[int]) -> None:
        """-inf at every id a row's token_bitmask leaves out, all rows in one copy to the device and one
        masked fill (the bits are unpacked on the device: the mask crosses at 1 bit an id)."""
        device = logits.device
        masks = host_to_device(np.stack([rows[i].token_bitmask for i in row_ids]), torch.int32, device)
        idx = host_to_device(row_ids, torch.long, device)
        allowed = unpack_token_bitmask(masks, logits.shape[1])
        logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed, float("-inf")))

    @staticmethod
    def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], row_ids: list[int]) -> None:
        """Adds each row's logit_bias to its logits in one launch (ids within a row are distinct)."""
        r_idx: list[int] = []
        t_idx: list[int] = []
        values: list[float] = []
        for i in row_ids:
            bias = rows[i].params.logit_bias or {}
            r_idx += [i] * len(bias)
            t_idx += bias.keys()
            values += bias.values()
        n = len(r_idx)
        flat = host_to_device(r_idx + t_idx, torch.long, logits.device)
        bias_values = host_to_device(values, torch.float32, logits.device)
        logits.index_put_((flat[:n], flat[n:]), bias_values, accumulate=True)

    @staticmethod
    def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow], row_ids: list[int]) -> None:
        pairs = []
        for i in row_ids:
            p = rows[i].params
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(rows[i].eos_token_ids)
            pairs += [(i, t) for t in stop_ids]
        Sampler._ban(logits, pairs)

    @staticmethod
    def _ban(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """-inf at each (row, id) of ``pairs`` within the vocabulary, in one copy and one launch."""
        vocab = logits.shape[1]
        pairs = [(i, t) for i, t in pairs if t < vocab]
        if pairs:
            flat = host_to_device([i for i, _ in pairs] + [t for _, t in pairs], torch.long, logits.device)
            n = len(pairs)
            logits.index_put_((flat[:n], flat[n:]), logits.new_full((), float("-inf")))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], row_ids: list[int]) -> None:
        """vLLM's apply_penalties: repetition over prompt+output, then frequency and presence over output."""
        device = logits.device
        vocab = logits.shape[1]
        sel = [rows[i] for i in row_ids]
        idx = host_to_device(row_ids, torch.long, device)
        sub = logits.index_select(0, idx)

        outputs = _pad([r.output_token_ids for r in sel], vocab)
        output_counts = _bin_counts(host_to_device(outputs, torch.long, device), vocab)
        output_mask = output_counts > 0

        if any(r.params.repetition_penalty != 1.0 for r in sel):
            rep = host_to_device([r.params.repetition_penalty for r in sel], torch.float32, device)
            # Prompts are only transferred for rows that actually use a repetition penalty.
            prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in sel]
            prompt_mask = _bin_counts(host_to_device(_pad(prompts, vocab), torch.long, device), vocab) > 0
            penalties = torch.where(prompt_mask | output_mask, rep[:, None], 1.0)
            # Positive logits are divided by the penalty, negative ones multiplied, so both move down.
            sub *= torch.where(sub > 0, 1.0 / penalties, penalties)

        freq = host_to_device([r.params.frequency_penalty for r in sel], torch.float32, device)
        presence = host_to_device([r.params.presence_penalty for r in sel], torch.float32, device)
        sub -= freq[:, None] * output_counts
        sub -= presence[:, None] * output_mask
        logits.index_copy_(0, idx, sub)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], drawn_from_rows: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the ids, the logits ``drawn_from_rows`` were drawn from: a sampled row's after temperature and
        its top-k, top-p and min-p cuts, a greedy row's as argmax read them; None without such rows)."""
        device = logits.device
        vocab = logits.shape[1]
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        token_ids = argmax_rows(logits) if any(greedy) else torch.empty(len(rows), dtype=torch.long,
                                                                        device=device)

        # Greedy rows get temperature 1 just to keep the arithmetic finite; the race skips them.
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        logits.div_(host_to_device(temps, torch.float32, device)[:, None])
        sampled = [i for i, g in enumerate(greedy) if not g]
        top_k_rows = [i for i in sampled if TOP_K_DISABLED < params[i].top_k < vocab]
        top_k = None
        if top_k_rows:
            ks = [params[i].top_k for i in top_k_rows]
            idx = host_to_device(top_k_rows, torch.long, device)
            ks_t = host_to_device(ks, torch.long, device)
            kth, room = top_k_cut(logits.index_select(0, idx), ks_t, max(ks))
            top_k = (torch.full((len(rows),), NO_TOP_K_KTH, device=device).index_copy_(0, idx, kth),
                     torch.full((len(rows),), NO_TOP_K_ROOM, dtype=torch.int32, device=device)
                     .index_copy_(0, idx, room))
        top_p = min_p = None
        if any(params[i].top_p < 1.0 for i in sampled):
            top_p = host_to_device([p.top_p for p in params], torch.float32, device)
        if any(params[i].min_p > 0.0 for i in sampled):
            min_p = host_to_device([p.min_p for p in params], torch.float32, device)

        drawn_from = None
        if drawn_from_rows:
            drawn_from = logits.index_select(0, host_to_device(drawn_from_rows, torch.long, device))
            cut = [j for j, i in enumerate(drawn_from_rows) if not greedy[i]]
            if cut:
                cut_rows = host_to_device([drawn_from_rows[j] for j in cut], torch.long, device)
                drawn_from.index_copy_(0, host_to_device(cut, torch.long, device),
                                       filtered_logits(logits, cut_rows, top_k, top_p, min_p))
        keys = host_to_device([[k & _MASK32, k >> 32] for k in self._noise_keys(rows, sampled)], torch.long,
                              device)
        sampled_t = host_to_device(sampled, torch.long, device)
        if use_triton(logits):
            from plait.kernels.sampling import race_sample
            race_sample(logits, keys, sampled_t, token_ids, top_k, top_p, min_p)
        else:
            noise = torch.empty_like(logits)
            hashed_exponential_ref(noise, sampled_t, keys)
            race_sample_ref(logits, noise, sampled_t, token_ids, top_k, top_p, min_p)
        return token_ids, drawn_from

    def _noise_keys(self, rows: list[SamplingRow], sampled: list[int]) -> list[int]:
        """The 64-bit key of each sampled row's noise. A seeded row's comes from (its seed, its position)
        alone, so its draws do not depend on the batch and repeat after preemption and recompute. The
        others take the engine's stream: the engine seed and how many unseeded draws came before, so the
        same requests in the same steps draw the same tokens."""
        keys = []
        for i in sampled:
            seed = rows[i].params.seed
            if seed is None:
                keys.append(_splitmix64(self._stream_key ^ next(self._unseeded_draws)))
            else:
                keys.append(step_seed(seed, rows[i].num_output_tokens))
        return keys

    @staticmethod
    def _gather_logprobs(
        values: torch.Tensor,
        token_ids: torch.Tensor,
        rows: list[SamplingRow],
        row_ids: list[int],
        out: list[Logprobs | None],
    ) -> None:
        sampled = token_ids.index_select(0, host_to_device(row_ids, torch.long, values.device))
        max_n = max(rows[i].params.logprobs or 0 for i in row_ids)
        table = logprob_table(values, sampled, max_n).tolist()
        for j, i in enumerate(row_ids):
            out[i] = unpack_logprobs(table[j], rows[i].params.logprobs or 0, max_n)
