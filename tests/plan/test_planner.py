"""`runyard plan` as a user runs it: the data's facts and preparation time, every phase of the run timed,
the requirement written, training against inference; and its refusals."""

import csv
import json

import numpy as np
import pytest
import yaml

from runyard import cli
from runyard.data.pipeline import prepare_data
from runyard.errors import EXIT_BAD_SPEC
from runyard.market.requirement import Requirement
from runyard.plan.dataprep import estimate_data
from runyard.run.preflight import resolve_sources
from runyard.spec.job import parse_spec

SPEC = {
    "name": "tiny-plan",
    "seed": 3,
    "data": {"sources": [{"path": "{stdlib}/json/*.py"}], "heldout_fraction": 0.2, "tokenizer": {"vocab_size": 300},
             "workers": 1},
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "context_length": 32},
    "train": {"steps": 20, "batch_size": 4},
    "stages": [{"name": "smoke", "train": {"steps": 5}}, {"name": "main"}],
    "eval": {"interval": 10, "batches": 2, "final_batches": 2, "prompts": ["def "], "sample_tokens": 4},
    "resources": {"device": "cpu", "threads": 1},
}


@pytest.fixture
def spec_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


def test_text_facts_and_preparation_are_measured_then_read_from_the_cache(tmp_path):
    spec = parse_spec(SPEC)
    files, _ = resolve_sources(spec.data)
    first = estimate_data(spec.task, spec.data, spec.seed, files, 1, tmp_path / "cache")
    again = estimate_data(spec.task, spec.data, spec.seed, files, 1, tmp_path / "cache")
    assert not first.cached and first.facts.files == len(files) and first.facts.bytes == sum(f.size for f in files)
    assert set(first.parts) == {"fingerprint", "clean", "tokenizer", "tokenize", "report"}
    # Deterministic apart from the timings: the same sample, the same tokenizer, the same counts.
    assert (first.facts.tokens, first.bytes_per_token) == (again.facts.tokens, again.bytes_per_token)
    prepared = prepare_data(spec.data, seed=spec.seed, report_dir=None, cache_dir=tmp_path / "cache", progress=False)
    cached = estimate_data(spec.task, spec.data, spec.seed, files, 1, tmp_path / "cache")
    split = prepared.stats["split"]
    assert cached.cached and set(cached.parts) == {"fingerprint"}
    assert cached.facts.tokens == split["train"]["tokens"] + split["heldout"]["tokens"]
    assert cached.facts.vocab_size == prepared.vocab_size
    # The sample's estimate of the corpus's tokens lands near the real count.
    assert 0.5 < first.facts.tokens / cached.facts.tokens < 2.0


def test_tables_and_images_are_counted_by_the_runs_readers(tmp_path):
    table = tmp_path / "t.csv"
    with table.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["a", "b", "target"])
        writer.writerows([[i, i * 2, i % 2] for i in range(7)])
    table_data = parse_spec({"name": "t", "task": "tabular_classification",
                             "data": {"sources": [{"path": str(table), "format": "csv"}], "table": {"target": "target"}}}).data
    files, _ = resolve_sources(table_data)
    tab = estimate_data("tabular_classification", table_data, 0, files, 1)
    assert (tab.facts.kind, tab.facts.rows, tab.facts.features, tab.facts.classes) == ("tabular", 7, 2, 2)
    arrays = tmp_path / "digits.npz"
    np.savez(arrays, images=np.random.default_rng(0).integers(0, 255, (12, 8, 8), dtype=np.uint8), labels=np.arange(12) % 3)
    image_data = parse_spec({"name": "t", "task": "image_classification",
                             "data": {"sources": [{"path": str(arrays), "format": "npz"}],
                                      "images": {"npz_images": "images", "npz_labels": "labels"}}}).data
    files, _ = resolve_sources(image_data)
    img = estimate_data("image_classification", image_data, 0, files, 1)
    assert (img.facts.rows, img.facts.image_shape, img.facts.classes, img.facts.features) == (12, (1, 8, 8), 3, 64)
    assert img.facts.config_facts("image_classification")["channels"] == 1


