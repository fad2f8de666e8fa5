"""`runyard market ...`: the open market's verbs, in two groups.

Trading verbs (cli/market_trade.py) talk HTTP as the account in an identity file, one verb per
market operation (derived from `runyard.market.operations`). Administration verbs
(cli/market_admin.py: `serve` and `admin ...`) act directly on a store (`--db URL`) as the
operator who runs it.

As at the top level (cli/__init__.py), a command imports only its own group: a tenant's `runyard market
demand` never loads the store, the service and the HTTP server the administration verbs need (fastapi,
sqlalchemy: most of a trading verb's start-up), and those are listed by name and help only.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from runyard.cli import import_verb_module, market_trade, verb_of
from runyard.cli.market_common import ADMIN_ACTIONS

ADMIN_MODULE = "runyard.cli.market_admin"


def register(subparsers: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    market = subparsers.add_parser(
        "market", help="the open compute market: serve it, administer it, or trade on it"
    )
    verbs = market.add_subparsers(dest="market_verb", metavar="ACTION", required=True)
    words = list(argv)
    action = verb_of(words[words.index("market") + 1 :]) if "market" in words else None
    if action is None or action in ADMIN_ACTIONS:
        import_verb_module("market", ADMIN_MODULE).add_verbs(verbs)
    else:
        for name, help_text in ADMIN_ACTIONS.items():
            verbs.add_parser(name, help=help_text)
    market_trade.add_verbs(verbs)
