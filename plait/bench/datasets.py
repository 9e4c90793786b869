"""Benchmark prompts: random token-id length mixes (WORKLOADS.md W5), a file of prompts, ShareGPT
conversations (as `vllm bench serve --dataset-name sharegpt` samples them), and random images to send with
chat prompts (an image model's serving load)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# W5: 80% of prompts uniform in 128..512 tokens and 20% in 2,048..8,192; outputs uniform in 64..512.
W5_PROMPT_MIX = "0.8:128-512,0.2:2048-8192"
W5_OUTPUT_LENS = "64-512"
# Random prompt ids start here, as in shared/bench/workloads.py: most vocabularies keep their
# special tokens (BOS, EOS, padding) at the bottom.
MIN_RANDOM_TOKEN_ID = 10
# vLLM's ShareGPT filter: a conversation is sent only where its prompt and answer each have at least
# SHAREGPT_MIN_TOKENS tokens, its prompt at most SHAREGPT_MAX_PROMPT_TOKENS and both together at most
# SHAREGPT_MAX_TOTAL_TOKENS (the answer's length is the output length asked for).
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048
# Conversations whose texts are counted at a time while sampling ShareGPT requests.
SHAREGPT_COUNT_BATCH = 64


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: a prompt (text or token ids) and how many tokens to ask for."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # known for token ids; a text prompt is counted by the server
    images: tuple[str, ...] = ()  # data URLs sent as image_url parts before the text (chat only)


@dataclass(frozen=True)
class LengthRange:
    """Lengths uniform in [low, high], both included."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'128-512' or '128' (a single length)."""
        low, sep, high = text.strip().partition("-")
        try:
            lo, hi = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"length range {text!r} must be N or LOW-HIGH (whole numbers)") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"length range {text!r} must have 1 <= LOW <= HIGH")
        return cls(lo, hi)

    @classmethod
    def around(cls, length: int, ratio: float) -> LengthRange:
        """vLLM's random lengths (--random-range-ratio): int(length * (1 - ratio)) to
        int(length * (1 + ratio)), at least 1."""
        if not 0 <= ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        return cls(max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio))))

    def __str__(self) -> str:
        """'LOW-HIGH', as parse reads it."""
        return f"{self.low}-{self.high}"

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, size=n).tolist()


def parse_mix(text: str) -> list[tuple[float, LengthRange]]:
    """'0.8:128-512,0.2:2048-8192' -> [(0.8, 128..512), (0.2, 2048..8192)]; weights are normalised."""
    parts = []
    for item in text.split(","):
        weight, sep, lengths = item.partition(":")
        if not sep:
            raise ValueError(f"prompt mix item {item!r} must be WEIGHT:LOW-HIGH")
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"prompt mix item {item!r}: {weight!r} is not a number") from None
        if not w > 0:
            raise ValueError(f"prompt mix item {item!r}: the weight must be positive")
        parts.append((w, LengthRange.parse(lengths)))
    total = sum(w for w, _ in parts)
    return [(w / total, r) for w, r in parts]


def _component_counts(weights: Sequence[float], n: int) -> list[int]:
    """Split n into integer counts proportional to ``weights`` (largest remainder), so a small run
    has the mix's proportions as closely as n allows rather than as luck gives them."""
    exact = [w * n for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    return counts


def random_requests(n: int, vocab_size: int, seed: int, prompt_mix: str = W5_PROMPT_MIX,
                    output_lens: str = W5_OUTPUT_LENS, prefix_len: int = 0) -> list[SampleRequest]:
    """n requests of random token ids, prompt lengths drawn from ``prompt_mix``, in a seeded order; with
    ``prefix_len`` (vLLM's --random-prefix-len), every prompt starts with the same that many random ids, a
    prefix a server's prefix cache can share."""
    if prefix_len < 0:
        raise ValueError(f"the prefix length must be >= 0, got {prefix_len}")
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")
    mix = parse_mix(prompt_mix)
    rng = np.random.default_rng(seed)
    components = [i for i, c in enumerate(_component_counts([w for w, _ in mix], n)) for _ in range(c)]
    components = [components[k] for k in rng.permutation(n)]
    outputs = LengthRange.parse(output_lens).sample(rng, n)
    # Drawn from a generator of its own, so the prompts after it are those of the same seed without one.
    prefix = np.random.default_rng([seed, prefix_len]).integers(MIN_RANDOM_TOKEN_ID, vocab_size,
                                                                size=prefix_len).tolist()
    requests = []
    for component, out_len in zip(components, outputs):
        (length,) = mix[component][1].sample(rng, 1)
        ids = rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, size=length).tolist()
        prompt = prefix + ids
        requests.append(SampleRequest(prompt=prompt, output_len=out_len, prompt_len=len(prompt)))
    return requests


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: one per line, or JSON Lines with a "prompt" field (blank lines skipped)."""
    path = Path(path)
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
                prompt = record["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" field") from None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{number}: \"prompt\" must be a non-empty string")
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def file_requests(path: str | Path, n: int | None, output_lens: str, seed: int) -> list[SampleRequest]:
    """The file's prompts in order (cycled to reach ``n``; all of them once when ``n`` is None)."""
    prompts = read_prompts(path)
    n = len(prompts) if n is None else n
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    outputs = LengthRange.parse(output_lens).sample(np.random.default_rng(seed), n)
    return [SampleRequest(prompt=prompts[i % len(prompts)], output_len=outputs[i]) for i in range(n)]


