"""ONNX beside a table or image export, where a converter exists, checked against the model itself.

LightGBM boosters convert through onnxmltools, the linear model's scikit-learn pipeline through
skl2onnx, the CNN through torch.onnx (the TorchScript-based exporter: the newer torch.export one needs
onnxscript, which this project does not depend on). onnxruntime then runs the file on rows of the test
split and the largest difference from the model's own predictions is recorded in the export's
config.json: ONNX computes in float32, so a float64 split threshold can fall between a value and its
float32 rounding, and the record says so rather than claiming equality.

The converters and onnxruntime are the optional extra runyard[onnx]; without it the export says that no
ONNX file was written, and why.
"""

from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
# Probabilities within this of the model's (and the same predicted class) count as matching; regression
# values within this fraction of the predictions' spread.
PROBABILITY_TOLERANCE = 1e-4
REGRESSION_TOLERANCE = 1e-4


@dataclass(frozen=True)
class OnnxResult:
    written: bool
    reason: str = ""
    max_abs_diff: float | None = None
    matches: bool | None = None
    rows_checked: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"file": ONNX_FILE if self.written else None, "written": self.written, "reason": self.reason,
                "max_abs_diff": self.max_abs_diff, "matches": self.matches, "rows_checked": self.rows_checked}


def _convert(family: str, model: Any, n_features: int, example: np.ndarray) -> bytes:
    # The converters are the optional extra runyard[onnx], imported only on this path.
    if family == "lightgbm":
        from onnxmltools import convert_lightgbm
        from onnxmltools.convert.common.data_types import FloatTensorType

        return convert_lightgbm(model.booster, initial_types=[("input", FloatTensorType([None, n_features]))],
                                zipmap=False).SerializeToString()
    if family == "linear":
        from skl2onnx import to_onnx

        if model.pipeline is None:
            raise ValueError("the scikit-learn pipeline is not at hand (a loaded model); refit to convert")
        estimator = model.pipeline.named_steps["model"]
        options = {id(estimator): {"zipmap": False}} if hasattr(estimator, "predict_proba") else None
        return to_onnx(model.pipeline, example[:1].astype(np.float32), options=options).SerializeToString()
    if family == "cnn":
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(model.eval(), (torch.from_numpy(example[:1].astype(np.float32)),), buffer,
                              input_names=["pixels"], output_names=["logits"],
                              dynamic_axes={"pixels": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
        return buffer.getvalue()
    raise ValueError(f"no ONNX converter for family {family!r}")


def _run(onnx_bytes: bytes, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort  # the optional extra runyard[onnx]

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: converted classifiers' label shape warns on every batch
    session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.astype(np.float32)})


def _onnx_prediction(family: str, outputs: list[np.ndarray], classification: bool) -> np.ndarray:
    if family == "cnn":
        logits = outputs[0].astype(np.float64)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)
    if classification:
        return np.asarray(outputs[-1], dtype=np.float64)  # [label, probabilities]
    return np.asarray(outputs[0], dtype=np.float64).ravel()


def write_onnx(family: str, model: Any, directory: Path, check_x: np.ndarray, expected: np.ndarray,
               classification: bool) -> OnnxResult:
    """Convert `model`, write `directory/model.onnx`, and compare onnxruntime's predictions on `check_x`
    with `expected` (the model's own). A missing extra or a failed conversion writes nothing and says why."""
    try:
        onnx_bytes = _convert(family, model, check_x.shape[1] if check_x.ndim == 2 else 0, check_x)
        got = _onnx_prediction(family, _run(onnx_bytes, check_x), classification)
    except ImportError as exc:
        return OnnxResult(False, f"the ONNX converters are not installed (pip install 'runyard[onnx]'): {exc}")
    except Exception as exc:  # converters raise their own types for what they cannot convert
        log.warning("no ONNX export for family %s: %s", family, exc)
        return OnnxResult(False, f"conversion failed: {type(exc).__name__}: {exc}")
    (directory / ONNX_FILE).write_bytes(onnx_bytes)
    diff = float(np.max(np.abs(got.reshape(expected.shape) - expected))) if len(expected) else 0.0
    if classification:
        matches = diff <= PROBABILITY_TOLERANCE and bool(np.array_equal(got.reshape(expected.shape).argmax(1), expected.argmax(1)))
        reason = "" if matches else "float32 inference moves some probabilities (or a predicted class) past the tolerance"
    else:
        spread = float(np.std(expected)) or 1.0
        matches = diff <= REGRESSION_TOLERANCE * spread
        reason = "" if matches else (f"ONNX runs in float32: a value and its float32 rounding can fall on opposite sides "
                                     f"of a split threshold (max difference {diff:.4g}, {diff / spread:.2%} of the "
                                     "predictions' standard deviation)")
    return OnnxResult(True, reason, diff, matches, len(check_x))
