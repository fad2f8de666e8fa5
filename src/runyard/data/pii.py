"""PII scrubbing: e-mail addresses, phone numbers, IP addresses and card numbers are replaced by
placeholders (`<EMAIL>`, `<PHONE>`, `<IP>`, `<CARD>`), each replacement counted, and a few kept as
samples for the data report (the original text, the text after, and each replacement). Every kind is
matched on the original text, so a sample's "before" is what the document said.

The rules are written for technical text, where most things that look like PII are not:
- IP addresses: documentation ranges (RFC 5737 TEST-NETs, RFC 3849's 2001:db8::/32), private, loopback,
  link-local, multicast and reserved addresses are left alone, and so are networks in CIDR notation
  (`11.0.0.0/8`), the well-known public resolvers (8.8.8.8, 1.1.1.1, ...), and a dotted quad that reads
  as a section or version number: after `section`, `chapter`, `§`, `version`, `v`, `ver`, `release`, ...
  (also through a list: `sections 5.2.2.1 and 5.2.2.3`), after a hyphenated software name
  (`util-linux-ng 2.13.1.1`, `linux-2.6.32.71`), part of a longer dotted number (`1.2.3.4.5`,
  `1.2.3.4-rc1`), a heading number (`2.1.1.2 Timestamp types` first on its line) or `2.8.10.2 and lower`;
- phone numbers need a phone's shape: `+` and a country code, an area code in parentheses, the
  NANP `555-123-4567` form with one separator throughout, or a phone word before them (`tel:`, `call`);
  a run of digits or space-separated numbers (a table of figures) is not a phone number, and neither
  is a NANP number reserved for fiction (555-0100 to 555-0199);
- card numbers are 13-19 digits, contiguous or in groups split by one kind of separator, with a known
  issuer prefix, that network's length and a valid Luhn check digit; digits after a decimal point or
  inside an identifier (`svc/5191...`, `id-4111...`) never are;
- e-mail addresses at reserved example domains (example.com, .test, .invalid, ...) are left alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Callable

from runyard.spec.data import PiiSpec

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,})(?![\w-])")
_EXAMPLE_DOMAINS = re.compile(r"(?:^|\.)(?:example\.(?:com|net|org)|example|test|invalid|localhost)$", re.I)

PHONE = re.compile(
    r"(?<![\w+.])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]\d{2,4}){1,4}"  # +44 20 7946 0958
    r"|\(\d{2,4}\)[ .-]?\d{3,4}[ .-]\d{3,4}"  # (555) 123-4567
    r"|\d{3}(?P<sep>[-.])\d{3}(?P=sep)\d{4}"  # 555-123-4567, 555.123.4567
    r")(?!\w|[.-]\d)"
)
# Spaced digit groups are a phone number only after a phone word: "call 020 7946 0958", "Tel: 030 1234 567".
PHONE_AFTER_WORD = re.compile(
    r"(?i:\b(?:tel|phone|telephone|call|fax|mobile|cell)\b\W{0,3})(?P<number>\d{2,5}(?:[ .-]\d{2,4}){1,3})(?!\w|[.-]\d)"
)
IPV4 = re.compile(r"(?<![\w.-])(?:\d{1,3}\.){3}\d{1,3}(?![\w/-]|\.\d)")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{1,4}(?![\w:/])")
# Contiguous, or groups split by one separator kind; never the digits of a decimal or of an identifier.
CARD = re.compile(
    r"(?<![\w.,/-])(?:\d{13,19}|\d{4}(?P<sep>[ -])\d{4,6}(?:(?P=sep)\d{4,5}){1,3})(?![\w/]|[.,-]\d)"
)
# A word that makes the number after it a section or a version, possibly through a list of such numbers
# ("sections 5.2.2.1, 5.2.2.3 and 6.1.1.1", "versions 2.6.32.1 to 2.6.32.9").
_NUMBER_WORD = (
    r"(?:\b(?:sections?|sect?s?\.|chapters?|ch\.|clauses?|paragraphs?|para\.|appendix|appendices|parts?|"
    r"figures?|fig\.|tables?|steps?|items?|versions?|ver\.?|releases?|rev\.?|revisions?|kernel|linux|python|perl|gcc|glibc|openssl|firmware)\s*"
    r"|\bv|§+\s*)"
)
_LIST_SEP = r"(?:\s*(?:,|;|&|-|–|\band\b|\bor\b|\bto\b|\bthrough\b)\s*)"
_VERSION_BEFORE = re.compile(_NUMBER_WORD + r"(?:[\d.]*\d" + _LIST_SEP + r")*$", re.I)
# A software name before its version: "util-linux-ng 2.13.1.1", "e2fs-progs 1.41.4.1" (a hyphenated name
# right before the number; a prose word such as "server" or "to" is not one).
_NAME_BEFORE = re.compile(r"(?<![\w.-])[A-Za-z][\w+]*(?:-[A-Za-z0-9][\w+]*)+[ \t]+$")
# A heading number: first on its line (after indentation or '#' marks), then a title.
_HEADING_PREFIX = re.compile(r"[ \t]*(?:#{1,6}[ \t]+)?")
# The title: a capitalised word or a quoted/marked-up one ("GET /" of a log line and "is ..." of prose are not).
_HEADING_AFTER = re.compile(r"\.?[ \t]+(?:[A-Z][a-z]|[(\"'`*_]\w)")
_VERSION_AFTER = re.compile(
    r"\s+(?:and|or)\s+(?:lower|higher|earlier|later|older|newer|above|below)\b"
    r"|[ \t]+\S+[ \t]+--version\b",  # a requirements table: "util-linux-ng  2.13.1.1  fdformat --version"
    re.I,
)
# Public DNS resolvers that documentation names all the time; no person behind them.
_WELL_KNOWN_IPS = {"8.8.8.8", "8.8.4.4", "1.1.1.1", "1.0.0.1", "9.9.9.9", "149.112.112.112", "208.67.222.222",
                   "208.67.220.220", "2001:4860:4860::8888", "2001:4860:4860::8844", "2606:4700:4700::1111"}
_FICTIONAL_NANP = re.compile(r"(?:\D|^)555\D?01\d\d$")

_DOCUMENTATION_NETS = [
    ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")
]
# Issuer prefixes (IIN) of the card networks and the lengths each issues.
_CARD_NETWORKS = [
    (re.compile(r"4"), (13, 16, 19)),  # Visa
    (re.compile(r"5[1-5]|2[2-7]"), (16,)),  # Mastercard
    (re.compile(r"3[47]"), (15,)),  # American Express
    (re.compile(r"6011|64[4-9]|65"), (16, 17, 18, 19)),  # Discover
    (re.compile(r"35[2-8]"), (16, 17, 18, 19)),  # JCB
    (re.compile(r"30[0-5]|3[689]"), (14, 15, 16, 17, 18, 19)),  # Diners Club
    (re.compile(r"62"), (16, 17, 18, 19)),  # UnionPay
]

SAMPLE_CONTEXT = 30  # characters either side of a replacement in a sample


def _span(match: re.Match) -> tuple[int, int]:
    """What is replaced: the `number` group where a pattern has one (the phone word stays), else all."""
    return match.span("number") if "number" in match.re.groupindex else match.span()


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def is_card_number(candidate: str) -> bool:
    """A known network's prefix and length, and a valid Luhn check digit."""
    digits = re.sub(r"\D", "", candidate)
    network = any(prefix.match(digits) and len(digits) in lengths for prefix, lengths in _CARD_NETWORKS)
    return network and _luhn_ok(digits)


