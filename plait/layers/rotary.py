"""Rotary position embeddings (neox layout, as HF Llama/Qwen), with linear, llama3, YaRN and longrope scaling,
over whole heads or their leading channels."""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.config import rope_kind
from plait.kernels.dispatch import use_triton

LONGROPE = "longrope"
YARN = "yarn"
# YaRN's defaults where a config leaves them out (transformers' _compute_yarn_parameters): the rotation
# counts bounding the band of channels blended between extrapolated and interpolated frequencies.
YARN_BETA_FAST = 32
YARN_BETA_SLOW = 1


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # theta ** (2i / head_dim) for i < head_dim / 2: [head_dim / 2] fp32
    return theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / _base_inv_freq(head_dim, theta)
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported "
                     "(supported: linear, llama3, yarn, longrope)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    # positions: [P] int64; inv_freq: [D/2] -> [P, D] fp32: cos then sin, both times attention_factor
    freqs = torch.outer(positions.float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's frequencies: each of the head_dim / 2 base frequencies divided by its own factor (the
    config's short_factor or long_factor), in transformers' arithmetic (_compute_longrope_parameters)."""
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope factors: {len(factors)} given, the rotary of {head_dim} channels needs "
                         f"{head_dim // 2}")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * _base_inv_freq(head_dim, theta))


def longrope_attention_factor(s: dict) -> float:
    """What LongRoPE multiplies cos and sin by: the config's attention_factor, else sqrt(1 + ln(factor) /
    ln(original_max_position_embeddings)) for a context stretched by ``factor`` (1 if not stretched), where
    ``factor`` is max_position_embeddings / original_max_position_embeddings unless the config gives one
    (ModelConfig.from_hf fills it in, as transformers does)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))


