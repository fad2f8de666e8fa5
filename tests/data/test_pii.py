"""PII scrubbing: what must be replaced, what technical text must keep, the counts and the samples."""

from __future__ import annotations

from collections import Counter
from pydoc_data.topics import topics as PYTHON_REFERENCE

import pytest

from runyard.data.pii import scrub_pii
from runyard.spec.data import PiiSpec

ON = PiiSpec(enabled=True)


def scrub(text: str, spec: PiiSpec = ON) -> tuple[str, Counter, dict]:
    counts: Counter = Counter()
    samples: dict = {}
    return scrub_pii(text, spec, counts, samples), counts, samples


def test_replaces_each_kind_and_counts():
    text = (
        "Mail jane.doe+work@mail.acme-corp.co.uk or call +44 20 7946 0958 / (555) 123-4567 / 415-734-0134; "
        "server 93.184.216.34. And 2a00:1450:4001:82b::200e; card 4111 1111 1111 1111, amex 3782-822463-10005. "
        "Tel: 030 1234 5678."
    )
    out, counts, _ = scrub(text)
    assert "jane.doe" not in out and "<EMAIL>" in out
    assert "7946" not in out and "123-4567" not in out and "734-0134" not in out and "1234 5678" not in out
    assert "Tel: <PHONE>" in out  # the phone word stays
    assert "93.184" not in out and "2a00" not in out and out.count("<IP>") == 2
    assert "4111" not in out and "3782" not in out and out.count("<CARD>") == 2
    assert counts == Counter(email=1, phone=4, ip_address=2, credit_card=2)


@pytest.mark.parametrize(
    "text",
    [
        # documentation, private, loopback and link-local addresses
        "Bind to 192.0.2.10, 198.51.100.7 or 203.0.113.254; the LAN is 10.0.0.0/8, e.g. 192.168.1.20 and "
        "172.16.5.4; loopback 127.0.0.1 and ::1; IPv6 docs 2001:db8::1 and 2001:db8:85a3::8a2e:370:7334; "
        "link-local fe80::1ff:fe23:4567:890a; any 0.0.0.0; multicast 224.0.0.251",
        # versions that look like addresses
        "Requires v1.2.3.4 or version 2.0.0.1; the 4.3.2.1-rc1 build; Python 3.11.7; ratio = 1.2.3",
        # digit runs without a phone's shape: a table of figures, dates, counts, ids
        "| 1000 2000 3000 | 12 345 6789 | 2024-01-15 | 1234567 | 0 255 65535 | 86400 3600 60 |",
        "Ports 8080 8443 9090 and 5432 5433 5434; build 20240115 123456; order 100 200 300 400",
        # numbers reserved for fiction, networks, public resolvers, identifiers
        "Text +1-555-555-0100 or 206-555-0123; block 11.0.0.0/8 and 2a00:1450::/32; DNS 8.8.8.8 and 1.1.1.1; "
        "deployment ecs-svc/5191625155316533644 and id-4111111111111111; CMake 2.8.10.2 and lower",
        # decimals alone: never card numbers, whatever their digits
        "pi = 3.14159265358979323846; x = 0.4111111111111111; y = 4111111111111111.0; z = 1,4111111111111111",
        # e-mail at reserved example domains
        "Write to user@example.com, admin@example.org, bob@mail.test or root@host.invalid",
        # code
        "s = x[1::2]\nx = 0x7fff_ffff\nfor i in range(1234567):\n    pass\nid = 4111111111111112\n@property",
    ],
    ids=["documentation-ips", "versions", "digit-runs", "figures", "fiction-networks-ids", "decimals", "example-emails", "code"],
)
def test_technical_text_is_left_alone(text):
    out, counts, samples = scrub(text)
    assert out == text and not counts and not samples


def test_python_reference_docs_are_left_alone():
    # Python's own reference documentation: addresses, versions and figures, none of them PII.
    changed = {name: counts for name, text in PYTHON_REFERENCE.items() if (counts := scrub(text)[1])}
    assert len(PYTHON_REFERENCE) > 50 and changed == {}


def test_samples_show_before_and_after():
    text = "Contact the desk at +44 20 7946 0958 during office hours. " * 5
    out, counts, samples = scrub(text, PiiSpec(enabled=True, samples_per_kind=2))
    assert counts["phone"] == 5 and len(samples["phone"]) == 2
    first = samples["phone"][0]
    assert "+44 20 7946 0958" in first["before"] and "<PHONE>" not in first["before"]
    assert "<PHONE>" in first["after"] and "7946" not in first["after"]
    assert first["before"].startswith("Contact the desk at") and first["after"].endswith(first["before"][-10:])


def test_each_kind_can_be_switched_off():
    text = "a@mail.acme-corp.com +44 20 7946 0958 93.184.216.34 4111 1111 1111 1111"
    out, counts, _ = scrub(text, PiiSpec(enabled=True, emails=False, phones=False, ip_addresses=False))
    assert out == "a@mail.acme-corp.com +44 20 7946 0958 93.184.216.34 <CARD>" and counts == Counter(credit_card=1)


def test_disabled_by_default():
    counts: Counter = Counter()
    assert scrub_pii("a@mail.acme-corp.com", PiiSpec(), counts) == "a@mail.acme-corp.com" and not counts
