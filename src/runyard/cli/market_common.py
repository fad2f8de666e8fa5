"""What the market's trading and administration verbs share: printing and argument types."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime


def print_json(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def timestamp(text: str) -> int:
    """Unix seconds from an integer or an ISO 8601 date-time (UTC when no zone is given)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is neither Unix seconds nor an ISO date-time") from exc
    return int((moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp())
