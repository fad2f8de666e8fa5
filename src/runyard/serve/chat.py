"""The chat template: how a list of messages becomes the prompt text the model was trained on.

It comes from the export's `tokenizer_config.json` (`chat_template`, as Hugging Face writes it: a
Jinja string, or a list of named templates of which `default` is used), rendered the way
`transformers`' `apply_chat_template` renders it: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, the messages, `add_generation_prompt`, the tokenizer's `bos_token` / `eos_token`,
and `raise_exception` for templates that check the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runyard.serve.errors import InvalidRequest, ServeError

TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(ServeError):
    """The export's tokenizer_config.json is unreadable or its template does not compile."""


def _token_text(value: Any) -> str | None:
    # HF writes special tokens as a string or as {"content": "...", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise InvalidRequest(f"the chat template refused the conversation: {message}", "messages")


@dataclass
class ChatTemplate:
    source: str
    bos_token: str | None = None
    eos_token: str | None = None

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{role, content}, ...]); InvalidRequest if the template
        refuses them."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except InvalidRequest:
            raise
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template failed on these messages: {exc}", "messages") from None


def load_chat_template(export_dir: Path) -> ChatTemplate | None:
    """The export's chat template, or None when it has none (no tokenizer_config.json, or no
    `chat_template` in it)."""
    path = Path(export_dir) / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object")
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]: HF's named templates
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{path}: chat_template must be a string or a list of named templates")
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
