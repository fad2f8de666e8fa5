"""The evaluation report of a tabular or image run: the verdict, every metric beside its baseline (and the
linear model beside the trees), the confusion matrix, and PNGs: confusion_matrix.png and calibration.png
(classification), predictions.png (regression), loss.png (each stage's training and validation loss).

Writes `eval/report.json` (for machines) and `eval/report.md` (for people). Figures are drawn without
pyplot (no global backend), as for the language model's report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from runyard.evaluate.prediction import PredictionMetrics
from runyard.evaluate.report import Verdict
from runyard.system.files import atomic_write_text

_WORDS = {"accuracy": "accuracy", "f1": "F1", "roc_auc": "ROC AUC", "log_loss": "log loss", "rmse": "RMSE",
          "mae": "MAE", "r2": "R²"}


def plot_confusion(result: PredictionMetrics, path: Path) -> None:
    matrix = np.asarray(result.confusion, dtype=np.float64)
    rows = matrix.sum(axis=1, keepdims=True)
    share = np.divide(matrix, rows, out=np.zeros_like(matrix), where=rows > 0)
    n = len(result.classes)
    fig = Figure(figsize=(1.2 + 0.7 * n, 1.0 + 0.6 * n))
    ax = fig.subplots()
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{int(matrix[i, j])}", ha="center", va="center",
                    color="white" if share[i, j] > 0.5 else "black", fontsize=9)
    ax.set_xticks(range(n), result.classes, rotation=45, ha="right")
    ax.set_yticks(range(n), result.classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("Confusion matrix (test split; colour: share of the true class)")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_calibration(result: PredictionMetrics, path: Path) -> None:
    cal = result.calibration
    fig = Figure(figsize=(5.5, 5.5))
    ax, hist = fig.subplots(2, 1, height_ratios=[3, 1], sharex=True)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
    ax.plot(cal["predicted"], cal["observed"], marker="o", label=f"model (ECE {cal['ece'][0]:.3f})")
    ax.set_ylabel("observed frequency" if cal["of"][0] == "positive class" else "accuracy")
    ax.set_title(f"Calibration, {cal['of'][0]} (test split)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    hist.bar(cal["predicted"], cal["counts"], width=0.05)
    hist.set_xlabel("predicted probability" if cal["of"][0] == "positive class" else "confidence")
    hist.set_ylabel("rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_predictions(y: np.ndarray, prediction: np.ndarray, path: Path) -> None:
    fig = Figure(figsize=(5.5, 5.5))
    ax = fig.subplots()
    ax.scatter(y, prediction, s=10, alpha=0.7)
    lo, hi = float(min(y.min(), prediction.min())), float(max(y.max(), prediction.max()))
    ax.plot([lo, hi], [lo, hi], linestyle="--", color="grey")
    ax.set_xlabel("true")
    ax.set_ylabel("predicted")
    ax.set_title("Predictions on the test split")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_losses(stage_metrics: dict[str, list[dict]], loss_label: str, path: Path) -> None:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for stage, rows in stage_metrics.items():
        ax.plot([r["step"] for r in rows if "loss" in r], [r["loss"] for r in rows if "loss" in r],
                label=f"{stage} train", linewidth=1)
        held = [(r["step"], r["heldout_loss"]) for r in rows if r.get("heldout_loss") is not None]
        if held:
            ax.plot(*zip(*held, strict=True), marker=".", label=f"{stage} validation")
    ax.set_xlabel("step (boosting round, or optimizer step)")
    ax.set_ylabel(loss_label)
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_prediction_report(out_dir: Path, run_name: str, result: PredictionMetrics, verdict: Verdict,
                            stages: list[dict], stage_metrics: dict[str, list[dict]], model: dict[str, Any],
                            y: np.ndarray, prediction: np.ndarray, loss_label: str) -> dict:
    """Write the report and its figures into `out_dir`; `model` names the family and why it was chosen."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if result.confusion is not None:
        plot_confusion(result, out_dir / "confusion_matrix.png")
        plot_calibration(result, out_dir / "calibration.png")
        plots += ["confusion_matrix.png", "calibration.png"]
    else:
        plot_predictions(y, prediction, out_dir / "predictions.png")
        plots.append("predictions.png")
    plot_losses(stage_metrics, loss_label, out_dir / "loss.png")
    plots.append("loss.png")
    report = {
        "run": run_name,
        "fit_to_ship": verdict.fit_to_ship,
        "reasons": verdict.reasons,
        "passed": verdict.passed,
        "flags": verdict.flags,
        "model": model,
        "prediction": result.to_dict(),
        "stages": stages,
        "plots": plots,
    }
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out_dir / "report.md", _markdown(report))
    return report


def _value(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _markdown(report: dict) -> str:
    p = report["prediction"]
    verdict = "**FIT TO SHIP**" if report["fit_to_ship"] else "**NOT FIT TO SHIP**: " + "; ".join(report["reasons"])
    lines = [f"# Evaluation: {report['run']}", "", verdict, ""]
    lines += [f"- held: {line}" for line in report["passed"]]
    lines += ["", f"Model: `{report['model']['family']}` ({report['model']['chosen']}). Test split: {p['rows']:,} rows "
              "(never seen in training or early stopping).", ""]
    others = list(p["others"])
    lines += ["| metric | model | " + " | ".join(others + ["baseline"]) + " |",
              "| --- | --- | " + " | ".join("---" for _ in [*others, 0]) + " |"]
    for name, value in p["metrics"].items():
        cells = [_value(value)] + [_value(p["others"][o].get(name)) for o in others] + [_value(p["baseline"].get(name))]
        label = _WORDS.get(name, name) + (f" ({p['f1_average']})" if name == "f1" else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Baseline: {p['baseline_name']}."]
    lines += [f"Note: {n}" for n in p["notes"]]
    if p["confusion"] is not None:
        classes = p["classes"]
        lines += ["", "## Confusion matrix (rows: true class, columns: predicted)", "",
                  "| true \\ predicted | " + " | ".join(classes) + " |", "| --- |" + " --- |" * len(classes)]
        lines += [f"| {c} | " + " | ".join(str(v) for v in row) + " |" for c, row in zip(classes, p["confusion"], strict=True)]
        lines += ["", f"Expected calibration error ({p['calibration']['of'][0]}): {p['calibration']['ece'][0]:.4f}."]
    lines += ["", "## Stages", "", "| stage | family | steps | best step | final train loss | validation loss | gates |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in report["stages"]:
        lines.append(f"| {s['name']} | {s.get('family', '-')} | {s['steps']} | {s.get('best_step', '-')} | "
                     f"{_value(s.get('final_loss'))} | {_value(s.get('heldout_loss'))} | "
                     f"{'passed' if s['gates_passed'] else 'FAILED'} |")
    lines += ["", "## Figures", ""] + [f"![{name}]({name})" for name in report["plots"]]
    return "\n".join(lines) + "\n"
