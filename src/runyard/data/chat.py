"""Chat templates: the one renderer that training, evaluation and serving use, so a conversation becomes
the same text when a model is trained and when it is served (and when transformers' `apply_chat_template`
renders the export).

Rendering is transformers' (utils/chat_template_utils.py): an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` block, the `raise_exception` and
`strftime_now` helpers, its `tojson` filter (json.dumps, ensure_ascii=False), its guarded `dict` and
`namespace`; the template sees `messages` (keys holding None dropped), `tools`, `documents`,
`add_generation_prompt` and every special token of the tokenizer (`tokenizer_special_tokens`).

Where the supervised spans come from: a template with `{% generation %}` blocks marks them itself (what
the blocks render, as transformers' assistant mask). Otherwise, for each assistant turn i, the
conversation up to i rendered with `add_generation_prompt=True` must be a prefix of the conversation up
to and including i; what the latter adds is the assistant's turn (its content and the template's
end-of-turn text, which the model must learn to produce so that it stops). This is exactly the split an
inference engine sees (the prompt rendered with a generation prompt, then generated tokens). A template
that renders prefixes differently is refused, naming the turn.

Which template: the spec's (`stages[i].data.chat_template`: Jinja text, or `default`), else the one of the
tokenizer's model directory, found where transformers finds it (`directory_template`: chat_template.jinja,
tokenizer_config.json's `chat_template`, chat_template.json), else, for prompt/response data only,
DEFAULT_TEMPLATE. Serving takes the export's (`load_chat_template`), where the export wrote the trained
template.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runyard.data.tokenizer import SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE, read_tokenizer_config
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

# Where transformers keeps a model directory's chat templates (utils/hub.py): the file its
# `save_pretrained` writes today, the folder of further named ones, and its processors' legacy file.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
# The files of a tokenizer's directory that decide its template and special tokens (for fingerprints).
TEMPLATE_INPUTS = (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE, LEGACY_CHAT_TEMPLATE_FILE)

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens every tokenizer may have.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' spelling of a template that marks its generated text (it warns when the mask is asked
# for and this is absent).
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# Names a message's reasoning is passed under; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What a template can raise on the values it is given (`'a' + 1`, a missing index), besides Jinja's own.
_RENDER_FAILURES = (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


class ChatTemplateError(DataError):
    """A chat template that cannot be compiled or rendered, or that renders prefixes inconsistently."""


class ChatTemplateRefused(ChatTemplateError):
    """The template called `raise_exception` on a conversation: `origin` names the template (its file),
    `reason` is the template's message. Serving answers it with a 400."""

    def __init__(self, origin: str, reason: str):
        super().__init__(f"the chat template ({origin}) refused the conversation: {reason}")
        self.origin, self.reason = origin, reason


class _Refusal(jinja2.exceptions.TemplateError):
    """What `raise_exception` raises: a TemplateError, as in transformers, told apart to name it."""


