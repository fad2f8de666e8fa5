"""The comparison report: `report.json` (for machines), `report.md` (for people), `curves.png`.

Uses matplotlib's object API (Figure + Agg canvas), so writing a report never changes the process's
global plotting backend.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from runyard.reproduce.compare import BITWISE, WITHIN_TOLERANCE, Comparison, read_metrics
from runyard.system.files import atomic_write_bytes, atomic_write_text

PLOT_FILE = "curves.png"
VERDICT_TEXT = {
    BITWISE: "BITWISE: every curve, metric and weight is identical",
    WITHIN_TOLERANCE: "WITHIN TOLERANCE",
    "different": "DIFFERENT",
}


def plot_curves(comparison: Comparison, path: Path) -> None:
    """Per stage: both train-loss curves (top) and their absolute difference per step (bottom)."""
    stages = comparison.stages or []
    fig = Figure(figsize=(5.5 * max(1, len(stages)), 6.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, max(1, len(stages)), squeeze=False, sharex="col")
    for col, stage in enumerate(stages):
        a = {r["step"]: r for r in read_metrics(Path(comparison.original), stage.name) if "loss" in r}
        b = {r["step"]: r for r in read_metrics(Path(comparison.other), stage.name) if "loss" in r}
        top, bottom = axes[0][col], axes[1][col]
        top.plot(sorted(a), [a[s]["loss"] for s in sorted(a)], label="original", linewidth=2.5, alpha=0.6)
        top.plot(sorted(b), [b[s]["loss"] for s in sorted(b)], label="reproduction", linewidth=1, linestyle="--")
        top.set_title(f"stage {stage.name}: train loss")
        top.set_ylabel("cross-entropy (nats/token)")
        top.grid(alpha=0.3)
        top.legend()
        common = sorted(set(a) & set(b))
        diffs = [abs(a[s]["loss"] - b[s]["loss"]) for s in common]
        if common and any(diffs):
            bottom.semilogy(common, [d if d > 0 else float("nan") for d in diffs], marker=".", linewidth=1)
            bottom.axhline(comparison.tolerance, color="red", linestyle=":", label=f"tolerance {comparison.tolerance:g}")
            bottom.legend()
        else:
            bottom.text(0.5, 0.5, "identical at every step" if common else "no common steps",
                        ha="center", va="center", transform=bottom.transAxes)
        if stage.first_parting_step is not None:
            for ax in (top, bottom):
                ax.axvline(stage.first_parting_step, color="red", alpha=0.4,
                           label=None if ax is bottom else f"curves part (step {stage.first_parting_step})")
            top.legend()
        bottom.set_ylabel("|difference|")
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3)
    fig.suptitle(VERDICT_TEXT.get(comparison.verdict, comparison.verdict))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write_bytes(path, buffer.getvalue())


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def markdown(comparison: Comparison, title: str, context: dict | None = None) -> str:
    c = comparison
    verdict = VERDICT_TEXT.get(c.verdict, c.verdict)
    if c.verdict == WITHIN_TOLERANCE:
        verdict += f" ({c.tolerance:g} nats per token)"
    lines = [f"# {title}", "", f"**Verdict: {verdict}**", "",
             f"- original: `{c.original}`", f"- reproduction: `{c.other}`",
             f"- expected: {'bitwise (CPU, same processor, same torch build)' if c.expected == BITWISE else 'within tolerance (other hardware, another build, or a GPU)'}"]
    if c.verdict != BITWISE and c.expected == BITWISE:
        lines.append("- **a bitwise result was expected here**: the differences below are the candidates")
    lines += ["", "## Loss curves", "", "| stage | steps compared | steps missing | max abs diff (train) | "
              "max abs diff (held-out) | first differing step | first step past tolerance | bitwise |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in c.stages:
        missing = f"{len(s.steps_missing)}" + (f" (from {s.steps_missing[0]})" if s.steps_missing else "")
        lines.append(f"| {s.name} | {s.steps_compared} | {missing} | {_fmt(s.max_abs_diff)} | {_fmt(s.heldout_max_abs_diff)} | "
                     f"{_fmt(s.first_differing_step)} | {_fmt(s.first_parting_step)} | {'yes' if s.bitwise else 'no'} |")
    lines += ["", f"![curves]({PLOT_FILE})", ""]
    if c.metrics:
        lines += ["## Final held-out metrics", "", "| metric | original | reproduction | abs diff |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {_fmt(m['original'])} | {_fmt(m['other'])} | {_fmt(m['abs_diff'])} |" for k, m in c.metrics.items()]
        lines.append("")
    w = c.weights
    lines += ["## Exported weights", "",
              f"- original `{_fmt(w['original_sha256'])}`", f"- reproduction `{_fmt(w['other_sha256'])}`",
              f"- {'identical' if w['equal'] else 'not identical'}", ""]
    for heading, items in (("Inputs that differ", c.input_differences),
                           ("Environment differences", c.environment_differences),
                           ("Hardware differences", c.hardware_differences)):
        lines += [f"## {heading}", ""] + ([f"- {i}" for i in items] or ["- none"]) + [""]
    if context:
        lines += ["## How it was reproduced", ""]
        lines += [f"- {k}: {_fmt(v) if not isinstance(v, list | dict) else json.dumps(v)}" for k, v in context.items()]
        lines.append("")
    return "\n".join(lines)


def write_report(out_dir: Path, comparison: Comparison, title: str, context: dict | None = None) -> dict:
    """Write report.json, report.md and curves.png into `out_dir`; returns the JSON written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(comparison, out_dir / PLOT_FILE)
    data = {**comparison.to_json(), "context": context or {}, "plot": PLOT_FILE}
    atomic_write_text(out_dir / "report.json", json.dumps(data, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "report.md", markdown(comparison, title, context))
    return data
