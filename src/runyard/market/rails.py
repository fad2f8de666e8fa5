"""Payment rails: the only way money enters the market besides an operator's credit.

A rail tells the market that money arrived by posting a signed event to
`POST /v1/rails/{rail}/events`. The signature is an HMAC-SHA256 over the raw request body with a
secret the rail and the market share, sent as

    Runyard-Rail-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

(the scheme Stripe's webhooks use). An event is applied once per (rail, event id), so a rail may
deliver it again and again. `HmacRail` checks that signature; `TestRail` is an `HmacRail` named
"test" that can also make signed events, for tests and demos. A real rail's adapter is an
`HmacRail` (or any `Rail`) configured with that rail's secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Mapping
from typing import Protocol

from runyard.market.errors import Unauthenticated

SIGNATURE_HEADER = "Runyard-Rail-Signature"
TOLERANCE_S = 300  # how old a signed event may be (replays beyond that are refused outright)


class Rail(Protocol):
    name: str

    def verify(self, body: bytes, headers: Mapping[str, str]) -> None:
        """Raise Unauthenticated unless `body` is an event this rail signed."""


def signature_header(secret: bytes, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


class HmacRail:
    """A rail whose events carry an HMAC-SHA256 signature (see the module docstring)."""

    def __init__(self, name: str, secret: bytes, tolerance_s: int = TOLERANCE_S):
        if len(secret) < 16:
            raise ValueError("a rail secret needs at least 16 bytes")
        self.name, self.secret, self.tolerance_s = name, secret, tolerance_s

    def verify(self, body: bytes, headers: Mapping[str, str]) -> None:
        header = headers.get(SIGNATURE_HEADER.lower()) or headers.get(SIGNATURE_HEADER) or ""
        parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
        stamp, given = parts.get("t", ""), parts.get("v1", "")
        if not stamp.isdigit() or not given:
            raise Unauthenticated(f"a {self.name} rail event needs a {SIGNATURE_HEADER}: t=...,v1=... header")
        if abs(time.time() - int(stamp)) > self.tolerance_s:
            raise Unauthenticated(f"the rail signature's timestamp is more than {self.tolerance_s} s away")
        expected = signature_header(self.secret, body, int(stamp)).split("v1=", 1)[1]
        if not hmac.compare_digest(expected, given):
            raise Unauthenticated(f"the {self.name} rail signature does not verify")


class TestRail(HmacRail):
    """The rail for tests and demos: it signs its own deposit events."""

    __test__ = False  # not a pytest test class

    def __init__(self, secret: bytes, name: str = "test"):
        super().__init__(name, secret)

    def deposit_event(
        self, account_id: int, amount: int, currency: str = "USD", event_id: str | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """A signed `deposit.succeeded` event: (raw body, headers) to post to the rail's endpoint."""
        event = {
            "id": event_id or f"evt_{uuid.uuid4().hex}",
            "type": "deposit.succeeded",
            "account_id": account_id,
            "amount": amount,
            "currency": currency,
        }
        body = json.dumps(event, separators=(",", ":")).encode()
        headers = {SIGNATURE_HEADER: signature_header(self.secret, body, int(time.time())),
                   "Content-Type": "application/json"}  # fmt: skip
        return body, headers
