"""The one chat-template renderer: it renders as transformers' `apply_chat_template` does (Llama-3-,
ChatML/Qwen-, Mistral-like templates; tojson of tools, raise_exception, strftime_now, the generation
block, every special token), training and serving render a conversation identically, and a template's
refusal is a runyard error naming the template file and its message (a 400 when serving)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from runyard.data.chat import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateRefused,
    choose_template,
    load_chat_template,
    tokenizer_special_tokens,
)
from runyard.data.tokenizer import EOS_TOKEN, tokenizer_config_for
from runyard.errors import DataError
from runyard.serve.chat import chat_prompt, request_messages
from runyard.serve.errors import InvalidRequest
from runyard.serve.protocol import ChatMessage
from tests.data.test_instruct import CONVERSATION
from tests.train.finetune_fixtures import prepare, write_tokenizer

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
MARKERS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
           "<|im_end|>", "[INST]", "[/INST]"]

LLAMA3 = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5's shape: block tags on their own lines (trim_blocks / lstrip_blocks matter), tools as JSON.
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\nindented:\\n" + tools[0] | tojson(indent=2) + "<|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral's shape: roles must alternate, or the template refuses.
MISTRAL = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {{ message['content'] + eos_token }}
    {% else %}
        {{ raise_exception('Only user and assistant roles are supported!') }}
    {% endif %}
{% endfor %}
"""

# Llama 3.2's shape: today's date through strftime_now, a namespace, a pad token and a dict.
DATED = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- set meta = dict(pad=pad_token, unk=unk_token) %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: " + date_string + " " + meta | tojson + "<|eot_id|>" }}
{%- for message in messages %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' ~ ns.turns ~ ': ' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# SmolLM3/TRL's shape: the assistant's text inside {% generation %} blocks, for the assistant mask.
GENERATION = """{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TEMPLATES = {"llama3": LLAMA3, "qwen": QWEN, "mistral": MISTRAL, "dated": DATED, "generation": GENERATION}
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Le temps qu'il fait — «aujourd'hui»",
                                           "parameters": {"type": "object", "properties": {"ville": {"type": "string"}}}}}]
ALTERNATING = [m for m in CONVERSATION if m["role"] != "system"]


@pytest.fixture(scope="module")
def small_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[*SPECIALS.values(), *MARKERS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([json.dumps(CONVERSATION), LLAMA3, QWEN, json.dumps(TOOLS)] * 3, trainer=trainer)
    return tok


def hf_tokenizer(tok: Tokenizer, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **SPECIALS)


def model_dir(tmp_path: Path, tok: Tokenizer, template: str) -> Path:
    """A model directory as an export writes it: tokenizer.json and tokenizer_config.json."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **SPECIALS,
              "sep_token": None, "eot_token": {"content": "<|eot_id|>", "special": True}, "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_equal_transformers(small_tokenizer, name, tmp_path):
    template = TEMPLATES[name]
    hf = hf_tokenizer(small_tokenizer, template)
    ours = ChatTemplate(template, "test", tuple(SPECIALS.items()))
    conversation = ALTERNATING if name == "mistral" else CONVERSATION
    for messages in (conversation, conversation[:2], conversation[:4]):
        for gen in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render(messages, gen) == expected, (name, len(messages), gen)
    loaded = load_chat_template(model_dir(tmp_path, small_tokenizer, template))
    assert loaded.render(conversation, True) == hf.apply_chat_template(conversation, tokenize=False,
                                                                       add_generation_prompt=True)


def test_tools_render_as_transformers_tojson(small_tokenizer):
    hf = hf_tokenizer(small_tokenizer, QWEN)
    ours = ChatTemplate(QWEN, "test", tuple(SPECIALS.items()))
    text = ours.render(CONVERSATION, True, tools=TOOLS)
    assert text == hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"météo"' in text and "«aujourd'hui»" in text  # ensure_ascii=False, no HTML escaping
    assert '{\n  "type": "function"' in text  # tojson(indent=2)


def test_strftime_now_is_todays_date(small_tokenizer):
    from datetime import datetime

    text = ChatTemplate(DATED, "test", tuple(SPECIALS.items())).render(CONVERSATION)
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')} " in text
    assert '{"pad": "<pad>", "unk": "<unk>"}' in text and text.endswith("5: 6<|eot_id|>")


def test_the_generation_block_marks_what_transformers_masks(small_tokenizer):
    hf = hf_tokenizer(small_tokenizer, GENERATION)
    out = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = hf.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])
    ours = ChatTemplate(GENERATION, "test")
    text, spans = ours.render_marked(CONVERSATION)
    assert "".join(text[a:b] for a, b in spans) == masked == "4<|im_end|>6<|im_end|>"
    segments = ours.segments(CONVERSATION)
    assert [t for t, sup in segments if sup] == ["4<|im_end|>", "6<|im_end|>"]
    assert "".join(t for t, _ in segments) == text
    # Without the block the prefix rule marks the turn and its end, newline included.
    plain = GENERATION.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert [t for t, sup in ChatTemplate(plain, "test").segments(CONVERSATION) if sup] == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_every_special_token_of_the_config_reaches_the_template():
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, "pad_token": None,
              "mask_token": "<mask>", "eot_token": "<|eot_id|>", "add_bos_token": True,
              "extra_special_tokens": {"image_token": "<img>"}, "chat_template": "x"}
    assert tokenizer_special_tokens(config) == {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>",
                                                "eot_token": "<|eot_id|>", "image_token": "<img>"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_training_and_serving_render_the_same(small_tokenizer, name, tmp_path):
    """Training (choose_template beside the tokenizer, its segments) and serving (the export's template,
    OpenAI messages through chat_prompt) give the same text: what serving prompts with is exactly what
    training left unsupervised before each assistant turn."""
    directory = model_dir(tmp_path, small_tokenizer, TEMPLATES[name])
    trained = choose_template(None, directory / "tokenizer.json", "</s>", True, "stages[1].data")
    served = load_chat_template(directory)
    assert trained == served
    conversation = ALTERNATING if name == "mistral" else CONVERSATION
    segments = trained.segments(conversation)
    assert "".join(t for t, _ in segments) == trained.render(conversation)
    starts = [sum(len(t) for t, _ in segments[:k]) for k, (_, sup) in enumerate(segments) if sup]
    turns = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    full = trained.render(conversation)
    for i, start in zip(turns, starts, strict=True):
        wire = request_messages(ChatMessage.model_validate(m) for m in conversation[:i])
        prompt = chat_prompt(served, wire)
        assert prompt == trained.render(conversation[:i], add_generation_prompt=True)
        assert full[:start] == prompt


def test_a_runyard_tokenizer_and_its_export_render_the_same(tmp_path):
    """A spec's template over runyard's own BPE (no tokenizer_config.json) trains with the tokens that the
    export's tokenizer_config.json then gives serving: eos, and no bos."""
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    template = "{% if bos_token is defined %}BOS{% endif %}" + TEMPLATES["qwen"].replace("'<|im_end|>'", "eos_token")
    trained = choose_template(template, tokenizer, EOS_TOKEN, True, "stages[1].data")
    export = tmp_path / "export"
    export.mkdir()
    (export / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_for(64, template)))
    served = load_chat_template(export)
    assert trained.special_tokens == served.special_tokens == (("eos_token", EOS_TOKEN),)
    wire = request_messages(ChatMessage.model_validate(m) for m in CONVERSATION[:2])
    assert chat_prompt(served, wire) == trained.render(CONVERSATION[:2], True)
    assert not chat_prompt(served, wire).startswith("BOS")


