"""Normalisation and each quality filter on documents made to trip it and documents that must pass."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from runyard.data.config import FilterSpec, NormalizeSpec
from runyard.data.filters import check_document
from runyard.data.normalize import normalize_text

PROSE = (
    "The river ran quietly past the old stone bridge, where children gathered each evening to watch "
    "the boats drift toward the harbour and argue about which one would arrive first.\n"
) * 1
PROSE += "Later that night the lamps were lit along the quay and the market stalls closed one by one.\n"


def test_normalisation():
    spec = NormalizeSpec()
    assert normalize_text("a\r\nb\rc", spec) == "a\nb\nc"
    assert normalize_text("x\x00y\x1bz\tq", spec) == "xyz\tq"
    assert normalize_text("cafe\u0301", spec) == "caf\u00e9"  # NFC
    assert normalize_text("line  \t\nnext ", spec) == "line\nnext"


# (bound, tripping document, passing document)
CASES = {
    "too_short_chars": ({"min_chars": 50}, "short", PROSE),
    "too_long_chars": ({"max_chars": 100}, PROSE * 3, "a short but fine line"),
    "too_few_words": ({"min_words": 20}, "only four words here", PROSE),
    "too_many_words": ({"max_words": 30}, PROSE, "just a few words"),
    "mean_word_length_low": ({"min_mean_word_length": 3}, "a b c d e f g h i j", PROSE),
    "mean_word_length_high": (
        {"max_mean_word_length": 10},
        "supercalifragilistic antidisestablishmentarianism pneumonoultramicroscopic",
        PROSE,
    ),
    "symbol_word_ratio": ({"max_symbol_word_ratio": 0.1}, "# a # b # c ... d # e", PROSE),
    "non_alpha_words": ({"max_non_alpha_word_fraction": 0.3}, "12 34 56 78 90 ok", PROSE),
    "duplicate_lines": ({"max_duplicate_line_fraction": 0.3}, "same line\n" * 5 + "other\n", PROSE),
    "duplicate_paragraphs": (
        {"max_duplicate_paragraph_fraction": 0.3},
        "para one\n\npara one\n\npara one",
        "first para\n\nsecond para",
    ),
    "top_ngram_repetition": ({"max_top_ngram_fraction": 0.2}, "buy now " * 30 + "please", PROSE),
    "ellipsis_lines": ({"max_ellipsis_line_fraction": 0.3}, "wait...\nand then...\nso…\nok", PROSE),
    "bullet_lines": ({"max_bullet_line_fraction": 0.5}, "• one\n• two\n- three\nend", PROSE),
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_filter_trips_and_passes(reason: str):
    bounds, bad, good = CASES[reason]
    spec = FilterSpec(**{"max_duplicate_line_fraction": None, **bounds})
    failed = check_document(bad, spec)
    assert failed is not None and failed[0] == reason
    assert check_document(good, spec) is None


def test_disabled_filters_pass_everything():
    assert check_document("", FilterSpec(enabled=False)) is None


def test_default_filters_keep_normal_python_source():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:120]
    spec = FilterSpec()
    removed = [f.name for f in files if check_document(f.read_text(encoding="utf-8", errors="replace"), spec)]
    assert removed == []
