"""HTML pages of runyard's web consoles (the market's /console, `runyard control ui`): Jinja2 templates
shipped in the package that serves them, autoescaped, with filters for integer money and Unix-second times."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any
from urllib.parse import parse_qs

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

# Pages are served with this policy: nothing is loaded from anywhere but the console itself, no script runs,
# and forms post only back to it.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}  # fmt: skip


def when(value: Any) -> str:
    """A Unix time as UTC text; '-' for none."""
    if value is None or value == "":
        return "-"
    if isinstance(value, str):  # already a datetime in ISO form (a requirement's latest_start)
        return value
    return dt.datetime.fromtimestamp(int(value), dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def money(value: Any) -> str:
    """Integer minor units with thousands separators (the market never holds fractions)."""
    if value is None:
        return "-"
    return f"{int(value):,}"


def new_key() -> str:
    """A fresh idempotency key, one per form as it is rendered: submitting that form twice (a double
    click, a reload) applies once, as a client retrying with the same key."""
    return f"console-{uuid.uuid4().hex}"


def environment(package: str) -> Environment:
    env = Environment(
        loader=PackageLoader(package, "templates"),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,  # a template naming a missing value fails loudly, not silently blank
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=when, money=money)
    env.globals.update(new_key=new_key)
    return env


def parse_form(body: bytes) -> dict[str, list[str]]:
    """An `application/x-www-form-urlencoded` body: each field's values, in order. Strict: a body that is
    not UTF-8 is refused (ValueError), never half-read."""
    text = body.decode("utf-8")  # UnicodeDecodeError is a ValueError
    return parse_qs(text, keep_blank_values=True, strict_parsing=False, max_num_fields=200)
