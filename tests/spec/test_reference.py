"""The spec reference: generated from the models, committed in docs/, complete, and usable by editors
(the JSON Schema accepts every example and refuses what validation refuses); `runyard spec init`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from runyard import cli
from runyard.errors import EXIT_BAD_SPEC, SpecError
from runyard.spec.job import TASKS, parse_spec
from runyard.spec.reference import (
    MARKDOWN_FILE,
    SCHEMA_FILE,
    UnknownSpecField,
    entry_text,
    json_schema,
    json_schema_text,
    markdown_reference,
    undocumented_fields,
)
from runyard.spec.templates import TEMPLATES, render_template

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml"))
REGENERATE = "the spec changed: regenerate with `runyard spec reference --write-docs docs` and commit"


def test_committed_markdown_is_what_the_code_generates():
    assert (DOCS / MARKDOWN_FILE).read_text(encoding="utf-8") == markdown_reference(), REGENERATE


def test_committed_schema_is_what_the_code_generates():
    assert (DOCS / SCHEMA_FILE).read_text(encoding="utf-8") == json_schema_text(), REGENERATE


def test_every_field_and_section_is_described():
    assert undocumented_fields() == []


def test_every_field_has_an_anchor_and_a_row():
    text = markdown_reference()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    assert len(anchors) == len(re.findall(r'<a id="', text)), "anchors must be unique"
    for path in ("data.filters.min_words", "stages.gates.min_loss_drop", "resources.requirement.device_count",
                 "data.sources.path", "eval.unigram_margin", "task", "top", "data.pii"):
        assert path in anchors


def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((DOCS / SCHEMA_FILE).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_schema_accepts_every_example(path):
    assert EXAMPLES, "no example specs found"
    assert [e.message for e in _validator().iter_errors(yaml.safe_load(path.read_text()))] == []


@pytest.mark.parametrize(
    "patch, where",
    [
        ({"stages": [{"name": "s", "model": {"d_modle": 64}}]}, ["stages", 0, "model"]),
        ({"resources": {"requirement": {"accelerator_kinds": ["h1000"]}}}, ["resources", "requirement", "accelerator_kinds", 0]),
        ({"schedule": {"decay": "exp"}}, ["schedule", "decay"]),
        ({"data": {"sources": [{"path": "x"}], "filters": {"max_top_ngram_fraction": 1.5}}}, ["data", "filters", "max_top_ngram_fraction"]),
        ({"task": "chess"}, ["task"]),
    ],
)
def test_schema_refuses_what_validation_refuses(patch, where):
    raw = {"name": "t", "data": {"sources": [{"path": "x"}]}} | patch
    with pytest.raises(SpecError):
        parse_spec(raw)
    errors = list(_validator().iter_errors(raw))
    assert any(list(e.path) == where for e in errors), [(list(e.path), e.message) for e in errors]


def test_schema_has_defaults_for_editors():
    schema = json_schema()
    props = schema["$defs"]["EvalSpec"]["properties"]
    assert props["prompts"]["default"] == ["def ", "import ", "class "]
    assert props["unigram_margin"]["default"] == 0.1
    assert schema["$defs"]["StageSpec"]["properties"]["train"]["$ref"] == "#/$defs/TrainSpec"


def test_entry_text_for_a_field_a_section_and_an_unknown_path():
    entry = entry_text("data.filters.max_top_ngram_fraction")
    assert "number in [0, 1], or null" in entry and "most frequent word n-gram" in entry
    assert "| <a id=\"stages.gates.min_loss_drop\"></a>" in entry_text("stages.gates")
    assert "min_loss_drop" in entry_text("stages[0].gates.min_loss_drop")
    with pytest.raises(UnknownSpecField, match="data.filters.min_words"):
        entry_text("data.filter.min_words")


def test_every_task_has_a_starting_spec_that_loads():
    assert set(TEMPLATES) == set(TASKS)
    for task in TASKS:
        text = render_template(task, "starter")
        spec = parse_spec(yaml.safe_load(text))
        assert spec.task == task and spec.name == "starter"
        assert text.count("\n# ") >= 5  # commented


def test_spec_init_writes_a_spec_that_plans(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "first-run.yaml"
    assert cli.main(["spec", "init", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["name"] == "first-run"
    assert cli.main(["plan", str(out), "--json"]) == 0
    assert [s["stage"] for s in json.loads(capsys.readouterr().out)["stages"]] == ["smoke", "main"]
    assert cli.main(["spec", "init", str(out)]) != 0 and "--force" in capsys.readouterr().err


def test_spec_reference_cli(tmp_path, capsys):
    # The real entry point, as a user runs it.
    proc = subprocess.run([sys.executable, "-m", "runyard", "spec", "reference", "eval.unigram_margin"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "eval.unigram_margin" in proc.stdout and "default: 0.1" in proc.stdout
    assert cli.main(["spec", "reference", "eval.unigram_marginn"]) == EXIT_BAD_SPEC
    assert "no field" in capsys.readouterr().err
    assert cli.main(["spec", "reference", "--write-docs", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / MARKDOWN_FILE).read_text() == (DOCS / MARKDOWN_FILE).read_text()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_point_the_yaml_language_server_at_the_schema(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=")
    assert (path.parent / first.split("=", 1)[1]).resolve() == (DOCS / SCHEMA_FILE).resolve()
