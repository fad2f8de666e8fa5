"""Normalisation: one canonical form for every document before it is filtered, hashed or tokenized,
so that the same text from two sources (CRLF vs LF, composed vs decomposed accents) counts as one."""

from __future__ import annotations

import re
import unicodedata

from runyard.spec.data import NormalizeSpec

# C0 and C1 control characters other than tab and newline (CR is handled as a line ending first).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)


def normalize_text(text: str, spec: NormalizeSpec) -> str:
    """Apply the spec's normalisations in a fixed order: line endings, controls, NFC, trailing space."""
    if spec.line_endings and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if spec.control_chars:
        text = _CONTROL.sub("", text)
    if spec.nfc and not text.isascii():
        text = unicodedata.normalize("NFC", text)
    if spec.trailing_whitespace:
        text = _TRAILING.sub("", text)
    return text