def test_plan_times_every_phase_writes_the_requirement_and_weighs_inference(spec_file, tmp_path, capsys):
    png, req = tmp_path / "life.png", tmp_path / "req.json"
    args = ["plan", str(spec_file), "--json", "--traffic", "5000", "--tokens-per-request", "64",
            "--png", str(png), "--requirement-out", str(req), "--budget-s", "0.5"]
    assert cli.main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["machine"]["calibrated"] and plan["data"]["parts"]["tokenize"] > 0
    for stage in plan["stages"]:
        assert set(stage["phases"]) == {"training", "evaluation", "checkpoints", "setup"}
        assert stage["calibration"]["steps"] >= 1 and stage["how"].startswith("calibrated")
        assert stage["memory"]["framework"] > 0 and stage["memory_per_device_bytes"] >= stage["memory"]["framework"]
    assert {"final evaluation", "export", "samples", "report"} <= set(plan["final_phases"])
    parts = plan["data"]["seconds"] + sum(s["estimated_seconds"] for s in plan["stages"]) + sum(
        plan["final_phases"].values())
    assert plan["estimated_seconds"] == pytest.approx(parts)
    assert plan["family"]["family"] == "decoder"
    assert plan["recommended_training"]["kind"] == "cpu"  # a tiny decoder: CPU cores, cheaper than a GPU's lease
    written = Requirement.model_validate(json.loads(req.read_text()))  # what `market demand --requirement` reads
    assert written.accelerator_kinds == ["cpu"] and written.model_dump(mode="json") == plan["requirement"]
    life = plan["lifetime"]
    assert life["traffic"]["units_per_request"] == 64 and life["serving"]["devices"] >= 1
    per_day, training = life["serving"]["cost_per_day"]["minor_units"], life["training"]["minor_units"]
    assert life["crossover_day"] == training // per_day + 1
    assert plan["cost"]["minor_units"] == training and isinstance(training, int)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_prints_a_table_without_calibrating(spec_file, tmp_path, capsys):
    args = ["plan", str(spec_file), "--no-calibrate", "--traffic", "100", "--png", str(tmp_path / "p.png")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "stated rates" in out and "FLOPs at 50% of the table matmul rate" in out
    assert "| day | cumulative inference | training |" in out and "overtakes training on day" in out
    assert "recommended training: 1 x CPU core" in out and "requirement: {" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--traffic", "-5"], "--traffic: must be 0 or more requests per day"),
        (["--traffic", "lots"], "--traffic: must be a number"),
        (["--traffic", "10", "--tokens-per-request", "0"], "--tokens-per-request: must be at least 1"),
        (["--traffic", "10", "--tokens-per-request", "5", "--rows-per-request", "5"], "not allowed with argument"),
    ],
)
def test_bad_command_lines_are_usage_errors(spec_file, capsys, extra, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", str(spec_file), *extra])
    assert info.value.code == EXIT_BAD_SPEC and message in capsys.readouterr().err


def test_rows_for_a_language_model_and_unknown_devices_are_refused(spec_file, tmp_path, capsys):
    assert cli.main(["plan", str(spec_file), "--traffic", "10", "--rows-per-request", "3"]) == EXIT_BAD_SPEC
    assert "--rows-per-request" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**SPEC, "costs": {"prices": {"h100": 250}}, "traffic": {"requests_per_day": -1}}))
    assert cli.main(["plan", str(bad)]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert "costs.prices" in err and "unknown accelerator kind(s) ['h100']" in err
    assert "traffic.requests_per_day" in err
    eur = tmp_path / "eur.yaml"
    eur.write_text(yaml.safe_dump({**SPEC, "costs": {"currency": "EUR"}}))
    assert cli.main(["plan", str(eur), "--no-calibrate"]) == EXIT_BAD_SPEC
    assert "costs.prices.cpu" in capsys.readouterr().err  # the kind chosen (by the table's prices) has none
