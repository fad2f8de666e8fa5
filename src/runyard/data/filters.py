"""Quality filters: each rule measures one property of a document and removes it when a bound in the
spec is crossed. A removed document is counted under the first rule that removed it (the reason), and
the caller keeps a few samples per reason for the report: the rule (spec field), its threshold, the
measured value and what tripped it (the repeated n-gram, the symbols, the repeated line...).

Measures follow the Gopher rules (Rae et al. 2021) so bounds from that paper carry over; every bound is
optional (null turns the rule off) because code, tables and prose need different ones. With
`markup_aware` (the default), every rule but the character counts reads the document's prose view
(data/markup.py): table borders and heading adornments of technical text are not repetition or symbols,
the repetition rules (lines, paragraphs, n-grams) leave heading titles out, and literal blocks (Markdown
fences, reST `::` blocks and code directives) are left out of every statistic; the word counts
(min_words, max_words) still count the words inside them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from runyard.data.markup import prose_view
from runyard.spec.data import FilterSpec

_PARAGRAPH_SPLIT = re.compile(r"\n\s*\n")
_BULLETS = ("•", "‣", "◦", "⁃", "- ", "* ", "–", "—")
_ELLIPSES = ("...", "…")
_SHOWN = 3  # items named in a failure's detail
_SNIPPET = 60  # characters of a line or paragraph quoted in a detail


class _Doc:
    """Lazily computed views of one document, shared by the rules that need them. `raw` is the text as
    read; `text` is what the word and line rules read (the prose view when markup-aware)."""

    def __init__(self, raw: str, markup_aware: bool):
        self.raw = raw
        view = prose_view(raw) if markup_aware else None
        self.text = view.text if view is not None else raw
        self.body = view.body if view is not None else raw
        # Heading titles count as text but never as a repeat: "Parameters" under every function is structure.
        self.titles = view.titles if view is not None else frozenset()
        # Words inside literal blocks (code, program output) are not prose, but they are the document's words.
        self.literal_words = view.literal_words if view is not None else 0
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

    @property
    def paragraphs(self) -> list[str]:
        return [p.strip() for p in _PARAGRAPH_SPLIT.split(self.text) if p.strip()]

    def repeats(self, items: list[str]) -> list[str]:
        """Items that repeat an earlier one (each repeat once), heading titles aside."""
        seen: set[str] = set()
        out = []
        for item in items:
            if item in seen and item.strip() not in self.titles:
                out.append(item)
            seen.add(item)
        return out

    def duplicate_fraction(self, items: list[str]) -> float:
        return len(self.repeats(items)) / len(items) if items else 0.0

    def top_ngram(self, n: int) -> tuple[tuple[str, ...], int] | None:
        """The most frequent word n-gram outside heading titles, and its count."""
        words = self.body.split()
        if len(words) < n:
            return None
        counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
        return counts.most_common(1)[0]

    def top_ngram_fraction(self, n: int) -> float:
        """Characters covered by the most frequent word n-gram over all word characters (Gopher)."""
        top = self.top_ngram(n)
        if top is None or top[1] < 2:
            return 0.0
        gram, freq = top
        total = sum(len(w) for w in self.words)
        return min(1.0, freq * sum(len(w) for w in gram) / total) if total else 0.0


@dataclass(frozen=True)
class FilterFailure:
    """Why a document was removed: the rule's reason, its spec field and threshold, the measured value,
    and what tripped it in words."""

    reason: str
    field: str
    threshold: float
    kind: str  # "min" or "max"
    value: float
    tripped_by: str

    def sample(self, doc_id: str, text: str) -> dict:
        """The report's record of one removed document."""
        return {
            "id": doc_id,
            "rule": self.field,
            "threshold": self.threshold,
            "value": round(self.value, 4),
            "tripped_by": self.tripped_by,
            "text": text,
        }


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SNIPPET else text[: _SNIPPET - 1] + "…")


def _most_common(items: list[str], n: int = _SHOWN) -> str:
    return ", ".join(f"{_quote(item)} x{count}" for item, count in Counter(items).most_common(n))


# --- measures ------------------------------------------------------------------------------------


def _mean_word_length(d: _Doc) -> float:
    return sum(len(w) for w in d.words) / len(d.words) if d.words else 0.0


def _symbol_counts(d: _Doc) -> Counter:
    counts = Counter({"#": d.text.count("#"), "...": d.text.count("..."), "…": d.text.count("…")})
    return +counts


def _symbol_ratio(d: _Doc) -> float:
    return sum(_symbol_counts(d).values()) / max(1, len(d.words))


def _non_alpha(word: str) -> bool:
    return not any(c.isalpha() for c in word)


def _non_alpha_fraction(d: _Doc) -> float:
    if not d.words:
        return 1.0
    return sum(1 for w in d.words if _non_alpha(w)) / len(d.words)


def _is_ellipsis_line(line: str) -> bool:
    return line.rstrip().endswith(_ELLIPSES)


def _is_bullet_line(line: str) -> bool:
    return line.lstrip().startswith(_BULLETS)


