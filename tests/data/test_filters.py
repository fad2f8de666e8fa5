"""Normalisation and each quality filter on documents made to trip it and documents that must pass."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from pydoc_data.topics import topics as PYTHON_REFERENCE  # Python's own reference docs, as text

import pytest

from runyard.data.filters import check_document
from runyard.data.markup import classify_line, prose_view
from runyard.data.normalize import normalize_text
from runyard.spec.data import FilterSpec, NormalizeSpec

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
    assert failed is not None and failed.reason == reason
    assert failed.field in bounds and failed.threshold == bounds[failed.field]
    assert (failed.value < failed.threshold) if failed.kind == "min" else (failed.value > failed.threshold)
    assert check_document(good, spec) is None


@pytest.mark.parametrize(
    "bounds, text, tripped",
    [
        ({"max_top_ngram_fraction": 0.2}, "buy now " * 30 + "please", "2-gram 'buy now' x30"),
        ({"max_symbol_word_ratio": 0.1}, "see # a # b # c ... d # e", "'#' x4, '...' x1 over"),
        ({"max_duplicate_line_fraction": 0.3}, "same line\n" * 5 + "other\n", "repeated lines: 'same line' x4"),
        ({"max_non_alpha_word_fraction": 0.3}, "12 34 12 -- 12 ok", "words without a letter: '12' x3"),
        ({"max_ellipsis_line_fraction": 0.3}, "wait...\nand then...\nok", "2 of 3 lines, e.g. 'wait...'"),
        ({"max_mean_word_length": 10}, "supercalifragilistic antidisestablishmentarianism x", "longest words 'antidis"),
    ],
)
def test_failure_names_what_tripped_it(bounds, text, tripped):
    failed = check_document(text, FilterSpec(**{"max_duplicate_line_fraction": None, **bounds}))
    assert failed is not None and tripped in failed.tripped_by, failed
    sample = failed.sample("doc-1", text)
    assert sample["rule"] == next(iter(bounds)) and sample["threshold"] == next(iter(bounds.values()))
    assert sample["tripped_by"] == failed.tripped_by and sample["id"] == "doc-1"


# Gopher-style bounds for prose, as a user sets them for a documentation corpus.
PROSE_BOUNDS = {
    "min_words": 50,
    "max_symbol_word_ratio": 0.1,
    "max_non_alpha_word_fraction": 0.3,
    "max_top_ngram_fraction": 0.2,
    "max_duplicate_line_fraction": 0.3,
    "max_duplicate_paragraph_fraction": 0.3,
}

INDEX_PAGE = """\
##################
  Library manual
##################

.. toctree::
   :maxdepth: 2

   intro.rst
   builtins.rst

Overview
########

The library manual describes the modules that ship with the interpreter, how to import them and
what each one offers, from text processing to networking and concurrency.

Text services
#############

String operations, regular expressions, difflib and textwrap help with text of every kind, from
log files to generated reports, and each module documents its functions with examples.

Networking
##########

Sockets, HTTP clients and servers, and e-mail handling are covered in the chapters that follow,
each with a short tutorial and a reference section.
"""

GRID_TABLE_PAGE = """\
Status codes
============

The server answers every request with one of the following codes; the table lists each with its
meaning and what a client should do next.

+--------+----------------------+------------------------------+
| Code   | Meaning              | What to do                   |
+========+======================+==============================+
| 200    | OK                   | read the body                |
+--------+----------------------+------------------------------+
| 301    | Moved permanently    | follow the new location      |
+--------+----------------------+------------------------------+
| 404    | Not found            | check the address            |
+--------+----------------------+------------------------------+
| 429    | Too many requests    | wait, then retry             |
+--------+----------------------+------------------------------+
| 503    | Unavailable          | retry with backoff           |
+--------+----------------------+------------------------------+

Markdown tables work the same way:

