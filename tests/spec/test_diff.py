"""An edited spec against a run directory's stored one: which changes only judge again, which alter work,
and what opening the run directory does with each (runyard.spec.diff, runyard.run.continuation)."""

from __future__ import annotations

import copy
import json

import pytest

from runyard.errors import EXIT_BAD_SPEC, SpecChanged, SpecError
from runyard.reproduce import manifest as mf
from runyard.run.continuation import SPEC_FILE, open_run_dir
from runyard.spec.diff import compare, field_changes
from runyard.spec.job import load_spec, parse_spec

BASE = {
    "name": "t",
    "data": {"sources": [{"path": "corpus/*.txt"}]},
    "model": {"d_model": 32},
    "stages": [{"name": "base", "gates": {"min_loss_drop": 0.15}}, {"name": "sft", "kind": "sft",
                                                                   "data": {"sources": [{"path": "c.jsonl"}]}}],
}


def spec(**edits):
    raw = copy.deepcopy(BASE)
    for path, value in edits.items():
        node, keys = raw, path.split("__")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[keys[-1]] = value
    return parse_spec(raw)


def test_an_unchanged_spec_has_no_changes():
    change = compare(spec(), spec())
    assert change.none and change.first_changed_stage is None and not change.altering


def test_a_gate_is_named_with_both_values_and_only_judges():
    change = compare(spec(), spec(stages__0__gates__min_loss_drop=0.1))
    assert [str(c) for c in change.changes] == ["stages[0].gates.min_loss_drop: 0.15 -> 0.1"]
    assert change.judgement == change.changes and change.first_changed_stage is None


@pytest.mark.parametrize("edit", [{"eval__unigram_margin": 0.05}, {"eval__prompts": ["x"]}, {"name": "u"},
                                  {"checkpoint__keep_last": 5}])
def test_the_final_evaluations_settings_only_judge(edit):
    change = compare(spec(), spec(**edit))
    assert change.changes and not change.altering


def test_a_later_stages_change_keeps_the_earlier_stages():
    change = compare(spec(), spec(stages__1__train={"steps": 7}))
    assert [(str(c), at) for c, at in change.altering] == [("stages[1].train.steps: (absent) -> 7", 1)]
    assert change.first_changed_stage == 1 and not change.every_stage


def test_an_inherited_section_alters_the_first_stage_that_inherits_it():
    # Both stages inherit model.d_model: the first one trains differently.
    assert compare(spec(), spec(model__d_model=64)).first_changed_stage == 0
    # With the first stage overriding it, only the second one does.
    old = spec(stages__0__model={"d_model": 48})
    new = spec(stages__0__model={"d_model": 48}, model__d_model=64)
    assert compare(old, new).first_changed_stage == 1


def test_data_and_seed_alter_every_stage():
    for edit in ({"seed": 1}, {"data__heldout_fraction": 0.2}, {"eval__batches": 3}):
        change = compare(spec(), spec(**edit))
        assert change.first_changed_stage == 0 and change.every_stage, edit


def test_a_new_layout_alters_no_work_done():
    # A checkpoint resumes under any layout (tests/e2e/test_tensor_parallel.py), so a run continues.
    change = compare(spec(), spec(resources__parallel={"tp": 2}, resources__nproc=2))
    assert change.first_changed_stage is None and not change.every_stage
    assert {c.path for c in change.layout} == {"resources.parallel", "resources.nproc"}


def test_added_and_removed_stages():
    raw = copy.deepcopy(BASE)
    raw["stages"].append({"name": "more"})
    added = compare(spec(), parse_spec(raw))
    assert added.first_changed_stage == 2
    removed = compare(parse_spec(raw), spec())
    assert removed.first_changed_stage is None and removed.changes  # nothing kept trains differently


def test_field_changes_walks_lists_of_sections():
    paths = [c.path for c in field_changes(spec(), spec(data__sources=[{"path": "other/*.txt"}]))]
    assert paths == ["data.sources[0].path"]


