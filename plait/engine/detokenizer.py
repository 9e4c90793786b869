"""Incremental detokenisation of one request's output, with UTF-8-safe streaming and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# The last few prompt tokens are decoded along with the output so that tokenizers whose decode depends
# on the preceding token (SentencePiece strips the leading space of the first token) render the
# continuation as it reads after the prompt, as vLLM does. A suffix is only used if it decodes without
# U+FFFD; with none, there is no context and the text is exactly tokenizer.decode(output_ids).
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24

# Tokens are held while the text ends inside a character. Byte-level BPE tokens may straddle character
# boundaries, so a few in a row can stay incomplete, but this many means the model emits invalid bytes;
# they are then emitted as U+FFFD rather than stalling the stream and re-decoding an ever longer window.
_MAX_HELD_TOKENS = 64


def rust_decoder(tokenizer: Any) -> Any | None:
    """The ``tokenizers`` object behind a transformers fast tokenizer whose decode is that object's decode
    and nothing more (no clean-up of spaces, no override), or None. Decoding through it skips transformers'
    conversion of the ids (a walk over every id), about half of a short decode's time; a request's text
    is decoded once or twice for every token it streams."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is None or not hasattr(backend, "decode") or cleans_up:
        return None
    decode = getattr(type(tokenizer), "_decode", None)
    owner = getattr(decode, "__qualname__", "").split(".")[0]
    # transformers 5's and 4's fast tokenizers, whose _decode is the backend's decode (plus clean-up).
    return backend if owner in ("TokenizersBackend", "PreTrainedTokenizerFast") else None


class Detokenizer:
    """Turns a request's sampled token ids into text deltas that are safe to stream.

    Feed the ids that the engine appends to the output (vLLM does not feed the EOS / stop token that
    ends a request unless include_stop_str_in_output is set; with skip_special_tokens it decodes to ""
    anyway). Stop strings are checked once more than params.min_tokens tokens have been fed, as in vLLM.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._backend = rust_decoder(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens

        # _ids[:_read_offset] is context whose text is already accounted for (the prompt tail, then the
        # last decoded chunk); _ids[_read_offset:] is held back because its text ends inside a UTF-8
        # character or is empty (e.g. skipped special tokens).
        self._ids: list[int] = self._prompt_context(list(prompt_token_ids))
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # the text of _ids[:_read_offset], once decoded
        self._num_output_tokens = 0

        self._decoded = ""  # all output text decoded so far; may run ahead of what was emitted
        self._text = ""  # emitted text == concatenation of returned deltas
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """Output text emitted so far; after flush() or a stop match, the final output text."""
        return self._text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        return self._flushed or self._stop_reason is not None

    def feed(self, new_token_ids: Sequence[int]) -> str:
        """Adds newly sampled ids; returns the text delta that can be emitted now (possibly "")."""
        if self._flushed:
            raise RuntimeError("Detokenizer.feed() called after flush()")
        if self._stop_reason is not None:
            # Tokens sampled after the stop string (e.g. in the same step) are not part of the output.
            return ""
        # One token at a time, so the read offset stops at every character boundary that a per-token
        # feed would see; a multi-token chunk may end mid-character even when its tokens do not.
        new_text = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            new_text.append(self._decode_pending(force=False))
        self._num_output_tokens += len(new_token_ids)
        return self._advance("".join(new_text), final=False)

    def flush(self) -> str:
        """Finishes the request: returns everything still held back, unless a stop string matched."""
        if self.finished:
            self._flushed = True
            return ""
        self._flushed = True
        return self._advance(self._decode_pending(force=True), final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        if len(prompt_ids) <= _MIN_PROMPT_CONTEXT:
            candidates = [prompt_ids]
        else:
            # Longer suffixes are tried when a short one starts inside a multi-byte character.
            stop = min(len(prompt_ids), _MAX_PROMPT_CONTEXT)
            candidates = [prompt_ids[-n:] for n in range(_MIN_PROMPT_CONTEXT, stop + 1)]
        for ids in candidates:
            if REPLACEMENT_CHAR not in self._decode(ids):
                return ids
        return []

    def _decode_pending(self, force: bool) -> str:
        """Decodes the held ids in the context of the preceding chunk; "" while that is unsafe."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:  # the context changes only when a chunk is emitted
            self._prefix_text = self._decode(self._ids[: self._read_offset])
        prefix_text = self._prefix_text
        full_text = self._decode(self._ids)
        held = len(self._ids) - self._read_offset
        incomplete = len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)
        if incomplete and not force and held <= _MAX_HELD_TOKENS:
            return ""
        # The decoded chunk becomes the next context; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return full_text[len(prefix_text) :]

    def _advance(self, new_text: str, final: bool) -> str:
        checked_len = len(self._decoded)
        self._decoded += new_text
        if self._stop and self._num_output_tokens > self._min_tokens:
            match = self._find_stop(checked_len)
            if match is not None:
                end, self._stop_reason = match
                self._decoded = self._decoded[:end]
                return self._emit(end)
        if final:
            return self._emit(len(self._decoded))
        return self._emit(len(self._decoded) - self._stop_prefix_len())

    def _emit(self, end: int) -> str:
        delta = self._decoded[len(self._text) : end]
        self._text += delta
        return delta

    def _find_stop(self, checked_len: int) -> tuple[int, str] | None:
        """Earliest stop string ending in the text added since checked_len, as (truncation index, stop)."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # An occurrence must end in the new text, so it starts at most len(stop) - 1 chars earlier.
            start = self._decoded.find(stop, max(0, checked_len - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        if best is None:
            return None
        start, stop = best
        return (start + len(stop) if self._include_stop else start), stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        hold = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._decoded)), hold, -1):
                if self._decoded.endswith(stop[:k]):
                    hold = k
                    break
        return hold
