"""Chat templates: a conversation rendered to text with a Jinja template, as transformers renders it
(`apply_chat_template`: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, the
`raise_exception` and `strftime_now` helpers and the `tojson` filter), and the rendered text cut into
the segments the loss covers (the assistant's turns) and those it does not.

Where the supervised spans come from: for each assistant turn i, the conversation up to i rendered with
`add_generation_prompt=True` must be a prefix of the conversation up to and including i; what the latter
adds is the assistant's turn (its content and the template's end-of-turn text, which the model must learn
to produce so that it stops). This is exactly the split an inference engine sees (the prompt rendered
with a generation prompt, then generated tokens), so it needs no `{% generation %}` markers in the
template. A template that renders prefixes differently is refused, naming the turn.

Which template: the spec's (`stages[i].data.chat_template`: Jinja text, or `default`), else the one in the
tokenizer's `tokenizer_config.json`, else, for prompt/response data only, DEFAULT_TEMPLATE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runyard.errors import DataError

# The stated default: a plain instruction format whose end of turn is the end-of-text token, which every
# runyard tokenizer has (a BPE trained by runyard knows no ChatML markers).
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}### Response:\n{{ message['content'] }}{{ eos_token }}\n\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}### Response:\n{% endif %}"
)

ROLES = ("system", "user", "assistant")


class ChatTemplateError(DataError):
    """A chat template that cannot be compiled or rendered, or that renders prefixes inconsistently."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile `source` the way transformers does (its `_compile_jinja_template`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc.message} (line {exc.lineno})") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template with the special tokens it may name, and where it came from."""

    source: str
    origin: str  # "spec", "default" or the tokenizer_config.json path
    special_tokens: tuple[tuple[str, str], ...] = ()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return compile_template(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **dict(self.special_tokens)
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template ({self.origin}) failed to render: {exc}") from None

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, supervised) pieces in order; supervised pieces are the
        assistant turns. Concatenated, the texts equal `render(messages)`."""
        full = self.render(messages)
        out: list[tuple[str, bool]] = []
        done = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not upto.startswith(prompt) or not full.startswith(upto) or len(prompt) < done:
                raise ChatTemplateError(
                    f"the chat template ({self.origin}) renders the conversation before assistant turn {i} "
                    "(with add_generation_prompt) differently from the start of the whole conversation, so "
                    "the assistant's tokens cannot be told apart; use a template whose prefixes agree"
                )
            if len(prompt) > done:
                out.append((full[done : len(prompt)], False))
            out.append((full[len(prompt) : len(upto)], True))
            done = len(upto)
        if done < len(full):
            out.append((full[done:], False))
        return out


def tokenizer_config_template(tokenizer_path: Path) -> tuple[str | None, Path, dict[str, str]]:
    """(chat template or None, the tokenizer_config.json looked at, its special tokens as text) for the
    tokenizer at `tokenizer_path` (a tokenizer.json; its config sits beside it in a model directory)."""
    config_path = Path(tokenizer_path).with_name("tokenizer_config.json")
    if not config_path.is_file():
        return None, config_path, {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{config_path}: not readable JSON ({exc})") from None
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):  # AddedToken serialised
            value = value.get("content")
        if isinstance(value, str):
            specials[key] = value
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), config_path, specials


def choose_template(spec_template: str | None, tokenizer_path: Path, eos_token: str, has_messages: bool,
                    where: str) -> ChatTemplate:
    """The template a stage renders with (see the module doc). `where` names the spec field and data file
    for the error raised when messages are given and no template is found."""
    config_template, config_path, specials = tokenizer_config_template(tokenizer_path)
    specials.setdefault("eos_token", eos_token)
    specials.setdefault("bos_token", "")
    tokens = tuple(sorted(specials.items()))
    if spec_template == "default":
        return ChatTemplate(DEFAULT_TEMPLATE, "default", tokens)
    if spec_template is not None:
        compile_template(spec_template)
        return ChatTemplate(spec_template, "spec", tokens)
    if config_template is not None:
        compile_template(config_template)
        return ChatTemplate(config_template, str(config_path), tokens)
    if has_messages:
        raise ChatTemplateError(
            f"{where}: the data gives `messages` but no chat template was found: {config_path} has no "
            "`chat_template` and the spec sets none. Set the stage's data.chat_template to a Jinja template, "
            "or to `default` for runyard's instruction format"
        )
    return ChatTemplate(DEFAULT_TEMPLATE, "default", tokens)