def _stage_work(run_dir, name):
    (run_dir / "stages" / name / "checkpoints").mkdir(parents=True)
    (run_dir / "stages" / name / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')


def test_opening_a_run_directory_with_an_edited_spec(tmp_path):
    run_dir = tmp_path / "run"
    assert open_run_dir(spec(), run_dir) is None
    _stage_work(run_dir, "base")
    mf.write_manifest(run_dir, mf.new_manifest(spec().fingerprint(), 0))

    # A gate loosened: the run continues under the edited spec, and the manifest says what changed.
    loose = spec(stages__0__gates__min_loss_drop=0.1)
    open_run_dir(loose, run_dir)
    assert load_spec(run_dir / SPEC_FILE).fingerprint() == loose.fingerprint()
    manifest = mf.read_manifest(run_dir)
    assert manifest["spec_sha256"] == loose.fingerprint()
    assert manifest["spec_changes"][-1]["changes"] == ["stages[0].gates.min_loss_drop: 0.15 -> 0.1"]

    # A change to the trained stage: refused, naming the field and the way forward; nothing moves.
    steps = spec(stages__0__gates__min_loss_drop=0.1, stages__0__train={"steps": 9})
    with pytest.raises(SpecChanged) as info:
        open_run_dir(steps, run_dir)
    message = str(info.value)
    assert info.value.exit_code == EXIT_BAD_SPEC
    assert "stages[0].train.steps" in message and "-> 9" in message
    assert "--restart-from base" in message and "train stage base again" in message
    assert (run_dir / "stages/base/metrics.jsonl").is_file()
    assert load_spec(run_dir / SPEC_FILE).fingerprint() == loose.fingerprint()

    # Said deliberately: the stage's work moves to superseded/1 with the spec it was made by.
    (run_dir / "export").mkdir()
    open_run_dir(steps, run_dir, restart_from="base")
    assert not (run_dir / "stages/base").exists() and not (run_dir / "export").exists()
    assert (run_dir / "superseded/1/stages/base/metrics.jsonl").is_file()
    assert (run_dir / "superseded/1/export").is_dir()
    assert load_spec(run_dir / "superseded/1" / SPEC_FILE).fingerprint() == loose.fingerprint()
    assert mf.read_manifest(run_dir)["spec_changes"][-1]["restart_from"] == "base"


def test_a_restart_is_carried_out_once_per_control_plane_job(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    open_run_dir(spec(), run_dir)
    mf.write_manifest(run_dir, mf.new_manifest(spec().fingerprint(), 0))
    _stage_work(run_dir, "base")
    monkeypatch.setenv("RUNYARD_JOB_ID", "12")
    open_run_dir(spec(), run_dir, restart_from="base")
    assert (run_dir / "superseded/1/stages/base").is_dir()
    _stage_work(run_dir, "base")  # the attempt trained again, then was preempted
    open_run_dir(spec(), run_dir, restart_from="base")  # the restarted attempt repeats its command line
    assert (run_dir / "stages/base/metrics.jsonl").is_file() and not (run_dir / "superseded/2").exists()
    assert [c["job"] for c in mf.read_manifest(run_dir)["spec_changes"]] == ["12"]


def test_restart_from_names_a_stage_of_the_spec(tmp_path):
    open_run_dir(spec(), tmp_path / "run")
    with pytest.raises(SpecError) as info:
        open_run_dir(spec(), tmp_path / "run", restart_from="nope")
    assert "one of the spec's stages ['base', 'sft']" in str(info.value)
    assert json.loads(json.dumps(info.value.problems))[0][0] == "--restart-from"


def test_a_layout_change_continues_and_a_precision_change_does_not():
    change = compare(spec(), spec(resources__parallel={"tp": 2}, resources__nproc=2, resources__threads=1))
    assert [c.path for c in change.layout] == ["resources.nproc", "resources.parallel", "resources.threads"]
    assert not change.altering and change.first_changed_stage is None
    priced = compare(spec(), spec(resources__requirement={"device_count": 2}))
    assert not priced.altering and [c.path for c in priced.judgement] == ["resources.requirement.device_count"]
    precision = compare(spec(), spec(resources__precision="bf16"))
    assert precision.every_stage and precision.first_changed_stage == 0
