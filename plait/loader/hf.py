"""Resolve a model argument to a local GGUF file or HF folder (a path, or a Hub id in the local HF cache),
and read HF safetensors folders."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from plait.loader.source import cached_hub_snapshot, default_model_path, is_gguf_file

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"
# "org/name" with Hub-legal characters: what a user means when they paste a Hub id.
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

ModelKind = Literal["gguf", "hf"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved local model: a GGUF file or an HF folder (config.json + safetensors)."""

    kind: ModelKind
    path: Path
    repo_id: str | None = None  # the Hub id it was found under in the HF cache (vLLM serves that name)


def resolve_model(model: str | Path | None, revision: str | None = None,
                  download_dir: str | None = None) -> ModelSource:
    """Classify a model argument; None means the bundled default GGUF.

    A local path wins; a string that is no local path but looks like a Hub id ("org/name") resolves to
    that model's snapshot at ``revision`` (None: main) in the local Hugging Face cache, or in
    ``download_dir`` where given (see cached_hub_snapshot): plait never downloads. Raises
    FileNotFoundError for a missing path or uncached id, and ValueError for anything that is not a model or
    a revision of a local path.
    """
    if model is None:
        source = ModelSource("gguf", default_model_path())
    else:
        raw = str(model)
        path = Path(raw).expanduser()
        if path.exists():
            source = _classify(path.resolve())
        elif isinstance(model, str) and _HUB_ID_RE.fullmatch(raw):
            return replace(_classify(cached_hub_snapshot(raw, revision, download_dir)), repo_id=raw)
        else:
            raise FileNotFoundError(f"model path {raw!r} does not exist")
    if revision is not None:
        raise ValueError(f"a revision ({revision!r}) picks a snapshot of a Hub id in the HF cache; "
                         f"{str(source.path)!r} is a local path")
    return source


def _classify(path: Path) -> ModelSource:
    """An existing path as a GGUF file or an HF folder."""
    if path.is_file():
        if path.suffix.lower() == GGUF_SUFFIX:
            if not is_gguf_file(path):
                raise ValueError(f"{str(path)!r} has a .gguf name but is not a GGUF file (bad magic bytes)")
            return ModelSource("gguf", path)
        raise ValueError(f"{str(path)!r} is neither a .gguf file nor a folder with {CONFIG_FILE}")
    if (path / CONFIG_FILE).is_file():
        return ModelSource("hf", path)
    ggufs = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
    hint = f"; it holds GGUF file(s) {ggufs[:5]}: pass one of them" if ggufs else ""
    raise ValueError(f"{str(path)!r} is neither a .gguf file nor a folder with {CONFIG_FILE}{hint}")


def load_hf_folder(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read an HF folder: (config.json dict, state dict with the checkpoint's own names and dtypes).

    Sharded checkpoints are read through model.safetensors.index.json; otherwise every *.safetensors
    file in the folder is read. Tied checkpoints keep whatever the files hold (save_pretrained omits
    lm_head.weight when it is tied).
    """
    config = read_hf_config(path)
    return config, dict(iter_hf_weights(path))


def read_hf_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no {CONFIG_FILE}")
    return json.loads(config_path.read_text())


def iter_hf_weights(path: str | Path, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors one at a time, shard after shard (only the tensor in hand is in memory), as
    load_hf_folder finds them; a name in two files is an error. ``progress``: a bar over the shards (vLLM's
    use_tqdm_on_load), for checkpoints whose load takes minutes."""
    path = Path(path)
    index_path = path / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{str(path)!r} has no *.safetensors weights (plait does not read pytorch_model.bin); "
            "convert them with transformers' save_pretrained(..., safe_serialization=True)"
        )
    seen: set[str] = set()
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
        with safe_open(file, framework="pt") as shard:
            names = list(shard.keys())
            duplicated = seen.intersection(names)
            if duplicated:
                raise ValueError(f"tensor(s) {sorted(duplicated)[:3]} appear in more than one file of "
                                 f"{str(path)!r}")
            seen.update(names)
            for name in names:
                yield name, shard.get_tensor(name)
