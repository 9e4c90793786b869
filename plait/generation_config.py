"""The model's generation_config.json, read as vLLM reads it: the sampling defaults of requests that leave
those fields out (vLLM's ``--generation-config auto``, its default) and the extra end-of-sequence ids."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# EngineConfig.generation_config values (vLLM's names): the model folder's file, or none of it (vLLM's own
# defaults); any other value is a folder holding a generation_config.json.
AUTO = "auto"
VLLM_DEFAULTS = "vllm"
# The fields of generation_config.json that become sampling defaults (vLLM's get_diff_sampling_param), by
# their SamplingParams names: HF's max_new_tokens is vLLM's max_tokens. The rest (do_sample, max_length,
# num_beams, ...) vLLM ignores, and so does plait.
SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's generation_config.json changes (nothing, for a model without one)."""

    # SamplingParams field -> the value a request that leaves the field out gets (read-only).
    sampling: dict[str, Any] = field(default_factory=dict)
    # End-of-sequence ids beside the model config's and the tokenizer's (eos_token_id may be a list).
    eos_token_ids: frozenset[int] = frozenset()
    # A limit even on requests that set max_tokens: vLLM treats max_new_tokens so only when the file comes
    # from a folder named by --generation-config; from the model's own file it is a default.
    max_tokens_cap: int | None = None

    def max_tokens(self, requested: int | None) -> int | None:
        """A request's max_tokens (None: to the end of the context) with these defaults, as vLLM's
        get_max_tokens: the request's own value, else the default, and never above the cap."""
        value = requested if requested is not None else self.sampling.get("max_tokens")
        if self.max_tokens_cap is None:
            return value
        return self.max_tokens_cap if value is None else min(value, self.max_tokens_cap)


def load_generation_defaults(source: str, model_path: Path,
                             override: dict[str, Any] | None = None) -> GenerationDefaults:
    """Read the generation_config.json that ``source`` names for the model at ``model_path``, with
    ``override``'s fields over its own (vLLM's --override-generation-config).

    "auto": the model folder's, if it has one (a GGUF file has none). "vllm": the same file's EOS ids only,
    so sampling keeps vLLM's defaults but for the override's. A folder: its generation_config.json, which
    must exist. Raises ValueError for a file that is not a JSON object, an override field that sets no
    sampling default, or values SamplingParams refuses.
    """
    override = override or {}
    unknown = sorted(set(override) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown} set no sampling default; it takes "
                         f"{sorted(SAMPLING_FIELDS)}")
    path = _config_path(source, model_path)
    raw = read_json_object(path) if path is not None else {}
    own = {} if source == VLLM_DEFAULTS else raw
    where = str(path) if path is not None and source != VLLM_DEFAULTS else None
    if override:
        where = f"{where} and --override-generation-config" if where else "--override-generation-config"
    sampling = _sampling_defaults({**own, **override}, where or "", from_file=bool(own))
    if sampling:
        # vLLM warns the same way: output changes without any request saying so.
        logger.warning("default sampling parameters come from %s: %s (--generation-config vllm ignores the "
                       "model's)", where, sampling)
    explicit_folder = source not in (AUTO, VLLM_DEFAULTS)
    return GenerationDefaults(sampling=sampling, eos_token_ids=_eos_token_ids(raw, path),
                              max_tokens_cap=sampling.get("max_tokens") if explicit_folder else None)


def _config_path(source: str, model_path: Path) -> Path | None:
    if source in (AUTO, VLLM_DEFAULTS):
        # vLLM reads the model's file under both: "vllm" drops its sampling defaults, not its EOS ids.
        path = Path(model_path) / GENERATION_CONFIG_FILE
        return path if Path(model_path).is_dir() and path.is_file() else None
    folder = Path(source).expanduser()
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"generation_config {source!r} must be 'auto', 'vllm' or a folder holding "
                                f"{GENERATION_CONFIG_FILE}; {str(folder)!r} has none")
    return folder / GENERATION_CONFIG_FILE


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object, or a ValueError naming the file."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _sampling_defaults(raw: dict[str, Any], where: str, from_file: bool) -> dict[str, Any]:
    sampling = {name: raw[key] for key, name in SAMPLING_FIELDS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**sampling)  # refuse bad values now, not in every request that leaves them out
    except (ValueError, TypeError) as err:
        hint = " (--generation-config vllm ignores the file's sampling defaults)" if from_file else ""
        raise ValueError(f"{where}: {err}{hint}") from err
    return sampling


def _eos_token_ids(raw: dict[str, Any], path: Path) -> frozenset[int]:
    eos = raw.get("eos_token_id")
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return frozenset(ids)
