"""What a tracker is sent, read from the run directory as the run writes it.

Every piece is a `Unit`: a name (`spec`, `metrics:<stage>`, `gates:<stage>`, `data`, `eval`, `export`) and a
version (the sha256 of the file it came from, or for metrics the last step sent), so a mirror records per
tracker what it has sent and sends a piece again only when it changed. Nothing here imports a tracking
library: the sinks (runyard.tracking.sinks) turn units into their calls.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runyard.spec.job import JobSpec, resolved_stage

# runyard.train.stage_result.stage_dir's layout, spelled here: importing train would load torch into the
# mirror's process (seconds of CPU) for one path.
STAGES_DIR = "stages"

# Parameter values past this are cut (MLflow's limit is 6000 characters).
MAX_PARAM_CHARS = 6000
# Sections of the data report that are not headline figures (samples, histograms, timings, settings).
DATA_REPORT_SKIP = {"doc_length_histogram", "removal_samples", "pii_samples", "filters", "timings", "cpu_seconds",
                    "steps", "seed", "input_files"}
ROW_SKIP = {"step", "time"}  # a metrics row's step and wall time are its coordinates, not figures
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


@dataclass(frozen=True)
class Point:
    key: str
    value: float
    step: int
    time: float | None = None  # seconds since the epoch, when the row recorded it


@dataclass
class Unit:
    name: str
    version: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: list[Point] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)  # name -> text (TensorBoard shows them; MLflow logs files)
    artifacts: list[tuple[Path, str]] = field(default_factory=list)  # (file, folder in the tracker's artefacts)
    last_step: int | None = None  # metrics: the newest step in this unit


def metric_key(*parts: str) -> str:
    """A metric or parameter name both trackers accept: '/'-joined, odd characters as '_'."""
    return _BAD_KEY.sub("_", "/".join(p for p in parts if p))


def flatten(value: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Dotted keys for nested mappings and lists of mappings (`stages.0.name`); a list of scalars stays a leaf."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{sep}{k}" if prefix else str(k), sep))
        return out
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}{sep}{i}" if prefix else str(i), sep))
        return out
    return {prefix: value}


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not written yet, or being replaced: read again next time


def param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MAX_PARAM_CHARS]


class RunReader:
    """Reads one run directory for a mirror. Metrics files are read from where the last read stopped (an
    atomic rewrite, as a resume's truncation does, is read again from the start); a unit's rows are the
    complete lines past `after_step`."""

    def __init__(self, spec: JobSpec, run_dir: Path):
        self.spec, self.run_dir = spec, run_dir
        self._offsets: dict[str, tuple[int, int]] = {}  # stage -> (inode, bytes read)
        self._pending: dict[str, list[dict]] = {}  # stage -> rows read but not yet taken

    def stage_offsets(self) -> dict[str, int]:
        """Each stage's first step on one axis across stages: the sum of the earlier stages' steps."""
        out, offset = {}, 0
        for stage in self.spec.stages:
            out[stage.name] = offset
            offset += resolved_stage(self.spec, stage.name).train.steps if self.spec.task == "language_model" else 0
        return out

    def spec_unit(self) -> Unit | None:
        path = self.run_dir / "spec.yaml"
        version = _sha(path)
        if version is None:
            return None
        resolved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        resolved.pop("tracking", None)  # where it is watched, not what it does
        manifest = _read_json(self.run_dir / "manifest.json") or {}
        unit = Unit("spec", version, params={k: param_text(v) for k, v in flatten(resolved).items()},
                    texts={"spec": path.read_text(encoding="utf-8")}, artifacts=[(path, "")])
        unit.tags = {"runyard.run_name": self.spec.name, "runyard.run_dir": str(self.run_dir.resolve()),
                     "runyard.task": self.spec.task, "runyard.spec_sha256": self.spec.fingerprint()}
        if (manifest.get("code") or {}).get("git_commit"):
            unit.tags["runyard.git_commit"] = str(manifest["code"]["git_commit"])
        for i, (name, offset) in enumerate(self.stage_offsets().items()):
            unit.tags[f"runyard.stage.{i}"] = name
            unit.tags[f"runyard.stage.{name}.kind"] = self.spec.stages[i].kind
            unit.tags[f"runyard.stage.{name}.step_offset"] = str(offset)
        return unit

    def data_unit(self) -> Unit | None:
        path = self.run_dir / "data" / "report.json"
        version, report = _sha(path), _read_json(path)
        if version is None or not isinstance(report, dict):
            return None
        figures = {k: v for k, v in report.items() if k not in DATA_REPORT_SKIP}
        unit = Unit("data", version)
        for key, value in flatten(figures, sep="/").items():
            number = _number(value)
            if number is not None and math.isfinite(number):
                unit.metrics.append(Point(metric_key("data", key), number, 0))
        if report.get("fingerprint"):
            unit.tags["runyard.data_fingerprint"] = str(report["fingerprint"])
        unit.artifacts = [(p, "data") for p in sorted((self.run_dir / "data").glob("*"))
                          if p.is_file() and p.suffix in {".md", ".json", ".png"}]
        return unit

    def metrics_unit(self, stage: str, after_step: int) -> Unit | None:
        """The rows of `stage`'s metrics.jsonl past `after_step`, as `<stage>/<figure>` points."""
        path = self.run_dir / STAGES_DIR / stage / "metrics.jsonl"
        try:
            stat = path.stat()
        except OSError:
            return None
        inode, read = self._offsets.get(stage, (stat.st_ino, 0))
        if inode != stat.st_ino or stat.st_size < read:
            read, self._pending[stage] = 0, []  # rewritten in place (a resume cut rows past its checkpoint)
        if stat.st_size > read:
            with open(path, "rb") as f:
                f.seek(read)
                chunk = f.read(stat.st_size - read)
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
            read += len(complete)
            for line in complete.decode("utf-8", "replace").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash mid-write
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    self._pending.setdefault(stage, []).append(row)
        self._offsets[stage] = (stat.st_ino, read)
        rows = [r for r in self._pending.get(stage, []) if r["step"] > after_step]
        if not rows:
            return None
        unit = Unit(f"metrics:{stage}", str(rows[-1]["step"]), last_step=max(r["step"] for r in rows))
        for row in rows:
            for key, value in flatten({k: v for k, v in row.items() if k not in ROW_SKIP}, sep="/").items():
                number = _number(value)
                if number is not None:
                    unit.metrics.append(Point(metric_key(stage, key), number, row["step"], row.get("time")))
        return unit

    def taken(self, stage: str, step: int) -> None:
        """Rows up to `step` were sent: forget them."""
        self._pending[stage] = [r for r in self._pending.get(stage, []) if r["step"] > step]

    def gates_unit(self, stage: str) -> Unit | None:
        path = self.run_dir / STAGES_DIR / stage / "gates.json"
        version, record = _sha(path), _read_json(path)
        if version is None or not isinstance(record, dict):
            return None
        steps = resolved_stage(self.spec, stage).train.steps if self.spec.task == "language_model" else 0
        unit = Unit(f"gates:{stage}", version, tags={f"runyard.stage.{stage}.gates": "passed" if record.get("passed") else "failed"})
        unit.metrics.append(Point(metric_key(stage, "gates", "passed"), float(bool(record.get("passed"))), steps))
        for gate in record.get("gates", []):
            number = _number(gate.get("value"))
            if number is not None and math.isfinite(number):
                unit.metrics.append(Point(metric_key(stage, "gates", str(gate.get("name"))), number, steps))
        unit.texts[f"{stage}/gates"] = json.dumps(record, indent=1)
        unit.artifacts = [(path, f"stages/{stage}")]
        return unit

    def eval_unit(self) -> Unit | None:
        eval_dir = self.run_dir / "eval"
        path = eval_dir / "report.json"
        version, report = _sha(path), _read_json(path)
        if version is None or not isinstance(report, dict):
            return None
        unit = Unit("eval", version)
        figures = {k: report.get(k) for k in ("metrics", "prediction", "finetune") if isinstance(report.get(k), dict)}
        for key, value in flatten(figures, sep="/").items():
            number = _number(value)
            if number is not None and math.isfinite(number) and "seed" not in key:
                unit.metrics.append(Point(metric_key("eval", key), number, 0))
        if report.get("fit_to_ship") is not None:
            unit.tags["runyard.fit_to_ship"] = str(bool(report["fit_to_ship"])).lower()
            unit.metrics.append(Point("eval/fit_to_ship", float(bool(report["fit_to_ship"])), 0))
        if (eval_dir / "report.md").is_file():
            unit.texts["eval/report"] = (eval_dir / "report.md").read_text(encoding="utf-8")
        unit.artifacts = [(p, "eval") for p in sorted(eval_dir.iterdir()) if p.is_file()]
        return unit

    def export_unit(self) -> Unit | None:
        """The export, once its provenance file (written last) is there: files, signature, fingerprints."""
        export = self.run_dir / "export"
        path = export / "runyard.json"
        version, provenance = _sha(path), _read_json(path)
        if version is None or not isinstance(provenance, dict):
            return None
        manifest = _read_json(self.run_dir / "manifest.json") or {}
        extra = provenance.get("extra") or {}
        unit = Unit("export", version, tags={
            "runyard.export.family": str(provenance.get("family")),
            "runyard.export.spec_sha256": str(extra.get("spec_sha256") or manifest.get("spec_sha256")),
            "runyard.export.runyard_json_sha256": version,
        })
        data_fingerprint = (manifest.get("data") or {}).get("fingerprint")
        if data_fingerprint:
            unit.tags["runyard.export.data_fingerprint"] = str(data_fingerprint)
        unit.artifacts = [(p, str(Path("export") / p.parent.relative_to(export)).removesuffix("/."))
                          for p in sorted(export.rglob("*")) if p.is_file()]
        if (self.run_dir / "manifest.json").is_file():
            unit.artifacts.append((self.run_dir / "manifest.json", ""))
        unit.texts["export/signature"] = json.dumps(signature(provenance), indent=1)
        return unit


def signature(provenance: dict) -> dict:
    """What the export takes and gives, in MLflow's signature shape (a decoder: a prompt in, a completion
    out; a table or image model: its feature schema in, a prediction out)."""
    family = provenance.get("family")
    features = provenance.get("features") or (provenance.get("extra") or {}).get("features")
    if family == "decoder" or features is None:
        inputs = [{"type": "string", "name": "prompt"}]
        outputs = [{"type": "string", "name": "completion"}]
    else:
        names = [f.get("name") if isinstance(f, dict) else str(f) for f in features] if isinstance(features, list) else list(features)
        inputs = [{"type": "double", "name": str(n)} for n in names]
        outputs = [{"type": "double", "name": "prediction"}]
    return {"family": family, "inputs": json.dumps(inputs), "outputs": json.dumps(outputs),
            "serve": "runyard serve RUN_DIR (OpenAI API for decoders, /v1/predict otherwise)"}
