"""Layer kinds: which decoder layers attend through a sliding window and which globally, and each kind's
rotary (Gemma 2 / 3, OLMo 3)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from plait.config import rope_kind
from plait.layers.rotary import RotaryEmbedding

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class LayerRope:
    """The rotary base and scaling of one kind of layer."""

    theta: float
    scaling: dict | None


def layer_types(raw: dict, default_pattern: int) -> list[str]:
    """Each layer's kind: the config's ``layer_types``, else every ``sliding_window_pattern``-th layer
    (``default_pattern`` where the config has none) global and the others sliding."""
    n = raw["num_hidden_layers"]
    kinds = raw.get("layer_types")
    if kinds:
        if len(kinds) != n or set(kinds) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}")
        return list(kinds)
    pattern = raw.get("sliding_window_pattern") or default_pattern
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def _scaling(params: dict | None) -> dict | None:
    if not params or rope_kind(params) == "default":
        return None
    return params


def layer_ropes(raw: dict, global_theta: float, local_theta: float) -> dict[str, LayerRope]:
    """The rotary of global and of sliding layers: per-kind ``rope_parameters`` (transformers 5's Gemma 3 and
    OLMo 3), or one ``rope_parameters`` / ``rope_theta`` + ``rope_scaling`` for the global layers, which the
    sliding ones share (Gemma 2) unless ``rope_local_base_freq`` gives them their own unscaled base (Gemma 3
    as transformers 4 writes it). The thetas are the family's defaults where the config has none."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        return {FULL: LayerRope(float(full.get("rope_theta", global_theta)), _scaling(full)),
                SLIDING: LayerRope(float(local.get("rope_theta", local_theta)), _scaling(local))}
    if isinstance(params, dict):
        full = LayerRope(float(params.get("rope_theta", local_theta)), _scaling(params))
    else:
        full = LayerRope(float(raw.get("rope_theta") or local_theta), _scaling(raw.get("rope_scaling")))
    local = raw.get("rope_local_base_freq")
    return {FULL: full, SLIDING: full if local is None else LayerRope(float(local), None)}


def kind_rotaries(ropes: dict[str, LayerRope], head_dim: int, max_positions: int) -> nn.ModuleDict:
    """Each layer kind's rotary table, as submodules of the model that holds them: what walks its modules
    (sleep mode parking its tensors, moves between devices) finds the tables."""
    return nn.ModuleDict({kind: RotaryEmbedding(head_dim, max_positions, rope.theta, rope.scaling)
                          for kind, rope in ropes.items()})
