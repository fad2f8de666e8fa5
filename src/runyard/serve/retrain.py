"""Retraining on drift: a job spec for the control plane whose data includes the logged traffic.

The server is started with the spec to retrain from (`--retrain-spec`, usually the spec the served
model was trained with) and the control plane (`--control`: its state directory, where its address and
API token are, or its URL with the token in $RUNYARD_CONTROL_TOKEN). On a drift event, the retrainer
writes a derived spec beside the request log: the same spec under a new name, its `data.sources`
plus the request log's directory as a `kind: traffic` source (a JSONL source cleaned with its own
filters, meant for requests: a floor of a few words and PII scrubbing, not the spec's prose rules, so
`min_words: 50` does not remove every prompt; exact repeats go by `data.dedup`), and, when the spec
schema has `model.init` (issue 11's weights-in), `model.init: {from: export, path: EXPORT}` so the new
run starts from the served weights, as its last stage alone (the stage the export holds), without the
loss-drop gate. Without that field the job trains as its spec says (from scratch).

Before submitting, the retrainer counts the logged records the job would use (its traffic filters
and exact-repeat removal applied to the sealed log, as the data stage will) and refuses, with the
counts and the reason, when fewer than `min_logged` survive: a retraining that cannot learn from the
traffic would only retrain on the original data. The derived spec is validated like any spec, then
submitted as spec text through `runyard.control.client`, as `runyard submit` does; the data report of
the job counts the logged records read, used and removed per reason.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import yaml

from runyard.control.auth import TokenError
from runyard.control.client import ControlClient
from runyard.control.info import ControlError
from runyard.data.clean import text_hash
from runyard.data.filters import check_document
from runyard.data.normalize import normalize_text
from runyard.errors import SpecError
from runyard.market.lineage import retraining_name
from runyard.serve.errors import RetrainError, RetrainRefused
from runyard.serve.request_log import SEGMENT_GLOB, RequestLog
from runyard.spec.data import DataSpec, SourceSpec
from runyard.spec.job import ModelSpec, load_spec
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.serve")

SPECS_DIR = "retrain-specs"
TOKEN_ENV = "RUNYARD_CONTROL_TOKEN"
DEFAULT_MIN_LOGGED = 200  # logged records a retraining must hold to be worth submitting


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


def usable_traffic(directory: Path, source: SourceSpec, data: DataSpec) -> dict[str, Any]:
    """What a retraining's data stage would make of the sealed log in `directory`: records read, used,
    and removed per reason (each of the source's filter rules, `exact_duplicate` of an earlier logged
    record). Near duplicates and repeats of the original corpus are left to the data stage, so `used`
    is an upper bound of what its report will count."""
    filters = source.filters or data.filters
    removed: dict[str, int] = {}
    seen: set[bytes] = set()
    read = used = 0
    for path in sorted(Path(directory).glob(SEGMENT_GLOB)):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                text = json.loads(line).get(source.text_field)
            except (json.JSONDecodeError, AttributeError):
                continue
            if not isinstance(text, str):
                continue
            read += 1
            text = normalize_text(text, data.normalize)
            failed = check_document(text, filters)
            reason = failed.reason if failed is not None else None
            if reason is None and data.dedup.exact:
                key = text_hash(text)
                reason = "exact_duplicate" if key in seen else None
                seen.add(key)
            if reason is None:
                used += 1
            else:
                removed[reason] = removed.get(reason, 0) + 1
    return {"records_read": read, "records_usable": used, "removed": dict(sorted(removed.items())),
            "filters": {k: v for k, v in filters.model_dump(mode="json").items() if v is not None}}


def refusal_reason(traffic: dict[str, Any], min_logged: int) -> str | None:
    """Why a retraining with these logged records is not submitted, or None when it holds enough."""
    if traffic["records_usable"] >= min_logged:
        return None
    removed = ", ".join(f"{k} {v}" for k, v in traffic["removed"].items())
    return (f"not submitted: {traffic['records_usable']} usable logged records, {min_logged} needed "
            f"(--retrain-min-logged); {traffic['records_read']} logged" + (f", removed: {removed}" if removed else ""))


class Retrainer:
    """Submits one retraining job to a control plane when asked, when the logged traffic is enough."""

    def __init__(self, spec_path: Path, control_url: str, export_dir: Path, request_log: RequestLog,
                 min_logged: int = DEFAULT_MIN_LOGGED):
        if request_log is None:
            raise RetrainError("--retrain-spec needs --log-requests: a retraining on drift learns from the "
                               "logged traffic")
        if min_logged < 0:
            raise RetrainError(f"--retrain-min-logged must be >= 0, got {min_logged}")
        self.spec_path = Path(spec_path)
        self.base = read_spec_mapping(self.spec_path)
        self.control = control_client(control_url)
        self.export_dir = Path(export_dir)
        self.request_log = request_log
        self.min_logged = min_logged
        self.specs_dir = request_log.directory.parent / SPECS_DIR
        self.traffic_source = SourceSpec(**request_log.source())
        self.data = DataSpec(**self.base["data"])

    def policy(self) -> dict[str, Any]:
        """What a retraining will use, for /v1/drift: the traffic source, its filters and the minimum."""
        return {
            "min_logged_records": self.min_logged,
            "traffic_source": self.traffic_source.path,
            "traffic_filters": {k: v for k, v in self.traffic_source.filters.model_dump(mode="json").items()
                                if v is not None},
            "exact_duplicates_removed": self.data.dedup.exact,
            "near_duplicates_removed": self.data.dedup.near,
        }

    def traffic(self) -> dict[str, Any]:
        """The sealed log as the retraining would use it (see usable_traffic)."""
        return usable_traffic(self.request_log.directory, self.traffic_source, self.data)

    def submit(self) -> dict[str, Any]:
        """Write the derived spec and submit it; returns {'spec', 'jobs', 'init_from_export', 'traffic'}.
        Raises RetrainRefused (with the counts) when too few logged records would be used, RetrainError
        naming what failed otherwise."""
        self.request_log.seal()  # the job reads complete segments only
        traffic = self.traffic()
        reason = refusal_reason(traffic, self.min_logged)
        if reason is not None:
            raise RetrainRefused(reason, traffic)
        name = retraining_name(str(self.base.get('name', 'model')), time.time())
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
        log.warning("drift: submitted retraining job(s) %s from %s; it uses up to %d of %d logged records "
                    "(removed before submitting: %s)", ids, path, traffic["records_usable"], traffic["records_read"],
                    traffic["removed"] or "none")
        return {"submitted": True, "spec": str(path), "jobs": ids, "init_from_export": spec_supports_init(),
                "traffic": traffic}