| option | default | meaning |
| --- | :---: | ---: |
| retries | 3 | attempts before giving up |
| timeout | 30 | seconds per attempt |
"""


def test_markup_lines_are_recognised():
    assert classify_line("+--------+-------+") == "table_border"
    assert classify_line("+========+=======+") == "table_border"
    assert classify_line("|========|=======|") == "table_border"
    assert classify_line("=====  =======  ====") == "table_border"
    assert classify_line("| --- | :---: | ---: |") == "table_border"
    assert classify_line("| 200 | OK |") == "table_row"
    assert classify_line("##########") == "heading_adornment"
    assert classify_line("~~~~~~") == "heading_adornment"
    assert classify_line("## Installation") == "heading"
    for prose in ("The end.", "a | b", "x = 1", "-- a dash", "#!/bin/sh", "...", "- item"):
        assert classify_line(prose) is None, prose
    view = prose_view(GRID_TABLE_PAGE)
    assert "Moved permanently follow the new location" in view.text and "+---" not in view.text
    assert view.titles == {"Status codes"} and "Status codes" not in view.body


@pytest.mark.parametrize("page", [INDEX_PAGE, GRID_TABLE_PAGE], ids=["index-page", "grid-table"])
def test_technical_pages_pass_only_when_markup_is_recognised(page):
    assert check_document(page, FilterSpec(**PROSE_BOUNDS)) is None
    plain = check_document(page, FilterSpec(**PROSE_BOUNDS, markup_aware=False))
    assert plain is not None and plain.reason in ("symbol_word_ratio", "duplicate_lines", "non_alpha_words")


def test_python_reference_docs_pass_the_prose_filters():
    # Python's own reference documentation (tables, reST headings), as shipped with every interpreter.
    spec = FilterSpec(**PROSE_BOUNDS)
    failures = {
        name: failed for name, text in PYTHON_REFERENCE.items()
        if (failed := check_document(text, spec)) is not None and failed.reason != "too_few_words"
    }
    assert len(PYTHON_REFERENCE) > 50 and failures == {}
    # The operator precedence table is what the repetition rule used to drop: its borders repeat.
    plain = check_document(PYTHON_REFERENCE["operator-summary"], FilterSpec(**PROSE_BOUNDS, markup_aware=False))
    assert plain is not None and plain.reason == "top_ngram_repetition" and "+----" in plain.tripped_by


@pytest.mark.parametrize(
    "spam, reason",
    [
        ("Great deals today #sale #deal #cheap #buy #now #best #offer #free #win #hot " * 8, "symbol_word_ratio"),
        (PROSE + "".join(f"| buy now | lot {i} |\n" for i in range(40)), "top_ngram_repetition"),
        ("Click here to win a prize today and every day.\n" * 30, "duplicate_lines"),
        ("# Buy now\n\nBuy cheap pills online, buy cheap pills online, buy cheap pills online.\n\n" * 10,
         "duplicate_lines"),
    ],
    ids=["hashtags", "repeated-table-cells", "repeated-lines", "repeated-sections"],
)
def test_spam_is_still_caught_with_markup_recognised(spam, reason):
    failed = check_document(spam, FilterSpec(**{**PROSE_BOUNDS, "min_words": 5}))
    assert failed is not None and failed.reason == reason, failed


def test_disabled_filters_pass_everything():
    assert check_document("", FilterSpec(enabled=False)) is None


def test_default_filters_keep_normal_python_source():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:120]
    spec = FilterSpec()
    removed = [f.name for f in files if check_document(f.read_text(encoding="utf-8", errors="replace"), spec)]
    assert removed == []


def test_indented_reST_adornments_are_recognised_but_indented_comments_are_not_headings():
    text = "Intro\n\n.. only:: html\n\n  Reference\n  ######\n\n  Text.\n\n    # a comment in code\n"
    view = prose_view(text)
    assert view.markup_lines == {"heading_adornment": 1} and "######" not in view.text
    assert "Reference" in view.titles and "# a comment in code" in view.text


def _prose_words(n: int, first: int = 0) -> str:
    """n words of varied prose in paragraphs (no repeated n-gram dominates)."""
    words = [f"{w}{first + i}" if i % 3 else w for i, w in enumerate(
        ("the kernel schedules each task on a runqueue and balances load across cpus when idle " * (n // 14 + 1))
        .split()[:n])]
    return "\n\n".join(" ".join(words[i : i + 60]) + "." for i in range(0, n, 60))


# A kernel-doc style page: 900 words of prose and a literal block of a program's output full of '...'.
_OUTPUT = "\n".join(f"    [{i}.000] probing device {i} ... ... done ..." for i in range(60))
LITERAL_PAGES = {
    "rest-double-colon": _prose_words(450) + "\n\nThe boot log reads::\n\n" + _OUTPUT + "\n\n" + _prose_words(450, 1000),
    "rest-code-block": _prose_words(450) + "\n\n.. code-block:: console\n   :linenos:\n\n" + _OUTPUT + "\n\n"
    + _prose_words(450, 1000),
    "markdown-backticks": _prose_words(450) + "\n\n```console\n" + _OUTPUT + "\n# comment ###\n```\n\n" + _prose_words(450, 1000),
    "markdown-tildes": _prose_words(450) + "\n\n~~~\n" + _OUTPUT + "\n```\n~~~\n\n" + _prose_words(450, 1000),
}


@pytest.mark.parametrize("name", sorted(LITERAL_PAGES))
def test_literal_blocks_are_left_out_of_the_prose_statistics(name):
    page = LITERAL_PAGES[name]
    spec = FilterSpec(**PROSE_BOUNDS)
    assert check_document(page, spec) is None  # kept: the '...' are in the literal block
    plain = check_document(page, FilterSpec(**PROSE_BOUNDS, markup_aware=False))
    assert plain is not None and plain.reason == "symbol_word_ratio", plain
    view = prose_view(page)
    assert "probing device" not in view.text and view.markup_lines["literal_block"] >= 60
    assert view.literal_words >= 60 * 8 and len(view.text.split()) == 900 + 4 * ("reads::" in page)


def test_literal_blocks_still_count_as_words_and_prose_spam_is_still_caught():
    # All code: no prose words, but the document's words count for min_words.
    code_only = "```python\n" + "\n".join(f"value_{i} = compute(item_{i}, factor={i})" for i in range(30)) + "\n```\n"
    failed = check_document(code_only, FilterSpec(min_words=50))
    assert failed is None
    # '...' outside the block is still counted.
    spam = _prose_words(100) + "\n\nwait ... " * 40 + "\n\n```\nx = 1\n```\n"
    failed = check_document(spam, FilterSpec(**PROSE_BOUNDS))
    assert failed is not None and failed.reason == "symbol_word_ratio"


def test_only_literal_markup_makes_a_literal_block():
    # A `.. note::` directive and a paragraph ending in `::` without an indented block are prose.
    text = "Intro.\n\n.. note::\n\n   Read this ... carefully.\n\nA list::\nnot indented ...\n"
    view = prose_view(text)
    assert "literal_block" not in view.markup_lines and "carefully" in view.text and "not indented" in view.text
    # The `::` paragraph stays, the block after it goes; text after the block is prose again.
    text = "Example::\n\n    $ make ...\n    ok ...\n\nBack to prose.\n"
    view = prose_view(text)
    assert view.markup_lines["literal_block"] == 3 and "Example::" in view.text and "Back to prose." in view.text
    assert "make" not in view.text
