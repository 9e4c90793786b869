"""Hub ids ("org/name") load from the local Hugging Face cache, never from the network.

Each test builds its own cache in tmp_path with the real layout (models--org--name/refs/main holding a
commit hash, snapshots/<hash>/ of symlinks into blobs/) and points $HF_HUB_CACHE at it; plait reads
that variable at each call (huggingface_hub reads it once, at import), so monkeypatch.setenv works.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
from conftest import TINY_VOCAB

from plait.entrypoints.llm import LLM
from plait.loader.hf import ModelSource, resolve_model
from plait.loader.source import hub_cache_dir
from plait.sampling_params import SamplingParams

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits, as a real commit hash
PROMPTS = ["t5 t9 t33 t100", "t7 t7 t300", "t42"]
MAX_TOKENS = 8


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocab ("t0".."t511"), so text prompts work offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(folder)


def _add_to_cache(cache: Path, repo_id: str, model_folder: Path, commit: str = COMMIT,
                  ref: str = "main") -> Path:
    """Lay `model_folder`'s files out as `hf download` leaves them (`ref` naming `commit`); returns the
    snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model_folder.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no trailing newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tiny_llama, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-tok")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    _write_tokenizer(folder)
    return folder


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Records (and refuses) every connection or host lookup; HF_HUB_OFFLINE is off, as by default."""
    attempts: list = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted in a test that must stay offline")

    for owner, name in ((socket.socket, "connect"), (socket.socket, "connect_ex"),
                        (socket, "create_connection"), (socket, "getaddrinfo")):
        monkeypatch.setattr(owner, name, refuse)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read at import
    return attempts


def _greedy(llm: LLM) -> list[tuple[list[int], str]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def test_hub_id_resolves_to_its_cached_snapshot(hub_cache, tiny_llama, no_network) -> None:
    snapshot = _add_to_cache(hub_cache, REPO_ID, tiny_llama)
    assert resolve_model(REPO_ID) == ModelSource("hf", snapshot, repo_id=REPO_ID)
    assert no_network == []


def test_hub_id_loads_as_its_snapshot_folder(hub_cache, tiny_llama_with_tokenizer, no_network) -> None:
    """LLM("org/name") greedy output equals LLM(<snapshot folder>)'s, text included, with no network
    and without HF_HUB_OFFLINE."""
    snapshot = _add_to_cache(hub_cache, REPO_ID, tiny_llama_with_tokenizer)
    by_id = LLM(REPO_ID, block_size=8)
    assert by_id.get_tokenizer() is not None
    assert by_id.engine.config.model == REPO_ID
    assert _greedy(by_id) == _greedy(LLM(str(snapshot), block_size=8))
    assert no_network == []


def test_missing_hub_id_says_plait_never_downloads(hub_cache, no_network) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("tiny-org/not-cached")
    message = str(info.value)
    assert "never downloads" in message and "hf download tiny-org/not-cached" in message
    assert str(hub_cache) in message  # names the cache folder it looked in
    assert no_network == []


def test_without_huggingface_hub_a_hub_id_is_not_found(hub_cache, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    with pytest.raises(FileNotFoundError, match="huggingface_hub, which reads that cache, is not installed"):
        resolve_model(REPO_ID)


def test_hub_id_with_a_dangling_ref_is_not_cached(hub_cache, tiny_llama) -> None:
    """refs/main names a commit whose snapshot folder is gone (an interrupted or pruned download)."""
    _add_to_cache(hub_cache, REPO_ID, tiny_llama)
    (hub_cache / ("models--" + REPO_ID.replace("/", "--")) / "refs" / "main").write_text("f" * 40)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model(REPO_ID)


def test_local_folder_wins_over_hub_id(hub_cache, tiny_llama, tmp_path, monkeypatch) -> None:
    _add_to_cache(hub_cache, REPO_ID, tiny_llama)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llama, tmp_path / REPO_ID)  # ./tiny-org/tiny-llama, named like the id
    assert resolve_model(REPO_ID) == ModelSource("hf", (tmp_path / REPO_ID).resolve())


def test_non_hub_id_missing_path_is_a_plain_missing_path(hub_cache) -> None:
    for missing in ("no-such-model", "a/b/c", "./org/name", "org--x/name"):  # "--": no valid Hub id
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_model(missing)


def test_hub_cache_dir_follows_huggingface_hub_precedence(tmp_path, monkeypatch) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub_cache_dir() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == tmp_path / "hub"


def test_cli_takes_a_hub_id(hub_cache, tiny_llama_with_tokenizer, capsys) -> None:
    from plait.entrypoints.cli import main

    _add_to_cache(hub_cache, REPO_ID, tiny_llama_with_tokenizer)
    assert main(["generate", PROMPTS[0], "--model", REPO_ID, "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", PROMPTS[0], "--model", "tiny-org/not-cached"]) == 2
    assert "never downloads" in capsys.readouterr().err


def test_server_serves_a_hub_id_under_that_name(hub_cache, tiny_llama) -> None:
    """As vLLM: `plait serve org/name` reports "org/name", not its snapshot folder's commit hash."""
    pytest.importorskip("fastapi")
    from plait.entrypoints.server import default_served_model_name

    _add_to_cache(hub_cache, REPO_ID, tiny_llama)
    assert default_served_model_name(resolve_model(REPO_ID)) == REPO_ID
    assert default_served_model_name(resolve_model(str(tiny_llama))) == tiny_llama.name


