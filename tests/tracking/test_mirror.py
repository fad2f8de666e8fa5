"""The run's mirrors in MLflow and TensorBoard, read back with their own readers: a real SQLite MLflow store
in the run directory (MLflow's client), TensorBoard event files (tensorboard's EventAccumulator), a
server that cannot be reached, a resume that goes on logging into the same MLflow run, and the mirror's own
process, which never outlives the run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runyard.errors import SpecError
from runyard.spec.job import parse_spec
from runyard.spec.tracking import TrackingSpec, with_tracking_flags
from runyard.system.processes import is_zombie_or_gone, parent_of, popen_dying_with_me, processes_with_env
from runyard.tracking.mirror import tracked_run_id
from runyard.tracking.process import MIRROR_ENV, NICENESS
from runyard.tracking.sinks import default_mlflow_uri
from tests.e2e.conftest import TINY_SPEC, merge, runyard, shared_once, write_spec  # noqa: F401  (write_spec: a fixture)

mlflow_tracking = pytest.importorskip("mlflow.tracking", reason="the tracking extra: pip install 'runyard[tracking]'")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

# Two short stages, so that a resume has a stage left to train and the stage boundary is visible. The mirror's
# process imports MLflow on its own: on a loaded test machine that outlasts an 8-step session, and these tests
# are about what arrives, so the end of a session may wait longer than the default 30 s for it.
TWO_STAGES = {"train": {"steps": 8}, "stages": [{"name": "first", "gates": {"min_loss_drop": 0.0}},
                                                {"name": "second", "gates": {"min_loss_drop": 0.0}}],
              "tracking": {"flush_timeout_s": 180}}


def rows(run_dir: Path, stage: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages" / stage / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tracked_run(tmp_path_factory):
    """A run stopped after its first stage (`--stage first`), then resumed to the end with no flag: the
    tracking section the first command line added is in the run's spec.yaml. Made once per session,
    whichever xdist worker asks first (shared_once); read only."""

    def make(base: Path) -> None:
        spec = base / "spec.yaml"
        spec.write_text(__import__("yaml").safe_dump(merge(TINY_SPEC, TWO_STAGES)))
        run_dir = base / "run"
        runyard("run", str(spec), "--run-dir", str(run_dir), "--stage", "first", "--no-progress",
                "--tracking", "mlflow", "--tracking", "tensorboard", check=True)
        first_id = tracked_run_id(run_dir)
        client = mlflow_tracking.MlflowClient(default_mlflow_uri(run_dir)[0])
        first_history = len(client.get_metric_history(first_id, "first/loss"))
        runyard("resume", str(run_dir), "--no-progress", check=True)
        (base / "first.json").write_text(json.dumps({"id": first_id, "history": first_history}))

    base = shared_once(tmp_path_factory, "tracked-run", make)
    first = json.loads((base / "first.json").read_text())
    return base / "run", first["id"], first["history"]


def mirrors_of(run_dir: Path) -> list[int]:
    return processes_with_env(MIRROR_ENV, str(run_dir.resolve()))


def test_resume_continues_the_same_mlflow_run(tracked_run):
    run_dir, first_id, first_history = tracked_run
    assert mirrors_of(run_dir) == []  # each session's mirror ended with it
    assert first_id is not None and tracked_run_id(run_dir) == first_id
    assert first_history == len(rows(run_dir, "first"))  # the first session sent its stage before it ended
    client = mlflow_tracking.MlflowClient(default_mlflow_uri(run_dir)[0])
    experiment = client.get_experiment_by_name("runyard")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [first_id]
    run = client.get_run(first_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"


def test_mlflow_holds_params_metrics_by_step_artefacts_and_fingerprints(tracked_run):
    run_dir, run_id, _ = tracked_run
    client = mlflow_tracking.MlflowClient(default_mlflow_uri(run_dir)[0])
    run = client.get_run(run_id)
    params = run.data.params
    assert params["model.d_model"] == "32" and params["train.steps"] == "8" and params["seed"] == "7"
    assert params["stages.1.name"] == "second" and not any(k.startswith("tracking") for k in params)
    for stage in ("first", "second"):
        written = rows(run_dir, stage)
        for figure in ("loss", "lr", "grad_norm", "tokens_per_s"):
            history = sorted(client.get_metric_history(run_id, f"{stage}/{figure}"), key=lambda m: m.step)
            assert [(m.step, m.value) for m in history] == [(r["step"], r[figure]) for r in written], (stage, figure)
        held = client.get_metric_history(run_id, f"{stage}/heldout_loss")
        assert sorted((m.step, m.value) for m in held) == [(r["step"], r["heldout_loss"]) for r in written if "heldout_loss" in r]
        assert run.data.metrics[f"{stage}/gates/passed"] == 1.0
        assert run.data.tags[f"runyard.stage.{stage}.gates"] == "passed"
    # The stage boundary: the second stage's steps continue after the first's on one axis.
    assert run.data.tags["runyard.stage.first.step_offset"] == "0"
    assert run.data.tags["runyard.stage.second.step_offset"] == "8"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert run.data.tags["runyard.spec_sha256"] == manifest["spec_sha256"]
    assert run.data.tags["runyard.export.data_fingerprint"] == manifest["data"]["fingerprint"]
    assert run.data.metrics["eval/metrics/heldout_loss"] == report["metrics"]["heldout_loss"]
    assert run.data.metrics["data/read/documents_read"] > 0
    artefacts = {a.path for folder in ("", "eval", "export", "data") for a in client.list_artifacts(run_id, folder or None)}
    assert {"eval/report.md", "eval/report.json", "eval/loss.png", "export/model.safetensors", "export/runyard.json",
            "export/config.json", "data/report.json", "spec.yaml", "export_signature.json"} <= artefacts
    version = client.get_model_version("tiny", "1")
    assert version.run_id == run_id and version.tags["runyard.export.spec_sha256"] == manifest["spec_sha256"]


def test_tensorboard_events_hold_the_same_scalars(tracked_run):
    run_dir, _, _ = tracked_run
    events = event_accumulator.EventAccumulator(str(run_dir / "tracking" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for stage in ("first", "second"):
        written = rows(run_dir, stage)
        scalars = events.Scalars(f"{stage}/loss")
        assert [s.step for s in scalars] == [r["step"] for r in written]  # once each: the resume sent no row twice
        assert [s.value for s in scalars] == pytest.approx([r["loss"] for r in written], rel=1e-6)
    assert "eval/metrics/heldout_loss" in events.Tags()["scalars"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the socket is: nothing listens there


def test_an_unreachable_tracking_server_neither_fails_nor_stalls_the_run(write_spec, tmp_path):  # noqa: F811
    spec = write_spec({"train": {"steps": 4}, "tracking": {"interval_s": 0.5, "flush_timeout_s": 20}})
    run_dir, uri = tmp_path / "run", f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    proc = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", "--tracking", f"mlflow={uri}")
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"tracking: MLflow at {uri} failed" in said and "next `runyard resume`" in said
    assert (run_dir / "export" / "runyard.json").is_file() and len(rows(run_dir, "main")) == 4
    assert took < 240  # the end of the session waits flush_timeout_s at most, not MLflow's own retries


def test_tracking_flags_and_section():
    assert with_tracking_flags(TrackingSpec(), ["mlflow=http://h:5000", "tensorboard"]).model_dump() == {
        **TrackingSpec().model_dump(), "tensorboard": True,
        "mlflow": {"uri": "http://h:5000", "experiment": "runyard", "log_export": True, "registered_model": None}}
    with pytest.raises(SpecError, match="mlflow, mlflow=URI or tensorboard"):
        with_tracking_flags(TrackingSpec(), ["wandb"])
    plain, tracked = parse_spec(TINY_SPEC), parse_spec(merge(TINY_SPEC, {"tracking": {"mlflow": True}}))
    assert tracked.tracking.mlflow is not None and tracked.tracking.enabled and not plain.tracking.enabled
    assert tracked.fingerprint() == plain.fingerprint()  # where a run is watched is not what it computes


def niceness(stat: Path) -> int:
    raw = stat.read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[16])


def thread_niceness(pid: int) -> list[int]:
    return [niceness(task / "stat") for task in Path(f"/proc/{pid}/task").iterdir()]


def test_the_mirror_runs_in_a_process_of_its_own_that_dies_with_a_killed_run(write_spec, tmp_path):  # noqa: F811
    spec = write_spec({"train": {"steps": 100000}, "tracking": {"tensorboard": True, "interval_s": 0.5}})
    run_dir = tmp_path / "run"
    run = popen_dying_with_me([sys.executable, "-m", "runyard", "run", str(spec), "--run-dir", str(run_dir), "--no-progress"],
                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state, mirrors = run_dir / "tracking" / "state.json", []
    try:
        deadline = time.monotonic() + 240
        # Until the mirror has sent rows of the live run: it is mirroring, not starting.
        while '"metrics:main"' not in (state.read_text() if state.is_file() else ""):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:] if run.poll() else "timeout"
            time.sleep(0.5)
        mirrors = mirrors_of(run_dir)
        assert len(mirrors) == 1 and mirrors[0] != run.pid and parent_of(mirrors[0]) == run.pid
        # While the run trains, the mirror syncs on a thread at a lower CPU priority than the run's.
        assert min(19, niceness(Path(f"/proc/{run.pid}/stat")) + NICENESS) in thread_niceness(mirrors[0])
    finally:
        run.send_signal(signal.SIGKILL)  # no cleanup code runs in the run: the kernel ends the mirror
        run.wait()
    deadline = time.monotonic() + 10
    while not all(is_zombie_or_gone(pid) for pid in mirrors) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(is_zombie_or_gone(pid) for pid in mirrors) and mirrors_of(run_dir) == []