def _line_fraction(d: _Doc, test: Callable[[str], bool]) -> float:
    return sum(1 for line in d.lines if test(line)) / len(d.lines) if d.lines else 0.0


# --- what tripped a rule, in words ---------------------------------------------------------------


def _explain_symbols(d: _Doc, s: FilterSpec) -> str:
    counts = ", ".join(f"{_quote(sym)} x{n}" for sym, n in _symbol_counts(d).most_common())
    line = next((ln for ln in d.lines if "#" in ln or any(e in ln for e in _ELLIPSES)), "")
    return f"{counts} over {len(d.words)} words; e.g. line {_quote(line)}"


def _explain_top_ngram(d: _Doc, s: FilterSpec) -> str:
    top = d.top_ngram(s.top_ngram_n)
    if top is None:
        return ""
    gram, freq = top
    return f"{s.top_ngram_n}-gram {_quote(' '.join(gram))} x{freq}"


def _explain_lengths(d: _Doc, s: FilterSpec, longest: bool) -> str:
    words = sorted(set(d.words), key=len, reverse=longest)[:_SHOWN]
    return ("longest words " if longest else "shortest words ") + ", ".join(_quote(w) for w in words)


def _explain_lines(d: _Doc, test: Callable[[str], bool]) -> str:
    lines = [ln for ln in d.lines if test(ln)]
    return f"{len(lines)} of {len(d.lines)} lines, e.g. " + ", ".join(_quote(ln) for ln in lines[:_SHOWN])


def _no_detail(d: _Doc, s: FilterSpec) -> str:
    return ""


@dataclass(frozen=True)
class _Rule:
    reason: str
    field: str  # the FilterSpec field holding the bound
    kind: str  # "min": removed below the bound; "max": removed above it
    measure: Callable[[_Doc, FilterSpec], float]
    explain: Callable[[_Doc, FilterSpec], str] = _no_detail


# In the order they are applied; a document is counted under the first rule it fails.
_RULES: list[_Rule] = [
    _Rule("too_short_chars", "min_chars", "min", lambda d, s: len(d.raw)),
    _Rule("too_long_chars", "max_chars", "max", lambda d, s: len(d.raw)),
    _Rule("too_few_words", "min_words", "min", lambda d, s: len(d.words) + d.literal_words),
    _Rule("too_many_words", "max_words", "max", lambda d, s: len(d.words) + d.literal_words),
    _Rule("mean_word_length_low", "min_mean_word_length", "min", lambda d, s: _mean_word_length(d),
          lambda d, s: _explain_lengths(d, s, longest=False)),
    _Rule("mean_word_length_high", "max_mean_word_length", "max", lambda d, s: _mean_word_length(d),
          lambda d, s: _explain_lengths(d, s, longest=True)),
    _Rule("symbol_word_ratio", "max_symbol_word_ratio", "max", lambda d, s: _symbol_ratio(d), _explain_symbols),
    _Rule("non_alpha_words", "max_non_alpha_word_fraction", "max", lambda d, s: _non_alpha_fraction(d),
          lambda d, s: "words without a letter: " + _most_common([w for w in d.words if _non_alpha(w)])),
    _Rule("duplicate_lines", "max_duplicate_line_fraction", "max", lambda d, s: d.duplicate_fraction(d.lines),
          lambda d, s: "repeated lines: " + _most_common(d.repeats(d.lines))),
    _Rule("duplicate_paragraphs", "max_duplicate_paragraph_fraction", "max",
          lambda d, s: d.duplicate_fraction(d.paragraphs),
          lambda d, s: "repeated paragraphs: " + _most_common(d.repeats(d.paragraphs))),
    _Rule("top_ngram_repetition", "max_top_ngram_fraction", "max",
          lambda d, s: d.top_ngram_fraction(s.top_ngram_n), _explain_top_ngram),
    _Rule("ellipsis_lines", "max_ellipsis_line_fraction", "max",
          lambda d, s: _line_fraction(d, _is_ellipsis_line), lambda d, s: _explain_lines(d, _is_ellipsis_line)),
    _Rule("bullet_lines", "max_bullet_line_fraction", "max",
          lambda d, s: _line_fraction(d, _is_bullet_line), lambda d, s: _explain_lines(d, _is_bullet_line)),
]

FILTER_REASONS = [rule.reason for rule in _RULES]
# reason -> (the FilterSpec field holding its bound, "min" or "max"), for the report.
RULE_BOUNDS = {rule.reason: (rule.field, rule.kind) for rule in _RULES}


def check_document(text: str, spec: FilterSpec) -> FilterFailure | None:
    """None if the document passes every enabled rule, else the first rule it fails, with the measured
    value and what tripped it."""
    if not spec.enabled:
        return None
    doc = _Doc(text, spec.markup_aware)
    for rule in _RULES:
        bound = getattr(spec, rule.field)
        if bound is None:
            continue
        value = rule.measure(doc, spec)
        if (rule.kind == "min" and value < bound) or (rule.kind == "max" and value > bound):
            return FilterFailure(rule.reason, rule.field, bound, rule.kind, float(value), rule.explain(doc, spec))
    return None
