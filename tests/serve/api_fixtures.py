"""A live server for API tests: a real engine, the real app, uvicorn on loopback, and clients."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from runyard.data.chat import load_chat_template
from runyard.serve.batch_engine import BatchEngine
from runyard.serve.openai_api import create_app
from runyard.system.http_thread import AppThread

# ChatML-like, checking the conversation the way real templates do.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation cannot start with an assistant message') }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_chat_template(directory: Path, template: str = CHAT_TEMPLATE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|endoftext|>", "bos_token": None})
    )
    return directory


class Live:
    def __init__(self, engine: BatchEngine, url: str, app):
        self.engine, self.url, self.app = engine, url, app
        self.http = httpx.Client(base_url=url, timeout=60)
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """The /metrics text as {series: value} (labels included in the series name)."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@contextmanager
def live_server(model, tokenizer, *, start: bool = True, template_dir: Path | None = None, traffic=None, **engine_kw):
    engine = BatchEngine(model, tokenizer, **engine_kw)
    if start:
        engine.start()
    template = load_chat_template(template_dir) if template_dir is not None else None
    app = create_app(engine, "tiny", chat_template=template, traffic=traffic, max_body_bytes=64 * 1024)
    try:
        with AppThread(app, lifespan="off") as srv:
            live = Live(engine, srv.url, app)
            try:
                yield live
            finally:
                live.http.close()
                live.openai.close()
    finally:
        engine.close()
