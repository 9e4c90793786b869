"""Resolve a model argument to a local GGUF file or HF folder (a path, or a Hub id in the local HF cache),
and read HF safetensors folders."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from plait.config import EAGER_LOAD, LAZY_LOAD, PREFETCH_LOAD, EngineConfig
from plait.loader.source import cached_hub_snapshot, default_model_path, is_gguf_file

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
PT_INDEX_FILE = "pytorch_model.bin.index.json"
PT_SUFFIX = ".bin"
# *.bin files a training run leaves beside the weights (vLLM skips these too).
NOT_WEIGHT_FILES = frozenset({"training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin"})
GGUF_SUFFIX = ".gguf"
# What the "prefetch" load strategy's thread reads at a time (the data is dropped: the page cache keeps it).
PREFETCH_BLOCK_BYTES = 16 * 2**20
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


def resolve_config_folder(hf_config_path: str, revision: str | None = None,
                          download_dir: str | None = None) -> Path:
    """vLLM's --hf-config-path: a folder holding a config.json, or a Hub id whose snapshot at ``revision``
    (the model's, as vLLM reads both at the same one) is in the local HF cache (or ``download_dir``)."""
    path = Path(hf_config_path).expanduser()
    if path.exists():
        folder = path.resolve()
    elif _HUB_ID_RE.fullmatch(hf_config_path):
        folder = cached_hub_snapshot(hf_config_path, revision, download_dir)
    else:
        raise FileNotFoundError(f"hf_config_path {hf_config_path!r} does not exist (a folder holding "
                                f"{CONFIG_FILE}, or a Hub id in the local HF cache)")
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"hf_config_path {hf_config_path!r} is not a folder holding a {CONFIG_FILE}")
    return folder


def config_folder(config: EngineConfig) -> Path | None:
    """The folder config.hf_config_path names (vLLM's --hf-config-path), resolved; None where it is unset."""
    if config.hf_config_path is None:
        return None
    return resolve_config_folder(config.hf_config_path, config.revision, config.download_dir)


def checkpoint_files(path: str | Path) -> list[Path]:
    """An HF folder's weight files: the safetensors files its model.safetensors.index.json names, else every
    one; where there are none, PyTorch's (pytorch_model.bin, or the shards its index names; older checkpoints
    and EAGLE heads ship these), as vLLM falls back to them."""
    path = Path(path)
    for index_name, pattern in ((SAFETENSORS_INDEX_FILE, "*.safetensors"), (PT_INDEX_FILE, "*.bin")):
        index_path = path / index_name
        if index_path.is_file():
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))]
        files = sorted(p for p in path.glob(pattern) if p.name not in NOT_WEIGHT_FILES)
        if files:
            return files
    raise FileNotFoundError(f"{str(path)!r} has no weights (*.safetensors, or PyTorch's *.bin)")


def _is_pickle(file: Path) -> bool:
    return file.suffix == PT_SUFFIX


