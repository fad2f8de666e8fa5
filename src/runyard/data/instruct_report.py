"""The data report of an instruction or preference stage: report.json and report.md in the run's
data/<stage>/ directory: records at each step, what was removed and why, the split, tokens and the
supervised share, the chat template used and how two conversations were cut into segments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runyard.system.files import atomic_write_bytes

_REASONS = {
    "empty_response": "an assistant message (or the rejected answer) is empty",
    "no_response_tokens": "the rendered conversation has no assistant token to learn",
    "too_long_dropped": "longer than the context (too_long: drop)",
    "too_long_truncated_to_nothing": "longer than the context; truncated, no response token was left",
    "chosen_equals_rejected": "a preference pair whose chosen answer equals its rejected one",
    "template_refused": "the chat template refused the conversation (raise_exception)",
    "bad_record.malformed_json": "bad record: a line that is not JSON (on_bad_record: skip)",
    "bad_record.not_an_object": "bad record: not a JSON object (on_bad_record: skip)",
    "bad_record.no_messages": "bad record: no `messages` (or `prompt` and `response`) (on_bad_record: skip)",
    "bad_record.bad_message": "bad record: a message that is not an object (on_bad_record: skip)",
    "bad_record.not_a_string": "bad record: a field or content that is not a string (on_bad_record: skip)",
    "bad_record.unknown_role": "bad record: a role other than system, user, assistant (on_bad_record: skip)",
    "bad_record.roles_out_of_order": "bad record: roles out of order (on_bad_record: skip)",
    "bad_record.no_response": "bad record: does not end with an assistant message (on_bad_record: skip)",
    "bad_record.missing_field": "bad record: a required field is missing, e.g. `rejected` (on_bad_record: skip)",
}


def _sample(s: dict) -> str:
    extra = s.get("reason") or (f"{s['field']}: {s['expected']}" if "field" in s else "")
    return f"`{s['id']}`" + (f" ({extra})" if extra else "")


def _split_rows(stats: dict[str, Any]) -> list[str]:
    rows = ["| split | records | groups | tokens | supervised tokens | truncated |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("train", "heldout"):
        s = stats["split"][name]
        parts = [s] if "tokens" in s else [s["chosen"], s["rejected"]]
        tokens = sum(p["tokens"] for p in parts)
        supervised = sum(p["supervised_tokens"] for p in parts)
        rows.append(f"| {name} | {s['records']:,} | {s['groups']:,} | {tokens:,} | {supervised:,} "
                    f"({supervised / max(tokens, 1):.0%}) | {s['fit'].get('truncated', 0):,} |")
    return rows


def markdown(stats: dict[str, Any]) -> str:
    kind = "preference (dpo)" if stats["kind"] == "dpo" else "instruction (sft)"
    lines = [f"# Data report: {kind} records", "", f"Fingerprint: `{stats['fingerprint']}`  ",
             f"Seed: {stats['seed']}; context: {stats['context_length']} tokens", "",
             "## Records at each step", "", "| step | records |", "|---|---:|"]
    lines += [f"| {s['step']} | {s['records']:,} |" for s in stats["steps"]]
    read = stats["read"]
    if any(k.startswith("functions") for k in read):
        lines += ["", "Python functions: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in sorted(read.items())
                                                     if k.startswith(("functions", "files_not")))]
    lines += ["", "## Removed", ""]
    if stats["removed"]:
        lines += ["| reason | records |", "|---|---:|"]
        lines += [f"| {_REASONS.get(k, k)} (`{k}`) | {v:,} |" for k, v in sorted(stats["removed"].items())]
        samples = stats.get("removal_samples") or {}
        if samples:
            lines += ["", "Samples of what was removed:", ""]
            lines += [f"- `{k}`: " + "; ".join(_sample(s) for s in v) for k, v in sorted(samples.items())]
    else:
        lines.append("No record was removed.")
    d = stats["dedup"]
    lines += ["", f"Exact duplicate conversations removed: {d['exact_removed']:,}; near duplicates: "
              f"{d['near_removed']:,} (Jaccard >= {d['threshold']})."]
    sp = stats["split"]
    lines += ["", "## Split and tokens", "", f"Split: {sp['method']} (fraction {sp['heldout_fraction']}); "
              f"conversations longer than the context: {sp['too_long']}.", ""]
    lines += _split_rows(stats)
    tpl = stats["chat_template"]
    lines += ["", f"## Chat template ({tpl['origin']})", "", "```jinja", tpl["source"], "```", "",
              "Two conversations as the loss sees them (**bold**: the assistant tokens it learns):", ""]
    for ex in stats.get("examples", []):
        text = "".join(f"**{t}**" if sup else t for t, sup in ex["segments"])
        lines += [f"- `{ex['id']}`:", "", "  " + text[:600].replace("\n", "⏎"), ""]
    return "\n".join(lines) + "\n"


def write_instruct_report(report_dir: Path, stats: dict[str, Any]) -> None:
    """Write report.json and report.md into `report_dir`."""
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(report_dir / "report.json", (json.dumps(stats, indent=1, sort_keys=True) + "\n").encode())
    atomic_write_bytes(report_dir / "report.md", markdown(stats).encode())
