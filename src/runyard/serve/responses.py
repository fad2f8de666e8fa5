"""OpenAI's response shapes: completion and chat objects, their streaming chunks, logprobs, errors."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from tokenizers import Tokenizer

from runyard.serve.sampling import TokenLogprobs


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
    code: str | None = None, headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ChunkWriter:
    """A request's streaming chunks as JSON text, with the part that never changes (id, object,
    created, model) serialised once: a chunk per token per stream is the server's hottest path."""

    def __init__(self, chunk_id: str, object_name: str, created: int, model: str):
        fixed = json.dumps({"id": chunk_id, "object": object_name, "created": created, "model": model})
        self.head = fixed[:-1] + ',"choices":[{"index":'  # the object left open for the choice

    def __call__(self, index: int, fields: dict[str, Any]) -> str:
        """`{..., "choices": [{"index": index, **fields}]}` as text."""
        return f"{self.head}{index},{json.dumps(fields, ensure_ascii=False)[1:]}]}}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class TokenText:
    """Token ids as the text a client sees in logprobs (cached: the same ids come up again and again)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built token by token."""

    def __init__(self, token_text: TokenText):
        self.token_text = token_text
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, lp: TokenLogprobs, offset: int) -> dict[str, Any]:
        """Record one token; returns the object for this token alone (a streaming chunk's)."""
        token = self.token_text(lp.token_id)
        top = {self.token_text(t): v for t, v in lp.top} if lp.top else None
        self.tokens.append(token)
        self.token_logprobs.append(lp.logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)
        return {"tokens": [token], "token_logprobs": [lp.logprob], "top_logprobs": [top], "text_offset": [offset]}

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class ChatLogprobs:
    """The chat `logprobs` object ({"content": [...]}), built token by token."""

    def __init__(self, token_text: TokenText):
        self.token_text = token_text
        self.content: list[dict[str, Any]] = []

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def add(self, lp: TokenLogprobs) -> dict[str, Any]:
        entry = {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
        self.content.append(entry)
        return {"content": [entry]}

    def body(self) -> dict[str, Any]:
        return {"content": self.content}