def read_pt_file(file: Path, map_location: str = "cpu") -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint file's tensors: torch.load with weights_only (no code runs from it, only tensors
    and containers are unpickled), memory-mapped where the file allows (vLLM's --pt-load-map-location)."""
    try:
        state = torch.load(file, map_location=map_location, weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be mapped
        state = torch.load(file, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{str(file)!r} is not a state dict of tensors")
    return state


def iter_hf_weights(path: str | Path, progress: bool = False, strategy: str = LAZY_LOAD,
                    threads: int = 1, wanted: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors, shard after shard in file order, as load_hf_folder finds them; a name in two
    files is an error. ``progress``: a bar over the shards (vLLM's use_tqdm_on_load), for checkpoints whose
    load takes minutes.

    ``strategy`` is vLLM's safetensors_load_strategy: "lazy" maps each file and reads one tensor at a time
    (only the tensor in hand is in memory); "eager" reads each file whole, in one sequential read, before its
    tensors are handed out (a shard's size in memory); "prefetch" is "lazy" while a thread reads the files
    ahead, in order, so that the page cache holds them when their tensors are read. ``threads`` > 1 (vLLM's
    enable_multithread_load) reads that many shards at once on threads, each whole, handed out in file order
    (up to threads + 1 shards in memory). ``wanted``: the names to hand out (None: all); under "lazy" and
    "prefetch" the others are never read (an MTP draft head takes one layer of its target's checkpoint)."""
    files = checkpoint_files(path)
    prefetcher = Prefetcher(files) if strategy == PREFETCH_LOAD else None
    if prefetcher is not None:
        prefetcher.start()
    bar = tqdm(total=len(files), desc="Loading safetensors shards", unit="shard", disable=not progress)
    seen: set[str] = set()
    try:
        for names, tensors in _shards(files, strategy, threads, wanted):
            duplicated = seen.intersection(names)
            if duplicated:
                raise ValueError(f"tensor(s) {sorted(duplicated)[:3]} appear in more than one file of "
                                 f"{str(path)!r}")
            seen.update(names)
            yield from tensors
            bar.update(1)
    finally:
        bar.close()
        if prefetcher is not None:
            prefetcher.stop()


def _shards(files: list[Path], strategy: str, threads: int, wanted: Callable[[str], bool] | None = None
            ) -> Iterator[tuple[list[str], Iterable[tuple[str, torch.Tensor]]]]:
    """Each shard's tensor names and its wanted (name, tensor) pairs, in file order, read as iter_hf_weights
    says."""
    def keep(name: str) -> bool:
        return wanted is None or wanted(name)

    if threads > 1:
        for tensors in _shards_on_threads(files, strategy, threads):
            yield list(tensors), ((n, t) for n, t in tensors.items() if keep(n))
        return
    for file in files:
        if strategy == EAGER_LOAD or _is_pickle(file):
            tensors = read_shard(file, strategy)
            yield list(tensors), ((n, t) for n, t in tensors.items() if keep(n))
            continue
        with safe_open(file, framework="pt") as shard:
            names = list(shard.keys())
            yield names, ((name, shard.get_tensor(name)) for name in names if keep(name))


def read_shard(file: Path, strategy: str = LAZY_LOAD) -> dict[str, torch.Tensor]:
    """One weight file's tensors, all in memory: read whole first ("eager"), or through a map (a PyTorch
    file: torch.load's)."""
    if _is_pickle(file):
        return read_pt_file(file)
    if strategy == EAGER_LOAD:
        return safetensors.torch.load(file.read_bytes())
    with safe_open(file, framework="pt") as shard:
        return {name: shard.get_tensor(name) for name in shard.keys()}


def _shards_on_threads(files: list[Path], strategy: str, threads: int) -> Iterator[dict[str, torch.Tensor]]:
    """read_shard of every file, ``threads`` at a time ahead of the one handed out, in file order."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="plait-load")
    try:
        window: deque = deque()
        for file in files:
            window.append(pool.submit(read_shard, file, strategy))
            if len(window) > threads:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class Prefetcher(threading.Thread):
    """The "prefetch" load strategy's reader: reads ``files`` start to end, in order, dropping the data, so
    that the page cache holds them when the loader maps them (sequential reads, which network filesystems
    serve far faster than a map's page faults). Stops early when told; a file it cannot read is skipped (the
    loader then reports it)."""

    def __init__(self, files: list[Path], block_bytes: int = PREFETCH_BLOCK_BYTES) -> None:
        super().__init__(name="plait-prefetch", daemon=True)
        self.files, self.block_bytes = files, block_bytes
        self.bytes_read = 0
        self._stopped = threading.Event()

    def run(self) -> None:
        block = bytearray(self.block_bytes)
        for file in self.files:
            try:
                with open(file, "rb", buffering=0) as f:
                    while not self._stopped.is_set():
                        n = f.readinto(block)
                        if not n:
                            break
                        self.bytes_read += n
            except OSError as err:
                logger.debug("prefetching %s failed: %s", file, err)
            if self._stopped.is_set():
                return

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive():
            self.join()
