"""PII scrubbing: what must be replaced, what must be left alone, and the counts."""

from __future__ import annotations

from collections import Counter

from runyard.data.config import PiiSpec
from runyard.data.pii import scrub_pii

ON = PiiSpec(enabled=True)


def scrub(text: str) -> tuple[str, Counter]:
    counts: Counter = Counter()
    return scrub_pii(text, ON, counts), counts


def test_replaces_each_kind_and_counts():
    text = (
        "Mail jane.doe+work@example.co.uk or call +44 20 7946 0958 / (555) 123-4567; "
        "server 192.168.10.25. And fe80::1ff:fe23:4567:890a; card 4111 1111 1111 1111."
    )
    out, counts = scrub(text)
    assert "jane.doe" not in out and "<EMAIL>" in out
    assert "7946" not in out and "123-4567" not in out and out.count("<PHONE>") == 2
    assert "192.168" not in out and "fe80" not in out and out.count("<IP>") == 2
    assert "4111" not in out and "<CARD>" in out
    assert counts == Counter(email=1, phone=2, ip_address=2, credit_card=1)


def test_leaves_code_and_versions_alone():
    code = (
        "s = x[1::2]\nversion = '3.11.7'\nx = 0x7fff_ffff\nfor i in range(1234567):\n    pass\n"
        "timeout = 10.5\nratio = 1.2.3\nv = '1.2.3.4.5'\nid = 4111111111111112\ndecorator = '@property'"
    )
    out, counts = scrub(code)
    assert out == code and not counts


def test_disabled_by_default():
    counts: Counter = Counter()
    assert scrub_pii("a@b.com", PiiSpec(), counts) == "a@b.com" and not counts
