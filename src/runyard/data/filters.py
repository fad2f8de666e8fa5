"""Quality filters: each one measures one property of a document and removes it when a bound in the
spec is crossed. A removed document is counted under the first filter that removed it (the reason), and
the caller keeps a few samples per reason for the report.

Measures follow the Gopher rules (Rae et al. 2021) so bounds from that paper carry over; every bound is
optional (null turns the filter off) because code, tables and prose need different ones.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from runyard.data.config import FilterSpec

_PARAGRAPH_SPLIT = re.compile(r"\n\s*\n")
_BULLETS = ("•", "‣", "◦", "⁃", "- ", "* ", "–", "—")
_ELLIPSES = ("...", "…")


class _Doc:
    """Lazily computed views of one document, shared by the filters that need them."""

    def __init__(self, text: str):
        self.text = text
        self._words: list[str] | None = None
        self._lines: list[str] | None = None

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = self.text.split()
        return self._words

    @property
    def lines(self) -> list[str]:
        """Non-blank lines."""
        if self._lines is None:
            self._lines = [line for line in self.text.split("\n") if line.strip()]
        return self._lines


def duplicate_fraction(items: list[str]) -> float:
    """Fraction of items that repeat an earlier item."""
    return (len(items) - len(set(items))) / len(items) if items else 0.0


def top_ngram_fraction(words: list[str], n: int) -> float:
    """Characters covered by the most frequent word n-gram, over all word characters (Gopher)."""
    if len(words) < n:
        return 0.0
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, freq = counts.most_common(1)[0]
    if freq < 2:
        return 0.0
    total = sum(len(w) for w in words)
    return min(1.0, freq * sum(len(w) for w in gram) / total) if total else 0.0


def _mean_word_length(d: _Doc) -> float:
    return sum(len(w) for w in d.words) / len(d.words) if d.words else 0.0


def _symbol_ratio(d: _Doc) -> float:
    symbols = d.text.count("#") + sum(d.text.count(e) for e in _ELLIPSES)
    return symbols / max(1, len(d.words))


def _non_alpha_fraction(d: _Doc) -> float:
    if not d.words:
        return 1.0
    return sum(1 for w in d.words if not any(c.isalpha() for c in w)) / len(d.words)


def _line_fraction(d: _Doc, test: Callable[[str], bool]) -> float:
    return sum(1 for line in d.lines if test(line)) / len(d.lines) if d.lines else 0.0


# (reason, measure, bound field, "min" or "max"), in the order they are applied.
_RULES: list[tuple[str, Callable[[_Doc, FilterSpec], float], str, str]] = [
    ("too_short_chars", lambda d, s: len(d.text), "min_chars", "min"),
    ("too_long_chars", lambda d, s: len(d.text), "max_chars", "max"),
    ("too_few_words", lambda d, s: len(d.words), "min_words", "min"),
    ("too_many_words", lambda d, s: len(d.words), "max_words", "max"),
    ("mean_word_length_low", lambda d, s: _mean_word_length(d), "min_mean_word_length", "min"),
    ("mean_word_length_high", lambda d, s: _mean_word_length(d), "max_mean_word_length", "max"),
    ("symbol_word_ratio", lambda d, s: _symbol_ratio(d), "max_symbol_word_ratio", "max"),
    ("non_alpha_words", lambda d, s: _non_alpha_fraction(d), "max_non_alpha_word_fraction", "max"),
    ("duplicate_lines", lambda d, s: duplicate_fraction(d.lines), "max_duplicate_line_fraction", "max"),
    (
        "duplicate_paragraphs",
        lambda d, s: duplicate_fraction([p.strip() for p in _PARAGRAPH_SPLIT.split(d.text) if p.strip()]),
        "max_duplicate_paragraph_fraction",
        "max",
    ),
    (
        "top_ngram_repetition",
        lambda d, s: top_ngram_fraction(d.words, s.top_ngram_n),
        "max_top_ngram_fraction",
        "max",
    ),
    (
        "ellipsis_lines",
        lambda d, s: _line_fraction(d, lambda line: line.rstrip().endswith(_ELLIPSES)),
        "max_ellipsis_line_fraction",
        "max",
    ),
    (
        "bullet_lines",
        lambda d, s: _line_fraction(d, lambda line: line.lstrip().startswith(_BULLETS)),
        "max_bullet_line_fraction",
        "max",
    ),
]

FILTER_REASONS = [rule[0] for rule in _RULES]


def check_document(text: str, spec: FilterSpec) -> tuple[str, float] | None:
    """None if the document passes every enabled filter, else (reason, measured value) of the first
    filter it fails."""
    if not spec.enabled:
        return None
    doc = _Doc(text)
    for reason, measure, field, kind in _RULES:
        bound = getattr(spec, field)
        if bound is None:
            continue
        value = measure(doc, spec)
        if (kind == "min" and value < bound) or (kind == "max" and value > bound):
            return reason, float(value)
    return None
