"""PII scrubbing: e-mail addresses, phone numbers, IP addresses and card numbers are replaced by
placeholders (`<EMAIL>`, `<PHONE>`, `<IP>`, `<CARD>`), each replacement counted.

Patterns are deliberately conservative (anchored on word boundaries, card numbers Luhn-checked) so that
version strings, hex constants and line numbers in code are left alone."""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from runyard.data.config import PiiSpec

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![\w-])")
# International (+CC ...) or North-American style numbers with separators; bare digit runs are not phones.
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w])"
)
IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w|\.\d)")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{1,4}(?![\w:])")
CARD = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _valid_ip(candidate: str) -> bool:
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


def scrub_pii(text: str, spec: PiiSpec, counts: Counter) -> str:
    """Replace PII in `text` by placeholders; `counts[kind]` grows by the number replaced."""
    if not spec.enabled:
        return text

    def sub(pattern: re.Pattern, placeholder: str, kind: str, text: str, valid=None) -> str:
        def repl(m: re.Match) -> str:
            if valid is not None and not valid(m.group(0)):
                return m.group(0)
            counts[kind] += 1
            return placeholder

        return pattern.sub(repl, text)

    if spec.emails and "@" in text:
        text = sub(EMAIL, "<EMAIL>", "email", text)
    if spec.credit_cards:
        text = sub(CARD, "<CARD>", "credit_card", text, lambda s: _luhn_ok(re.sub(r"\D", "", s)))
    if spec.ip_addresses:
        text = sub(IPV4, "<IP>", "ip_address", text, _valid_ip)
        text = sub(IPV6, "<IP>", "ip_address", text, lambda s: s.count(":") >= 3 and _valid_ip(s))
    if spec.phones:
        text = sub(PHONE, "<PHONE>", "phone", text, lambda s: 7 <= sum(c.isdigit() for c in s) <= 15)
    return text