def is_personal_ip(candidate: str) -> bool:
    """A valid address that can point at someone: public, and not in a documentation range."""
    try:
        ip = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    if str(ip) in _WELL_KNOWN_IPS or any(ip in net for net in _DOCUMENTATION_NETS if net.version == ip.version):
        return False
    return ip.is_global and not ip.is_multicast


def _is_heading_number(text: str, match: re.Match) -> bool:
    """`2.1.1.2 Timestamp types` (a numbered heading or a table-of-contents line), not `93.184.216.34 is ...`."""
    line_start = text.rfind("\n", 0, match.start()) + 1
    if not _HEADING_PREFIX.fullmatch(text, line_start, match.start()):
        return False
    return bool(_HEADING_AFTER.match(text, match.end()))


def _ipv4_ok(text: str, match: re.Match) -> bool:
    """A dotted quad is an address only where one can stand: not a section or version number (after
    `section`, `chapter`, `version`, `v`, `§`, ... or a software name), not a heading number, not followed by
    `and lower`; then only a personal address (see `is_personal_ip`)."""
    before = text[max(0, match.start() - 80) : match.start()]
    if _VERSION_BEFORE.search(before) or _VERSION_AFTER.match(text, match.end()):
        return False
    if _NAME_BEFORE.search(before) or _is_heading_number(text, match):
        return False
    return is_personal_ip(match.group(0))


