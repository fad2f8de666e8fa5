"""The export of a table or image model, and loading it back for `runyard serve` (POST /v1/predict).

An export directory holds:
- the family's own files (LightGBM's `model.txt`, the linear model's `linear.json`, the CNN's
  `model.safetensors`): no pickle anywhere;
- `feature_schema.json`: a table's features (name, kind, categories, missing-value policy) and target
  classes (data/table_schema.py), or an image model's input shape and classes;
- `feature_drift.json`: the training distribution that serving compares live inputs with
  (serve/feature_drift.py);
- `model.onnx` where a converter exists (serve/onnx_export.py), with how closely it matched;
- `runyard.json`: format and version, `kind` (table or image), task, family and its config, the sha256 of
  every other file, the ONNX record and caller-supplied `extra`.
Written under a temporary name beside its destination, fsynced, renamed into place; loading checks every
checksum before anything is built.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runyard.data.table_schema import TableSchema, encode_records
from runyard.model.hf.export import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    PROVENANCE_FILE,
    install_export,
    read_export_config,
    verify_files,
)
from runyard.model.registry import ExportError, UnknownFamily, get_family
from runyard.serve.feature_drift import FeatureReference
from runyard.serve.onnx_export import write_onnx
from runyard.system.files import make_temp_dir, match_umask, sha256_file

SCHEMA_FILE = "feature_schema.json"
KIND_TABLE, KIND_IMAGE = "table", "image"
PREDICT_KINDS = (KIND_TABLE, KIND_IMAGE)


def image_drift_features(pixels: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Per image and channel: mean intensity and contrast (std), the numeric features image drift watches."""
    pixels = np.asarray(pixels, dtype=np.float64)
    channels = pixels.shape[1]
    features = np.concatenate([pixels.mean(axis=(2, 3)), pixels.std(axis=(2, 3))], axis=1)
    names = [f"mean_c{c}" for c in range(channels)] + [f"std_c{c}" for c in range(channels)]
    return features, names


def export_predictor(model: Any, config: Any, family: str, out_dir: Path, *, kind: str, task: str,
                     schema: dict[str, Any], reference: FeatureReference, check_x: np.ndarray,
                     expected: np.ndarray, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the export (see the module's docstring) atomically; return its runyard.json contents.
    `check_x` and `expected` are rows (or images) and the model's predictions for the ONNX check."""
    if kind not in PREDICT_KINDS:
        raise ExportError(f"unknown export kind {kind!r}; one of {PREDICT_KINDS}")
    out_dir = Path(out_dir)
    family_impl = get_family(family)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    try:
        names = list(family_impl.export_files(model, config, tmp))
        (tmp / SCHEMA_FILE).write_text(json.dumps(schema, indent=1) + "\n", encoding="utf-8")
        names += [SCHEMA_FILE, reference.save(tmp)]
        onnx = write_onnx(family, model, tmp, check_x, expected, classification=schema.get("classes") is not None)
        if onnx.written:
            names.append("model.onnx")
        for name in names:
            match_umask(tmp / name)
        record = {
            "format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "kind": kind, "task": task, "family": family,
            "model": family_impl.config_to_dict(config), "files": {n: sha256_file(tmp / n) for n in names},
            "sizes": {n: (tmp / n).stat().st_size for n in names},
            "onnx": onnx.to_dict(), "extra": extra or {},
        }
        install_export(tmp, out_dir, names, json.dumps(record, indent=2, sort_keys=True))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


@dataclass
class Predictor:
    """A loaded table or image model with its schema and drift reference."""

    kind: str
    task: str
    family: str
    config: Any
    model: Any
    schema: dict[str, Any]
    reference: FeatureReference | None
    record: dict[str, Any]

    @property
    def classes(self) -> list[str] | None:
        return self.schema.get("classes")

    @property
    def table_schema(self) -> TableSchema:
        return TableSchema.from_dict(self.schema)

    def predict_matrix(self, x: np.ndarray) -> np.ndarray:
        """Probabilities [n, classes] or values [n] of encoded rows, or of images [n, C, H, W] in [0, 1]."""
        if self.kind == KIND_TABLE:
            return np.asarray(self.model.predict(x))
        with torch.no_grad():
            logits = self.model(torch.as_tensor(np.asarray(x, dtype=np.float32)))
        return torch.softmax(logits.double(), dim=-1).numpy()

    def encode_rows(self, records: list[Any]) -> tuple[np.ndarray, list[dict], list[dict]]:
        return encode_records(records, self.table_schema)


def is_predict_export(export_dir: Path) -> bool:
    """True when `export_dir` holds a table or image model (not a language model)."""
    try:
        return read_export_config(Path(export_dir)).get("kind") in PREDICT_KINDS
    except ExportError:
        return False


def load_predictor(export_dir: Path, device: str = "cpu") -> Predictor:
    """Load a table or image export, every file checked against its checksum; ExportError naming the
    file and the problem."""
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise ExportError(f"export directory {export_dir} does not exist")
    record = read_export_config(export_dir)
    kind = record.get("kind")
    if kind not in PREDICT_KINDS:
        raise ExportError(f"{export_dir / PROVENANCE_FILE}: kind {kind!r} is not a table or image model")
    verify_files(export_dir, record, required=(SCHEMA_FILE,))
    try:
        family = get_family(record["family"])
        config = family.config_from_dict(record["model"])
    except (UnknownFamily, KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{export_dir / PROVENANCE_FILE}: {exc}") from None
    schema = json.loads((export_dir / SCHEMA_FILE).read_text(encoding="utf-8"))
    model = family.load_files(export_dir, config, device)
    return Predictor(kind, record.get("task", ""), family.name, config, model, schema,
                     FeatureReference.load(export_dir), record)
