"""Model directories as transformers writes them today (its installed version's save_pretrained: the chat
template in chat_template.jinja) and wrote them before (the template in tokenizer_config.json, special
tokens in special_tokens_map.json): the template is found with transformers' precedence and renders as
its apply_chat_template does, special and added tokens read as it reads them, the export writes the
template where it reads it; a Mistral and a Qwen2 keep their class and fields, weights bitwise; damaged
weights are named from their safetensors headers alone."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runyard.data.chat import ChatTemplateError, choose_template, directory_template, load_chat_template
from runyard.data.tokenizer import load_model_tokenizer, read_tokenizer_config
from runyard.errors import DataError
from runyard.model import hf
from runyard.model.hf.config import KEPT_FIELDS, read_json
from runyard.model.hf.export import export_model

from .hf_models import SHAPE, hf_model, save_hf_model, write_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OTHER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]


def saved_by_transformers(directory, template=TEMPLATE):
    """A tokenizer directory written by the installed transformers' save_pretrained, with a template."""
    write_tokenizer(directory / "src")
    tok = transformers.AutoTokenizer.from_pretrained(directory / "src")
    tok.chat_template = template
    tok.save_pretrained(directory)
    return directory


def older_layout(directory, template=TEMPLATE, **config):
    """tokenizer.json with the template inside tokenizer_config.json, as older transformers wrote it."""
    write_tokenizer(directory)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template, **config}))
    return directory


def transformers_renders(directory, messages=CHAT, **kwargs) -> str:
    return transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("layout", ["transformers-5", "older"])
def test_the_template_is_found_in_either_layout_and_renders_as_transformers(tmp_path, layout):
    directory = (saved_by_transformers if layout == "transformers-5" else older_layout)(tmp_path / "tok")
    file = "chat_template.jinja" if layout == "transformers-5" else "tokenizer_config.json"
    if layout == "transformers-5":
        assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    loaded = load_chat_template(directory)
    assert loaded.source == TEMPLATE and loaded.origin == str(directory / file)
    assert loaded.render(CHAT) == transformers_renders(directory)
    assert loaded.render(CHAT[:2], add_generation_prompt=True) == transformers_renders(
        directory, CHAT[:2], add_generation_prompt=True)
    # What an sft stage on `messages` renders with (it failed on the .jinja layout: "no chat template").
    chosen = choose_template(None, directory / "tokenizer.json", "</s>", True, "stages[1].data")
    assert chosen.source == TEMPLATE and chosen.origin == str(directory / file)
    load_model_tokenizer(directory)  # save_pretrained's added_tokens_decoder agrees with tokenizer.json


def test_template_files_take_precedence_as_transformers_gives_them(tmp_path):
    # chat_template.jinja replaces tokenizer_config.json's template, as transformers' tokenizer does.
    both = older_layout(tmp_path / "both", template=OTHER)
    (both / "chat_template.jinja").write_text(TEMPLATE)
    assert directory_template(both) == (TEMPLATE, str(both / "chat_template.jinja"))
    assert load_chat_template(both).render(CHAT) == transformers_renders(both)

    # A processor's legacy chat_template.json, alone, is the template; beside another template, it must agree.
    legacy = tmp_path / "legacy"
    write_tokenizer(legacy)
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert directory_template(legacy) == (TEMPLATE, str(legacy / "chat_template.json"))
    (legacy / "chat_template.jinja").write_text(TEMPLATE)
    assert directory_template(legacy)[0] == TEMPLATE
    (legacy / "chat_template.jinja").write_text(OTHER)
    with pytest.raises(ChatTemplateError, match=r"chat_template\.json holds another chat template than .*chat_template\.jinja"):
        directory_template(legacy)

    # Named templates: `default` is the one; named ones without a default are refused, naming the folder.
    named = older_layout(tmp_path / "named", template=[{"name": "tool_use", "template": OTHER},
                                                        {"name": "default", "template": TEMPLATE}])
    assert directory_template(named)[0] == TEMPLATE
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text(OTHER)
    with pytest.raises(ChatTemplateError, match="additional_chat_templates holds named templates"):
        directory_template(named)
    (named / "additional_chat_templates" / "default.jinja").write_text(TEMPLATE)
    assert directory_template(named)[0] == TEMPLATE

    none = tmp_path / "none"
    write_tokenizer(none)
    assert directory_template(none)[0] is None and load_chat_template(none) is None
    with pytest.raises(ChatTemplateError, match=r"has no chat_template\.jinja, no `chat_template` in tokenizer_config"):
        choose_template(None, none / "tokenizer.json", "</s>", True, "stages[1].data (chats.jsonl)")


def test_special_tokens_and_added_tokens_are_read_as_transformers_reads_them(tmp_path):
    # The older layout: no added_tokens_decoder, so special_tokens_map.json's tokens win.
    old = tmp_path / "old"
    write_tokenizer(old, eos="</s>", bos="<s>")
    (old / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<s>", "lstrip": False}}))
    theirs = transformers.AutoTokenizer.from_pretrained(old)
    assert theirs.eos_token == "<s>"
    assert read_tokenizer_config(old)["eos_token"]["content"] == "<s>"
    tok, _config = load_model_tokenizer(old)
    # With added_tokens_decoder (what transformers writes today), special_tokens_map.json is not read.
    config = json.loads((old / "tokenizer_config.json").read_text())
    decoder = {str(tok.token_to_id(t)): {"content": t, "special": True} for t in ("</s>", "<s>")}
    (old / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    assert transformers.AutoTokenizer.from_pretrained(old).eos_token == "</s>"
    assert read_tokenizer_config(old)["eos_token"] == "</s>"

    # An added token the config lists that tokenizer.json lacks (or holds at another id) is refused by name.
    (old / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": {
        **decoder, "299": {"content": "<|extra|>", "special": True}}}))
    with pytest.raises(DataError, match=r"tokenizer_config\.json lists added token '<\|extra\|>' at id 299"):
        load_model_tokenizer(old)
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    (old / "added_tokens.json").write_text(json.dumps({"</s>": 5}))
    with pytest.raises(DataError, match=r"added_tokens\.json lists added token '</s>' at id 5.*has id 0 there"):
        load_model_tokenizer(old)


