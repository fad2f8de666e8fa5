"""The data report: report.json (the stats as they are), report.md (for a person) and
doc_lengths.png (histogram of document lengths), written into a run's data/ directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runyard.data.filters import RULE_BOUNDS
from runyard.data.tokenizer import vocab_shortfall
from runyard.system.files import atomic_write_bytes


def markdown_report(stats: dict[str, Any]) -> str:
    """The report as Markdown text."""
    lines = [
        "# Data report",
        "",
        f"Dataset fingerprint: `{stats['fingerprint']}`  ",
        f"Seed: {stats['seed']}",
        "",
    ]
    lines += ["## Documents at each step", "", "| step | documents | bytes |", "|---|---:|---:|"]
    lines += [f"| {s['step']} | {s['documents']:,} | {s['bytes']:,} |" for s in stats["steps"]]
    read = stats.get("read", {})
    lines += [
        "",
        f"Files read: {read.get('files', 0):,}; bytes read: {read.get('bytes_read', 0):,}; "
        f"undecodable replaced: {read.get('undecodable_replaced', 0)}, skipped: "
        f"{read.get('undecodable_skipped', 0)}; bad records: {read.get('bad_records', 0)}",
        "",
    ]
    lines += _removals_markdown(stats)
    lines += _own_filters_markdown(stats)
    lines += _pii_markdown(stats)
    d = stats["dedup"]
    lines += [
        "",
        "## Deduplication",
        "",
        f"Exact duplicates removed: {d['exact_removed']:,}  ",
        f"Near duplicates removed: {d['near_removed']:,} (Jaccard >= {d['threshold']}"
        + (
            f", {d['bands']} bands x {d['rows']} rows, {d['candidate_pairs']:,} candidate pairs"
            if "bands" in d
            else ""
        )
        + ")",
    ]
    for c in d.get("largest_clusters", []):
        lines.append(
            f"- cluster of {c['size']}: kept `{c['kept']}`; e.g. "
            + ", ".join(f"`{m}`" for m in c["members"][:3])
        )
    sp = stats["split"]
    lines += [
        "",
        "## Split and tokens",
        "",
        f"Split: {sp['method']} (fraction {sp['heldout_fraction']})",
        "",
        "| split | documents | bytes | tokens | shards | bytes/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("train", "heldout"):
        s = sp[name]
        lines.append(
            f"| {name} | {s['documents']:,} | {s['bytes']:,} | {s['tokens']:,} | {s['shards']} | {s['bytes_per_token']} |"
        )
    tok = stats["tokenizer"]
    lines += [
        "",
        f"Tokenizer: {tok['source']}, vocabulary {tok['vocab_size']:,}, end-of-document id {tok['eos_id']}.",
    ]
    asked = tok.get("requested_vocab_size")
    if tok["source"] == "trained" and asked is not None and asked != tok["vocab_size"]:
        lines += ["", f"**Changed from the spec:** {vocab_shortfall(asked, tok['vocab_size'])}"]
    lines += [
        "",
        "![document lengths](doc_lengths.png)",
        "",
    ]
    return "\n".join(lines)


def _snippet(text: str, limit: int = 160) -> str:
    return text[:limit].replace("\n", "⏎").replace("`", "'")


def _bound_text(stats: dict[str, Any], reason: str) -> tuple[str, str]:
    """(rule, threshold) of a removal reason: the spec field and its bound as this dataset was cleaned."""
    field, kind = RULE_BOUNDS.get(reason, (reason, "max"))
    bound = stats.get("filters", {}).get(field)
    return f"data.filters.{field}", "-" if bound is None else f"{kind} {bound}"


def _removals_markdown(stats: dict[str, Any]) -> list[str]:
    lines = ["## Removed by quality filters", ""]
    if not stats["removed"]:
        return lines + ["No document was removed by a quality filter."]
    if stats.get("filters", {}).get("markup_aware"):
        lines += [
            "Table borders, table rows' pipes and heading markup (reST, Markdown) were set aside before the "
            "word, symbol and repetition rules (data.filters.markup_aware).",
            "",
        ]
    lines += ["| reason | rule | threshold | documents |", "|---|---|---|---:|"]
    for reason, n in sorted(stats["removed"].items(), key=lambda x: -x[1]):
        rule, threshold = _bound_text(stats, reason)
        lines.append(f"| {reason} | `{rule}` | {threshold} | {n:,} |")
    for reason, samples in stats["removal_samples"].items():
        rule, threshold = _bound_text(stats, reason)
        lines += ["", f"### Samples: {reason} (`{rule}`, {threshold})", ""]
        for s in samples:
            tripped = f"; tripped by {s['tripped_by']}" if s.get("tripped_by") else ""
            snippet = _snippet(s["text"])
            lines.append(f"- `{s['id']}`: measured {s['value']}{tripped}  \n  `{snippet}`")
    return lines


def _own_filters_markdown(stats: dict[str, Any]) -> list[str]:
    """Sources cleaned with their own filters (a server's logged requests): what became of their records."""
    rows = [r for r in stats.get("sources", []) if r.get("own_filters")]
    if not rows:
        return []
    lines = ["", "## Sources with their own filters", ""]
    traffic = stats.get("traffic")
    if traffic:
        reasons = ", ".join(f"{k} {v:,}" for k, v in traffic["removed"].items()) or "none"
        lines += [f"Logged requests: {traffic['records_read']:,} read, {traffic['records_used']:,} used "
                  f"({traffic['records_train']:,} train, {traffic['records_heldout']:,} held out); removed: {reasons}.", ""]
    lines += ["| source | kind | read | removed by its filters | exact dup | near dup | used |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['path']}` | {r['kind']} | {r['read']:,} | {sum(r['removed'].values()):,} | "
                     f"{r['exact_duplicates']:,} | {r['near_duplicates']:,} | {r['used']:,} |")
    for r in rows:
        bounds = {k: v for k, v in (r.get("filters") or {}).items() if v is not None and k in _BOUND_FIELDS}
        for reason, n in sorted(r["removed"].items(), key=lambda x: -x[1]):
            field, kind = RULE_BOUNDS.get(reason, (reason, "max"))
            bound = bounds.get(field)
            lines.append(f"- `{r['path']}`: {reason} (`data.sources[{r['source']}].filters.{field}`, "
                         f"{'-' if bound is None else f'{kind} {bound}'}): {n:,}")
            for sample in r["removal_samples"].get(reason, []):
                lines.append(f"  - `{sample['id']}`: measured {sample['value']}  `{_snippet(sample['text'])}`")
    return lines


_BOUND_FIELDS = {field for field, _ in RULE_BOUNDS.values()}


def _pii_markdown(stats: dict[str, Any]) -> list[str]:
    if not stats.get("pii"):
        return []
    lines = ["", "## PII replaced", "", "| kind | replaced |", "|---|---:|"]
    lines += [f"| {k} | {v:,} |" for k, v in sorted(stats["pii"].items())]
    for kind, samples in sorted(stats.get("pii_samples", {}).items()):
        lines += ["", f"### Before and after: {kind}", ""]
        for s in samples:
            lines.append(f"- `{_snippet(s['before'])}`  \n  → `{_snippet(s['after'])}`")
            if s.get("replaced"):  # samples written before the list existed have none
                lines.append("  (" + "; ".join(f"`{_snippet(r)}`" for r in s["replaced"]) + ")")
    if stats.get("pii_samples"):
        lines += ["", "The samples show the original text and each replacement in it: keep this report as "
                  "private as the data."]
    return lines


def _histogram_png(stats: dict[str, Any], path: Path) -> None:
    # Imported when drawn: a data worker that writes no report never pays for matplotlib. Drawn without
    # pyplot (no global backend or figure state), as evaluate/report.py draws.
    from matplotlib.figure import Figure

    h = stats["doc_length_histogram"]
    edges, counts = h["edges"], h["counts"]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.bar(
        edges[:-1],
        counts,
        width=[b - a for a, b in zip(edges[:-1], edges[1:], strict=True)],
        align="edge",
        edgecolor="black",
        linewidth=0.4,
    )
    ax.set_xscale("log")
    ax.set_xlabel(f"document length ({h['unit']})")
    ax.set_ylabel("documents")
    ax.set_title("Document lengths after cleaning and deduplication")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(report_dir: Path, stats: dict[str, Any]) -> None:
    """Write report.json, report.md and doc_lengths.png into report_dir."""
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(
        report_dir / "report.json", (json.dumps(stats, indent=1, sort_keys=True) + "\n").encode()
    )
    atomic_write_bytes(report_dir / "report.md", markdown_report(stats).encode())
    _histogram_png(stats, report_dir / "doc_lengths.png")