def test_revision_and_download_dir_pick_cached_snapshots(tmp_path, tiny_llama, tiny_llama_with_tokenizer,
                                                         no_network) -> None:
    """vLLM's --revision (a branch, tag or commit) and --download-dir (a cache outside $HF_HUB_CACHE): both
    only pick among what is on disk."""
    elsewhere = tmp_path / "elsewhere"
    main = _add_to_cache(elsewhere, REPO_ID, tiny_llama)
    other_commit = "fedcba9876543210fedcba9876543210fedcba98"
    tagged = _add_to_cache(elsewhere, REPO_ID, tiny_llama_with_tokenizer, other_commit, ref="v2")
    where = str(elsewhere)
    assert resolve_model(REPO_ID, download_dir=where).path == main
    assert resolve_model(REPO_ID, "v2", where) == ModelSource("hf", tagged, repo_id=REPO_ID)
    assert resolve_model(REPO_ID, other_commit, where).path == tagged
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(REPO_ID, "v3", where)
    assert f"'{REPO_ID}@v3'" in str(info.value) and f"hf download {REPO_ID} --revision v3" in str(info.value)
    with pytest.raises(ValueError, match="is a local path"):
        resolve_model(str(tiny_llama), "v2")
    # Only the v2 snapshot ships a tokenizer: the engine loads that revision's files.
    assert LLM(REPO_ID, revision="v2", download_dir=where, block_size=8).get_tokenizer() is not None
    assert LLM(REPO_ID, download_dir=where, block_size=8).get_tokenizer() is None
    assert no_network == []


def test_tokenizer_from_another_folder_or_hub_id(hub_cache, tiny_llama, tiny_llama_with_tokenizer, tmp_path,
                                                 capsys) -> None:
    """vLLM's --tokenizer: a model folder without a tokenizer serves text with another's (a folder, or a Hub
    id at --tokenizer-revision), the same tokens as the folder that ships both."""
    from plait.entrypoints.cli import main

    want = _greedy(LLM(str(tiny_llama_with_tokenizer), block_size=8))
    assert _greedy(LLM(str(tiny_llama), tokenizer=str(tiny_llama_with_tokenizer), block_size=8)) == want
    _add_to_cache(hub_cache, "tiny-org/tokenizer", tiny_llama_with_tokenizer, ref="v1")
    by_id = LLM(str(tiny_llama), tokenizer="tiny-org/tokenizer", tokenizer_revision="v1", block_size=8)
    assert _greedy(by_id) == want
    with pytest.raises(ValueError, match="holds no tokenizer"):
        LLM(str(tiny_llama_with_tokenizer), tokenizer=str(tiny_llama), block_size=8)
    with pytest.raises(ValueError, match="is a local path"):  # the model's own tokenizer at a revision
        LLM(str(tiny_llama), tokenizer_revision="v1", block_size=8)
    args = ["generate", PROMPTS[0], "--model", str(tiny_llama), "--tokenizer", str(tiny_llama_with_tokenizer),
            "--max-tokens", "4", "--temperature", "0", "--trust-remote-code", "--enable-chunked-prefill"]
    assert main(args) == 0 and capsys.readouterr().out.strip()
    assert main([*args, "--no-enable-chunked-prefill"]) == 2
    assert "always chunks prompts" in capsys.readouterr().err
    assert main([*args, "--guided-decoding-backend", "guidance"]) == 0 and capsys.readouterr().out.strip()
    assert main([*args, "--structured-outputs-backend", "xgrammar"]) == 2
    assert "--guided-decoding-backend xgrammar is not available" in capsys.readouterr().err
    assert main([*args, "--tokenizer-mode", "hf"]) == 0 and capsys.readouterr().out.strip()
    assert main([*args, "--tokenizer-mode", "mistral"]) == 2
    assert "--tokenizer-mode mistral is not available" in capsys.readouterr().err
