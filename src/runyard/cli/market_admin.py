"""Administration verbs of `runyard market`: `serve` runs the service; `admin ...` act directly on
a store (`--db URL`) as the operator at the console. Every `admin` verb but `token` is an operator
operation of `runyard.market.operations` (its `admin` name), run in-process through the same
handler the HTTP API uses; its options are the operation's body fields.
"""

from __future__ import annotations

import argparse
import getpass
import inspect
import os
import secrets
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from runyard.cli.market_common import ADMIN_ACTIONS, print_json
from runyard.cli.market_trade import _option
from runyard.errors import EXIT_FAILURE, RunyardError
from runyard.market import identity
from runyard.market.api import DEFAULT_MAX_BODY, HANDLERS
from runyard.market.operations import OPERATIONS, Operation
from runyard.market.rails import HmacRail, Rail, TestRail
from runyard.market.server import serve, write_operator_token
from runyard.market.service import Market, Principal, Settings
from runyard.market.verifiers import OperatorVerifier
from runyard.system.files import atomic_write_text

DEFAULT_DB = os.environ.get("RUNYARD_MARKET_DB", "runyard-market.db")


def _db_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=DEFAULT_DB,
        help="the market store: a SQLite path or a postgresql:// URL (env RUNYARD_MARKET_DB)",
    )


def console_operator() -> Principal:
    """The operator at the console: account id 0, named after the OS user, for the audit trail."""
    return Principal(
        id=0, name=f"console:{getpass.getuser()}", role="operator", state="verified", public_key=""
    )


def open_store(open_fn: Callable[[], Market], db: str) -> Market:
    """Open a market store, turning a database that cannot be reached or read into a clear error."""
    try:
        return open_fn()
    except DBAPIError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        shown = (
            make_url(db).render_as_string(hide_password=True) if "://" in db else db
        )  # never echo a password
        raise RunyardError(f"cannot open the market store {shown}: {reason}") from exc


def admin_market(args: argparse.Namespace, fn: Callable[[Market], Any]) -> Any:
    """Run `fn` on the store named by --db, then let it go."""
    if "://" not in args.db and not Path(args.db).exists():
        raise RunyardError(f"no market store at {args.db}")
    market = open_store(lambda: Market.open(args.db, verifier=OperatorVerifier(), pool_size=2), args.db)
    try:
        return fn(market)
    finally:
        market.store.dispose()


def _rails(specs: list[str]) -> dict[str, Rail]:
    """`NAME=SECRET_FILE` pairs: each file holds the rail's shared secret (made, 0600, if missing)."""
    rails: dict[str, Rail] = {}
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise RunyardError(f"--rail takes NAME=SECRET_FILE, got {spec!r}")
        path = Path(file)
        if not path.exists():
            atomic_write_text(path, secrets.token_hex(32) + "\n", mode=0o600)
        secret = path.read_text().strip().encode()
        rails[name] = TestRail(secret) if name == "test" else HmacRail(name, secret)
    return rails


def _serve(args: argparse.Namespace) -> int:
    settings = Settings(
        currency=args.currency, fee_bps=args.fee_bps, dispute_window_s=args.dispute_window_s,
        accept_timeout_s=args.accept_timeout_s, start_timeout_s=args.start_timeout_s,
        tolerance_bps=args.tolerance_bps, test_clock=args.test_clock,
    )  # fmt: skip
    rails = _rails(args.rail)
    market = open_store(
        lambda: Market.open(args.db, settings, verifier=OperatorVerifier(), rails=rails, pool_size=16),
        args.db,
    )
    if args.operator_token_file and write_operator_token(market, args.operator_token_file):
        print(f"operator token written to {args.operator_token_file}", file=sys.stderr)
    print(f"runyard market on http://{args.host}:{args.port} (store {market.store.dialect})", file=sys.stderr)
    serve(market, args.host, args.port, args.sweep_interval, args.max_body_bytes)
    return 0


