"""Attention backends over the paged KV cache, and the NaN-safe merge of partial results."""

from plait.attention.base import AttentionBackend, get_backend, register_backend
from plait.attention.merge import merge_attn_states

__all__ = ["AttentionBackend", "get_backend", "merge_attn_states", "register_backend"]
