"""`runyard market ...`: the open market's verbs, in two groups.

Trading verbs (cli/market_trade.py) talk HTTP as the account in an identity file, one verb per
market operation (derived from `runyard.market.operations`). Administration verbs
(cli/market_admin.py: `serve` and `admin ...`) act directly on a store (`--db URL`) as the
operator who runs it.
"""

from __future__ import annotations

import argparse

from runyard.cli import market_admin, market_trade


def register(subparsers: argparse._SubParsersAction) -> None:
    market = subparsers.add_parser(
        "market", help="the open compute market: serve it, administer it, or trade on it"
    )
    verbs = market.add_subparsers(dest="market_verb", metavar="ACTION", required=True)
    market_admin.add_verbs(verbs)
    market_trade.add_verbs(verbs)
