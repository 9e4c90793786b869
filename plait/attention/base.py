"""The attention backend interface and the registry that picks one by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from plait.attention.fp8_kv import UNIT_SCALES, KVScales

if TYPE_CHECKING:
    from plait.runner.forward_batch import ForwardBatch

# (positions [T], q [T, Hq, D], k [T, Hkv, D]) -> rotated (q, k): plait.layers.rotary.RotaryEmbedding and kin.
Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (q_norm, k_norm): per-head RMSNorms applied before the rotation (plait.layers.norm.RMSNorm: .weight, .eps).
QKNormModules = tuple[Any, Any]


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer caches a token: ``planes`` tensors (2: K and V; 1: MLA's single latent row,
    which serves as K and, its leading columns, as V) of ``heads`` x ``width`` values. The runner allocates
    each layer's cache as [planes, num_blocks, block_size, heads, width] and sizes the pool by it; a model
    declares its own (``kv_cache_spec``) where it is not [2, ..., num_key_value_heads, head_dim]."""

    planes: int
    heads: int
    width: int

    def values_per_token(self) -> int:
        return self.planes * self.heads * self.width


def rotary_positions(rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
    """[T] the rows of ``rotary.cos_sin`` each token is rotated by: the rotary's own ``token_positions`` where
    it has them (M-RoPE's per-step table: plait.layers.rotary.MRopeRotary), else the batch's positions."""
    own = getattr(rotary, "token_positions", None)
    return batch.positions if own is None else own


class AttentionBackend(ABC):
    """Stores a step's new K/V into the paged cache and attends over it.

    The KV cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: the K
    and V of token ``t`` of a request live at slot ``block_table[t // block_size] * block_size
    + t % block_size``. Every backend handles any mix of first chunks, later chunks and decodes
    in one call; none looks at query lengths to decide what a row is.

    A cache in the model's dtype holds K/V as they are; an FP8 cache (plait.attention.fp8_kv) holds codes
    that stand for code * ``kv_scales.k`` (or ``.v``), written and read with the layer's ``kv_scales``.
    """

    name: str = ""
    # True if attend/store_kv never read host-side batch data (``*_cpu`` lists) or sync with the host,
    # so a forward through this backend can be captured in a CUDA graph.
    graph_safe: bool = False

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
                 kv_scales: KVScales = UNIT_SCALES) -> None:
        """Write k, v ([T, Hkv, D]) at ``batch.slot_mapping``."""

    def rotate_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
        rotary: Rotary, kv_scales: KVScales = UNIT_SCALES, qk_norm: QKNormModules | None = None,
    ) -> torch.Tensor:
        """[Normalise q's and k's head rows with ``qk_norm``,] rotate q and k at ``batch.positions``, store
        the rotated k and v as ``store_kv`` does, and return the rotated q. A backend may fuse this where
        ``rotary`` has a ``cos_sin`` table (RotaryEmbedding's: [max_positions, R] fp32, cos then sin, the
        neox rotation of each head's first R channels), then multiply the q it returns by ``rotary.q_scale``
        where the rotary has one (plait.layers.rotary.QueryScaledRotary)."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rotary(rotary_positions(rotary, batch), q, k)
        self.store_kv(k, v, kv_cache, batch, kv_scales)
        return q

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        return_lse: bool = False,
        kv_scales: KVScales = UNIT_SCALES,
        logit_softcap: float | None = None,
        causal: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D] -> out [T, Hq, D] (and lse [T, Hq] if asked). Each query token sees its
        request's cached context and its own chunk up to itself (``causal`` False, an encoder's: its whole
        chunk too, every key of its row below ``seq_len``). ``logit_softcap`` c (Gemma 2): each
        scaled score s becomes c * tanh(s / c) before the softmax.

        ``sinks`` ([Hq], fp32 or q's dtype, on q's device; gpt-oss's attention sinks): one learned logit
        per query head, in the units of the scaled (and capped) scores but itself neither scaled nor
        capped. Each query attends as if it had one more key, visible whatever the mask or window, of
        score ``sinks[h]`` and value zero: the softmax's denominator grows by exp(sinks[h]), and the
        returned lse (natural log) includes it, so a query that sees no key gets zeros and lse
        ``sinks[h]``."""


    def store_latent(self, row: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> None:
        """MLA: write each token's latent row ([T, W]: the normalised c_kv, then the rotated k_pe) at
        ``batch.slot_mapping`` into a one-plane cache [1, num_blocks, block_size, 1, W]."""
        # An index_put on the device (any cache strides): graph-safe, no host data. Padded tokens write the
        # pad block.
        block_size = kv_cache.shape[2]
        block, pos = batch.slot_mapping // block_size, batch.slot_mapping % block_size
        kv_cache[0, block, pos, 0] = row.to(kv_cache.dtype)

    @abstractmethod
    def attend_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                      value_width: int) -> torch.Tensor:
        """MLA in its weight-absorbed form: q [T, Hq, W] (each head's query in the latent space, then its
        rotated rope part) attends as multi-query attention over the one-plane latent cache
        [1, num_blocks, block_size, 1, W]: K is each cached row whole, V its first ``value_width`` columns
        (c_kv). Causal, as ``attend``. Returns [T, Hq, value_width] in q's dtype."""


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def get_backend(name: str) -> AttentionBackend:
    # Import for the side effect of registration; GPU backends register only where they import.
    import plait.attention.torch_ref  # noqa: F401

    if name == "triton" and name not in _REGISTRY:
        _import_triton_backend()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def _import_triton_backend() -> None:
    """Register the Triton backend on demand, so importing plait never needs triton."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise ImportError("attention backend 'triton' needs the 'triton' package (pip install triton)")
    import plait.attention.triton_backend  # noqa: F401
