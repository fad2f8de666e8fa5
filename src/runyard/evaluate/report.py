"""The evaluation report: fit-to-ship verdict, metrics, samples, and PNG curves.

Writes `eval/report.json` (for machines), `eval/report.md` (for people) and `eval/*.png`; with the spec's
`traffic`, also the training-against-inference section and `eval/lifetime.png` (runyard.plan.runlife).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from runyard.evaluate.heldout import HeldoutMetrics
from runyard.plan.lifetime import Lifetime, plot_lifetime
from runyard.spec.job import EvalSpec
from runyard.system.files import atomic_write_text
from runyard.train.finetune_metrics import finetune_markdown
from runyard.train.gates import compared


@dataclass(frozen=True)
class Verdict:
    """Fit to ship or not; `reasons` names each bound that failed, `passed` each that held, and `flags`
    what a person should look at though it does not change the verdict."""

    fit_to_ship: bool
    reasons: list[str]
    passed: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)


def verdict(
    metrics: HeldoutMetrics, thresholds: EvalSpec, stage_metrics: dict[str, list[dict]] | None = None
) -> Verdict:
    """Every bound the spec sets must hold, each failing one named. Without bounds the held-out loss must
    still beat the unigram baseline by eval.unigram_margin. `stage_metrics` (each stage's metrics.jsonl
    rows) lets it flag a held-out loss that stopped improving well before a stage ended."""
    reasons, passed = [], []
    if thresholds.max_heldout_perplexity is not None:
        line = f"held-out perplexity {metrics.heldout_perplexity:.2f} against the bound {thresholds.max_heldout_perplexity} (eval.max_heldout_perplexity)"
        (passed if metrics.heldout_perplexity <= thresholds.max_heldout_perplexity else reasons).append(line)
    if thresholds.max_gap is not None:
        line = f"train/held-out gap {metrics.gap:.3f} against the bound {thresholds.max_gap} (eval.max_gap, memorisation)"
        (passed if metrics.gap <= thresholds.max_gap else reasons).append(line)
    if thresholds.must_beat_unigram:
        margin = thresholds.unigram_margin
        needed = metrics.unigram_loss * (1 - margin)
        line = (
            f"held-out loss {metrics.heldout_loss:.3f} is {compared(metrics.heldout_loss, metrics.unigram_loss)} the unigram baseline "
            f"{metrics.unigram_loss:.3f}; fit to ship needs at least {margin:.0%} (eval.unigram_margin), "
            f"a loss of {needed:.3f} or lower"
        )
        ok = metrics.heldout_loss < metrics.unigram_loss and metrics.heldout_loss <= needed
        (passed if ok else reasons).append(line)
    flags = stalled_heldout(stage_metrics or {}, thresholds.stall_fraction)
    return Verdict(fit_to_ship=not reasons, reasons=reasons, passed=passed, flags=flags)


def finetune_verdict(stage: str, kind: str, record: dict, thresholds: EvalSpec,
                     stage_metrics: dict[str, list[dict]] | None = None) -> Verdict:
    """The verdict of a run whose last stage is sft or dpo, on that stage's own held-out figures before its
    first step and after its last (stages/<stage>/finetune.json): sft, the response loss against the initial
    weights' (eval.min_response_loss_drop) and the task metric where there is one (eval.min_task_score, else
    not below the initial weights'); dpo, reward accuracy and margin (eval.min_reward_accuracy,
    eval.min_reward_margin)."""
    reasons, passed = [], []
    before = (record.get("before") or {}).get("metrics") or {}
    after = (record.get("after") or {}).get("metrics") or {}
    if not before or not after:
        reasons.append(f"stage {stage} ({kind}) has no held-out figures from before and after its training "
                       f"(stages/{stage}/finetune.json)")
        return Verdict(False, reasons, flags=stalled_heldout(stage_metrics or {}, thresholds.stall_fraction))
    if kind == "sft":
        drop = thresholds.min_response_loss_drop
        a, b = after.get("heldout_loss"), before.get("heldout_loss")
        if drop is not None and (a is None or b is None):
            reasons.append(_missing_figure(stage, "held-out response loss" + (" before training" if b is None else ""),
                                           "eval.min_response_loss_drop"))
        elif drop is not None:
            needed = b * (1 - drop)
            line = (f"stage {stage}'s held-out response loss {a:.4f} is {compared(a, b)} its initial weights' "
                    f"{b:.4f}; fit to ship needs it {'lower' if drop == 0 else f'at least {drop:.0%} lower'} "
                    f"(eval.min_response_loss_drop)" + (f", {needed:.4f} or lower" if drop else ""))
            (passed if a < b and a <= needed else reasons).append(line)
        for key in sorted(k for k in after if k.startswith("task_")):
            score, base = after[key], before.get(key)
            name = key.removeprefix("task_")
            if thresholds.min_task_score is not None:
                line = (f"stage {stage}'s task metric {name} {score:.3f} on held-out prompts against the bound "
                        f"{thresholds.min_task_score} (eval.min_task_score)")
                ok = score >= thresholds.min_task_score
            else:
                base_text = f"{base:.3f}" if base is not None else "-"
                line = (f"stage {stage}'s task metric {name} {score:.3f} on held-out prompts against its initial "
                        f"weights' {base_text}; fit to ship needs it not lower (eval.min_task_score: null)")
                ok = base is None or score >= base
            (passed if ok else reasons).append(line)
    else:
        accuracy, margin = after.get("heldout_reward_accuracy"), after.get("heldout_reward_margin")
        if thresholds.min_reward_accuracy is not None:
            if accuracy is None:
                reasons.append(_missing_figure(stage, "held-out reward accuracy", "eval.min_reward_accuracy"))
            else:
                line = (f"stage {stage}'s held-out reward accuracy {accuracy:.3f} (initial weights "
                        f"{_figure(before.get('heldout_reward_accuracy'), '.3f')}) against the bound "
                        f"{thresholds.min_reward_accuracy} (eval.min_reward_accuracy)")
                (passed if accuracy >= thresholds.min_reward_accuracy else reasons).append(line)
        if thresholds.min_reward_margin is not None:
            if margin is None:
                reasons.append(_missing_figure(stage, "held-out mean reward margin", "eval.min_reward_margin"))
            else:
                line = (f"stage {stage}'s held-out mean reward margin {margin:.4f} against the bound "
                        f"{thresholds.min_reward_margin}: fit to ship needs it above (eval.min_reward_margin)")
                (passed if margin > thresholds.min_reward_margin else reasons).append(line)
    flags = stalled_heldout(stage_metrics or {}, thresholds.stall_fraction)
    return Verdict(fit_to_ship=not reasons, reasons=reasons, passed=passed, flags=flags)


def _missing_figure(stage: str, figure: str, bound: str) -> str:
    """A bound the spec sets whose figure the stage did not record: not fit, and said so (never a crash)."""
    return (f"stage {stage} recorded no {figure} (stages/{stage}/finetune.json), so {bound} cannot be judged; "
            "fit to ship needs the figure")


def _figure(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def stalled_heldout(stage_metrics: dict[str, list[dict]], stall_fraction: float | None) -> list[str]:
    """Stages whose best held-out loss came `stall_fraction` of their steps or more before their end,
    with no better evaluation since: the steps after it did not help (or the model began to memorise)."""
    if stall_fraction is None:
        return []
    flags = []
    for stage, rows in stage_metrics.items():
        held = [(r["step"], r["heldout_loss"]) for r in rows if r.get("heldout_loss") is not None]
        steps = max((r["step"] for r in rows if "step" in r), default=0)
        if len(held) < 3 or steps <= 0:
            continue
        best_step, best = min(held, key=lambda h: (h[1], h[0]))
        last_step, last = held[-1]
        after = sum(1 for step, _ in held if step > best_step)
        if after and steps - best_step >= stall_fraction * steps:
            trend = (
                f"it rose to {last:.3f} since, so the model may be memorising its training data"
                if last > best * 1.01 else f"it ended at {last:.3f}"
            )
            flags.append(
                f"stage {stage}: the held-out loss stopped improving at step {best_step} of {steps} "
                f"(best {best:.3f}; {after} evaluation{'s' if after != 1 else ''} since, none better); {trend}. "
                "Fewer steps, more data or more regularisation (model.dropout, optim.weight_decay) may do as "
                "well or better"
            )
    return flags


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
    metrics: HeldoutMetrics | None,
    result: Verdict,
    samples: list[dict],
    stage_metrics: dict[str, list[dict]],
    stage_summaries: list[dict],
    finetune: dict[str, dict] | None = None,
    lifetime: Lifetime | None = None,
    notes: list[str] | None = None,
) -> dict:
    """Write report.json, report.md and the curves. `finetune` holds each sft/dpo stage's before/after
    record (train/finetune_metrics.py), shown side by side. `metrics` is None for a run without top-level
    data (no pretraining split to score); `notes` are further facts for a reader (what the drift reference
    holds). A sample with `before` was also completed by the weights the last stage began with."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_curves(stage_metrics, out_dir)
    report = {
        "run": run_name,
        "fit_to_ship": result.fit_to_ship,
        "reasons": result.reasons,
        "passed": result.passed,
        "flags": result.flags,
        "metrics": asdict(metrics) if metrics is not None else None,
        "notes": notes or [],
        "stages": stage_summaries,
        "samples": samples,
        "plots": [p.name for p in plots],
        "finetune": finetune or {},
    }
    if lifetime is not None:
        plot = plot_lifetime(lifetime, out_dir / "lifetime.png")
        report["lifetime"] = {**lifetime.to_dict(), "lines": lifetime.lines(), "plot": plot.name}
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
    lines = [f"# Evaluation: {report['run']}", "", verdict_line, ""]
    lines += [f"- held: {p}" for p in report.get("passed", [])]
    lines += [f"- **flag**: {f}" for f in report.get("flags", [])]
    if report.get("passed") or report.get("flags"):
        lines.append("")
    lines += [f"- {note}" for note in report.get("notes") or []]
    if report.get("notes"):
        lines.append("")
    lines += _metric_lines(m) + _stage_and_sample_lines(report)
    return "\n".join(lines) + "\n"


