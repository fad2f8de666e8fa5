"""The data report names what each filter removed and why, shows PII before and after, and says when
the trained vocabulary is smaller than the spec asked: through the real pipeline on real files."""

from __future__ import annotations

import json
from pathlib import Path
from pydoc_data.topics import topics as PYTHON_REFERENCE

from runyard.data.pipeline import prepare_data
from runyard.data.report import markdown_report
from runyard.data.tokenizer import vocab_shortfall
from runyard.spec.data import DataSpec


def _corpus(directory: Path) -> Path:
    directory.mkdir(parents=True)
    # Real technical pages: Python's reference documentation, tables and headings included.
    for name in ("operator-summary", "typesseq", "formatstrings", "specialnames", "types"):
        (directory / f"{name}.txt").write_text(PYTHON_REFERENCE[name], encoding="utf-8")
    (directory / "spam.txt").write_text("limited offer buy now " * 60, encoding="utf-8")
    (directory / "contact.txt").write_text(
        "The support desk answers on +44 20 7946 0958 and at help.desk@mail.acme-corp.com during office "
        "hours; the status page lives on 93.184.216.34 while the lab network uses 10.0.0.0/8 and the "
        "examples in the manual use 192.0.2.10. Requests are logged with version 2.0.0.1 of the client. "
        * 3,
        encoding="utf-8",
    )
    return directory


def test_report_names_rule_threshold_value_and_what_tripped(tmp_path: Path):
    spec = DataSpec.model_validate(
        {
            "sources": [{"path": str(_corpus(tmp_path / "docs") / "*.txt")}],
            "heldout_fraction": 0.2,
            "tokenizer": {"vocab_size": 60000},
            "workers": 1,
            "shard_tokens": 1024,
            "filters": {"min_words": 50, "max_symbol_word_ratio": 0.1, "max_top_ngram_fraction": 0.2,
                        "max_duplicate_line_fraction": 0.3},
            "pii": {"enabled": True},
            "dedup": {"near": False},
        }
    )
    prepared = prepare_data(spec, seed=0, report_dir=tmp_path / "rep", cache_dir=tmp_path / "c", progress=False)
    stats = json.loads((tmp_path / "rep" / "report.json").read_text())

    # The reference pages pass (the operator precedence table among them); the spam does not.
    assert stats["removed"] == {"top_ngram_repetition": 1}, stats["removal_samples"]
    (sample,) = stats["removal_samples"]["top_ngram_repetition"]
    assert sample["id"].endswith("spam.txt") and sample["rule"] == "max_top_ngram_fraction"
    assert sample["threshold"] == 0.2 and sample["value"] > 0.2
    assert "'limited offer'" in sample["tripped_by"] or "'buy now'" in sample["tripped_by"]

    assert stats["pii"] == {"phone": 3, "email": 3, "ip_address": 3}
    (before_after, *_) = stats["pii_samples"]["ip_address"]
    assert "93.184.216.34" in before_after["before"] and "<IP>" in before_after["after"]

    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| top_ngram_repetition | `data.filters.max_top_ngram_fraction` | max 0.2 | 1 |" in md
    assert "tripped by 2-gram" in md and "### Before and after: phone" in md and "→ `" in md

    assert prepared.vocab_size < 60000 and stats["tokenizer"]["requested_vocab_size"] == 60000
    assert f"supports only {prepared.vocab_size:,}" in md and "Changed from the spec" in md
    assert "data.tokenizer.vocab_size asked for 60,000" in md


def test_report_of_an_older_dataset_still_renders():
    # prepared.json written before the detailed samples existed: no rule, no tripped_by, no filters.
    stats = {
        "fingerprint": "f", "seed": 0, "steps": [], "read": {},
        "removed": {"too_few_words": 2}, "removal_samples": {"too_few_words": [{"id": "a", "value": 3, "text": "x"}]},
        "pii": {}, "dedup": {"exact_removed": 0, "near_removed": 0, "threshold": 0.8},
        "split": {"method": "m", "heldout_fraction": 0.1, **{
            s: {"documents": 1, "bytes": 1, "tokens": 1, "shards": 1, "bytes_per_token": 1} for s in ("train", "heldout")}},
        "tokenizer": {"source": "trained", "vocab_size": 300, "eos_id": 0},
    }
    md = markdown_report(stats)
    assert "| too_few_words | `data.filters.min_words` | - | 2 |" in md and "- `a`: measured 3" in md


def test_vocab_shortfall_says_what_to_do():
    text = vocab_shortfall(60000, 6933)
    assert "60,000" in text and "6,933" in text and "min_frequency" in text and "set vocab_size to 6,933" in text