def _longrope_cos_sin(head_dim: int, max_positions: int, theta: float, s: dict) -> torch.Tensor:
    # Phi-3 long-context checkpoints were trained with short factors up to original_max_position_embeddings
    # and long factors past it. Each position takes its own: rows below the original length are the short
    # factors', rows from it on the long ones', so a token's rotation never depends on what else is in its
    # step (plait must not let an answer depend on batching). transformers instead rotates a whole forward
    # with the long factors once its last position reaches the original length, so the two differ only for
    # a sequence that has positions on both sides of it in one forward (a prompt longer than the original
    # length), and after generation crosses it (transformers then recomputes the whole cache with the long
    # factors; plait keeps the cached tokens' short rotation).
    original = s["original_max_position_embeddings"]
    scale = longrope_attention_factor(s)
    positions = torch.arange(max_positions)
    short = _cos_sin(positions[:original], longrope_inv_freq(head_dim, theta, s["short_factor"]), scale)
    long = _cos_sin(positions[original:], longrope_inv_freq(head_dim, theta, s["long_factor"]), scale)
    return torch.cat([short, long])


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: dict) -> float:
    """What YaRN multiplies cos and sin by: the config's attention_factor, else 0.1 ln(factor) + 1 (DeepSeek's
    mscale / mscale_all_dim ratio where both are given)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(s["factor"], s["mscale"]) / _yarn_mscale(s["factor"], s["mscale_all_dim"])
    return _yarn_mscale(s["factor"])


def yarn_inv_freq(head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters): channels that turn many times within the
    original context keep their frequency, slow ones are divided by ``factor``, and a linear ramp blends the
    band between (bounded by beta_fast / beta_slow rotations, rounded outwards unless ``truncate`` is off)."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def channel(rotations: float) -> float:  # the channel pair that turns ``rotations`` times in the original
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(s.get("beta_fast") or YARN_BETA_FAST), channel(s.get("beta_slow") or YARN_BETA_SLOW)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # [head_dim / 2]: 1 where the frequency is kept
    pos_freqs = _base_inv_freq(head_dim, theta)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def cos_sin_table(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_positions, head_dim] fp32: row p holds cos then sin of position p's half-dim angles."""
    kind = rope_kind(scaling)
    if kind == LONGROPE:
        return _longrope_cos_sin(head_dim, max_positions, theta, scaling)
    if kind == YARN:
        return _cos_sin(torch.arange(max_positions), yarn_inv_freq(head_dim, theta, scaling),
                        yarn_attention_factor(scaling))
    return _cos_sin(torch.arange(max_positions), _inv_freq(head_dim, theta, scaling))


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at arbitrary (per-token) positions.

    ``cos_sin`` is the whole rotation: an attention backend that fuses the rotation into its KV store
    (AttentionBackend.rotate_and_store) reads this table instead of calling forward.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        # cos_sin: [max_positions, head_dim] fp32; first half cos, second half sin (of the half-dim freqs).
        # A plain attribute, not a buffer, so casting the model to bf16 leaves it fp32; it is made on
        # the device the model is constructed under (``with torch.device(...)``).
        self.cos_sin = cos_sin_table(head_dim, max_positions, theta, scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        return rotate_at(self.cos_sin, positions, q, k)


def rotate_at(cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the rows ``positions`` of ``cos_sin`` ([rows, D] fp32, cos then sin)."""
    # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
    if use_triton(q) and cos_sin.device == q.device:
        from plait.kernels.rotary import apply_rotary

        return apply_rotary(positions, q, k, cos_sin)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# M-RoPE's position components: temporal, height, width (Qwen2-VL).
MROPE_COMPONENTS = 3


def mrope_columns(section: list[int], head_dim: int) -> torch.Tensor:
    """[head_dim] int64: the position component (0 t, 1 h, 2 w) each cos_sin column is read at. The half-dim
    frequencies are split in ``section`` bands, in turn t, h, w (transformers'
    apply_multimodal_rotary_pos_emb); cos and sin columns alike."""
    if sum(section) != head_dim // 2 or len(section) != MROPE_COMPONENTS:
        raise ValueError(f"mrope_section {section} must be 3 bands summing to head_dim / 2 = {head_dim // 2}")
    half = torch.repeat_interleave(torch.arange(MROPE_COMPONENTS), torch.tensor(section))
    return torch.cat([half, half])


def interleaved_mrope_columns(section: list[int], head_dim: int) -> torch.Tensor:
    """[head_dim] int64: mrope_columns for Qwen3-VL's interleaved M-RoPE, whose half-dim frequencies take
    t, h, w in turn (frequency i: h where i % 3 == 1 and i < 3 section[1], w where i % 3 == 2 and i < 3
    section[2], else t; transformers' Qwen3VLTextRotaryEmbedding), so every component spans low and high
    frequencies alike."""
    if sum(section) != head_dim // 2 or len(section) != MROPE_COMPONENTS:
        raise ValueError(f"mrope_section {section} must be 3 bands summing to head_dim / 2 = {head_dim // 2}")
    half = torch.zeros(head_dim // 2, dtype=torch.int64)
    for component in (1, 2):
        half[component:MROPE_COMPONENTS * section[component]:MROPE_COMPONENTS] = component
    return torch.cat([half, half])


class MRopeRotary:
    """M-RoPE for one step: each token's cos_sin row is gathered from the 1D table at its three positions,
    each column at its component's (mrope_columns). ``cos_sin`` is then that per-token table [T, D] and
    ``token_positions`` arange(T): an attention backend rotates at ``token_positions`` where a rotary has
    them (its fused rotary + KV store kernel unchanged), at ``batch.positions`` otherwise. Pure torch on
    static inputs, so CUDA graphs capture it (a decode token's three positions are equal: its usual row)."""

    def __init__(self, table: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> None:
        # table: [max_positions, D] fp32; positions: [3, T] int64; columns: [D] int64
        rows = table[positions]  # [3, T, D]
        index = columns.to(rows.device)[None, None, :].expand(1, rows.shape[1], -1)
        self.cos_sin = rows.gather(0, index)[0]  # [T, D]
        self.token_positions = torch.arange(positions.shape[1], device=positions.device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] indices into this step's cos_sin (token_positions); q: [T, Hq, D]; k: [T, Hkv, D]
        return rotate_at(self.cos_sin, positions, q, k)


class PartialRotaryEmbedding(nn.Module):
    """Rotary embedding on the first ``rotary_dim`` channels of each head; the rest pass through (Bamba,
    Phi-4-mini)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.rotary = RotaryEmbedding(rotary_dim, max_positions, theta, scaling)

    @property
    def cos_sin(self) -> torch.Tensor:
        """[max_positions, rotary_dim] fp32: narrower than the head, so a fused kernel (the attention
        backend's rotate_and_store) rotates the first rotary_dim channels and copies the rest, as here."""
        return self.rotary.cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D]; k: [T, Hkv, D]
        r = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


def rotary_embedding(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                     partial_rotary_factor: float = 1.0) -> RotaryEmbedding | PartialRotaryEmbedding:
    """The rotary of heads of head_dim channels whose first int(head_dim * partial_rotary_factor) channels
    turn (transformers' rounding): a whole-head RotaryEmbedding where that is all of them."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim == head_dim:
        return RotaryEmbedding(head_dim, max_positions, theta, scaling)
    return PartialRotaryEmbedding(rotary_dim, max_positions, theta, scaling)


def llama4_query_scale(positions: torch.Tensor, beta: float, period: int, dtype: torch.dtype) -> torch.Tensor:
    """Llama 4's attention temperature as Ministral 3 applies it: each query row is multiplied by
    1 + beta * ln(1 + floor(position / period)), so scores sharpen as the context grows past each
    ``period`` (the rotary's original context); 1 exactly within the first."""
    # positions: [T] -> [T, 1, 1] in dtype (computed in fp32, as transformers' get_llama_4_attn_scale)
    scale = 1 + beta * torch.log(1 + torch.floor(positions.float() / period))
    return scale.to(dtype)[:, None, None]


class QueryScaledRotary:
    """A rotary whose rotated q is then multiplied by a per-token factor (llama4_query_scale), made for one
    step. ``cos_sin`` is the base rotary's, so a backend that fuses the rotation into its KV store must also
    multiply the q it returns by ``q_scale`` (the rotation is linear, so the order only moves roundings)."""

    def __init__(self, rotary: RotaryEmbedding | PartialRotaryEmbedding, q_scale: torch.Tensor) -> None:
        self.rotary, self.q_scale = rotary, q_scale  # q_scale: [T, 1, 1]
        self.cos_sin = rotary.cos_sin

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rotary(positions, q, k)
        return q * self.q_scale, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as HF's x * cos + rotate_half(x) * sin with cos/sin duplicated over halves,
    # done in fp32 so bf16 activations rotate without extra rounding.
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
