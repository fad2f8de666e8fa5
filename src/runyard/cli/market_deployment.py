"""`runyard market deployment rollout|rollback`: the tenant changes what its standing lease serves.

`rollout LEASE_ID EXPORT` uploads a run's export (a run directory or its export/; files the provider
should fetch instead go by `--export-url PATH=URL`) and asks the provider to serve it on the same
lease and endpoint; `rollback LEASE_ID` asks for the export served before the one serving now (the
market resolves which). The provider's agent starts the new server beside the old one and switches
only once it answers (runyard.control.agent_rollout); with `--wait S` the verb waits for the
provider's outcome and exits 1 when the switch failed (the old export then keeps serving), printing
the provider's reason. `deployment rollouts LEASE_ID` lists them all.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from runyard.cli.market_common import client_for, print_json
from runyard.cli.readers import export_dir_of
from runyard.errors import RunyardError
from runyard.market.client import MarketClient
from runyard.market.jobs import init_export_body
from runyard.market.operations import Operation

ENDED = ("switched", "failed", "withdrawn")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lease_id", type=int, help="the running standing lease")
    parser.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for the provider's outcome; exit 1 if the switch failed "
                        "(default: return once the market has the request)")
    parser.add_argument("--idempotency-key", help="reuse a key to retry a request safely (default: a fresh key)")


def rollout_args(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
    _common(parser)
    parser.add_argument("export", type=Path, help="the export to serve: a run directory or its export/")
    parser.add_argument("--export-url", action="append", default=[], metavar="PATH=URL",
                        help="an export file the provider fetches instead of receiving it (repeatable; "
                        "uploads are limited to 256 KiB in all)")

    def handler(args: argparse.Namespace) -> int:
        urls = {}
        for item in args.export_url:
            path, sep, url = item.partition("=")
            if not sep or not path or not url:
                raise RunyardError(f"--export-url {item!r}: expected PATH=URL")
            urls[path] = url
        export = export_dir_of(args.export)
        try:
            body = init_export_body(export, urls)
        except ValueError as exc:
            raise RunyardError(f"{export}: {exc}; give large files with --export-url PATH=URL") from exc
        with client_for(args) as client:
            asked = client.request_rollout(args.lease_id, idempotency_key=args.idempotency_key, **body)
            return _outcome(client, asked, args.wait)

    return handler


def rollback_args(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
    _common(parser)

    def handler(args: argparse.Namespace) -> int:
        with client_for(args) as client:
            asked = client.request_rollout(args.lease_id, rollback=True, idempotency_key=args.idempotency_key)
            return _outcome(client, asked, args.wait)

    return handler


def _outcome(client: MarketClient, asked: dict, wait_s: float) -> int:
    """Print the roll-out (once ended, when waiting); 1 when it failed, 0 otherwise."""
    deadline = time.monotonic() + wait_s
    rollout = asked
    while wait_s > 0 and rollout["state"] not in ENDED and time.monotonic() < deadline:
        time.sleep(1.0)
        rollout = next(r for r in client.rollouts(asked["lease_id"]) if r["id"] == asked["id"])
    print_json({k: v for k, v in rollout.items() if k != "export"})
    if wait_s > 0 and rollout["state"] not in ENDED:
        raise RunyardError(f"roll-out {rollout['id']} is still {rollout['state']} after {wait_s:g} s; "
                           f"see `runyard market deployment rollouts {rollout['lease_id']}`")
    return 1 if rollout["state"] == "failed" else 0
