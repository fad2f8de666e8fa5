"""The `tracking` section: MLflow and TensorBoard mirrors of the run directory (runyard.tracking).

Tracking never changes the work: the spec's fingerprint leaves it out, and editing it continues a run
directory like any judgement-only change (runyard.spec.diff). `--tracking` on `runyard run`/`resume` is
the same section written on the command line (`with_tracking_flags`), kept in the run's spec.yaml so that
a resume goes on mirroring into the same place.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runyard.errors import SpecError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MLflowSpec(_Strict):
    """Where and how the run is logged to MLflow."""

    uri: str | None = Field(
        default=None,
        description="the MLflow tracking URI: a server (`http://host:5000`), a database "
        "(`sqlite:///path/mlflow.db`, shared by several runs so they compare side by side). Default: a SQLite "
        "store in the run directory, tracking/mlflow/mlflow.db, with its artefacts in tracking/mlflow/artifacts "
        "(MLflow's own file store is in maintenance mode and refused by MLflow 3 unless MLFLOW_ALLOW_FILE_STORE "
        "is set)",
    )
    experiment: str = Field(
        default="runyard", min_length=1, description="the MLflow experiment the run is logged under (made if absent)"
    )
    log_export: bool = Field(
        default=True,
        description="log the export's files as the run's artefacts (export/) and register them as a model "
        "version; off for a large model whose copy in the tracking store is not wanted (its fingerprints are "
        "still logged as tags)",
    )
    registered_model: str | None = Field(
        default=None,
        description="the registered model the export becomes a version of (default: the run's name); "
        "needs a store with a model registry (the default SQLite store and an MLflow server have one)",
    )


class TrackingSpec(_Strict):
    """Mirrors of the run directory in the tools people watch runs in. The run directory stays the source of
    truth: a background thread reads what the run writes (metrics.jsonl, gates.json, the data and eval
    reports, the export) and forwards it, so logging never slows or stops the run; an unreachable tracking
    server is retried with backoff and reported at the end. Needs `pip install 'runyard[tracking]'`."""

    mlflow: MLflowSpec | None = Field(
        default=None,
        description="log to MLflow (`mlflow: true` for the defaults): the resolved spec as parameters, every "
        "metrics.jsonl row as metrics by step (named `<stage>/<figure>`), gates, the data and eval reports' "
        "figures, the reports and plots as artefacts, and the export with its fingerprints as tags",
    )
    tensorboard: bool = Field(
        default=False,
        description="write TensorBoard event files into the run directory's tracking/tensorboard/: the same "
        "scalars by step, and the spec as text (`tensorboard --logdir runs/` shows every run)",
    )
    interval_s: float = Field(
        default=2.0, gt=0, le=300, description="seconds between the mirror's reads of the run directory"
    )
    flush_timeout_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="seconds the end of a session waits for the mirror to send what is left; past it the rest "
        "is reported, and sent by the next `runyard resume`",
    )

    @model_validator(mode="before")
    @classmethod
    def _mlflow_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("mlflow"), bool):
            data = {**data, "mlflow": {} if data["mlflow"] else None}
        return data

    @property
    def enabled(self) -> bool:
        return self.mlflow is not None or self.tensorboard


TRACKING_FLAG_HELP = (
    "mirror the run into MLflow or TensorBoard, as the spec's `tracking:` section does (repeat for both): "
    "`mlflow` (a store in the run directory, or the spec's tracking.mlflow.uri), `mlflow=URI` (a server or "
    "database), `tensorboard`. Kept in the run's spec.yaml, so `runyard resume` goes on logging to the same run"
)


def with_tracking_flags(tracking: TrackingSpec, flags: list[str] | None) -> TrackingSpec:
    """`tracking` with each `--tracking` value applied; a bad value is a SpecError naming it."""
    out = tracking
    for flag in flags or []:
        name, _, uri = flag.partition("=")
        if name == "mlflow":
            mlflow = out.mlflow or MLflowSpec()
            out = out.model_copy(update={"mlflow": mlflow.model_copy(update={"uri": uri}) if uri else mlflow})
        elif name == "tensorboard" and not uri:
            out = out.model_copy(update={"tensorboard": True})
        else:
            raise SpecError("--tracking", [("--tracking", flag, "mlflow, mlflow=URI or tensorboard")])
    return out
