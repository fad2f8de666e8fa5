"""Chat requests to prompt text, through the renderer training uses (data/chat.py), so a served model
sees its conversations rendered as it was trained on them.

What is serving's own: the export's template is loaded once at start-up (data.chat.load_chat_template,
from the export's tokenizer_config.json), OpenAI's request messages become the renderer's plain dicts, the prompt
always ends with the generation prompt, and a template that refuses a conversation (`raise_exception`)
or fails on it answers that request with a 400 naming `messages`, never stopping the server.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from runyard.data.chat import ChatTemplate, ChatTemplateError
from runyard.serve.errors import InvalidRequest
from runyard.serve.protocol import ChatMessage


def request_messages(messages: Iterable[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI's chat messages as the template's messages: role, content as text, and name when given."""
    return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]


def chat_prompt(template: ChatTemplate, messages: list[dict[str, Any]]) -> str:
    """The prompt text for `messages`, ending with the generation prompt; InvalidRequest (400, param
    `messages`) when the template refuses them or fails on them."""
    try:
        return template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), "messages") from None
