"""The spine end to end through the real command line: run, checkpoint, SIGTERM, resume, gates,
evaluation, export and generate. Tiny model, real data (a slice of the stdlib), real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runyard.errors import EXIT_GATE_FAILED, EXIT_PREEMPTED
from runyard.model.hf.export import load_export
from runyard.model.transformer import Transformer
from runyard.system.processes import popen_dying_with_me
from runyard.train import checkpoint as ckpt
from runyard.train.checkpoint.checksums import CHECKSUM

from .conftest import REFERENCE_STEPS as STEPS
from .conftest import runyard

pytestmark = pytest.mark.slow


@pytest.fixture
def reference(reference_run):
    """The session's reference run (tests/e2e/conftest.py): 60 steps on a corpus a tiny model learns
    decisively, so that its quality holds on any CPU."""
    return reference_run.spec, reference_run.run_dir, reference_run.stdout


def final_weights(run_dir: Path, stage: str = "main") -> dict[str, torch.Tensor]:
    ref = ckpt.latest_good(run_dir / "stages" / stage / "checkpoints")
    assert ref is not None and ref.step == STEPS
    tensors, _ = ckpt.read_checkpoint(ref.path)
    return tensors["model"]


def losses(run_dir: Path, stage: str = "main") -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "stages" / stage / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def test_run_directory_is_complete(reference):
    _spec, run_dir, stdout = reference
    for rel in [
        "spec.yaml", "manifest.json", "data/report.md", "data/report.json",
        "stages/main/metrics.jsonl", "stages/main/gates.json",
        "eval/report.md", "eval/report.json", "eval/loss.png", "eval/lr.png",
        "export/model.safetensors", "export/tokenizer.json", "export/config.json", "export/drift_reference.json",
        "data/held_out.txt",
    ]:
        assert (run_dir / rel).is_file(), rel
    # The drift reference was written before the export's rename, and its runyard.json lists it.
    listed = json.loads((run_dir / "export" / "runyard.json").read_text())["files"]
    assert {"drift_reference.json", "drift_sample.safetensors"} <= set(listed)
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == sorted([*listed, "runyard.json"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for key in ("spec_sha256", "seeds", "code", "packages", "hardware", "command_line", "started_at", "finished_at", "data"):
        assert manifest.get(key) is not None, key
    assert manifest["packages"]["torch"] == torch.__version__.split("+")[0] or manifest["packages"]["torch"].startswith(torch.__version__[:4])
    assert manifest["data"]["inputs"], "input fingerprints recorded"
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    m = report["metrics"]
    # Measured 1.86 against 4.40 (58% below); the bound, a third below, leaves ~1 nat, a hundred times
    # the difference between CPUs (~0.01 nats when this run trained on the stdlib and barely learned).
    assert m["heldout_loss"] < (2 / 3) * m["unigram_loss"], f"the model must beat a context-free baseline: {m}"
    assert "held-out perplexity" in stdout and "unigram" in stdout
    # --no-progress, output to a pipe: no bars, but every long phase says when it starts and ends
    for line in ("stage main: started of 60", "stage main: done 60 in", "tokenize: done", "final evaluation: done",
                 "export: done", "samples: done"):
        assert line in stdout, f"{line!r} not logged:\n{stdout}"
    gates = json.loads((run_dir / "stages/main/gates.json").read_text())
    assert gates["passed"] and {g["name"] for g in gates["gates"]} >= {"finite", "loss_drop", "checkpoint_roundtrip"}
    assert [s for s, _ in losses(run_dir)] == list(range(1, STEPS + 1))


def test_export_gives_the_same_logits_as_the_trained_model(reference):
    _spec, run_dir, _ = reference
    model, cfg, _tok = load_export(run_dir / "export")
    live = Transformer(cfg)
    live.load_state_dict(final_weights(run_dir))
    live.eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(idx), live(idx))


def test_generate_cli_is_deterministic_for_a_seed(reference):
    _spec, run_dir, _ = reference
    a = runyard("generate", str(run_dir), "--prompt", "def ", "--max-tokens", "12", "--seed", "3", check=True)
    b = runyard("generate", str(run_dir), "--prompt", "def ", "--max-tokens", "12", "--seed", "3", check=True)
    assert a.stdout == b.stdout and a.stdout.startswith("def ")
    show = runyard("show", str(run_dir), "--json", check=True)
    assert json.loads(show.stdout)["exported"] is True


@pytest.mark.parametrize("option", [["--top-p", "0"], pytest.param(["--temperature", "-1"], marks=pytest.mark.full),
                                    pytest.param(["--top-k", "0"], marks=pytest.mark.full)])
def test_generate_rejects_bad_sampling_options_without_a_traceback(tmp_path, option):
    proc = runyard("generate", str(tmp_path), "--prompt", "x", *option)
    assert proc.returncode == 2, proc.stderr
    assert option[0] in proc.stderr and "Traceback" not in proc.stderr


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if len(lines) >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("run did not reach the step in time")


@pytest.mark.parametrize("corrupt_newest", [False, True], ids=["resume", "resume-after-corrupt-checkpoint"])
def test_sigterm_then_resume_is_bitwise_identical(reference, tmp_path, corrupt_newest):
    spec, ref_dir, _ = reference
    run_dir = tmp_path / "run"
    proc = popen_dying_with_me(
        [sys.executable, "-m", "runyard", "run", str(spec), "--run-dir", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_for_step(run_dir / "stages/main/metrics.jsonl", 23, proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped by SIGTERM" in err
    refs = ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")
    stopped_at = refs[-1].step
    assert 23 <= stopped_at < STEPS
    if corrupt_newest:
        model_file = refs[-1].path / "model.safetensors"
        data = bytearray(model_file.read_bytes())
        data[-100] ^= 0xFF
        model_file.write_bytes(bytes(data))

    resumed = runyard("resume", str(run_dir), "--no-progress", check=True)
    if corrupt_newest:
        # Log lines wrap at the terminal's width, wherever the run directory's path puts them.
        assert f"fails its {CHECKSUM} checksum" in " ".join((resumed.stderr + resumed.stdout).split())
    reference, result = final_weights(ref_dir), final_weights(run_dir)
    assert reference.keys() == result.keys()
    for name in reference:
        assert torch.equal(reference[name], result[name]), f"{name} differs after resume"
    assert losses(run_dir) == losses(ref_dir), "the same loss at every step"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert len(manifest["sessions"]) == 2


def test_failed_gate_stops_the_run_before_later_stages(write_spec, tmp_path):
    spec = write_spec(
        {
            "train": {"steps": 8},
            "stages": [
                {"name": "smoke", "gates": {"max_heldout_loss": 0.001}},
                {"name": "full"},
            ],
        }
    )
    run_dir = tmp_path / "run"
    proc = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == EXIT_GATE_FAILED, proc.stderr
    assert "heldout_loss" in proc.stderr and "later stages not started" in proc.stderr
    gates = json.loads((run_dir / "stages/smoke/gates.json").read_text())
    assert gates["passed"] is False
    assert [g["name"] for g in gates["gates"] if not g["passed"]] == ["heldout_loss"]
    assert not (run_dir / "stages/full").exists()
    assert not (run_dir / "export").exists()
    # Resuming a run whose gate failed refuses again rather than starting the next stage.
    again = runyard("resume", str(run_dir), "--no-progress")
    assert again.returncode == EXIT_GATE_FAILED and not (run_dir / "stages/full").exists()

    # The gate judged again without training: with the stored spec it fails, with a loosened one it passes.
    smoke = run_dir / "stages/smoke"
    trained = {p.relative_to(smoke): p.read_bytes() for p in smoke.rglob("*") if p.is_file() and p.name != "gates.json"}
    loose = write_spec({"train": {"steps": 8}, "stages": [{"name": "smoke", "gates": {"max_heldout_loss": 50.0}},
                                                          {"name": "full", "gates": {"min_loss_drop": None}}]},
                       name="loose.yaml")
    judged = runyard("gates", str(run_dir))
    assert judged.returncode == EXIT_GATE_FAILED and "stage smoke: failed" in judged.stdout, judged.stdout
    judged = runyard("gates", str(run_dir), "--spec", str(loose), "--json")
    assert judged.returncode == 0, judged.stdout + judged.stderr
    verdict = json.loads(judged.stdout)["stages"]
    assert verdict[0]["state"] == "passed" and verdict[0]["recorded"] is False
    assert verdict[1]["state"] == "not finished"
    assert json.loads((smoke / "gates.json").read_text())["passed"] is False  # `gates` writes nothing

    # A change to what the smoke stage trained on is refused, naming the field and the way forward.
    steps = write_spec({"train": {"steps": 8}, "stages": [{"name": "smoke", "train": {"steps": 6},
                                                           "gates": {"max_heldout_loss": 50.0}}, {"name": "full"}]},
                       name="steps.yaml")
    refused = runyard("run", str(steps), "--run-dir", str(run_dir), "--no-progress")
    assert refused.returncode == 2, refused.stderr
    said = " ".join(refused.stderr.split())
    assert "stages[0].train.steps: (absent) -> 6" in said and "--restart-from smoke" in said, said

    # Run with the loosened spec: smoke is judged again and passes, untouched; the next stage trains.
    proc = runyard("run", str(loose), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert {p.relative_to(smoke): p.read_bytes() for p in smoke.rglob("*")
            if p.is_file() and p.name != "gates.json"} == trained
    assert json.loads((smoke / "gates.json").read_text())["passed"] is True
    assert (run_dir / "stages/full/gates.json").is_file() and (run_dir / "export/runyard.json").is_file()
    changes = json.loads((run_dir / "manifest.json").read_text())["spec_changes"]
    assert changes[-1]["changes"] == ["stages[0].gates.max_heldout_loss: 0.001 -> 50.0",
                                      "stages[1].gates.min_loss_drop: 0.1 -> null"]

    # --restart-from says it deliberately: the full stage and the export move aside, and are made again.
    proc = runyard("run", str(loose), "--run-dir", str(run_dir), "--no-progress", "--restart-from", "full")
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "superseded/1/stages/full/gates.json").is_file()
    assert (run_dir / "superseded/1/export/runyard.json").is_file()
    assert (run_dir / "stages/full/gates.json").is_file() and (run_dir / "export/runyard.json").is_file()
    assert (run_dir / "stages/smoke/gates.json").is_file() and not (run_dir / "superseded/1/stages/smoke").exists()


def test_spec_that_does_not_fit_its_data_is_refused_before_training(write_spec, tmp_path):
    spec = write_spec({"model": {"vocab_size": 300, "context_length": 1_000_000}})
    run_dir = tmp_path / "run"
    proc = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert "model.vocab_size: got 300; at least the tokenizer's vocabulary, 512" in proc.stderr
    assert "model.context_length: got 1000000" in proc.stderr
    assert not (run_dir / "stages").exists()