def _ipv6_ok(text: str, match: re.Match) -> bool:
    return match.group(0).count(":") >= 3 and is_personal_ip(match.group(0))


def _phone_ok(text: str, match: re.Match) -> bool:
    start, end = _span(match)
    number = text[start:end]
    return 7 <= sum(c.isdigit() for c in number) <= 15 and not _FICTIONAL_NANP.search(number)


def _email_ok(text: str, match: re.Match) -> bool:
    return not _EXAMPLE_DOMAINS.search(match.group(1))


def _card_ok(text: str, match: re.Match) -> bool:
    return is_card_number(match.group(0))


def _window(text: str, start: int, end: int) -> tuple[int, int]:
    return max(0, start - SAMPLE_CONTEXT), min(len(text), end + SAMPLE_CONTEXT)


def scrub_pii(
    text: str, spec: PiiSpec, counts: Counter, samples: dict[str, list[dict[str, str]]] | None = None
) -> str:
    """Replace PII in `text` by placeholders; `counts[kind]` grows by the number replaced, and `samples[kind]`
    (when given) collects up to `spec.samples_per_kind` samples: `before` is the original text around the
    replacement, `after` the same window with every replacement in it made, and `replaced` lists each
    replacement in the window as `original -> placeholder`.

    Every kind is matched on the original text, in a fixed order (e-mail, card, IP, phone); a match that
    overlaps one already taken is skipped, so each character is replaced at most once."""
    if not spec.enabled:
        return text
    passes: list[tuple[re.Pattern, str, str, Callable[[str, re.Match], bool]]] = []
    if spec.emails and "@" in text:
        passes.append((EMAIL, "<EMAIL>", "email", _email_ok))
    if spec.credit_cards:
        passes.append((CARD, "<CARD>", "credit_card", _card_ok))
    if spec.ip_addresses:
        passes.append((IPV4, "<IP>", "ip_address", _ipv4_ok))
        if ":" in text:
            passes.append((IPV6, "<IP>", "ip_address", _ipv6_ok))
    if spec.phones:
        passes.append((PHONE, "<PHONE>", "phone", _phone_ok))
        passes.append((PHONE_AFTER_WORD, "<PHONE>", "phone", _phone_ok))

    taken: list[tuple[int, int, str, str]] = []  # (start, end, placeholder, kind)
    for pattern, placeholder, kind, ok in passes:
        for m in pattern.finditer(text):
            start, end = _span(m)
            if any(start < e and s < end for s, e, _, _ in taken) or not ok(text, m):
                continue
            taken.append((start, end, placeholder, kind))
    if not taken:
        return text
    taken.sort()

    def rewrite(lo: int, hi: int) -> str:
        out, pos = [], lo
        for s, e, placeholder, _ in taken:
            if s >= lo and e <= hi:
                out += [text[pos:s], placeholder]
                pos = e
        return "".join(out) + text[pos:hi]

    for s, e, _, kind in taken:
        counts[kind] += 1
        if samples is not None:
            kept = samples.setdefault(kind, [])
            if len(kept) < spec.samples_per_kind:
                lo, hi = _window(text, s, e)
                # The window grows to whole replacements, so `after` never shows half a number.
                for s2, e2, _, _ in taken:
                    if s2 < lo < e2:
                        lo = s2
                    if s2 < hi < e2:
                        hi = e2
                replaced = [f"{text[s2:e2]} -> {p2}" for s2, e2, p2, _ in taken if s2 >= lo and e2 <= hi]
                kept.append({"before": text[lo:hi], "after": rewrite(lo, hi), "replaced": replaced})
    return rewrite(0, len(text))
