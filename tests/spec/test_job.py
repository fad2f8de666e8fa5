"""Spec validation: every bad spec is refused up front with the field path, the value and the expectation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runyard.errors import EXIT_BAD_SPEC, SpecError
from runyard.spec.job import dump_spec, load_spec, parse_spec, resolved_stage, spec_warnings

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stdlib-code.yaml"


def base() -> dict:
    return {"name": "t", "data": {"sources": [{"path": "corpus/*.txt"}]}}


def problems_of(raw) -> list[tuple[str, object, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(raw, "test.yaml")
    return info.value.problems


def test_example_spec_is_valid_and_stages_inherit():
    spec = load_spec(EXAMPLE)
    smoke = resolved_stage(spec, "smoke")
    full = resolved_stage(spec, "full")
    assert smoke.model.d_model == 64 and smoke.model.context_length == spec.model.context_length
    assert full.model == spec.model
    assert smoke.train.steps == 40 and smoke.train.grad_accum == spec.train.grad_accum


@pytest.mark.parametrize(
    "patch, path, fragment",
    [
        ({"model": {"d_model": "big"}}, "model.d_model", "valid integer"),
        ({"modle": {}}, "modle", "unknown key"),
        ({"optim": {"lr": -1}}, "optim.lr", "greater than 0"),
        ({"schedule": {"decay": "exp"}}, "schedule.decay", "'cosine', 'linear' or 'constant'"),
        ({"stages": [{"name": "s", "train": {"steps": 0}}]}, "stages[0].train.steps", "greater than or equal to 1"),
        ({"stages": [{"name": "s", "model": {"n_heads": 7}}]}, "stages[0].model", "divisible by n_heads"),
        ({"stages": [{"name": "a"}, {"name": "a"}]}, "(top level)", "unique"),
        ({"resources": {"device": "tpu"}}, "resources.device", "'cpu', 'cuda' or 'auto'"),
        ({"resources": {"requirement": {"accelerator_kinds": ["h1000"]}}}, "resources.requirement", "unknown accelerator"),
        ({"data": {"sources": []}}, "data.sources", "at least 1"),
        ({"name": "../escape"}, "name", "letters, digits"),
    ],
)
def test_bad_field_is_named_with_value_and_expectation(patch, path, fragment):
    raw = base() | patch
    problems = problems_of(raw)
    assert any(p == path and fragment in expected for p, _value, expected in problems), problems


def test_missing_section_and_value_reported():
    problems = problems_of({"name": "t"})
    # `data` may be left out only when no stage pretrains; the default stage `main` does, and is named.
    assert ("data", "(missing)", "stage 'main' has kind pretrain, which trains on the top-level data: give `data` "
            "(sources, tokenizer), or make every stage sft or dpo on its own data (see docs/spec.md#data)") in problems


@pytest.mark.parametrize(
    "patch, path, anchor",
    [
        ({"data": {"sources": [{"path": "x", "formt": "text"}]}}, "data.sources[0].formt", "data.sources"),
        ({"stages": [{"name": "s", "train": {"steps": 0}}]}, "stages[0].train.steps", "train.steps"),
        ({"stages": [{"name": "s", "gates": {"min_loss_drop": 2}}]}, "stages[0].gates.min_loss_drop", "stages.gates.min_loss_drop"),
        ({"modle": {}}, "modle", "top"),
        ({"resources": {"requirement": {"device_count": 0}}}, "resources.requirement.device_count", "resources.requirement.device_count"),
    ],
)
def test_every_problem_points_to_its_reference_entry(patch, path, anchor):
    problems = dict((p, expected) for p, _value, expected in problems_of(base() | patch))
    assert problems[path].endswith(f"(see docs/spec.md#{anchor})"), problems


def test_unknown_key_suggests_the_close_field():
    problems = problems_of(base() | {"data": {"sources": [{"path": "x"}], "filters": {"min_wrds": 3}}})
    assert problems[0][0] == "data.filters.min_wrds" and "did you mean 'min_words'?" in problems[0][2]


def test_warmup_longer_than_the_stage_is_a_warning_naming_the_field(tmp_path, caplog):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(base() | {"train": {"steps": 5},
                                             "stages": [{"name": "a"}, {"name": "b", "schedule": {"warmup_steps": 80}}]}))
    with caplog.at_level("WARNING", logger="runyard.spec.job"):
        spec = load_spec(path)
    assert spec.schedule.warmup_steps == 20  # the spec is not changed, only flagged
    assert "schedule.warmup_steps = 20" in caplog.text and "peaks at 25% of optim.lr" in caplog.text
    assert "stages[1].schedule.warmup_steps = 80" in caplog.text and "set it below 5" in caplog.text
    assert spec_warnings(parse_spec(base() | {"train": {"steps": 30}})) == []


def test_a_stored_resolved_spec_loads_again(tmp_path):
    # A run directory keeps the spec with every default written out; resume must accept it as it is.
    spec = parse_spec(base() | {"train": {"steps": 3}})
    stored = tmp_path / "spec.yaml"
    stored.write_text(dump_spec(spec))
    assert load_spec(stored).fingerprint() == spec.fingerprint()


def test_message_names_file_path_value_and_expectation():
    with pytest.raises(SpecError) as info:
        parse_spec(base() | {"optim": {"betas": [0.9, 1.5]}}, "bad.yaml")
    text = str(info.value)
    assert "bad.yaml" in text and "optim.betas" in text and "[0, 1)" in text


def test_invalid_yaml_reports_line(tmp_path):
    bad = tmp_path / "spec.yaml"
    bad.write_text("name: t\ndata: [unclosed\n")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert "line" in info.value.problems[0][0]


def test_fingerprint_changes_with_any_setting():
    a = parse_spec(base())
    b = parse_spec(base() | {"seed": 1})
    assert a.fingerprint() == parse_spec(base()).fingerprint()
    assert a.fingerprint() != b.fingerprint()


def test_cli_exits_2_before_any_work(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(base() | {"train": {"steps": "many"}}))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "runyard", "run", str(spec), "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == EXIT_BAD_SPEC
    assert "train.steps" in proc.stderr and "'many'" in proc.stderr
    assert not run_dir.exists()
