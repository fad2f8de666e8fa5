"""The trackers a mirror sends units to: MLflow (through its client, to a store or a server) and TensorBoard
(event files in the run directory). Their libraries are the optional extra runyard[tracking], imported
when a sink opens, so a run that tracks nothing never loads them.

A sink's calls may raise anything (a server that is down, a store that refuses): the mirror catches,
retries later with backoff, and reports; a sink never sees the training thread.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

from runyard.errors import RunyardError
from runyard.spec.job import JobSpec
from runyard.tracking.reader import Unit

log = logging.getLogger(__name__)

TRACKING_DIR = "tracking"
EXTRA_HINT = "pip install 'runyard[tracking]'"
PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000  # MLflow's log_batch limits


def check_installed(spec: JobSpec) -> None:
    """Raise before any work when the spec asks for a tracker whose library is missing."""
    tracking = spec.tracking
    if tracking.mlflow is not None and importlib.util.find_spec("mlflow") is None:
        raise RunyardError(f"tracking.mlflow needs MLflow, which is not installed: {EXTRA_HINT}")
    if tracking.tensorboard and not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise RunyardError(f"tracking.tensorboard needs tensorboard (or tensorboardX), neither installed: {EXTRA_HINT}")


def default_mlflow_uri(run_dir: Path) -> tuple[str, str]:
    """The default store (a SQLite database in the run directory) and its artefact root."""
    root = (run_dir / TRACKING_DIR / "mlflow").resolve()
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


class MLflowSink:
    name = "mlflow"

    def __init__(self, spec: JobSpec, run_dir: Path, state: dict):
        self.spec, self.run_dir, self.state = spec, run_dir, state
        self.settings = spec.tracking.mlflow
        default_uri, self.artifact_root = default_mlflow_uri(run_dir)
        self.uri = self.settings.uri or default_uri
        self.local = self.settings.uri is None
        self.client: Any = None
        self.run_id: str | None = None

    def where(self) -> str:
        return f"MLflow at {self.uri}"

    def open(self) -> None:
        if self.client is not None:
            return
        # The mirror retries with its own backoff; MLflow's default (7 tries, 2 minutes) would hold a sync.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if self.local:
            (self.run_dir / TRACKING_DIR / "mlflow").mkdir(parents=True, exist_ok=True)
        tracking = importlib.import_module("mlflow.tracking")
        client = tracking.MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        run_id = self.state.get("run_id") if self.state.get("uri") == self.uri else None
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")  # the same tracked run, continued
        else:
            experiment = client.get_experiment_by_name(self.settings.experiment)
            experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(
                self.settings.experiment, artifact_location=self.artifact_root if self.local else None)
            run_id = client.create_run(experiment_id, run_name=self.spec.name).info.run_id
            self.state.clear()
            self.state.update({"uri": self.uri, "experiment": self.settings.experiment, "run_id": run_id, "sent": {}})
        self.client, self.run_id = client, run_id

    def send(self, unit: Unit) -> None:
        entities = importlib.import_module("mlflow.entities")
        sent_params = self.state.setdefault("params", {})
        new = {k: v for k, v in unit.params.items() if k not in sent_params}
        # MLflow's parameters are written once: a value changed by an edited spec goes in as a tag.
        changed = {f"runyard.spec_changed.{k}": v[:5000] for k, v in unit.params.items()
                   if k in sent_params and sent_params[k] != v}
        params = [entities.Param(k, v) for k, v in new.items()]
        tags = [entities.RunTag(k, v) for k, v in {**unit.tags, **changed}.items()]
        metrics = [entities.Metric(p.key, p.value, int(1000 * (p.time if p.time is not None else time.time())), p.step)
                   for p in unit.metrics]
        for i in range(0, max(len(params), len(tags)), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_CALL], tags=tags[i:i + PARAMS_PER_CALL])
        for i in range(0, len(metrics), METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + METRICS_PER_CALL])
        sent_params.update(new)
        for path, folder in unit.artifacts:
            if unit.name == "export" and not self.settings.log_export and folder.startswith("export"):
                continue
            self.client.log_artifact(self.run_id, str(path), folder or None)
        if "export/signature" in unit.texts:
            self.client.log_text(self.run_id, unit.texts["export/signature"], "export_signature.json")
            if self.settings.log_export:
                self._register(unit)

    def _register(self, unit: Unit) -> None:
        """The export as a new version of the registered model, tagged with its fingerprints."""
        name = self.settings.registered_model or self.spec.name
        try:
            self.client.get_registered_model(name)
        except Exception:  # MLflow raises its own RESOURCE_DOES_NOT_EXIST
            self.client.create_registered_model(name, description="runyard exports")
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/export"
        version = self.client.create_model_version(name, source, run_id=self.run_id, tags=unit.tags)
        self.state["model_version"] = {"name": name, "version": str(version.version)}

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status)


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, spec: JobSpec, run_dir: Path, state: dict):
        self.log_dir = run_dir / TRACKING_DIR / "tensorboard"
        self.state = state
        self.writer: Any = None

    def where(self) -> str:
        return f"TensorBoard event files in {self.log_dir}"

    def open(self) -> None:
        if self.writer is not None:
            return
        # tensorboard's own event writer, not torch's SummaryWriter: torch would cost the mirror's process
        # seconds of CPU to import; tensorboardX stands alone where only it is installed.
        writer_class = _EventWriter if importlib.util.find_spec("tensorboard") else \
            importlib.import_module("tensorboardX").SummaryWriter
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = writer_class(log_dir=str(self.log_dir))
        self.state.setdefault("sent", {})

    def send(self, unit: Unit) -> None:
        for p in unit.metrics:
            self.writer.add_scalar(p.key, p.value, global_step=p.step, walltime=p.time)
        for name, text in unit.texts.items():
            self.writer.add_text(name, "    " + text.replace("\n", "\n    "))  # markdown: shown as written
        if unit.tags:
            self.writer.add_text(f"tags/{unit.name}", "\n".join(f"- {k}: {v}" for k, v in sorted(unit.tags.items())))
        self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


class _EventWriter:
    """Scalars and text into TensorBoard event files through the tensorboard package alone, as torch's
    SummaryWriter writes them (a text summary is tagged `<tag>/text_summary`)."""

    def __init__(self, log_dir: str):
        writer = importlib.import_module("tensorboard.summary.writer.event_file_writer")
        self.event_pb2 = importlib.import_module("tensorboard.compat.proto.event_pb2")
        self.summary_pb2 = importlib.import_module("tensorboard.compat.proto.summary_pb2")
        self.tensor_pb2 = importlib.import_module("tensorboard.compat.proto.tensor_pb2")
        self.shape_pb2 = importlib.import_module("tensorboard.compat.proto.tensor_shape_pb2")
        self.text_pb2 = importlib.import_module("tensorboard.plugins.text.plugin_data_pb2")
        self.file = writer.EventFileWriter(log_dir)

    def _add(self, value, step: int | None, walltime: float | None) -> None:
        event = self.event_pb2.Event(wall_time=time.time() if walltime is None else walltime,
                                     summary=self.summary_pb2.Summary(value=[value]))
        if step is not None:
            event.step = int(step)
        self.file.add_event(event)

    def add_scalar(self, tag: str, value: float, global_step: int | None = None, walltime: float | None = None) -> None:
        self._add(self.summary_pb2.Summary.Value(tag=tag, simple_value=float(value)), global_step, walltime)

    def add_text(self, tag: str, text: str, global_step: int | None = None) -> None:
        plugin = self.summary_pb2.SummaryMetadata.PluginData(
            plugin_name="text", content=self.text_pb2.TextPluginData(version=0).SerializeToString())
        tensor = self.tensor_pb2.TensorProto(
            dtype="DT_STRING", string_val=[text.encode("utf-8")],
            tensor_shape=self.shape_pb2.TensorShapeProto(dim=[self.shape_pb2.TensorShapeProto.Dim(size=1)]))
        value = self.summary_pb2.Summary.Value(tag=f"{tag}/text_summary", tensor=tensor,
                                               metadata=self.summary_pb2.SummaryMetadata(plugin_data=plugin))
        self._add(value, global_step, None)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