def token_counter(tokenizer: Any) -> Callable[[list[str]], list[int]]:
    """Each text's token count as ``tokenizer`` (a transformers tokenizer) encodes it, special tokens added
    as a completion's prompt gets them: ShareGPT's lengths without a server's /tokenize."""
    return lambda texts: [len(ids) for ids in tokenizer(texts)["input_ids"]]


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first turn, the reply to it) of each conversation with two turns or more, from a ShareGPT JSON file: a
    list of {"conversations": [{"from": ..., "value": ...}, ...]} (ShareGPT_V3_unfiltered_cleaned_split.json's
    layout, which `vllm bench serve` reads)."""
    path = Path(path)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        values = [turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2]]
        if all(isinstance(v, str) and v for v in values):
            pairs.append((values[0], values[1]))
    if not pairs:
        raise ValueError(f"{path} holds no conversation of two turns or more")
    return pairs


def sharegpt_requests(pairs: Sequence[tuple[str, str]], n: int, seed: int,
                      count_tokens: Callable[[list[str]], list[int]], output_len: int | None = None,
                      max_total_tokens: int = SHAREGPT_MAX_TOTAL_TOKENS) -> list[SampleRequest]:
    """``n`` requests from ShareGPT pairs as vLLM samples them: in an order shuffled by ``seed``, each
    conversation's first turn as the prompt and its reply's token count as the output length (or
    ``output_len``), skipping those outside vLLM's length limits (``max_total_tokens``: a smaller context
    than vLLM's 2,048 where the model has one). ``count_tokens`` counts texts' tokens with
    the served model's tokenizer (the server's /tokenize); only as many are counted as the sample needs."""
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests: list[SampleRequest] = []
    for start in range(0, len(order), SHAREGPT_COUNT_BATCH):
        batch = [pairs[i] for i in order[start: start + SHAREGPT_COUNT_BATCH]]
        counts = count_tokens([text for pair in batch for text in pair])
        for k, (prompt, _) in enumerate(batch):
            prompt_len, reply_len = counts[2 * k], counts[2 * k + 1]
            out_len = reply_len if output_len is None else output_len
            if (min(prompt_len, out_len) < SHAREGPT_MIN_TOKENS or prompt_len > SHAREGPT_MAX_PROMPT_TOKENS
                    or prompt_len + out_len > max_total_tokens):
                continue
            requests.append(SampleRequest(prompt=prompt, output_len=out_len, prompt_len=prompt_len))
            if len(requests) == n:
                return requests
    raise ValueError(f"only {len(requests)} of the file's conversations are within the length limits "
                     f"(prompts of {SHAREGPT_MIN_TOKENS}-{SHAREGPT_MAX_PROMPT_TOKENS} tokens, at most "
                     f"{max_total_tokens} with the answer); {n} were asked for")


def with_random_images(requests: Sequence[SampleRequest], per_prompt: int, size: tuple[int, int], seed: int
                       ) -> list[SampleRequest]:
    """The requests, each with ``per_prompt`` images of random pixels (PNG data URLs, ``size`` = (width,
    height)), a different one for every request, so no image is served from a prefix cache."""
    import base64
    import dataclasses
    import io

    from PIL import Image

    if per_prompt < 0:
        raise ValueError(f"images per prompt must be >= 0, got {per_prompt}")
    rng = np.random.default_rng(seed)
    width, height = size
    out = []
    for request in requests:
        urls = []
        for _ in range(per_prompt):
            buf = io.BytesIO()
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(buf, format="PNG")
            urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        out.append(dataclasses.replace(request, images=tuple(urls)))
    return out


def parse_image_size(text: str) -> tuple[int, int]:
    """'336x336' -> (336, 336): width x height."""
    width, sep, height = text.lower().partition("x")
    try:
        size = (int(width), int(height))
    except ValueError:
        raise ValueError(f"image size {text!r} must be WIDTHxHEIGHT (whole numbers)") from None
    if not sep or min(size) < 1:
        raise ValueError(f"image size {text!r} must be WIDTHxHEIGHT, each >= 1")
    return size