def _add_serve(verbs: argparse._SubParsersAction) -> None:
    serve_p = verbs.add_parser("serve", help=ADMIN_ACTIONS["serve"])
    _db_arg(serve_p)
    serve_p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve_p.add_argument("--port", type=int, default=8470, help="port (default %(default)s)")
    serve_p.add_argument("--currency", default="USD", help="the market's one currency, for a new store")
    serve_p.add_argument("--fee-bps", type=int, default=0, help="market fee in basis points, for a new store")
    serve_p.add_argument(
        "--dispute-window-s", type=int, default=86400, help="seconds to acknowledge or dispute"
    )
    serve_p.add_argument("--accept-timeout-s", type=int, default=900, help="seconds a provider has to accept")
    serve_p.add_argument("--start-timeout-s", type=int, default=3600, help="grace after the expected start")
    serve_p.add_argument(
        "--tolerance-bps",
        type=int,
        default=500,
        help="tenant measurement vs provider record mismatch that opens a dispute",
    )
    serve_p.add_argument(
        "--test-clock", action="store_true", help="let operators move the clock (tests, demos)"
    )
    serve_p.add_argument("--sweep-interval", type=float, default=5.0, help="seconds between deadline sweeps")
    serve_p.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="largest request body accepted"
    )
    serve_p.add_argument(
        "--operator-token-file", type=Path,
        help="if this file does not exist, create an operator account and write its token there",
    )  # fmt: skip
    serve_p.add_argument(
        "--rail", action="append", default=[], metavar="NAME=SECRET_FILE",
        help="a payment rail whose signed events add money (repeatable; the file holds its shared secret, "
        "made if missing); NAME 'test' is the test rail for demos",
    )  # fmt: skip
    serve_p.set_defaults(handler=_serve)


def _admin_op(parser: argparse.ArgumentParser, op: Operation) -> Callable[[argparse.Namespace], int]:
    """Arguments from the operation's path parameters and body fields; the handler runs it here."""
    for name in op.path_params:
        parser.add_argument(name, help=f"{name.replace('_', ' ')} (name or id)")
    fields = dict(op.body.model_fields) if op.body is not None else {}
    for name, info in fields.items():
        default = inspect.Parameter.empty if info.is_required() else info.default
        # argparse formats help with %: a description's own % (a fee's "100 = 1%") is escaped
        _option(parser, name, info.annotation, default, (info.description or name.replace("_", " ")).replace("%", "%%"))
    if op.key is not None:
        parser.add_argument(
            "--idempotency-key", help="reuse a key to retry a request safely (default: a fresh key)"
        )

    def handler(args: argparse.Namespace) -> int:
        body = op.body(**{n: getattr(args, n) for n in fields}) if op.body is not None else None
        values = {n: getattr(args, n) for n in op.path_params}
        key = getattr(args, "idempotency_key", None) or uuid.uuid4().hex
        run = HANDLERS[op.name]
        result = admin_market(
            args, lambda m: run(m, console_operator(), SimpleNamespace(body=body, key=key, **values))
        )
        return AFTER.get(op.name, _print_result)(result)

    return handler


def _print_result(result: Any) -> int:
    print_json(result)
    return 0


def _print_audit(result: dict) -> int:
    if result["ok"]:
        counts = ", ".join(f"{v} {k}" for k, v in result["counts"].items())
        print(f"audit ok: every invariant holds ({counts})")
    else:
        print(f"audit FAILED: {len(result['violations'])} violation(s)")
        for line in result["violations"]:
            print(f"  {line}")
    return 0 if result["ok"] else EXIT_FAILURE


AFTER: dict[str, Callable[[Any], int]] = {"audit": _print_audit}


def _token(args: argparse.Namespace) -> int:
    print_json(admin_market(args, lambda m: identity.create_operator(m, args.name)))
    return 0


def add_verbs(verbs: argparse._SubParsersAction) -> None:
    """`serve`, and `admin` with one verb per operator operation plus `token`."""
    _add_serve(verbs)
    admin = verbs.add_parser("admin", help=ADMIN_ACTIONS["admin"])
    admin_verbs = admin.add_subparsers(dest="admin_verb", metavar="ACTION", required=True)
    for op in OPERATIONS:
        if op.admin is None:
            continue
        parser = admin_verbs.add_parser(op.admin, help=op.summary)
        _db_arg(parser)
        parser.set_defaults(handler=_admin_op(parser, op))
    token = admin_verbs.add_parser("token", help="create an operator account and print its API token once")
    _db_arg(token)
    token.add_argument("name", help="operator account name")
    token.set_defaults(handler=_token)
