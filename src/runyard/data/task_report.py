"""The data report of the tabular and image tasks: what was read, what cleaning removed and why, how the
rows were split, the class balance, each feature's type and summary, and plots (class_balance.png,
features.png for tables, samples.png for images). Written into the run's `data/` as report.json,
report.md and the PNGs, as the text data stage writes its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from runyard.system.files import atomic_write_text

MAX_FEATURE_PLOTS = 12


def plot_class_balance(balance: dict[str, dict[str, int]], path: Path) -> None:
    splits = list(balance)
    classes = list(next(iter(balance.values())))
    fig = Figure(figsize=(max(5.0, 0.5 * len(classes) * len(splits)), 3.8))
    ax = fig.subplots()
    width = 0.8 / len(splits)
    for k, split in enumerate(splits):
        ax.bar(np.arange(len(classes)) + k * width, [balance[split][c] for c in classes], width, label=split)
    ax.set_xticks(np.arange(len(classes)) + 0.4 - width / 2, classes, rotation=30, ha="right")
    ax.set_ylabel("rows")
    ax.set_title("Class balance per split")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_features(columns: dict[str, np.ndarray], kinds: dict[str, str], path: Path) -> None:
    """Histograms of the first numeric features and bar charts of the first categorical ones (training rows)."""
    names = list(columns)[:MAX_FEATURE_PLOTS]
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(3.2 * cols, 2.4 * rows))
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    for ax, name in zip(axes, names, strict=False):
        values = columns[name]
        if kinds[name] == "numeric":
            present = values[~np.isnan(values)]
            ax.hist(present, bins=30)
            missing = len(values) - len(present)
            ax.set_title(f"{name}" + (f" ({missing} missing)" if missing else ""), fontsize=8)
        else:
            labels, counts = np.unique(np.asarray([str(v) for v in values], dtype=object), return_counts=True)
            top = np.argsort(-counts, kind="stable")[:10]
            ax.barh([str(labels[i]) for i in top][::-1], counts[top][::-1])
            ax.set_title(f"{name} ({len(labels)} categories)", fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in axes[len(names):]:
        ax.axis("off")
    fig.suptitle(f"Feature distributions, training split (first {len(names)} of {len(columns)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_samples(pixels: np.ndarray, labels: np.ndarray, class_names: list[str], path: Path, per_class: int = 6) -> None:
    n = len(class_names)
    fig = Figure(figsize=(1.0 * per_class + 1, 1.0 * n + 0.5))
    axes = np.atleast_2d(fig.subplots(n, per_class))
    for i, name in enumerate(class_names):
        rows = np.flatnonzero(labels == i)[:per_class]
        for j in range(per_class):
            ax = axes[i, j]
            ax.axis("off")
            if j < len(rows):
                image = np.asarray(pixels[rows[j]], dtype=np.float32)
                ax.imshow(image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0), cmap="gray", vmin=0, vmax=1)
            if j == 0:
                ax.set_title(name, fontsize=7, loc="left")
    fig.suptitle("Training images per class", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _removed_lines(removed: dict[str, int]) -> list[str]:
    reasons = {"missing_target": "no target value", "missing_label": "no label", "duplicate_rows": "exact duplicate row",
               "duplicate_keys": "a row whose data.table.dedup_key repeats an earlier row's",
               "duplicate_images": "exact duplicate image (pixels and label)"}
    return [f"| {reasons.get(k, k.replace('missing_', 'missing value in column '))} | {v:,} |" for k, v in removed.items()]


def _dedup_lines(dedup: dict[str, Any] | None) -> list[str]:
    """The duplicate policy and the exact duplicates found, stated whether or not they were removed."""
    if not dedup:
        return []
    found = dedup["exact_duplicate_rows"]
    policy = {"none": "none (every row kept)", "rows": "rows (exact duplicate rows removed)",
              "key": f"key (rows repeating an earlier row's {dedup['key']} removed)"}[dedup["policy"]]
    repeat = f"{found:,} row{'s repeat' if found != 1 else ' repeats'} an earlier row exactly in every column read"
    return [f"Duplicates (data.table.dedup): {policy}; {repeat}" + (" (kept)" if dedup["policy"] == "none" and found else "")]


def write_table_report(out_dir: Path, stats: dict[str, Any], train_columns: dict[str, np.ndarray],
                       kinds: dict[str, str]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if stats.get("class_balance"):
        plot_class_balance(stats["class_balance"], out_dir / "class_balance.png")
        plots.append("class_balance.png")
    plot_features(train_columns, kinds, out_dir / "features.png")
    plots.append("features.png")
    report = {**stats, "plots": plots}
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2, default=str))
    lines = ["# Data report (table)", "", f"- rows read: {stats['rows_read']:,}; used: {stats['rows_used']:,}",
             f"- target: `{stats['target']}`", f"- split: {stats['split']['method']}; "
             + ", ".join(f"{k} {v:,}" for k, v in stats["split"]["counts"].items()),
             f"- missing values: numeric `{stats['missing_policy']['numeric']}`, categorical "
             f"`{stats['missing_policy']['categorical']}`", "", "## Removed", "", "| reason | rows |", "| --- | --- |",
             *_removed_lines(stats["removed"]), "", *_dedup_lines(stats.get("dedup")), ""]
    if stats.get("class_balance"):
        classes = list(next(iter(stats["class_balance"].values())))
        lines += ["## Class balance", "", "| split | " + " | ".join(classes) + " |", "| --- |" + " --- |" * len(classes)]
        lines += [f"| {s} | " + " | ".join(str(b[c]) for c in classes) + " |" for s, b in stats["class_balance"].items()]
        lines.append("")
    if stats.get("unseen_categories_in_test"):
        lines += ["Test rows with a category the training rows never had (encoded as missing): "
                  + ", ".join(f"`{k}` {v}" for k, v in stats["unseen_categories_in_test"].items()), ""]
    lines += ["## Features (types inferred; summaries over the training split)", "",
              "| feature | type | missing | summary |", "| --- | --- | --- | --- |"]
    for f in stats["feature_summary"]:
        if f["kind"] == "numeric":
            summary = "-" if f["mean"] is None else f"mean {f['mean']:.4g}, std {f['std']:.4g}, min {f['min']:.4g}, max {f['max']:.4g}"
        else:
            summary = f"{f['categories']} categories; top " + ", ".join(f"{v} ({n})" for v, n in f["top"])
        lines.append(f"| {f['name']} | {f['kind']} | {f['missing']} | {summary} |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    return report


def write_image_report(out_dir: Path, stats: dict[str, Any], train_pixels: np.ndarray, train_labels: np.ndarray) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_class_balance(stats["class_balance"], out_dir / "class_balance.png")
    plot_samples(train_pixels, train_labels, stats["class_names"], out_dir / "samples.png")
    plots = ["class_balance.png", "samples.png"]
    report = {**stats, "plots": plots}
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2))
    classes = stats["class_names"]
    c, h, w = stats["shape"]
    lines = ["# Data report (images)", "", f"- images read: {stats['images_read']:,}; used: {stats['images_used']:,}",
             f"- shape: {c} channel{'s' if c > 1 else ''}, {h}x{w} (height x width); pixel mean "
             + ", ".join(f"{m:.3f}" for m in stats["pixel_mean"]) + ", std " + ", ".join(f"{s:.3f}" for s in stats["pixel_std"]),
             f"- split: {stats['split']['method']}; " + ", ".join(f"{k} {v:,}" for k, v in stats["split"]["counts"].items()),
             "", "## Removed", "", "| reason | images |", "| --- | --- |", *_removed_lines(stats["removed"]), "",
             "## Class balance", "", "| split | " + " | ".join(classes) + " |", "| --- |" + " --- |" * len(classes)]
    lines += [f"| {s} | " + " | ".join(str(b[k]) for k in classes) + " |" for s, b in stats["class_balance"].items()]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    return report