def _metric_lines(m: dict | None) -> list[str]:
    """The final evaluation on the top-level split; a run without top-level data says it has none."""
    if m is None:
        return ["No top-level data: no pretraining held-out loss or unigram baseline. The verdict is the last "
                "stage's own held-out figures (below).", ""]
    return [
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
    ]


def _stage_and_sample_lines(report: dict) -> list[str]:
    lines = [
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
    lines += finetune_markdown(report.get("finetune") or {})
    if report.get("lifetime"):
        lines += ["", "## Training against a lifetime of inference", ""]
        lines += [line if not line or line.startswith("|") else f"- {line}" for line in report["lifetime"]["lines"]]
        lines += ["", f"![{report['lifetime']['plot']}]({report['lifetime']['plot']})"]
    lines += ["", "## Curves", ""] + [f"![{p}]({p})" for p in report["plots"]]
    lines += ["", "## Samples", ""]
    for s in report["samples"]:
        lines += _sample_lines(s)
    return lines


def _sample_lines(sample: dict) -> list[str]:
    """A text prompt with its completion; a chat prompt as the template rendered it, then its completion
    from the initial weights (when there is one) and from the export."""
    if isinstance(sample["prompt"], str):
        shown = [("", sample["prompt"] + sample["completion"])]
        if "before" in sample:
            shown = [("Initial weights:", sample["prompt"] + sample["before"]), ("After training:", shown[0][1])]
        lines = [f"Prompt `{sample['prompt']!r}`:", ""]
    else:
        turns = "; ".join(f"{m['role']}: {m['content']!r}" for m in sample["prompt"])
        lines = [f"Chat prompt ({turns}), rendered with the model's chat template:", "", "```", sample["rendered"], "```", ""]
        shown = [("Initial weights:", sample["before"])] if "before" in sample else []
        shown.append(("After training:" if "before" in sample else "Completion:", sample["completion"]))
    for title, text in shown:
        lines += ([title, ""] if title else []) + ["```", text, "```", ""]
    return lines
