"""Request bodies of the OpenAI API as runyard serves it: `/v1/completions` and `/v1/chat/completions`.

Types are strict (a string where a number belongs is refused, not converted), numbers must be
finite, and a field the server does not implement is refused by name rather than ignored, so a client
never gets a silent approximation of what it asked for. Two fields beyond OpenAI's are vLLM's:
`top_k` and `truncate_prompt_tokens` (keep only the prompt's last N tokens; without it a prompt longer
than the context is refused).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runyard.serve.errors import InvalidRequest
from runyard.serve.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request
MAX_STOPS = 4  # OpenAI's limit


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM's: -1 or absent means no top-k")
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop is up to {MAX_STOPS} non-empty strings")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise InvalidRequest(f"{name} is not supported by this server; send 0 or leave it out", name)
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
        return self

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def top_k_or_none(self) -> int | None:
        return None if self.top_k in (None, -1) else self.top_k


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise InvalidRequest("echo is not supported by this server", "echo")
        if self.suffix is not None:
            raise InvalidRequest("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported by this server (leave it out or equal to n)", "best_of")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self) -> ChatCompletionRequest:
        for name in ("tools", "tool_choice"):
            if getattr(self, name) not in (None, [], "none"):
                raise InvalidRequest(f"{name} is not supported by this server", name)
        if self.response_format not in (None, {"type": "text"}):
            raise InvalidRequest("response_format other than text is not supported by this server", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class _NonFinite:
    """Stands in for a NaN / Infinity literal (which Python's json accepts) so that validation refuses
    it at its field, with the field's name."""

    def __init__(self, literal: str):
        self.literal = literal

    def __repr__(self) -> str:
        return self.literal


def _finite_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


class UnsupportedMediaType(InvalidRequest):
    """A body sent with a content type other than JSON (415, as the market and control plane answer)."""

    status = 415


def check_content_type(header: str | None) -> None:
    """Refuse a body whose declared content type is not JSON (`application/json`, with or without
    parameters, or a `+json` type); a request that declares none is read as JSON."""
    if header is None:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        shown = ascii(header[:100])
        raise UnsupportedMediaType(f"request bodies must be JSON, sent with Content-Type: application/json; got {shown}")


def parse_body(raw: bytes) -> Any:
    """The request body as JSON (its content type checked by `check_content_type`); a malformed body,
    or one holding a string that is not valid Unicode, is an InvalidRequest saying where."""
    try:
        body = json.loads(raw, parse_constant=_NonFinite, parse_float=_finite_float)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    check_unicode(body)
    return body


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def invalid_unicode_field(value: Any, path: str = "") -> str | None:
    """The first place in parsed JSON holding a string that is not valid Unicode (JSON's `\\ud800`
    escape decodes to a lone UTF-16 surrogate, which no tokenizer or encoder takes), written as OpenAI
    writes a param (`messages[0].content`); None when every string is valid. A bad key is shown escaped."""
    if isinstance(value, str):
        return None if _valid_unicode(value) else (path or "(body)")
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = invalid_unicode_field(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key if _valid_unicode(key) else ascii(key)
            here = f"{path}.{name}" if path else name
            if name is not key:
                return here
            found = invalid_unicode_field(item, here)
            if found is not None:
                return found
    return None


def check_unicode(body: Any) -> None:
    """Refuse (400 naming the field) a parsed body holding a string that is not valid Unicode."""
    param = invalid_unicode_field(body)
    if param is not None:
        raise InvalidRequest(
            f"{param}: the string is not valid Unicode (it holds a lone UTF-16 surrogate such as \\ud800); "
            "send UTF-8 text, or a surrogate pair for characters outside the basic plane",
            None if param == "(body)" else param,
        )


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "is-instance"}


def _param(loc: tuple) -> str | None:
    """pydantic's error location as OpenAI writes a param: `messages[0].role`. Union members that
    pydantic names in the location (`str`, `list[int]`...) are left out: field names never hold brackets."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _TYPE_TAGS and not any(c in str(part) for c in "[]()"):
            out += ("." if out else "") + str(part)
    return out or None


def validate(model: type[_Strict], body: Any) -> Any:
    """Validate a parsed body against `model`, turning the first problem into an InvalidRequest that
    names the field (OpenAI's `param`)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
        if isinstance(first.get("input"), _NonFinite):
            message = f"{param}: {first['input']!r} is not a finite number"
        elif first["type"] == "extra_forbidden":
            message = f"{param}: unrecognised request argument (not supported by this server)"
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        raise InvalidRequest(message, param) from None
