"""The evaluation report: fit-to-ship verdict, metrics, samples, and PNG curves.

Writes `eval/report.json` (for machines), `eval/report.md` (for people) and `eval/*.png`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from runyard.evaluate.heldout import HeldoutMetrics
from runyard.fsutil import atomic_write_text
from runyard.spec import EvalSpec


@dataclass(frozen=True)
class Verdict:
    fit_to_ship: bool
    reasons: list[str]


def verdict(metrics: HeldoutMetrics, thresholds: EvalSpec) -> Verdict:
    """Every threshold the spec sets must hold; each failing one is named."""
    reasons = []
    if thresholds.max_heldout_perplexity is not None and metrics.heldout_perplexity > thresholds.max_heldout_perplexity:
        reasons.append(
            f"held-out perplexity {metrics.heldout_perplexity:.2f} above bound {thresholds.max_heldout_perplexity}"
        )
    if thresholds.max_gap is not None and metrics.gap > thresholds.max_gap:
        reasons.append(f"train/held-out gap {metrics.gap:.3f} above bound {thresholds.max_gap} (memorisation)")
    if thresholds.must_beat_unigram and not metrics.heldout_loss < metrics.unigram_loss:
        reasons.append(
            f"held-out loss {metrics.heldout_loss:.3f} does not beat the unigram baseline {metrics.unigram_loss:.3f}"
        )
    return Verdict(fit_to_ship=not reasons, reasons=reasons)


def plot_curves(stage_metrics: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    """loss.png (train and held-out per stage) and lr.png. Figures are drawn without pyplot (no global
    backend, no window), as matplotlib recommends for servers."""
    written = []
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for stage, rows in stage_metrics.items():
        steps = [r["step"] for r in rows if "loss" in r]
        ax.plot(steps, [r["loss"] for r in rows if "loss" in r], label=f"{stage} train", linewidth=1)
        held = [(r["step"], r["heldout_loss"]) for r in rows if r.get("heldout_loss") is not None]
        if held:
            ax.plot(*zip(*held, strict=True), marker="o", label=f"{stage} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Training and held-out loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=110)
    written.append(out_dir / "loss.png")

    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    for stage, rows in stage_metrics.items():
        ax.plot([r["step"] for r in rows if "lr" in r], [r["lr"] for r in rows if "lr" in r], label=stage)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("Learning-rate schedule")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "lr.png", dpi=110)
    written.append(out_dir / "lr.png")
    return written


def write_report(
    out_dir: Path,
    run_name: str,
    metrics: HeldoutMetrics,
    result: Verdict,
    samples: list[dict],
    stage_metrics: dict[str, list[dict]],
    stage_summaries: list[dict],
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_curves(stage_metrics, out_dir)
    report = {
        "run": run_name,
        "fit_to_ship": result.fit_to_ship,
        "reasons": result.reasons,
        "metrics": asdict(metrics),
        "stages": stage_summaries,
        "samples": samples,
        "plots": [p.name for p in plots],
    }
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out_dir / "report.md", _markdown(report))
    return report


def _coverage_lines(coverage: dict) -> list[str]:
    """What each final evaluation sample covered of its split."""
    if not coverage:
        return []
    lines = [
        "## Evaluation samples",
        "",
        "Each loss is measured on sequences drawn across its whole split (one from each of n equal "
        "stretches, seeded from the spec), the two samples the same size.",
        "",
        "| sample | sequences | tokens scored | documents covered | seed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, c in coverage.items():
        docs = "-" if c.get("documents") is None else f"{c['documents']:,} of {c['split_documents']:,}"
        lines.append(f"| {name} | {c['sequences']:,} of {c['split_sequences']:,} | {c['tokens']:,} | {docs} | "
                     f"{c['seed']} |")
    return [*lines, ""]


def _markdown(report: dict) -> str:
    m = report["metrics"]
    verdict_line = "**FIT TO SHIP**" if report["fit_to_ship"] else "**NOT FIT TO SHIP**: " + "; ".join(report["reasons"])
    lines = [
        f"# Evaluation: {report['run']}",
        "",
        verdict_line,
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| held-out loss | {m['heldout_loss']:.4f} |",
        f"| held-out perplexity | {m['heldout_perplexity']:.2f} |",
        f"| train loss (same-size sample, eval mode) | {m['train_loss']:.4f} |",
        f"| gap (held-out - train) | {m['gap']:.4f} |",
        f"| unigram baseline loss | {m['unigram_loss']:.4f} |",
        f"| unigram baseline perplexity | {m['unigram_perplexity']:.2f} |",
        f"| held-out tokens scored | {m['heldout_tokens']:,} |",
        "",
        *_coverage_lines(m.get("coverage") or {}),
        "## Stages",
        "",
        "| stage | steps | final train loss | held-out loss | tokens/s | gates |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in report["stages"]:
        held = f"{s['heldout_loss']:.4f}" if s.get("heldout_loss") is not None else "-"
        lines.append(
            f"| {s['name']} | {s['steps']} | {s['final_loss']:.4f} | {held} | {s['tokens_per_s']:,.0f} | "
            f"{'passed' if s['gates_passed'] else 'FAILED'} |"
        )
    lines += ["", "## Curves", ""] + [f"![{p}]({p})" for p in report["plots"]]
    lines += ["", "## Samples", ""]
    for s in report["samples"]:
        lines += [f"Prompt `{s['prompt']!r}`:", "", "```", s["prompt"] + s["completion"], "```", ""]
    return "\n".join(lines) + "\n"
