"""A run directory read before it finished: `show` says how far each stage got (interrupted at step N,
with its last checkpoint), and `generate` / `serve` say the run is unfinished, naming the stage and step,
instead of calling the directory something that is not an export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runyard.cli import main
from runyard.train.gates import GATES_FILE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stdlib-code.yaml"  # stages smoke (40 steps), full


def partly_trained(tmp_path: Path) -> Path:
    """A run killed in its second stage at step 120, with its newest checkpoint at step 100."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(EXAMPLE, run / "spec.yaml")
    smoke = run / "stages" / "smoke"
    (smoke / "checkpoints" / "step_00000040").mkdir(parents=True)
    (smoke / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (10, 20, 40)))
    (smoke / GATES_FILE).write_text(json.dumps({"stage": "smoke", "passed": True, "results": []}))
    full = run / "stages" / "full"
    for step in (50, 100):
        (full / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    (full / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0}) + "\n" for s in (50, 100, 120))
                                        + '{"step": 13')  # a line cut by the kill
    return run


def test_show_says_a_stage_is_interrupted_at_its_step_with_its_last_checkpoint(tmp_path, capsys):
    run = partly_trained(tmp_path)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "stage smoke: passed" in out
    assert "stage full: interrupted at step 120 of 300 (last checkpoint: step 100, " in out
    assert "step_00000100" in out and "not run" not in out
    assert main(["show", str(run), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [(s["name"], s["state"], s["gates"], s["step"], s["last_checkpoint_step"]) for s in stages] == [
        ("smoke", "passed", "passed", 40, 40), ("full", "interrupted", None, 120, 100)]
    # A stage that never started is still "not run".
    shutil.rmtree(run / "stages" / "full")
    assert main(["show", str(run)]) == 0
    assert "stage full: not run" in capsys.readouterr().out


@pytest.mark.parametrize("verb", [["generate"], ["serve"]])
def test_generate_and_serve_on_an_unfinished_run_say_it_is_unfinished(tmp_path, capsys, verb):
    run = partly_trained(tmp_path)
    args = [*verb, str(run), "--prompt", "x"] if verb == ["generate"] else [*verb, str(run)]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "is unfinished" in err and "stage full was interrupted at step 120 of 300" in err
    assert "last checkpoint: step 100" in err and f"runyard resume {run}" in err
    assert "is not a runyard export" not in err
    # A half-made export/ (no runyard.json: the rename had not happened) reads the same.
    (run / "export").mkdir()
    (run / "export" / "config.json").write_text("{}")
    assert main(args) != 0
    assert "is unfinished" in capsys.readouterr().err
