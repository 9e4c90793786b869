"""Mamba2 mixer operations in plain torch over a varlen batch: the reference every Triton kernel
is tested against, and the path the model takes on CPU.

Every operation takes the whole step (rows of any length, in plan order) and the per-row state
addressing (``MambaRows``). A row starts from zero state iff it is a first chunk
(``num_computed_tokens == 0``), whatever its length and whatever its slot held before; otherwise
it continues from its slot's state. Which arithmetic a row takes (one recurrence step for a
one-token row, the chunked scan otherwise) is a choice of method only: both give the same numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torch.nn.functional.softplus's default: above it softplus(x) == x in fp32.
SOFTPLUS_THRESHOLD = 20.0
# Decay exponents below this are taken as exactly zero weight (exp(-80) < 2e-35, far below fp32
# resolution of any sum it joins): on CPUs exp into the denormal range runs ~20x slower.
EXP_UNDERFLOW = -80.0


@dataclass
class MambaRows:
    """Where each row's tokens are and which state it owns. Built once per step."""

    query_start_loc: torch.Tensor  # [R + 1] int32 (device): row r's tokens are [qsl[r], qsl[r + 1])
    state_slots: torch.Tensor  # [R] int64 (device): the row's request's state slot
    is_first_chunk: torch.Tensor  # [R] bool (device): start from zero state
    query_start_loc_cpu: list[int] | None  # None under a CUDA graph (only the torch path reads it)
    max_query_len: int  # an upper bound under a CUDA graph

    @property
    def num_rows(self) -> int:
        return self.query_start_loc.shape[0] - 1

    def span(self, row: int) -> tuple[int, int]:
        return self.query_start_loc_cpu[row], self.query_start_loc_cpu[row + 1]

    # Host copies for the per-row torch path only (free on CPU); the GPU kernels read the device
    # tensors and never synchronise.
    @functools.cached_property
    def state_slots_cpu(self) -> list[int]:
        return self.state_slots.tolist()

    @functools.cached_property
    def is_first_chunk_cpu(self) -> list[bool]:
        return [bool(f) for f in self.is_first_chunk.tolist()]


def make_rows(query_start_loc: torch.Tensor, state_slots: torch.Tensor,
              is_first_chunk: torch.Tensor) -> MambaRows:
    """Row layout from tensors alone (tests and tools)."""
    qsl = query_start_loc.tolist()
    max_len = max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
    return MambaRows(query_start_loc.int(), state_slots.long(), is_first_chunk.bool(), qsl, max_len)


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    # dt: [..., H] raw projection -> discretisation step, fp32
    dt = F.softplus(dt.float() + dt_bias.float(), threshold=SOFTPLUS_THRESHOLD)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


# -- causal depthwise conv1d with state -----------------------------------------------------------


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, rows: MambaRows, silu: bool = True) -> torch.Tensor:
    """x: [T, D], weight: [D, K], conv_state: [slots, K - 1, D] (updated in place) -> [T, D].

    Each row sees the K - 1 inputs before it (its slot's state, or zeros for a first chunk) and
    leaves its last K - 1 inputs (old state included when the row is shorter) in its slot.
    """
    out = torch.empty_like(x)
    kernel = weight.shape[1]
    w = weight.float().t()  # [K, D]
    for r in range(rows.num_rows):
        a, b = rows.span(r)
        slot = rows.state_slots_cpu[r]
        prev = torch.zeros_like(conv_state[slot]) if rows.is_first_chunk_cpu[r] else conv_state[slot]
        padded = torch.cat([prev.to(x.dtype), x[a:b]])  # [K - 1 + L, D]
        p32 = padded.float()
        y = sum(p32[k : k + b - a] * w[k] for k in range(kernel))  # [L, D]: tap k reads t + k
        if bias is not None:
            y = y + bias.float()
        out[a:b] = (F.silu(y) if silu else y).to(x.dtype)
        conv_state[slot] = padded[b - a :].to(conv_state.dtype)
    return out


# -- the selective state space (SSD) ---------------------------------------------------------------


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a (non-positive) log-decay, without denormals."""
    return torch.where(log_decay > EXP_UNDERFLOW, log_decay, float("-inf")).exp()


@functools.lru_cache(maxsize=8)
def _causal_mask(size: int, device: torch.device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def ssm_step_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step of any number of rows. x: [R, H, P]; dt: [R, H] (after softplus);
    A, D: [H]; B, C: [R, H, N] (already expanded from groups to heads); state: [R, H, P, N] fp32
    -> (y [R, H, P] fp32, new state)."""
    x = x.float()
    decay = torch.exp(dt * A)  # [R, H]
    state = state * decay[..., None, None] + (dt[..., None] * x)[..., None] * B[..., None, :].float()
    y = torch.einsum("rhpn,rhn->rhp", state, C.float()) + D[:, None] * x
    return y, state


