"""Table and heading lines of technical text (reStructuredText, Markdown), recognised so that quality
filters measure the prose and not the markup around it.

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


def prose_view(text: str) -> ProseView:
    """The document as prose: table borders and heading adornments dropped, table rows reduced to their
    cells' text, Markdown headings to their titles. A line directly above a reST adornment is a title.
    Other lines are kept as they are."""
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
