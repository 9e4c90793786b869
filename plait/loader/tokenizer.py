"""Load a tokenizer (with chat template) from an HF folder or a GGUF file, caching GGUF conversions."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "PLAIT_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/plait")
TOKENIZER_CACHE_SUBDIR = "tokenizers"
# Bump when the cached layout changes so stale entries are ignored rather than misread.
TOKENIZER_CACHE_FORMAT = 1
CACHE_DIR_MODE = 0o755
# Any of these means an HF folder ships a tokenizer; random-weight benchmark configs have none.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# A processor's chat template, as transformers 4 saved it ({"chat_template": "..."}).
PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"
# GGUF architectures whose tokenizer transformers builds but whose config its GGUF reader refuses
# (AutoTokenizer reads the config to choose the tokenizer class): the class's tokenizer type, named instead.
# Gemma 1's files take GemmaTokenizer, as Gemma 2's do through their config; Cohere's, CohereTokenizer (a
# byte-level BPE, as llama.cpp's converter writes it).
TOKENIZER_TYPES_BY_GGUF_ARCHITECTURE = {"gemma": "gemma", "command-r": "cohere", "cohere2": "cohere"}


def _auto_tokenizer() -> Any:
    """transformers' AutoTokenizer, imported on first use: a process that loads no tokenizer (a
    tensor-parallel worker of a checkpoint that ships none) is spared transformers' ~1 s import."""
    from transformers import AutoTokenizer

    return AutoTokenizer


def cache_root() -> Path:
    """Root of plait's on-disk cache: $PLAIT_CACHE_DIR, else ~/.cache/plait."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def tokenizer_cache_dir(gguf_path: Path) -> Path:
    """Where the converted tokenizer of `gguf_path` is (or will be) cached.

    Keyed on the file's identity (absolute path, size, mtime) so an edited or replaced file gets
    a fresh conversion; the transformers version is in the key because the saved layout differs
    between major versions.
    """
    import transformers

    path = Path(gguf_path).resolve()
    st = path.stat()
    ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}\0{TOKENIZER_CACHE_FORMAT}"
    return cache_root() / TOKENIZER_CACHE_SUBDIR / hashlib.sha256(ident.encode()).hexdigest()


def load_tokenizer(model_path: str | Path) -> Any | None:
    """The tokenizer of a GGUF file or HF folder, or None for a folder that ships no tokenizer.

    Returns what `AutoTokenizer` builds (a fast tokenizer with the model's chat template). A GGUF
    tokenizer is converted once (several seconds: the vocabulary lives in the GGUF header) and
    then served from the cache directory.
    """
    model_path = Path(model_path)
    if model_path.is_dir():
        if not any((model_path / name).is_file() for name in HF_TOKENIZER_FILES):
            return None
        tokenizer = _auto_tokenizer().from_pretrained(model_path)
        processor_template = model_path / PROCESSOR_CHAT_TEMPLATE_FILE
        if tokenizer.chat_template is None and processor_template.is_file():
            # An image-text folder's template may be its processor's alone (llava-hf's older snapshots).
            tokenizer.chat_template = json.loads(processor_template.read_text())["chat_template"]
        return tokenizer
    if not model_path.is_file():
        raise FileNotFoundError(f"model path {str(model_path)!r} does not exist")
    if model_path.suffix != ".gguf":
        raise ValueError(f"{str(model_path)!r} is neither a .gguf file nor a model folder")
    return _load_gguf_tokenizer(model_path)


def _load_gguf_tokenizer(gguf_path: Path) -> Any:
    cached = tokenizer_cache_dir(gguf_path)
    if cached.is_dir():
        return _auto_tokenizer().from_pretrained(cached)
    tokenizer = _convert_gguf_tokenizer(gguf_path)
    try:
        _save_atomically(tokenizer, cached)
    except OSError as exc:
        # A read-only or full cache must not stop the engine; it only costs the conversion again.
        logger.warning("could not cache the tokenizer of %s in %s: %s", gguf_path, cached, exc)
        return tokenizer
    # Reload from disk so a first run and later (cached) runs use the exact same tokenizer.
    return _auto_tokenizer().from_pretrained(cached)


def _convert_gguf_tokenizer(gguf_path: Path) -> Any:
    from plait.loader.gguf import gguf_architecture

    kind = TOKENIZER_TYPES_BY_GGUF_ARCHITECTURE.get(gguf_architecture(gguf_path))
    named = {} if kind is None else {"tokenizer_type": kind}
    return _auto_tokenizer().from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **named)


def _save_atomically(tokenizer: Any, target: Path) -> None:
    """Save into a sibling temp dir, then rename: readers only ever see a complete directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        tmp.chmod(CACHE_DIR_MODE)  # mkdtemp makes it 0700; the published entry should be readable
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process renamed its (identical) copy into place first; use that one.
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
