"""OpenAI's API over real HTTP on loopback, called with the official `openai` client."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import openai
import pytest

from runyard.serve.batch_engine import BatchEngine
from runyard.serve.sampling import SamplingParams

from .api_fixtures import live_server, write_chat_template


@pytest.fixture()
def live(tokenizer, make_model, tmp_path):
    with live_server(make_model(tokenizer), tokenizer, template_dir=write_chat_template(tmp_path / "export")) as srv:
        yield srv


def reference_text(model, tokenizer, prompt: str, n: int) -> str:
    engine = BatchEngine(model, tokenizer)
    return engine.generate([tokenizer.encode(prompt).ids], [SamplingParams(max_tokens=n, temperature=0)])[0].text


def test_completion_matches_the_engine(live, tokenizer):
    r = live.openai.completions.create(model="tiny", prompt="def add(", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == reference_text(live.engine.model, tokenizer, "def add(", 12)
    n_prompt = len(tokenizer.encode("def add(").ids)
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 12 else "stop")


def test_streaming_chunks_add_up_to_the_seeded_completion(live):
    kwargs = dict(model="tiny", prompt="import ", max_tokens=20, temperature=0.9, seed=5)
    whole = live.openai.completions.create(**kwargs)
    chunks = list(live.openai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_and_prompt_lists(live, tokenizer):
    one = live.openai.completions.create(model="tiny", prompt="x = ", max_tokens=15, temperature=1.0, seed=9)
    three = live.openai.completions.create(model="tiny", prompt="x = ", max_tokens=15, temperature=1.0, seed=9, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    batch = live.openai.completions.create(model="tiny", prompt=["def ", "import os"], max_tokens=4, temperature=0, n=2)
    assert len(batch.choices) == 4
    assert batch.usage.prompt_tokens == len(tokenizer.encode("def ").ids) + len(tokenizer.encode("import os").ids)
    ids = live.openai.completions.create(model="tiny", prompt=tokenizer.encode("def ").ids, max_tokens=4, temperature=0)
    assert ids.choices[0].text == batch.choices[0].text


def test_logprobs(live):
    r = live.openai.completions.create(model="tiny", prompt="class ", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(top.values()) - chosen) < 1e-5 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


def test_stop_strings(live, tokenizer):
    full = reference_text(live.engine.model, tokenizer, "class ", 20)
    stop = full[3:5]
    r = live.openai.completions.create(model="tiny", prompt="class ", max_tokens=20, temperature=0, stop=[stop, "\x00"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_chat_completion_uses_the_exports_template(live, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    rendered = "<|system|>\nbe brief<|endoftext|>\n<|user|>\ndef add(a, b):<|endoftext|>\n<|assistant|>\n"
    r = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference_text(live.engine.model, tokenizer, rendered, 10)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered).ids)
    streamed = live.openai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, logprobs=True, top_logprobs=2
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)


def test_chat_template_refusals_and_a_model_without_one(live, tokenizer, make_model):
    with pytest.raises(openai.BadRequestError) as info:
        live.openai.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "hi"}])
    assert info.value.body["param"] == "messages" and "cannot start with an assistant" in info.value.body["message"]
    with live_server(make_model(tokenizer), tokenizer) as plain, pytest.raises(openai.BadRequestError) as info:
        plain.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 400 and info.value.body["code"] == "no_chat_template"
    assert "has no chat template" in info.value.body["message"]


def test_models_and_health(live):
    models = live.openai.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = live.http.get("/healthz").json()
    assert health["status"] == "ok" and health["kv_slots"] == live.engine.n_slots


def test_unknown_model_is_a_404(live):
    with pytest.raises(openai.NotFoundError) as info:
        live.openai.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model" and "'tiny'" in info.value.body["message"]


def test_long_prompts_are_refused_or_truncated_on_request(live, tokenizer):
    long_prompt = "import os\n" * 40  # well past the 64-token context
    r = live.http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded" and "truncate_prompt_tokens" in r.json()["error"]["message"]
    ok = live.http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4, "temperature": 0,
                                                 "truncate_prompt_tokens": 20})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == 20
    tail = tokenizer.encode(long_prompt).ids[-20:]
    assert ok.json()["choices"][0]["text"] == live.openai.completions.create(
        model="tiny", prompt=tail, max_tokens=4, temperature=0).choices[0].text
    r = live.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "truncate_prompt_tokens": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_readme_curl_example_works_as_printed(live):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    command = re.search(r"^curl .*/v1/completions.*$", readme, re.M).group(0)
    port = live.url.rsplit(":", 1)[1]
    out = subprocess.run(command.replace("localhost:8000", f"127.0.0.1:{port}"), shell=True,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"object":"text_completion"' in out.stdout.replace(" ", ""), out.stdout
