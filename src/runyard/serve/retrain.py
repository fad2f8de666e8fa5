"""Retraining on drift: a job spec for the control plane whose data includes the logged traffic.

The server is started with the spec to retrain from (`--retrain-spec`, usually the spec the served
model was trained with) and the control plane (`--control`: its state directory, where its address and
API token are, or its URL with the token in $RUNYARD_CONTROL_TOKEN). On a drift event, the retrainer
writes a derived spec beside the request log: the same spec under a new name, its `data.sources`
plus the request log's directory (a JSONL source), and, when the spec schema has `model.init`
(issue 11's weights-in), `model.init: {from: export, path: EXPORT}` so the new run starts from the
served weights, as its last stage alone (the stage the export holds), without the loss-drop gate.
Without that field the job trains as its spec says (from scratch). The derived spec is
validated like any spec, then submitted as spec text through `runyard.control.client`, as `runyard
submit` does.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any

import yaml

from runyard.control.auth import TokenError
from runyard.control.client import ControlClient
from runyard.control.info import ControlError
from runyard.errors import SpecError
from runyard.serve.errors import RetrainError
from runyard.serve.request_log import RequestLog
from runyard.spec.job import ModelSpec, load_spec
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.serve")

SPECS_DIR = "retrain-specs"
TOKEN_ENV = "RUNYARD_CONTROL_TOKEN"


def control_client(target: str) -> ControlClient:
    """The control plane `--control` names: its state directory (address and token read there), or its
    URL with the API token in $RUNYARD_CONTROL_TOKEN. Raises RetrainError naming what is missing."""
    if Path(target).is_dir():
        try:
            return ControlClient.for_state_dir(target)
        except (ControlError, TokenError, OSError) as exc:
            raise RetrainError(f"--control {target}: {exc}") from None
    if "://" not in target:
        raise RetrainError(f"--control {target}: neither a control plane's state directory nor a URL")
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise RetrainError(f"--control {target}: a URL needs the control plane's API token in ${TOKEN_ENV} "
                           "(or give its state directory)")
    return ControlClient(target, token)


def spec_supports_init() -> bool:
    """Whether this runyard's job spec can start a model from existing weights (`model.init`)."""
    return "init" in ModelSpec.model_fields


def read_spec_mapping(path: Path) -> dict[str, Any]:
    """The YAML mapping of a spec, checked to be a valid spec now (not at the first drift event)."""
    load_spec(path)  # SpecError names the field
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return raw


def derive_spec(
    base: dict[str, Any], name: str, traffic_source: dict[str, Any], export_dir: Path, base_dir: Path
) -> dict[str, Any]:
    """The retraining spec: `base` renamed, with the traffic as one more source, relative source
    paths made absolute against `base_dir` (the job runs elsewhere), and `model.init` from the export
    when the schema has it."""
    spec = copy.deepcopy(base)
    spec["name"] = name
    data = spec.setdefault("data", {})
    sources = []
    for source in data.get("sources", []):
        source = dict(source)
        path = str(source.get("path", ""))
        is_url = "://" in path and not path.startswith("file://")
        if path and not is_url and "{stdlib}" not in path and not Path(path).is_absolute():
            source["path"] = str((base_dir / path).resolve())
        sources.append(source)
    data["sources"] = [*sources, traffic_source]
    if spec_supports_init():
        spec.setdefault("model", {})["init"] = {"from": "export", "path": str(Path(export_dir).resolve())}
        # The export is the last stage's model: only that stage continues (an earlier, smaller stage
        # could not start from its weights). Weights that already fit the data need not lose a fixed
        # share of their loss again: the loss-drop gate, there to catch a run that does not learn, is
        # off; the finite, held-out and checkpoint gates stay.
        if spec.get("stages"):
            last = copy.deepcopy(spec["stages"][-1])
            last.setdefault("gates", {})["min_loss_drop"] = None
            spec["stages"] = [last]
    return spec


class Retrainer:
    """Submits one retraining job to a control plane when asked."""

    def __init__(self, spec_path: Path, control_url: str, export_dir: Path, request_log: RequestLog):
        self.spec_path = Path(spec_path)
        self.base = read_spec_mapping(self.spec_path)
        self.control = control_client(control_url)
        self.export_dir = Path(export_dir)
        self.request_log = request_log
        self.specs_dir = request_log.directory.parent / SPECS_DIR

    def submit(self) -> dict[str, Any]:
        """Write the derived spec and submit it; returns {'spec', 'jobs', 'init_from_export'}.
        Raises RetrainError naming what failed."""
        self.request_log.seal()  # the job reads complete segments only
        name = f"{self.base.get('name', 'model')}-retrain-{time.strftime('%Y%m%dT%H%M%S')}"
        raw = derive_spec(self.base, name, self.request_log.source(), self.export_dir, Path.cwd())
        self.specs_dir.mkdir(parents=True, exist_ok=True)
        path = self.specs_dir / f"{name}.yaml"
        atomic_write_text(path, yaml.safe_dump(raw, sort_keys=False))
        try:
            load_spec(path)  # refused here, with the field named, rather than by the control plane
            jobs = self.control.submit_spec(path.read_text())
        except SpecError as exc:
            raise RetrainError(f"the retraining spec {path} is invalid: {exc}") from None
        except ControlError as exc:
            raise RetrainError(str(exc)) from None
        ids = [int(job["id"]) for job in jobs]
        log.warning("drift: submitted retraining job(s) %s from %s", ids, path)
        return {"spec": str(path), "jobs": ids, "init_from_export": spec_supports_init()}
