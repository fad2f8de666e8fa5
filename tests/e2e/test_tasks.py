"""Whole tabular and image runs, as a user runs them: the shipped examples through the real command line
(data report, gated stage, evaluation beating its baseline, export with schema and ONNX), a second run
that reuses the passed stage, the family chosen from the data when the spec leaves it out, and
`runyard serve` answering POST /v1/predict with the model's own predictions."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from runyard.run.execute import execute_run
from runyard.serve.predict_export import load_predictor
from runyard.spec.job import load_spec, parse_spec
from runyard.system.cpus import choose_threads
from tests.e2e.conftest import runyard
from tests.serve.served import start_served

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "eval" / "report.json").read_text())


def test_the_breast_cancer_example_end_to_end_then_served(tmp_path):
    run_dir = tmp_path / "bc"
    proc = runyard("run", str(EXAMPLES / "tabular-breast-cancer.yaml"), "--run-dir", str(run_dir), "--no-progress", check=True)
    assert "fit to ship: yes" in proc.stdout
    first = report(run_dir)
    p = first["prediction"]
    assert first["fit_to_ship"] and p["metrics"]["accuracy"] > 0.9 > p["baseline"]["accuracy"]
    assert p["metrics"]["log_loss"] < 0.5 * p["baseline"]["log_loss"] and "linear" in p["others"]
    for name in ("confusion_matrix.png", "calibration.png", "loss.png"):
        assert (run_dir / "eval" / name).stat().st_size > 1000
    for name in ("report.md", "class_balance.png", "features.png"):
        assert (run_dir / "data" / name).is_file()
    # One thread count for torch and LightGBM, recorded in the manifest (runyard/system/cpus.py).
    threads = json.loads((run_dir / "manifest.json").read_text())["threads"]
    fitted = json.loads((run_dir / "stages" / "main" / "model" / "stage.json").read_text())
    assert threads["threads"] >= 1 and fitted["details"]["params"]["num_threads"] == threads["threads"]
    gates = json.loads((run_dir / "stages" / "main" / "gates.json").read_text())
    assert gates["passed"] and {g["name"] for g in gates["gates"]} >= {"loss_drop", "heldout_loss", "checkpoint_roundtrip"}
    config = json.loads((run_dir / "export" / "runyard.json").read_text())
    assert config["kind"] == "table" and config["onnx"]["written"] and config["onnx"]["matches"]

    # Again: the passed stage is reused (its model verified), and the evaluation is the same.
    stage_model = (run_dir / "stages" / "main" / "model" / "model.txt").stat().st_mtime_ns
    runyard("run", str(EXAMPLES / "tabular-breast-cancer.yaml"), "--run-dir", str(run_dir), "--no-progress", check=True)
    assert (run_dir / "stages" / "main" / "model" / "model.txt").stat().st_mtime_ns == stage_model
    assert report(run_dir)["prediction"]["metrics"] == p["metrics"]
    shown = json.loads(runyard("show", str(run_dir), "--json", check=True).stdout)
    assert shown["test_metrics"] == p["metrics"] and shown["exported"]

    server, url = start_served(run_dir, timeout_s=90, poll_s=0.2)
    try:
        predictor = load_predictor(run_dir / "export")
        names = predictor.table_schema.names
        rng = np.random.default_rng(0)
        rows = [{n: float(v) for n, v in zip(names, rng.normal(15, 5, size=len(names)), strict=True)} for _ in range(5)]
        body = httpx.post(f"{url}/v1/predict", json={"rows": rows}, timeout=60).json()
        expected = predictor.predict_matrix(np.array([[r[n] for n in names] for r in rows]))
        got = np.array([[q["probabilities"][c] for c in predictor.classes] for q in body["predictions"]])
        assert np.array_equal(got, expected) and body["model"] == "breast-cancer"
        missing = httpx.post(f"{url}/v1/predict", json={"rows": [{**rows[0], "mean radius": "big"}]})
        assert missing.status_code == 422 and missing.json()["error"]["param"] == "rows[0].mean radius"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def test_a_small_table_without_a_family_gets_the_linear_model_and_says_why(tmp_path):
    rng = np.random.default_rng(3)
    lines = ["x1,x2,colour,y"]
    for _ in range(90):
        x1, x2 = rng.normal(size=2)
        colour = rng.choice(["red", "blue"])
        lines.append(f"{x1:.4f},{x2:.4f},{colour},{2 * x1 - x2 + (colour == 'red') + rng.normal(scale=0.1):.4f}")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    spec = parse_spec({"task": "tabular_regression", "name": "small", "data": {
        "sources": [{"path": str(tmp_path / "t.csv"), "format": "csv"}], "heldout_fraction": 0.2,
        "table": {"target": "y"}}, "stages": [{"name": "main", "gates": {"min_loss_drop": 0.5}}]})
    summary = execute_run(spec, tmp_path / "run", show_progress=False)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["task"]["family"] == "linear" and "90 rows (< 100): too few for lightgbm" in manifest["task"]["chosen"]
    assert manifest["threads"] == choose_threads(None, 1).to_dict()
    assert summary.fit_to_ship and summary.prediction["metrics"]["r2"] > 0.9
    assert summary.prediction["metrics"]["rmse"] < 0.5 * summary.prediction["baseline"]["rmse"]
    assert (tmp_path / "run" / "eval" / "predictions.png").is_file()
    assert "recommended from the data" in (tmp_path / "run" / "eval" / "report.md").read_text()


def test_the_digits_cnn_trains_through_the_loop_and_beats_its_baseline(tmp_path):
    raw = yaml.safe_load((EXAMPLES / "digits-cnn.yaml").read_text())
    raw["train"]["steps"] = 60  # the example's 150, shortened: the test checks the path, the README the figures
    raw["checkpoint"]["interval"] = 20
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_spec(path)
    summary = execute_run(spec, tmp_path / "run", show_progress=False)
    p = summary.prediction
    assert p["metrics"]["accuracy"] > 0.8 and p["baseline"]["accuracy"] < 0.15
    assert summary.stages[0]["samples_per_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "stages" / "main" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["samples"] == 60 * 64 and "samples_per_s" in rows[-1] and "tokens_per_s" not in rows[-1]
    assert [c.name for c in sorted((tmp_path / "run" / "stages" / "main" / "checkpoints").glob("step_*"))][-1].endswith("60")
    config = json.loads((tmp_path / "run" / "export" / "runyard.json").read_text())
    assert config["kind"] == "image" and config["onnx"]["matches"] and "model.safetensors" in config["files"]
    assert (tmp_path / "run" / "data" / "samples.png").is_file()
    # Resumed after the fact: the passed stage is not trained again and the same model is evaluated.
    again = execute_run(spec, tmp_path / "run", show_progress=False)
    assert again.prediction["metrics"] == p["metrics"]


@pytest.mark.full  # fast tier: two DDP processes match one (test_distributed); the CNN trains (digits)
def test_the_cnn_on_two_processes_follows_the_one_process_curve(tmp_path):
    """Several processes through the same loop: 2 ranks x 32 images take the very 64 images one rank
    takes per step (the loader's contract), and DDP averages their gradients, so every step's loss
    matches the one-process run's. Batch norm is off: its statistics are per rank by design."""
    raw = yaml.safe_load((EXAMPLES / "digits-cnn.yaml").read_text())
    raw["train"] = {"steps": 12, "batch_size": 64}
    raw["model"]["cnn"]["batch_norm"] = False
    raw["checkpoint"]["interval"] = 6
    raw["eval"]["interval"] = 6
    raw["stages"][0]["gates"] = {"min_loss_drop": None}
    # 12 steps are not a model fit to ship (runyard run would exit 7): the test is about the curve.
    raw["eval"]["prediction"] = {**raw["eval"].get("prediction", {}), "min_accuracy": None, "must_beat_baseline": False}

    def curve(name: str, batch: int, *nproc: str) -> list[tuple[int, float]]:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump({**raw, "train": {"steps": 12, "batch_size": batch}}))
        runyard("run", str(spec), "--run-dir", str(tmp_path / name), "--no-progress", *nproc, check=True, timeout=600)
        rows = [json.loads(line) for line in (tmp_path / name / "stages" / "main" / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows]

    one, two = curve("one", 64), curve("two", 32, "--nproc", "2")
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, 13))
    for (step, a), (_, b) in zip(one, two, strict=True):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: one process {a}, two processes {b}"
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["sessions"][-1]["world_size"] == 2
