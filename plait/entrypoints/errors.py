"""OpenAI-style error answers: APIError, its JSON body, and the 400s that validation errors become."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from plait.entrypoints.protocol import TOOLS_PARAM, ErrorInfo, ErrorResponse, ProtocolError

# vLLM's words for a request beyond the context, which clients match case-sensitively.
CONTEXT_LENGTH_MESSAGE_START = "This model's maximum context length is"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class APIError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def __reduce__(self) -> tuple:
        # Exceptions pickle their message only; this one is rebuilt whole (it crosses from an engine process).
        return (type(self), (self.status, self.message, self.type, self.param, self.code))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    error = ErrorInfo(message=message, type=type_, param=param, code=code)
    return ErrorResponse(error=error).model_dump_json().encode()


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    info = ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=err.status, headers=headers)


# Fields whose name starts an engine / SamplingParams error message ("top_p must be in ...").
_KNOWN_PARAMS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
    "prompt_logprobs", "guided_choice", "bad_words", "prompt", "structured_outputs", "truncate_prompt_tokens",
    "priority", "cache_salt",
})


def bad_request(err: Exception, prompt_param: str = "prompt",
                 structured_param: str = "structured_outputs") -> APIError:
    """A 400 for a ValueError/TypeError from validation, naming the field the message starts with (the
    prompt's and the structured output's as the request named them: messages, response_format...)."""
    if isinstance(err, ProtocolError):
        return APIError(400, str(err), param=err.param, code=err.code)
    message = str(err) or type(err).__name__
    if message.startswith(CONTEXT_LENGTH_MESSAGE_START):  # the engine's: the prompt alone is too long
        return APIError(400, message, param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    first = message.split(" ", 1)[0]
    param = first if first in _KNOWN_PARAMS else None
    if param == "prompt":
        param = prompt_param
    elif param == "structured_outputs":
        param = structured_param
        if param == TOOLS_PARAM:  # the schema is the tools' parameters, forced by tool_choice
            detail = message.split(": ", 1)[-1]
            message = f"a tool's parameters are not a schema tool_choice can enforce: {detail}"
    return APIError(400, message, param=param)


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400, naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    # Of the alternatives of a union that all failed, the one that got furthest says the most.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return APIError(400, f"invalid JSON in the request body: {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if not loc:
        return APIError(400, f"invalid request body: {first.get('msg', '')}{more}")
    param = loc[0]
    where = f" at {'.'.join(loc)}" if len(loc) > 1 else ""
    return APIError(400, f"invalid value for '{param}'{where}: {first.get('msg', '')}{more}", param=param)



def error_type(status: int) -> str:
    return {408: "timeout_error", 500: "internal_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error")

