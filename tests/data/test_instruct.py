"""Instruction data: chat templates rendered as transformers renders them, responses marked, bad records
named, removals counted, groups kept on one side of the split, and a resumable padded loader."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from runyard.data.chat import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError, choose_template
from runyard.data.instruct_sources import BadRecords, preference_pairs, python_function_records
from runyard.data.samples import SampleLoader
from runyard.spec.data_instruct import InstructSourceSpec
from tests.train.finetune_fixtures import function_pairs, prepare, write_sft_jsonl, write_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.mark.parametrize("source", [CHATML, DEFAULT_TEMPLATE])
def test_rendering_equals_transformers(tok, source):
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok), eos_token="<|endoftext|>", chat_template=source)
    ours = ChatTemplate(source, "spec", (("bos_token", ""), ("eos_token", "<|endoftext|>")))
    for gen in (False, True):
        assert ours.render(CONVERSATION, gen) == hf.apply_chat_template(CONVERSATION, tokenize=False,
                                                                         add_generation_prompt=gen)


def test_segments_mark_each_assistant_turn():
    segments = ChatTemplate(CHATML, "spec").segments(CONVERSATION)
    assert [text for text, sup in segments if sup] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    assert "".join(text for text, _ in segments) == ChatTemplate(CHATML, "spec").render(CONVERSATION)


def test_a_template_whose_prefixes_disagree_is_refused():
    odd = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    with pytest.raises(ChatTemplateError, match="assistant turn 2"):
        ChatTemplate(odd, "spec").segments(CONVERSATION)


def test_messages_without_any_template_name_the_tokenizer_config(tok):
    with pytest.raises(ChatTemplateError, match="no `chat_template` in tokenizer_config.json"):
        choose_template(None, tok, "<|endoftext|>", True, "stages[1].data (chats.jsonl)")
    assert choose_template(None, tok, "<|endoftext|>", False, "x").origin == "default"
    (tok.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    try:
        assert choose_template(None, tok, "<|endoftext|>", True, "x").source == CHATML
    finally:
        (tok.parent / "tokenizer_config.json").unlink()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_roles_out_of_order_name_the_file_line_and_field(tok, tmp_path):
    bad = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    ])
    with pytest.raises(BadRecords, match=r"chats.jsonl:2: messages\[1\].role: 'assistant' \(roles out of order"):
        prepare({"sources": [{"path": str(bad)}], "chat_template": "default"}, "sft", tok, 64, tmp_path / "c")


def test_a_record_without_the_fields_is_named(tok, tmp_path):
    bad = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(BadRecords, match="pairs.jsonl:1: messages: a record needs `messages`, or `prompt` and `response`"):
        prepare({"sources": [{"path": str(bad)}]}, "sft", tok, 64, tmp_path / "c")


def test_removals_are_counted(tok, tmp_path):
    records = [{"prompt": f"question {i} " + "word " * 3, "response": f"answer {i} " + "x " * (3 if i % 3 else 80)}
               for i in range(30)]
    records += [{"prompt": "nothing to say", "response": "   "}, dict(records[1])]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    data = {"sources": [{"path": str(path)}], "heldout_fraction": 0.3, "dedup": {"near": False}}
    dropped = prepare(data, "sft", tok, 64, tmp_path / "c1")
    assert dropped.stats["removed"]["empty_response"] == 1
    assert dropped.stats["dedup"]["exact_removed"] == 1
    assert dropped.stats["removed"]["too_long_dropped"] == 10
    # every removal kind comes with samples: what was too long, and by how much
    samples = dropped.stats["removal_samples"]
    assert {"empty_response", "too_long_dropped"} <= set(samples)
    assert all(s["reason"].endswith("tokens, the context holds 65") and int(s["reason"].split()[0]) > 65
               for s in samples["too_long_dropped"])
    kept = prepare({**data, "too_long": "truncate"}, "sft", tok, 64, tmp_path / "c2")
    assert "too_long_dropped" not in kept.stats["removed"]
    split = kept.stats["split"]
    assert split["train"]["fit"].get("truncated", 0) + split["heldout"]["fit"].get("truncated", 0) == 10
    assert max(max(s.lengths) for s in kept.stores("train") + kept.stores("heldout")) <= 65


def test_groups_never_straddle_the_split(tok, tmp_path):
    pairs = function_pairs()
    path = write_sft_jsonl(tmp_path / "functions.jsonl", pairs)
    data = {"sources": [{"path": str(path), "group_field": "module"}], "heldout_fraction": 0.3, "too_long": "truncate"}
    prepared = prepare(data, "sft", tok, 256, tmp_path / "c")
    held_prompts = {r["prompt"] for r in prepared.references("heldout")}
    train_prompts = {r["prompt"] for r in prepared.references("train")}
    module_of = {p["prompt"]: p["module"] for p in pairs}
    assert held_prompts and train_prompts
    assert not {module_of[p] for p in held_prompts} & {module_of[p] for p in train_prompts}


def test_loader_resumes_exactly_and_groups_lengths(tok, tmp_path):
    path = write_sft_jsonl(tmp_path / "functions.jsonl", function_pairs())
    prepared = prepare({"sources": [{"path": str(path)}], "too_long": "truncate"}, "sft", tok, 256, tmp_path / "c")
    stores = prepared.stores("train")
    a = SampleLoader(stores, 4, seed=5, pad_id=0, length_grouping=8)
    for _ in range(3):
        a.next_batch()
    b = SampleLoader(stores, 4, seed=5, pad_id=0, length_grouping=8)
    b.load_state_dict(a.state_dict())
    for _ in range(20):  # across an epoch boundary
        x, y = a.next_batch(), b.next_batch()
        assert np.array_equal(x.inputs, y.inputs) and np.array_equal(x.labels, y.labels)
    plain = SampleLoader(stores, 4, seed=5, pad_id=0, length_grouping=0)
    waste = [sum(float(1 - ld.next_batch().real_tokens / ld.next_batch().inputs.numel()) for _ in range(10))
             for ld in (a, plain)]
    assert waste[0] < waste[1], "length grouping pads less"


def test_python_functions_give_preference_pairs_from_the_same_module(tok, tmp_path):
    data = {"sources": [{"path": p, "format": "python_functions", "max_body_lines": 12}
                        for p in ("{stdlib}/json/*.py", "{stdlib}/email/_*.py")],
            "too_long": "truncate", "heldout_fraction": 0.2}
    prepared = prepare(data, "dpo", tok, 256, tmp_path / "c")
    chosen, rejected = prepared.stores("train")
    assert len(chosen) == len(rejected) > 3
    differ = sum(not np.array_equal(chosen.sample(i)[0], rejected.sample(i)[0]) for i in range(len(chosen)))
    assert differ == len(chosen)
    # the prompt part is shared: the rendered conversation up to the response is the same tokens
    assert all(chosen.prompt(i) == rejected.prompt(i) for i in range(len(chosen)))


def test_shuffled_lines_reject_a_functions_own_body_out_of_order():
    source = InstructSourceSpec(path="{stdlib}/json/*.py", format="python_functions", rejected="shuffled_lines")
    records = [r for path in sorted(Path(json.__file__).parent.glob("*.py"))
               for r in python_function_records(path.name, path.read_text(), path.stem, source, Counter())]
    counts = Counter()
    pairs = list(preference_pairs(records, "shuffled_lines", counts))
    assert len(pairs) + counts["functions_without_a_rival"] == len(records) and len(pairs) > 3
    for pair in pairs:
        chosen = pair.messages[-1]["content"]
        assert pair.rejected != chosen
        assert sorted(pair.rejected.splitlines()) == sorted(chosen.splitlines())  # the same lines, reordered
    again = list(preference_pairs(records, "shuffled_lines", Counter()))
    assert [p.rejected for p in again] == [p.rejected for p in pairs]  # fixed by the function, not by chance
    rivals = list(preference_pairs(records, "next_function", Counter()))
    assert [p.rejected for p in rivals][:-1] == [r.messages[-1]["content"] for r in records[1:len(rivals)]]


def test_function_fields_on_a_records_file_are_refused_by_name():
    with pytest.raises(ValueError, match="rejected apply to format python_functions only, not 'jsonl'"):
        InstructSourceSpec(path="pairs.jsonl", rejected="shuffled_lines")
    assert InstructSourceSpec(path="pairs.jsonl").rejected == "next_function"  # the default is no choice made
