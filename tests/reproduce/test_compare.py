"""Comparing two run directories: verdicts, the step where curves part, the differences named, the
report files; and the input checks that name a changed seed or data file."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from runyard.reproduce.compare import BITWISE, DIFFERENT, WITHIN_TOLERANCE, compare_runs
from runyard.reproduce.datacheck import check_inputs, record_data_files
from runyard.reproduce.report import write_report
from runyard.spec.job import parse_spec

from .helpers import write_run

LOSSES = [6.2, 5.9, 5.5, 5.2, 5.0, 4.8]


def _lock(torch_cuda=None, numpy="2.4.6", omp="1", files=None):
    return {
        "python": {"implementation": "CPython", "version": "3.11.7", "platform": "linux-x86_64"},
        "torch": {"__version__": "2.13.0+cpu" if torch_cuda is None else "2.13.0+cu128", "cuda": torch_cuda},
        "distributions": [{"name": "numpy", "version": numpy, "content_sha256": "n" * 64},
                          {"name": "runyard", "version": "0.1.0", "content_sha256": "x"}],
        "runyard": {"source_sha256": json.dumps(files or {"runyard/a.py": "1"}), "files": files or {"runyard/a.py": "1"}},
        "numerics_env": {"OMP_NUM_THREADS": omp},
    }


def test_identical_runs_are_bitwise(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, {3: 5.6, 6: 5.1}, lock=_lock())
    b = write_run(tmp_path / "b", LOSSES, {3: 5.6, 6: 5.1}, lock=_lock())
    c = compare_runs(a, b)
    assert c.verdict == BITWISE and c.expected == BITWISE
    (s,) = c.stages
    assert s.steps_compared == 6 and s.max_abs_diff == 0 and s.first_differing_step is None and s.bitwise
    assert c.weights["equal"] and not c.environment_differences and not c.input_differences


def test_small_differences_hold_within_tolerance_and_name_the_first_differing_step(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, lock=_lock())
    nudged = LOSSES[:3] + [x + 1e-4 for x in LOSSES[3:]]
    b = write_run(tmp_path / "b", nudged, weights=b"other", lock=_lock(torch_cuda="12.8"),
                  metrics={"heldout_loss": LOSSES[-1] + 0.1 + 1e-4, "train_loss": LOSSES[-1] + 1e-4},
                  manifest={"hardware": {"cpu": "cpu-model", "cores": 2, "gpus": [{"name": "NVIDIA H100"}]}})
    c = compare_runs(a, b, tolerance=1e-3)
    assert c.verdict == WITHIN_TOLERANCE and c.expected == WITHIN_TOLERANCE
    (s,) = c.stages
    assert s.first_differing_step == 4 and s.first_parting_step is None
    assert s.max_abs_diff == pytest.approx(1e-4)
    assert any("torch cuda: None vs 12.8" in d for d in c.environment_differences)
    assert any("GPUs" in d and "H100" in d for d in c.hardware_differences)


def test_curves_that_part_are_different_with_the_step_and_the_causes(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, lock=_lock(), seed=7)
    b = write_run(tmp_path / "b", LOSSES[:2] + [5.7, 5.6, 5.6, 5.5], weights=b"other", seed=8,
                  lock=_lock(numpy="2.4.5", omp="2", files={"runyard/a.py": "2"}))
    c = compare_runs(a, b, tolerance=0.05)
    assert c.verdict == DIFFERENT
    (s,) = c.stages
    assert s.first_differing_step == 3 and s.first_parting_step == 3 and s.max_abs_diff == pytest.approx(0.7)
    assert "seed: 7 vs 8" in c.input_differences
    env = "\n".join(c.environment_differences)
    assert "numpy: 2.4.6 vs 2.4.5" in env and "$OMP_NUM_THREADS: 1 vs 2" in env and "runyard/a.py" in env


def test_a_rerun_that_stopped_early_is_different(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, lock=_lock())
    b = write_run(tmp_path / "b", LOSSES[:4], lock=_lock())
    c = compare_runs(a, b, tolerance=1.0)
    assert c.verdict == DIFFERENT and c.stages[0].steps_missing == [5, 6]


def test_report_files(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, lock=_lock())
    b = write_run(tmp_path / "b", LOSSES[:3] + [5.3, 5.1, 4.9], lock=_lock(), weights=b"other")
    c = compare_runs(a, b, tolerance=0.05)
    data = write_report(tmp_path / "out", c, "Reproduction of demo", {"backend": "local"})
    assert data["verdict"] == DIFFERENT and json.loads((tmp_path / "out" / "report.json").read_text())["stages"][0][
        "first_parting_step"] == 4
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Verdict: DIFFERENT**" in md and "a bitwise result was expected here" in md and "| main | 6 |" in md
    png = (tmp_path / "out" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_compare_cli_exit_codes(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, lock=_lock())
    b = write_run(tmp_path / "b", LOSSES, lock=_lock())
    c = write_run(tmp_path / "c", [x + 1 for x in LOSSES], lock=_lock(), weights=b"x")
    same = subprocess.run([sys.executable, "-m", "runyard", "compare", str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0 and "BITWISE" in same.stdout and (b / "comparison" / "report.md").is_file()
    other = subprocess.run([sys.executable, "-m", "runyard", "compare", str(a), str(c), "--out", str(tmp_path / "r")],
                           capture_output=True, text=True)
    assert other.returncode == 1 and "DIFFERENT" in other.stdout and (tmp_path / "r" / "curves.png").is_file()


def _spec(data_dir, seed=7):
    return parse_spec({"name": "t", "seed": seed, "data": {"sources": [{"path": f"{data_dir}/*.txt"}]}})


def test_check_inputs_names_changed_missing_and_new_files_and_the_seed(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (data / name).write_text(f"text of {name}\n")
    spec = _spec(data)
    manifest = {"spec_sha256": spec.fingerprint(), "seeds": {"spec": 7}, "data_files": record_data_files(spec.data)}
    assert check_inputs(spec, manifest) == []
    (data / "b.txt").write_text("edited\n")
    (data / "c.txt").unlink()
    (data / "d.txt").write_text("new\n")
    changes = dict(check_inputs(spec, manifest))
    (key,) = [k for k in changes if k.startswith("data ")]
    assert "content changed: b.txt" in changes[key] and "missing: c.txt" in changes[key] and "new: d.txt" in changes[key]
    reseeded = _spec(data, seed=8)
    changes = dict(check_inputs(reseeded, manifest))
    assert changes["seed"] == "the run used seed 7; spec.yaml now says 8" and "spec" in changes


def _sharded_export(run_dir, second_shard: bytes):
    """Replace the run's export with a sharded HF-style one whose runyard.json lists every file's sha256."""
    export = run_dir / "export"
    (export / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": b"first shard", "model-00002-of-00002.safetensors": second_shard,
             "model.safetensors.index.json": b"{}", "config.json": b"{}"}
    for name, data in files.items():
        (export / name).write_bytes(data)
    table = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    (export / "runyard.json").write_text(json.dumps({"format": "runyard-export", "files": table}))


def test_a_sharded_export_is_compared_by_every_file_its_record_lists(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, lock=_lock())
    b = write_run(tmp_path / "b", LOSSES, lock=_lock())
    same = write_run(tmp_path / "same", LOSSES, lock=_lock())
    _sharded_export(a, b"second shard")
    _sharded_export(b, b"second shard, changed")
    _sharded_export(same, b"second shard")
    differs = compare_runs(a, b)
    assert not differs.weights["equal"] and differs.weights["original_sha256"] is not None
    assert differs.verdict != BITWISE  # same curves and metrics, one shard differs
    held = compare_runs(a, same)
    assert held.weights["equal"] and held.verdict == BITWISE
