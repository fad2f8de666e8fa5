"""Bad sft and dpo records stop `runyard plan` and `runyard run` before any work (exit 2, the run
directory never made), each kind of problem and every bad record listed by file:line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runyard.cli import main
from tests.data.test_instruct_check import BAD_DPO, BAD_SFT, good_line, plant

from .conftest import TINY_SPEC, merge, runyard


def spec_for(tmp: Path, records: Path, kind: str = "sft", **data) -> Path:
    stage = {"name": "tune", "kind": kind, "data": {"sources": [{"path": str(records)}], "chat_template": "default",
                                                   **data}}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_SPEC, {"stages": [{"name": "pre"}, stage]})))
    return path


def both_refuse(spec: Path, run_dir: Path, capsys) -> str:
    """plan and run, in this process through the command line's own entry point: both exit 2, and the
    run directory is never made. Returns what run said."""
    assert main(["plan", str(spec), "--no-calibrate"]) == 2
    planned = capsys.readouterr().err
    assert main(["run", str(spec), "--run-dir", str(run_dir), "--no-progress"]) == 2
    said = capsys.readouterr().err
    assert not run_dir.exists()
    assert planned == said
    return said


@pytest.mark.parametrize("kind", sorted(BAD_SFT))
def test_each_kind_of_bad_instruction_record_stops_plan_and_run_before_work(kind, tmp_path, capsys):
    records = tmp_path / "chats.jsonl"
    (line, _), = plant(records, {kind: BAD_SFT[kind]}).items()
    said = both_refuse(spec_for(tmp_path, records), tmp_path / "run", capsys)
    assert f"1 bad record ({kind} 1)" in said and f"{records}:{line}: {BAD_SFT[kind][1]}: " in said


@pytest.mark.parametrize("kind", sorted(BAD_DPO))
def test_each_kind_of_bad_preference_record_stops_plan_and_run_before_work(kind, tmp_path, capsys):
    records = tmp_path / "pairs.jsonl"
    good = [json.dumps({"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}) for i in range(10)]
    records.write_text("\n".join(good[:4] + [BAD_DPO[kind][0]] + good[4:]) + "\n")
    said = both_refuse(spec_for(tmp_path, records, "dpo"), tmp_path / "run", capsys)
    assert f"1 bad record ({kind} 1)" in said and f"{records}:5: {BAD_DPO[kind][1]}: " in said


def test_every_bad_record_is_listed_by_the_real_command_line(tmp_path):
    records = tmp_path / "chats.jsonl"
    where = plant(records, BAD_SFT)
    spec = spec_for(tmp_path, records)
    for args in (["plan", str(spec), "--no-calibrate"], ["run", str(spec), "--run-dir", str(tmp_path / "run")]):
        proc = runyard(*args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        said = proc.stderr
        assert f"{len(BAD_SFT)} bad records" in said
        for line in where:
            assert f"{records}:{line}: " in said
    assert not (tmp_path / "run").exists()


def test_skip_lets_plan_say_what_it_will_leave_out(tmp_path, capsys):
    records = tmp_path / "chats.jsonl"
    plant(records, BAD_SFT)
    spec = spec_for(tmp_path, records, on_bad_record="skip")
    assert main(["plan", str(spec), "--no-calibrate"]) == 0
    out = capsys.readouterr().out
    assert f"records of stage tune: {40 + len(BAD_SFT)} checked, {len(BAD_SFT)} bad, left out" in out
    assert good_line(0)  # the fixture's good records are what is left