def ssd_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan of one row. x: [L, H, P]; dt: [L, H] (after softplus); A, D: [H];
    B, C: [L, H, N]; state: [H, P, N] fp32 initial state -> (y [L, H, P] fp32, final state).

    Within a chunk the output is a masked (decayed) attention-like product; across chunks the state
    carries the past. Padding tokens get dt = 0: they neither decay nor add to the state.
    """
    length = x.shape[0]
    pad = (-length) % chunk_size
    x, B, C = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))
    n_chunks = x.shape[0] // chunk_size
    # [L', ...] -> [chunks, Q, ...]
    x, B, C, dt = (t.reshape(n_chunks, chunk_size, *t.shape[1:]) for t in (x, B, C, dt))
    xdt = x * dt[..., None]  # [c, Q, H, P]
    acs = torch.cumsum(dt * A, dim=1)  # [c, Q, H]: log-decay from the chunk start to each token
    causal = _causal_mask(chunk_size, x.device)
    seg = (acs[:, :, None, :] - acs[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    scores = torch.einsum("cihn,cjhn->cijh", C, B) * _decay(seg)  # [c, Qi, Qj, H]
    y = torch.einsum("cijh,cjhp->cihp", scores, xdt)
    decay_to_end = _decay(acs[:, -1:, :] - acs)  # [c, Q, H]
    chunk_states = torch.einsum("cjhn,cjh,cjhp->chpn", B, decay_to_end, xdt)  # [c, H, P, N]
    starts = []
    for c in range(n_chunks):
        starts.append(state)
        state = state * _decay(acs[c, -1])[:, None, None] + chunk_states[c]
    y = y + torch.einsum("cihn,chpn->cihp", C, torch.stack(starts)) * _decay(acs)[..., None]
    y = y + D[:, None] * x
    return y.reshape(-1, *y.shape[2:])[:length], state


def ssd_varlen_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float],
                   ssm_state: torch.Tensor, rows: MambaRows, chunk_size: int) -> torch.Tensor:
    """x: [T, H, P]; dt: [T, H] raw; A (negative), D, dt_bias: [H]; B, C: [T, G, N];
    ssm_state: [slots, H, P, N] fp32, updated in place -> y: [T, H, P] in x's dtype (D skip included)."""
    num_heads, num_groups = x.shape[1], B.shape[1]
    dt = softplus_dt(dt, dt_bias, dt_limit)
    # Each group's B and C serve num_heads / num_groups consecutive heads.
    B = B.float().repeat_interleave(num_heads // num_groups, dim=1)  # [T, H, N]
    C = C.float().repeat_interleave(num_heads // num_groups, dim=1)
    A, D = A.float(), D.float()
    y = torch.empty_like(x)
    single = [r for r in range(rows.num_rows) if rows.span(r)[1] - rows.span(r)[0] == 1]
    if single:
        # One-token rows (decodes, and one-token first chunks) take one step, all together.
        tokens = torch.tensor([rows.span(r)[0] for r in single], device=x.device)
        slots = torch.tensor([rows.state_slots_cpu[r] for r in single], device=x.device)
        first = torch.tensor([rows.is_first_chunk_cpu[r] for r in single], device=x.device)
        state = ssm_state[slots].float().masked_fill(first[:, None, None, None], 0.0)
        out, state = ssm_step_ref(x[tokens], dt[tokens], A, B[tokens], C[tokens], D, state)
        y[tokens] = out.to(y.dtype)
        ssm_state[slots] = state.to(ssm_state.dtype)
    for r in range(rows.num_rows):
        a, b = rows.span(r)
        if b - a == 1:
            continue
        slot = rows.state_slots_cpu[r]
        state = torch.zeros_like(ssm_state[slot]) if rows.is_first_chunk_cpu[r] else ssm_state[slot].float()
        out, state = ssd_scan_ref(x[a:b], dt[a:b], A, B[a:b], C[a:b], D, state, chunk_size)
        y[a:b] = out.to(y.dtype)
        ssm_state[slot] = state.to(ssm_state.dtype)
    return y


# -- gated RMSNorm ---------------------------------------------------------------------------------


def gated_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                       eps: float) -> torch.Tensor:
    """RMSNorm(y * silu(z)) over groups of ``group_size`` channels, in fp32 (norm after gate, as
    Mamba2 / Bamba). y, z: [T, I] -> [T, I] in y's dtype."""
    dtype = y.dtype
    h = y.float() * F.silu(z.float())
    g = h.view(*h.shape[:-1], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(h).to(dtype)