def _raise_exception(message: str):
    raise _Refusal(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # A `dict` global without attribute access to break out through (transformers' TemplateDict).
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces that refuse underscore-prefixed attributes (transformers' TemplateNamespace).
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged and, while a tracker is active,
    records the character span it rendered into (transformers' AssistantTracker)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        environment.extend(activate_tracker=self.activate_tracker)
        self._tracking: ContextVar = ContextVar("generation_tracker", default=None)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: jinja2.nodes.EvalContext, caller: jinja2.runtime.Macro) -> str:
        rv = caller()
        if (tracking := self._tracking.get()) is not None:
            rendered_blocks, spans = tracking
            start = len("".join(rendered_blocks))
            spans.append((start, start + len(rv)))
        return rv

    @contextmanager
    def activate_tracker(self, rendered_blocks: list[str], spans: list[tuple[int, int]]):
        if self._tracking.get() is not None:
            raise ValueError("the generation tracker is already active")
        token = self._tracking.set((rendered_blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile `source` the way transformers does (its `_compile_jinja_template`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc.message} (line {exc.lineno})") from None


def _template_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to a template: keys holding None dropped (many templates
    render a literal "None" for them), older names of the reasoning aliased to `reasoning_content`."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template with the special tokens it may name, and where it came from."""

    source: str
    origin: str  # "spec", "default" or the file it was read from
    special_tokens: tuple[tuple[str, str], ...] = ()

    @property
    def eos_token(self) -> str | None:
        return dict(self.special_tokens).get("eos_token")

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's text with `{% generation %}` blocks."""
        return _GENERATION_TAG.search(self.source) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, *, tools: list[dict] | None = None,
               documents: list[dict] | None = None, **variables: Any) -> str:
        """The conversation as text, as `apply_chat_template(..., tokenize=False)` renders it. `variables`
        are further template variables (they win over special tokens of the same name).
        ChatTemplateRefused when the template calls raise_exception, ChatTemplateError when it fails."""
        return self.render_marked(messages, add_generation_prompt, tools=tools, documents=documents, **variables)[0]

    def render_marked(self, messages: list[dict], add_generation_prompt: bool = False, *,
                      tools: list[dict] | None = None, documents: list[dict] | None = None,
                      **variables: Any) -> tuple[str, list[tuple[int, int]]]:
        """(text, the character spans its `{% generation %}` blocks rendered), as transformers renders
        for `return_assistant_tokens_mask`; no spans when the template has no such blocks."""
        template = compile_template(self.source)
        context = {**dict(self.special_tokens), **variables}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with template.environment.activate_tracker(blocks, spans):
                for block in template.generate(messages=_template_messages(messages), tools=tools,
                                               documents=documents, add_generation_prompt=add_generation_prompt,
                                               **context):
                    blocks.append(block)
        except _Refusal as exc:
            raise ChatTemplateRefused(self.origin, exc.message or "") from None
        except _RENDER_FAILURES as exc:
            raise ChatTemplateError(f"the chat template ({self.origin}) failed to render: {exc}") from None
        return "".join(blocks), spans

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, supervised) pieces in order; supervised pieces are the
        assistant turns (see the module doc). Concatenated, the texts equal `render(messages)`."""
        if self.marks_generation:
            return self._generation_segments(messages)
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

    def _generation_segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        full, spans = self.render_marked(messages)
        out: list[tuple[str, bool]] = []
        done = 0
        for start, end in sorted(spans):
            if start < done:
                raise ChatTemplateError(f"the chat template ({self.origin}) has nested or overlapping "
                                        "{% generation %} blocks")
            if start > done:
                out.append((full[done:start], False))
            if end > start:
                out.append((full[start:end], True))
            done = end
        if done < len(full):
            out.append((full[done:], False))
        return out


def _token_text(value: Any) -> str | None:
    # A special token as tokenizer_config.json writes it: a string, or an AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens a tokenizer_config.json gives a chat template, as transformers' tokenizer
    exposes them (`special_tokens_map`): the named ones (bos_token, eos_token, unk_token, sep_token,
    pad_token, cls_token, mask_token), any other `*_token` key holding a token, and the named
    `extra_special_tokens`. A token the config leaves unset stays undefined in the template."""
    out = {}
    for key, value in config.items():
        named = key in SPECIAL_TOKEN_NAMES or (key.endswith("_token") and isinstance(value, str | dict))
        if named and (text := _token_text(value)) is not None:
            out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({key: text for key, value in extra.items() if (text := _token_text(value)) is not None})
    return out


def directory_template(directory: Path) -> tuple[str | None, str]:
    """(the chat template of a model directory or None, the file it came from), with transformers'
    precedence (its tokenizer's `_from_pretrained` and its processor's `from_pretrained`):

    1. `chat_template.jinja`, with `additional_chat_templates/*.jinja` beside it (what transformers 5's
       `save_pretrained` writes): when any of these files exists it replaces tokenizer_config.json's
       template, as transformers' tokenizer does;
    2. otherwise tokenizer_config.json's `chat_template` (what older transformers wrote: a string, or a
       list of named templates);
    3. `chat_template.json` (the legacy file of transformers' processors, which AutoTokenizer does not
       read): taken when neither of the above gives a template, refused when it holds another template
       than they do (transformers' tokenizer and processor would then render differently).

    Of several named templates, the one named `default` is the template (transformers' `get_chat_template`);
    ChatTemplateError naming the file when there is none, or a file is unreadable."""
    directory = Path(directory)
    jinja, extra_dir = directory / CHAT_TEMPLATE_FILE, directory / CHAT_TEMPLATE_DIR
    extras = sorted(extra_dir.glob("*.jinja")) if extra_dir.is_dir() else []
    source, origin = None, ""
    if jinja.is_file() or extras:
        named = {path.name.removesuffix(".jinja"): path for path in extras}
        if jinja.is_file():
            named["default"] = jinja
        if "default" not in named:
            raise ChatTemplateError(f"{extra_dir} holds named templates {sorted(named)} and {directory} no "
                                    f"{CHAT_TEMPLATE_FILE}: transformers has no default template to render with")
        source, origin = _read_text(named["default"]), str(named["default"])
    elif (directory / TOKENIZER_CONFIG_FILE).is_file():
        config_path = directory / TOKENIZER_CONFIG_FILE
        source = default_template(read_tokenizer_config(directory).get("chat_template"), config_path, "chat_template")
        origin = str(config_path) if source is not None else ""
    legacy = directory / LEGACY_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        try:
            data = json.loads(_read_text(legacy))
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"{legacy} is not readable JSON: {exc}") from None
        theirs = default_template(data.get("chat_template") if isinstance(data, dict) else None, legacy, "chat_template")
        if theirs is None:
            raise ChatTemplateError(f"{legacy}: field 'chat_template' is missing; it must hold the template")
        if source is None:
            return theirs, str(legacy)
        if theirs != source:
            raise ChatTemplateError(f"{legacy} holds another chat template than {origin}: transformers' "
                                    "processor would render with the first, its tokenizer with the second; "
                                    "keep one of the two")
    return source, origin


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path} is not readable UTF-8 text: {exc}") from None


