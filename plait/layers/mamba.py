"""The Mamba2 mixer layer and its per-slot recurrent state (conv window and SSM state)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.dispatch import on_kernel_device
from plait.layers import mamba_ops
from plait.layers.mamba_ops import MambaRows

if TYPE_CHECKING:
    from plait.parallel.group import TPGroup
    from plait.runner.forward_batch import ForwardBatch

# The SSM state accumulates over the whole sequence; it is kept in fp32 whatever the model dtype,
# so thousands of bf16 roundings do not pile up in it. The conv window holds raw inputs and keeps
# the model dtype (lossless).
SSM_STATE_DTYPE = torch.float32
# ForwardBatch.backend_state key of the row layout shared by every Mamba layer of a step.
_ROWS_KEY = "mamba_rows"


@dataclass(frozen=True)
class Mamba2Dims:
    """Shapes and options of one Mamba2 mixer, read from an HF config."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float]
    # Tensor parallelism: how many ranks share each group (its B and C columns, replicated on each, and the
    # span of its gated norm, whose sums of squares they add up); 1: every rank holds whole groups of its own.
    group_ranks: int = 1

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    def split(self, ranks: int) -> Mamba2Dims:
        """One of ``ranks`` tensor-parallel ranks' mixer (vLLM's MambaMixer2): its num_heads / ranks heads
        and the groups they read: n_groups / ranks of them, or the one group (n_groups 1) replicated on every
        rank (plait.parallel.shard.shard_for refuses any other split)."""
        if ranks == 1:
            return self
        heads = self.num_heads // ranks
        if self.n_groups % ranks == 0:
            return dataclasses.replace(self, num_heads=heads, n_groups=self.n_groups // ranks)
        return dataclasses.replace(self, num_heads=heads, group_ranks=ranks)

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def state_spec(self) -> MambaStateSpec:
        return MambaStateSpec(conv_shape=(self.conv_kernel - 1, self.conv_dim),
                              ssm_shape=(self.num_heads, self.head_dim, self.state_size))


@dataclass(frozen=True)
class MambaStateSpec:
    """Per-slot state shapes of one recurrent layer."""

    conv_shape: tuple[int, int]  # [K - 1, conv_dim]: the last K - 1 conv inputs, oldest first
    ssm_shape: tuple[int, int, int]  # [H, P, N]


@dataclass
class MambaLayerState:
    """One recurrent layer's state for every slot. Row ``slot`` belongs to the request holding it."""

    conv: torch.Tensor  # [slots, K - 1, conv_dim], model dtype
    ssm: torch.Tensor  # [slots, H, P, N], SSM_STATE_DTYPE


def allocate_mamba_states(specs: list[MambaStateSpec], num_rows: int, dtype: torch.dtype,
                          device: torch.device) -> list[MambaLayerState]:
    """Zeroed state tensors of ``num_rows`` slots (the pad slot included) for each recurrent layer."""
    return [MambaLayerState(torch.zeros((num_rows, *s.conv_shape), dtype=dtype, device=device),
                            torch.zeros((num_rows, *s.ssm_shape), dtype=SSM_STATE_DTYPE, device=device))
            for s in specs]


def mamba_state_bytes(specs: list[MambaStateSpec], dtype: torch.dtype) -> int:
    """Bytes of state one slot needs across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    ssm_elem = torch.empty((), dtype=SSM_STATE_DTYPE).element_size()
    return sum(elem * s.conv_shape[0] * s.conv_shape[1] + ssm_elem * s.ssm_shape[0] * s.ssm_shape[1]
               * s.ssm_shape[2] for s in specs)


def batch_rows(batch: ForwardBatch) -> MambaRows:
    """The step's row layout, built on first use and shared by every Mamba layer of the step."""
    rows = batch.backend_state.get(_ROWS_KEY)
    if rows is None:
        rows = batch.backend_state[_ROWS_KEY] = MambaRows(
            batch.query_start_loc, batch.state_slots, batch.is_first_chunk, batch.query_start_loc_cpu,
            batch.max_query_len)
    return rows


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) per group of ``group_size`` channels. Under tensor parallelism with one group
    replicated on ``ranks`` ranks, a rank holds group_size of the group's ranks * group_size channels: its
    sums of squares are added to the others' (``group``, set by plait.parallel.shard) before it normalises
    its slice, as vLLM's Mixer2RMSNormGated does."""

    def __init__(self, size: int, group_size: int, eps: float, ranks: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps, self.ranks = group_size, eps, ranks
        self.group: TPGroup | None = None

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # y, z: [T, I] (this rank's channels)
        if self.ranks > 1:
            return self._across_ranks(y, z)
        if on_kernel_device(y):
            from plait.kernels.mamba_norm import gated_rms_norm

            return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)
        return mamba_ops.gated_rms_norm_ref(y, z, self.weight, self.group_size, self.eps)

    def _across_ranks(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """gated_rms_norm_ref's arithmetic on this rank's group_size channels of a group spanning the ranks:
        one all-reduce of [T, 1] sums of squares (torch ops on a GPU too: the kernel normalises whole
        groups)."""
        if self.group is None:
            raise RuntimeError("a gated norm split across ranks needs their group "
                               "(plait.parallel.shard.sum_row_parallel_outputs)")
        h = y.float() * F.silu(z.float())  # [T, group_size]
        sums = self.group.all_reduce_(h.pow(2).sum(-1, keepdim=True))  # [T, 1]: the whole group's
        mean = sums / (self.group_size * self.ranks)
        return self.weight * (h * torch.rsqrt(mean + self.eps)).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> causal conv1d (with state) -> SSD (with state) -> gated RMSNorm -> out_proj.

    Parameter names follow HF (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
    ``out_proj``). ``state_index`` picks this layer's state among the model's recurrent layers.
    """

    def __init__(self, dims: Mamba2Dims, state_index: int) -> None:
        super().__init__()
        self.dims, self.state_index = dims, state_index
        i, h = dims.intermediate_size, dims.num_heads
        self.in_proj = nn.Linear(dims.hidden_size, i + dims.conv_dim + h, bias=dims.use_bias)
        self.conv1d = nn.Conv1d(dims.conv_dim, dims.conv_dim, dims.conv_kernel, groups=dims.conv_dim,
                                padding=dims.conv_kernel - 1, bias=dims.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GatedRMSNorm(i, i // dims.n_groups, dims.norm_eps, dims.group_ranks)
        self.out_proj = nn.Linear(i, dims.hidden_size, bias=dims.use_bias)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # hidden: [T, hidden] -> [T, hidden]
        d = self.dims
        i, gn = d.intermediate_size, d.n_groups * d.state_size
        z, xbc, dt = self.in_proj(hidden).split([i, d.conv_dim, d.num_heads], dim=-1)
        state = batch.recurrent_states[self.state_index]
        rows = batch_rows(batch)
        ops = _triton_ops() if on_kernel_device(hidden) else _torch_ops()
        xbc = ops.conv(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, state.conv, rows)
        x, B, C = xbc.split([i, gn, gn], dim=-1)
        num_tokens = hidden.shape[0]
        groups = (num_tokens, d.n_groups, d.state_size)
        y = ops.ssd(x.view(num_tokens, d.num_heads, d.head_dim), dt, -torch.exp(self.A_log.float()),
                    B.view(groups), C.view(groups), self.D, self.dt_bias, d.time_step_limit, state.ssm, rows,
                    d.chunk_size)
        y = self.norm(y.reshape(num_tokens, i), z)
        return self.out_proj(y)


@dataclass(frozen=True)
class _Ops:
    """The mixer's stateful operations: Triton kernels over the whole batch on a GPU, the torch
    reference (row by row) elsewhere. Both have the same signatures and contract."""

    conv: Callable[..., torch.Tensor]  # causal conv1d with state
    ssd: Callable[..., torch.Tensor]  # SSD scan / one-step update with state


def _torch_ops() -> _Ops:
    return _Ops(mamba_ops.causal_conv1d_ref, mamba_ops.ssd_varlen_ref)


def _triton_ops() -> _Ops:
    from plait.kernels.mamba_conv import causal_conv1d_varlen
    from plait.kernels.mamba_scan import ssd_varlen

    return _Ops(causal_conv1d_varlen, ssd_varlen)
