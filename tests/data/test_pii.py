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


# Technical text, line by line, with the dotted quads in each that are addresses a person could be behind.
# Every other dotted quad is a section, heading or version number, or an address runyard leaves alone on
# purpose (documentation ranges, private ranges, public resolvers).
KERNEL_AND_PYTHON_DOC_LINES: list[tuple[str, list[str]]] = [
    # kernel-doc style
    ("See section 5.2.2.1 of the ACPI specification for the _OSC method.", []),
    ("As described in Section 5.2.2.1 and 5.2.2.3, the firmware may refuse the request.", []),
    ("Refer to sections 6.1.1.1, 6.1.1.2 and 6.1.2.1 for the register layout.", []),
    ("The table is defined in chapter 3.2.1.4 of the USB 3.2 specification.", []),
    ("2.1.1.2 Timestamp types", []),
    ("   4.10.2.1. Memory barriers", []),
    ("### 3.1.4.1 Locking rules", []),
    ("util-linux-ng 2.13.1.1 is required for the mount helper.", []),
    ("  util-linux-ng          2.13.1.1         fdformat --version", []),
    ("The bug was fixed in linux-2.6.32.71 and backported to 2.6.32.1.5.", []),
    ("Tested on kernel 2.6.32.71 with version 4.19.2.1 of the firmware (v5.4.0.1).", []),
    ("This was introduced in release 3.10.1.2 and removed in ver. 4.1.2.3.", []),
    ("See RFC 2460 § 4.5.1.2 and §§ 4.5.1.3-4.5.1.4 for the extension headers.", []),
    ("To reproduce, ssh to the box at 93.184.216.34 and run dmesg.", ["93.184.216.34"]),
    ("The NFS server 151.101.1.69 exported /srv with no_root_squash.", ["151.101.1.69"]),
    ("Reported-by: a user whose gateway was 140.82.112.3 (not 10.0.0.1).", ["140.82.112.3"]),
    ("ip route add default via 192.168.1.1 dev eth0 src 52.94.236.248", ["52.94.236.248"]),
    ("Use nameserver 8.8.8.8 or 1.1.1.1; the LAN gateway is 192.168.1.20.", []),
    ("Bind to 203.0.113.5 in the examples (a documentation address).", []),
    # Python-doc style
    ("Changed in version 3.11.0.1: the *timeout* parameter was added.", []),
    ("New in version 2.7.18.1.", []),
    ("The :mod:`ipaddress` module: ``ip_address('17.253.144.10')`` returns an IPv4Address.", ["17.253.144.10"]),
    (">>> socket.create_connection(('93.184.216.34', 80))", ["93.184.216.34"]),
    ("2.3.4.1 Operator precedence", []),
    ("See section 6.10.1.1 of the language reference for comparisons.", []),
    ("Python 3.12.0.0 is not a real release, and neither is 1.2.3.4.5.", []),
    ("connect to 151.101.65.69 on port 443 and verify the certificate", ["151.101.65.69"]),
    ("93.184.216.34 is the address the resolver returned.", ["93.184.216.34"]),
]


def test_ip_precision_and_recall_on_technical_text(capsys):
    tp = fp = fn = 0
    wrong = []
    for line, addresses in KERNEL_AND_PYTHON_DOC_LINES:
        out, counts, _ = scrub(line, PiiSpec(enabled=True, phones=False, emails=False, credit_cards=False))
        hit = [a for a in addresses if a not in out]
        tp += len(hit)
        fn += len(addresses) - len(hit)
        fp += counts["ip_address"] - len(hit)
        if len(hit) != len(addresses) or counts["ip_address"] != len(hit):
            wrong.append((line, out))
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    with capsys.disabled():
        print(f"\nIP scrubbing on {len(KERNEL_AND_PYTHON_DOC_LINES)} technical lines: "
              f"precision {precision:.3f} ({tp}/{tp + fp}), recall {recall:.3f} ({tp}/{tp + fn})")
    assert wrong == [] and precision == 1.0 and recall == 1.0


def test_samples_show_the_original_text_and_each_replacement():
    # Two kinds in one window: the IP sample's "before" keeps the e-mail address (matched on the original
    # text), "after" has both replaced, and "replaced" names each one.
    text = "jane@mail.acme-corp.com via 93.184.216.34 today."
    out, counts, samples = scrub(text)
    assert out == "<EMAIL> via <IP> today." and counts == Counter(email=1, ip_address=1)
    (ip,) = samples["ip_address"]
    assert ip["before"] == text and ip["after"] == out
    assert ip["replaced"] == ["jane@mail.acme-corp.com -> <EMAIL>", "93.184.216.34 -> <IP>"]
    assert samples["email"][0]["before"] == text
