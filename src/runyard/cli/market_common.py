"""What the market's trading and administration verbs share: printing, argument types, the groups' names."""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from runyard.errors import RunyardError
from runyard.market.client import MarketClient


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


# The administration verbs (cli/market_admin.py) and their help: listed by name when a trading verb runs.
ADMIN_ACTIONS = {
    "serve": "run the market service (HTTP API)",
    "admin": "operator actions directly on a store (--db)",
}

DEFAULT_IDENTITY = os.environ.get("RUNYARD_MARKET_IDENTITY", str(Path.home() / ".runyard" / "market.json"))
DEFAULT_URL = os.environ.get("RUNYARD_MARKET_URL")


def client_for(args: argparse.Namespace) -> MarketClient:
    """The client acting as the saved identity (or anonymous, with --url, when there is none)."""
    path = Path(args.identity)
    if path.exists():
        return MarketClient.from_identity_file(path, base_url=args.url)
    if args.url and not getattr(args, "needs_identity", True):
        return MarketClient(args.url)
    raise RunyardError(
        f"no market identity at {path}; run `runyard market register` first (or pass --identity)"
    )