def test_a_refusal_names_the_template_file_and_its_message(small_tokenizer, tmp_path):
    directory = model_dir(tmp_path / "model", small_tokenizer, MISTRAL)
    config = directory / "tokenizer_config.json"
    trained = choose_template(None, directory / "tokenizer.json", "</s>", True, "stages[1].data")
    with pytest.raises(ChatTemplateRefused) as info:
        trained.segments([ALTERNATING[0], {"role": "system", "content": "late"}, *ALTERNATING[2:]])
    assert str(config) in str(info.value) and "Only user and assistant roles are supported!" in str(info.value)
    assert info.value.reason == "Only user and assistant roles are supported!" and info.value.origin == str(config)
    with pytest.raises(InvalidRequest) as served:  # serving: a 400 on `messages`, not a crash
        chat_prompt(load_chat_template(directory), [{"role": "assistant", "content": "hi"}])
    assert served.value.status == 400 and served.value.param == "messages"
    assert str(config) in served.value.message and "roles must alternate" in served.value.message
    with pytest.raises(InvalidRequest, match="failed to render"):  # a template error, not a refusal
        chat_prompt(ChatTemplate("{{ messages[0]['content'] + 1 }}", "x"), [{"role": "user", "content": "a"}])


def test_a_refusal_is_counted_and_a_split_left_empty_says_why(tmp_path):
    """A conversation the template refuses (raise_exception) is a counted removal, not a crash (runyard plan
    and run list such records before any work); a split that has nothing left names the refusal."""
    tok = write_tokenizer(tmp_path / "tok.json")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [ALTERNATING[:2], CONVERSATION[:3]] * 2))
    with pytest.raises(DataError, match=r"the chat template refused \d+ conversation\(s\): Conversation roles must alternate"):
        prepare({"sources": [{"path": str(data)}], "chat_template": MISTRAL.replace("bos_token", "''")}, "sft",
                tok, 64, tmp_path / "c")


def test_templates_cannot_escape_the_sandbox():
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", "x").render([])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", "x").render([])