@pytest.mark.parametrize("layout", ["transformers-5", "older"])
def test_the_export_writes_the_template_where_transformers_reads_it(tmp_path, layout):
    directory = (saved_by_transformers if layout == "transformers-5" else older_layout)(tmp_path / "tok")
    model = hf.load_model(save_hf_model(hf_model("llama"), tmp_path / "hf", tokenizer=False))
    out = export_model(model, model.cfg, directory / "tokenizer.json", tmp_path / "export",
                       tokenizer_config=read_tokenizer_config(directory),
                       chat_template=directory_template(directory)[0])
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    served = load_chat_template(out)  # what `runyard serve` renders with
    assert served.render(CHAT) == transformers_renders(out)
    assert served.render(CHAT[:2], add_generation_prompt=True) == transformers_renders(
        out, CHAT[:2], add_generation_prompt=True)
    # A template only in the tokenizer config handed over moves to chat_template.jinja too.
    again = export_model(model, model.cfg, directory / "tokenizer.json", tmp_path / "again",
                         tokenizer_config={**read_tokenizer_config(directory), "chat_template": TEMPLATE})
    assert (again / "chat_template.jinja").read_text() == TEMPLATE


ROUND_TRIPS = {
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "mistral-window-covers-context": ("mistral", {"sliding_window": 64}),
    "qwen2": ("qwen2", {}),
    "qwen2-window-covers-context": ("qwen2", {"use_sliding_window": True, "sliding_window": 64,
                                              "max_window_layers": 1}),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_the_architecture_goes_out_as_it_came_in_with_its_fields_and_weights_bitwise(tmp_path, name):
    case, overrides = ROUND_TRIPS[name]
    theirs = hf_model(case, **overrides)
    source = save_hf_model(theirs, tmp_path / "in", tokenizer=False)
    came_in = read_json(source / "config.json")
    ours = hf.load_model(source)
    out = tmp_path / "out"
    out.mkdir()
    hf.write_model(ours, ours.cfg, out, source_config=came_in)
    went_out = read_json(out / "config.json")
    assert went_out["architectures"] == came_in["architectures"] and went_out["model_type"] == came_in["model_type"]
    for field in KEPT_FIELDS[came_in["architectures"][0]]:
        assert went_out.get(field) == came_in.get(field), field
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(again) is type(theirs)
    idx = torch.randint(0, theirs.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, theirs(idx).logits, rtol=0, atol=1e-5)


def test_a_window_shorter_than_the_context_is_refused_by_name_even_when_left_to_mistrals_default(tmp_path):
    source = save_hf_model(hf_model("mistral", sliding_window=None), tmp_path / "in", tokenizer=False)
    config = read_json(source / "config.json")
    del config["sliding_window"]  # MistralConfig's default then applies: a 4096-token window
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    with pytest.raises(hf.ModelDirectoryError, match=r"field 'sliding_window': = 4096 is shorter than "
                                                     r"max_position_embeddings = 8192"):
        hf.read_config(source)


@pytest.fixture
def llama_dir(tmp_path):
    return save_hf_model(hf_model("llama"), tmp_path / "hf", tokenizer=False)


def damage(directory, how):
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    if how == "header-beyond-file":
        weights.write_bytes(data[: 8 + length // 2])
    elif how == "tensor-beyond-file":
        weights.write_bytes(data[:-100])
    elif how == "unreadable-header":
        weights.write_bytes(data[:8] + b"{" * length + data[8 + length:])
    elif how == "missing-tensor":
        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "pickle-only":
        weights.rename(directory / "pytorch_model.bin")
    return weights


@pytest.mark.parametrize(("how", "message"), [
    ("header-beyond-file", r"model\.safetensors: is truncated: its header says it is [\d,]+ bytes long"),
    ("tensor-beyond-file", r"model\.safetensors: is truncated: tensor '[^']+' ends at byte"),
    ("unreadable-header", r"model\.safetensors: is not a readable safetensors file: its header is not JSON"),
    ("missing-tensor", r"the weights lack 1 tensor\(s\) config\.json implies: \['model\.layers\.1\.mlp\.down_proj"),
    ("pickle-only", r"pytorch_model\.bin: holds the weights as a pickle.*convert it to safetensors"),
])
def test_damaged_weights_are_named_from_their_headers_alone(llama_dir, monkeypatch, how, message):
    damage(llama_dir, how)
    cfg = hf.read_config(llama_dir)
    monkeypatch.setattr("runyard.model.hf.directory.read_tensor", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(hf.ModelDirectoryError, match=message):
        hf.check_weights(llama_dir, cfg)
    assert SHAPE["num_hidden_layers"] == 2  # the missing tensor above is the last layer's


def test_prepared_records_are_keyed_by_the_template_files_too(tmp_path):
    from runyard.data.instruct import instruct_fingerprint
    from runyard.spec.data_instruct import InstructDataSpec

    directory = saved_by_transformers(tmp_path / "tok")
    spec = InstructDataSpec(sources=[{"path": "chats.jsonl"}])
    before = instruct_fingerprint(spec, "sft", 0, 32, directory / "tokenizer.json", [])
    (directory / "chat_template.jinja").write_text(OTHER)
    assert instruct_fingerprint(spec, "sft", 0, 32, directory / "tokenizer.json", []) != before
