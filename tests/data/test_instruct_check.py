"""Bad instruction and preference records: the pass before any work finds each kind of problem with its
file:line and field, lists every one (the first 20, with a count of the rest); on_bad_record: skip counts
exactly the planted ones in the data report and the split holds none of them; a preference pair whose
chosen equals its rejected is removed; a conversation the template refuses is a counted removal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runyard.data.chat import ChatTemplate
from runyard.data.instruct_check import check_records, scan_records
from runyard.data.instruct_sources import BadRecords
from runyard.spec.data_instruct import InstructDataSpec
from tests.train.finetune_fixtures import prepare, write_tokenizer

GOOD = {"messages": [{"role": "user", "content": "say {i}"}, {"role": "assistant", "content": "{i} said, word {i}"}]}
# kind -> (the line as written, the field the error names)
BAD_SFT = {
    "malformed_json": ('{"messages": [', "(line)"),
    "no_messages": (json.dumps({"text": "no conversation here"}), "messages"),
    "roles_out_of_order": (json.dumps({"messages": [{"role": "assistant", "content": "a"},
                                                    {"role": "user", "content": "b"}]}), "messages[0].role"),
    "unknown_role": (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"},
                                              {"role": "assistant", "content": "c"}]}), "messages[1].role"),
    "not_a_string": (json.dumps({"messages": [{"role": "user", "content": ["a", "list"]},
                                              {"role": "assistant", "content": "c"}]}), "messages[0].content"),
    "no_response": (json.dumps({"messages": [{"role": "user", "content": "a"}]}), "messages"),
}
BAD_DPO = {
    "missing_field": (json.dumps({"prompt": "p", "chosen": "c"}), "rejected"),
    "malformed_json": ("not json at all", "(line)"),
    "not_a_string": (json.dumps({"prompt": "p", "chosen": 3, "rejected": "r"}), "chosen"),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def good_line(i: int) -> str:
    return json.dumps(json.loads(json.dumps(GOOD).replace("{i}", str(i))))


def plant(path: Path, bad: dict[str, tuple[str, str]], good: int = 40, every: int = 5) -> dict[int, str]:
    """`good` good lines with the bad ones spread among them; returns line number -> kind."""
    lines, where = [], {}
    bad_items = list(bad.items())
    for i in range(good):
        lines.append(good_line(i))
        if i % every == 0 and bad_items:
            kind, (text, _field) = bad_items.pop(0)
            lines.append(text)
            where[len(lines)] = kind
    path.write_text("\n".join(lines) + "\n")
    return where


def data(path: Path, **extra) -> InstructDataSpec:
    return InstructDataSpec.model_validate({"sources": [{"path": str(path)}], "chat_template": "default", **extra})


def test_every_kind_of_bad_record_is_found_with_its_line_and_field(tmp_path):
    path = tmp_path / "chats.jsonl"
    where = plant(path, BAD_SFT)
    scan = scan_records(data(path), preference=False)
    assert scan.records == 40 + len(BAD_SFT) and scan.bad_total == len(BAD_SFT)
    found = {(int(b.where.rsplit(":", 1)[1]), b.problem, b.field) for b in scan.bad}
    assert found == {(line, kind, BAD_SFT[kind][1]) for line, kind in where.items()}
    with pytest.raises(BadRecords) as caught:
        check_records(data(path), False, "stages[1].data (tune)")
    message = str(caught.value)
    assert caught.value.exit_code == 2 and f"{len(BAD_SFT)} bad records" in message
    for line, kind in where.items():
        assert f"{path}:{line}: {BAD_SFT[kind][1]}: " in message
    assert "one of ['system', 'user', 'assistant'], got 'tool'" in message
    assert "on_bad_record: skip" in message


def test_preference_records_without_rejected_are_bad(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}) for i in range(10)]
    lines += [text for text, _ in BAD_DPO.values()]
    path.write_text("\n".join(lines) + "\n")
    scan = scan_records(data(path), preference=True)
    assert sorted(b.problem for b in scan.bad) == sorted(BAD_DPO)
    assert {b.field for b in scan.bad} == {f for _, f in BAD_DPO.values()}


def test_the_first_twenty_are_listed_with_a_count_of_the_rest(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([good_line(0)] + ["{broken"] * 57) + "\n")
    with pytest.raises(BadRecords) as caught:
        check_records(data(path), False, "stages[0].data")
    message = str(caught.value)
    assert "57 bad records (malformed_json 57)" in message and "... and 37 more" in message
    assert message.count(": (line): a JSON object") == 20 and f"{path}:21:" in message


def test_skip_counts_exactly_the_planted_records_and_the_split_holds_none(tok, tmp_path):
    path = tmp_path / "chats.jsonl"
    plant(path, BAD_SFT)
    spec = {"sources": [{"path": str(path)}], "chat_template": "default", "on_bad_record": "skip",
            "dedup": {"near": False}, "heldout_fraction": 0.2}
    prepared = prepare(spec, "sft", tok, 64, tmp_path / "cache")
    removed = prepared.stats["removed"]
    assert {k: v for k, v in removed.items() if k.startswith("bad_record.")} == {f"bad_record.{k}": 1 for k in BAD_SFT}
    assert prepared.stats["read"]["records_read"] == 40 + len(BAD_SFT)
    kept = prepared.stats["split"]["train"]["records"] + prepared.stats["split"]["heldout"]["records"]
    assert kept == 40
    refs = prepared.references("train") + prepared.references("heldout")
    assert all(r["prompt"].startswith("say ") for r in refs)
    assert prepared.stats["removal_samples"]["bad_record.unknown_role"][0]["field"] == "messages[1].role"
    # The same records under on_bad_record: error stop the data stage itself too, listing them.
    with pytest.raises(BadRecords):
        prepare({**spec, "on_bad_record": "error"}, "sft", tok, 64, tmp_path / "cache2")


def test_a_pair_whose_chosen_equals_its_rejected_is_counted_and_removed(tok, tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"prompt": f"question {i}", "chosen": f"good answer {i}", "rejected": f"bad {i} x"})
             for i in range(20)]
    lines += [json.dumps({"prompt": f"same {i}", "chosen": f"same answer {i}", "rejected": f"same answer {i}"})
              for i in range(3)]
    path.write_text("\n".join(lines) + "\n")
    prepared = prepare({"sources": [{"path": str(path)}], "dedup": {"near": False}}, "dpo", tok, 64, tmp_path / "c")
    assert prepared.stats["removed"]["chosen_equals_rejected"] == 3
    assert scan_records(data(path), preference=True).bad_total == 0  # not a bad record: a pair with nothing to learn


REFUSING = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
            "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_a_conversation_the_template_refuses_is_a_bad_record_before_work_and_a_removal_in_the_data_stage(tok, tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [good_line(i) for i in range(20)]
    lines.insert(3, json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}))
    path.write_text("\n".join(lines) + "\n")
    spec = InstructDataSpec.model_validate({"sources": [{"path": str(path)}], "chat_template": REFUSING})
    template = ChatTemplate(REFUSING, "spec", (("eos_token", "<|endoftext|>"),))
    with pytest.raises(BadRecords, match=r"chats.jsonl:4: messages: .*it refused: System role not supported"):
        check_records(spec, False, "stages[1].data", template)
    assert check_records(spec, False, "x").bad_total == 0  # without the template nothing is rendered
    prepared = prepare({"sources": [{"path": str(path)}], "chat_template": REFUSING, "dedup": {"near": False}},
                       "sft", tok, 64, tmp_path / "c")
    assert prepared.stats["removed"]["template_refused"] == 1
    assert prepared.stats["removal_samples"]["template_refused"][0]["reason"] == "System role not supported"
