"""Table, heading and literal-block lines of technical text (reStructuredText, Markdown), recognised so
that quality filters measure the prose and not the markup around it.

Literal blocks are where the markup says the text is literal: Markdown fences (``` and ~~~), reST literal
blocks (the indented block after a paragraph ending in `::`) and code directives (`.. code-block::`,
`.. code::`, `.. sourcecode::`, `.. parsed-literal::`, `.. doctest::`, `.. testcode::`). They are taken
out of the prose view whole: a `...` in a program's output or a `#` comment is not symbol spam, and
`}` on every other line is not repetition.

Documentation repeats its markup by design: a grid table's borders are the same line over and over,
a reST title sits between two rows of `#####`, a Markdown table has a `| --- | --- |` separator. Read
as prose, those lines look like repetition and symbol spam; `prose_view` removes the markup and keeps
the words (a table row keeps its cells' text, a `## Heading` keeps its title).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

# A markup line starts (after indentation) with one of these characters; only such lines are
# classified, found by one scan of the text, so plain prose costs little. A Markdown heading starts at
# the line's first column, which also leaves out the comments of indented code; an indented line of
# '#' can still be a reST adornment (inside a directive).
_CANDIDATE = re.compile(r"\n(?:[ \t]*[-+=|:`'\"~^_*]|#|[ \t]+###)")
# reST section adornment (over/underline) or transition: one of these characters, 3 or more times.
# '.' is left out so that a line of dots still counts for the ellipsis rule.
_ADORNMENT_CHARS = frozenset("=-`:'\"~^_*+#")
# reST grid borders +----+----+ and header separators +====+ or |====|; reST simple table borders
# (columns of '=' or '-' separated by spaces); Markdown separators | --- | :---: | (one inner pipe).
_TABLE_BORDER = re.compile(
    r"[+|](?:[-=]+[+|])+|={2,}(?: +={2,})+|-{2,}(?: +-{2,})+"
    r"|\|?[ \t]*:?-{3,}:?[ \t]*(?:\|[ \t]*:?-{3,}:?[ \t]*)+\|?"
)


@dataclass
class ProseView:
    """A document with its table and heading markup taken out, and what was taken.

    `text` keeps the words a reader reads (table cells, heading titles); `titles` are the heading titles,
    whose repetition is structure ("Parameters", "What's Changed" in every section), and `body` is the
    text without them."""

    text: str
    body: str
    titles: frozenset[str] = frozenset()
    markup_lines: Counter = field(default_factory=Counter)  # kind -> lines recognised
    literal_words: int = 0  # whitespace-separated words inside the literal blocks taken out

    @property
    def lines_recognised(self) -> int:
        return sum(self.markup_lines.values())


def classify_line(line: str) -> str | None:
    """'table_border', 'table_row', 'heading_adornment' or 'heading' for a markup line, else None."""
    s = line.strip()
    if len(s) < 3:
        return None
    first = s[0]
    if first in _ADORNMENT_CHARS and s.count(first) == len(s):
        return "heading_adornment"
    if first in "+|=-" and _TABLE_BORDER.fullmatch(s):
        return "table_border"
    if first == "|" and s[-1] == "|":
        return "table_row"
    if first == "#" and heading_title(s) is not None:
        return "heading"
    return None


def heading_title(line: str) -> str | None:
    """The title of a Markdown ATX heading (`## Title ##`), or None if the line is not one."""
    if not line.startswith("#"):
        return None
    s = line.strip()
    marks = len(s) - len(s.lstrip("#"))
    if not 1 <= marks <= 6 or len(s) == marks or s[marks] not in " \t":
        return None
    title = s[marks:].strip()
    closing = title.rstrip("#")
    if closing != title and (not closing or closing[-1] in " \t"):
        title = closing.strip()
    return title


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_CODE_DIRECTIVE = re.compile(r"([ \t]*)\.\.[ \t]+(?:code-block|code|sourcecode|parsed-literal|doctest|testcode)::")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _indented_block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the block of lines from `start` that are blank or indented deeper than `indent`,
    trailing blank lines left out."""
    end = last = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
        if lines[end - 1].strip():
            last = end
    return last