def default_template(template: Any, path: Path | str, field: str) -> str | None:
    """The template a `chat_template` field holds (of the file `path`, named in errors): a string, or of a
    list of {name, template} the one named `default`; None when the field is unset."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(f"{path}: field {field!r} names templates {sorted(map(str, named))} but none "
                                    "'default', which transformers renders with")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{path}: field {field!r} must be a string or a list of named templates")
    return template


def directory_special_tokens(directory: Path) -> dict[str, str]:
    """The special tokens a model directory's tokenizer gives its chat template (tokenizer_config.json as
    transformers reads it, special_tokens_map.json included); {} without a tokenizer_config.json."""
    if not (Path(directory) / TOKENIZER_CONFIG_FILE).is_file():
        return {}
    return tokenizer_special_tokens(read_tokenizer_config(directory))


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template of a model directory (an export, a Hugging Face model), found as
    `directory_template` says, with its tokenizer's special tokens; None when it has none."""
    source, origin = directory_template(directory)
    if source is None:
        return None
    compile_template(source)
    return ChatTemplate(source, origin, tuple(sorted(directory_special_tokens(directory).items())))


def missing_template(directory: Path) -> str:
    """Why a stage on `messages` has no template, and what to do, for the tokenizer in `directory`."""
    return (f"{directory} has no {CHAT_TEMPLATE_FILE}, no `chat_template` in {TOKENIZER_CONFIG_FILE} and no "
            f"{LEGACY_CHAT_TEMPLATE_FILE}, and the spec sets none. Set the stage's data.chat_template to a Jinja "
            "template, or to `default` for runyard's instruction format")


def choose_template(spec_template: str | None, tokenizer_path: Path, eos_token: str, has_messages: bool,
                    where: str) -> ChatTemplate:
    """The template a stage renders with (see the module doc). `eos_token` is the tokenizer's end of
    text, for a tokenizer without a config (runyard's own BPE, whose export writes that same token).
    `where` names the spec field and data file for the error raised when messages are given and no
    template is found."""
    directory = Path(tokenizer_path).parent
    config_template, origin = directory_template(directory)
    specials = directory_special_tokens(directory)
    specials.setdefault("eos_token", eos_token)
    tokens = tuple(sorted(specials.items()))
    if spec_template == "default":
        return ChatTemplate(DEFAULT_TEMPLATE, "default", tokens)
    if spec_template is not None:
        compile_template(spec_template)
        return ChatTemplate(spec_template, "spec", tokens)
    if config_template is not None:
        compile_template(config_template)
        return ChatTemplate(config_template, origin, tokens)
    if has_messages:
        raise ChatTemplateError(f"{where}: the data gives `messages` but no chat template was found: "
                                f"{missing_template(directory)}")
    return ChatTemplate(DEFAULT_TEMPLATE, "default", tokens)