def literal_blocks(text: str) -> list[tuple[int, int]]:
    """Line ranges [start, end) of `text.split("\n")` that the markup marks literal: a Markdown fence with
    its fence lines (an unclosed fence runs to the end), a reST code directive with its options and
    content, the indented block after a paragraph line ending in `::` (that line stays: it is prose)."""
    if "```" not in text and "~~~" not in text and "::" not in text:
        return []
    lines = text.split("\n")
    blocks: list[tuple[int, int]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence and not (fence.group(1)[0] == "`" and "`" in line[fence.end():]):
            mark = fence.group(1)
            close = re.compile(r" {0,3}" + re.escape(mark[0]) + "{" + str(len(mark)) + r",}[ \t]*$")
            end = next((j + 1 for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
            blocks.append((i, end))
            i = end
            continue
        directive = _CODE_DIRECTIVE.match(line)
        if directive:
            end = _indented_block_end(lines, i + 1, len(directive.group(1).expandtabs()))
            blocks.append((i, end))
            i = max(end, i + 1)
            continue
        stripped = line.rstrip()
        if stripped.endswith("::") and not stripped.lstrip().startswith(".."):
            j = i + 1
            if j < len(lines) and not lines[j].strip():  # a literal block follows a blank line
                end = _indented_block_end(lines, j, _indent(line))
                if end > j:
                    blocks.append((i + 1, end))
                    i = end
                    continue
        i += 1
    return blocks


def prose_view(text: str) -> ProseView:
    """The document as prose: literal blocks dropped (see `literal_blocks`), table borders and heading
    adornments dropped, table rows reduced to their cells' text, Markdown headings to their titles. A line
    directly above a reST adornment is a title. Other lines are kept as they are."""
    blocks = literal_blocks(text)
    if not blocks:
        return _tables_and_headings(text)
    lines = text.split("\n")
    kept: list[str] = []
    literal_lines = literal_words = 0
    pos = 0
    for start, end in blocks:
        kept += lines[pos:start] + [""]  # a blank line where the block was keeps the paragraphs apart
        literal_lines += end - start
        literal_words += sum(len(ln.split()) for ln in lines[start:end])
        pos = end
    kept += lines[pos:]
    view = _tables_and_headings("\n".join(kept))
    view.markup_lines["literal_block"] += literal_lines
    view.literal_words = literal_words
    return view


def _tables_and_headings(text: str) -> ProseView:
    text_parts: list[str] = []
    body_parts: list[str] = []
    titles: set[str] = set()
    kinds: Counter = Counter()
    pos = 0  # text before pos has been copied (or dropped)
    for candidate in _CANDIDATE.finditer("\n" + text):
        start = candidate.start()  # in `text`: the "\n" prefix shifts every match by one
        if start < pos:
            continue
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        line = text[start:end]
        kind = classify_line(line)
        if kind is None:
            continue
        kinds[kind] += 1
        segment = text[pos:start]
        body_segment = segment
        if kind == "heading_adornment" and segment.endswith("\n"):
            previous = segment[:-1].rpartition("\n")[2]
            if previous.strip():  # an underline: the line above is a section title
                titles.add(previous.strip())
                body_segment = segment[: len(segment) - len(previous) - 1]
        text_parts.append(segment)
        body_parts.append(body_segment)
        if kind == "table_row":
            cells = " ".join(c.strip() for c in line.strip().strip("|").split("|") if c.strip())
            if cells:
                text_parts.append(cells + "\n")
                body_parts.append(cells + "\n")
        elif kind == "heading":
            title = heading_title(line) or ""
            titles.add(title)
            text_parts.append(title + "\n")
        pos = min(len(text), end + 1)
    if not kinds:
        return ProseView(text, text)
    text_parts.append(text[pos:])
    body_parts.append(text[pos:])
    return ProseView("".join(text_parts), "".join(body_parts), frozenset(titles), kinds)
