"""Verbs of the open market: `runyard market serve|register|verify-status|verify-request|list|demand|
deposit|withdraw|leases|lease|usage|dispute|statement|admin ...`.

Client verbs talk HTTP through `MarketClient` as the account in an identity file (token and
Ed25519 private key, written by `register`). `serve` runs the service; `admin` verbs act directly
on a store (`--db URL`) as the operator who runs it.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from runyard.errors import EXIT_FAILURE, RunyardError

DEFAULT_IDENTITY = os.environ.get("RUNYARD_MARKET_IDENTITY", str(Path.home() / ".runyard" / "market.json"))
DEFAULT_URL = os.environ.get("RUNYARD_MARKET_URL")
DEFAULT_DB = os.environ.get("RUNYARD_MARKET_DB", "runyard-market.db")


def _print(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from runyard.market.client import MarketClient

    path = Path(args.identity)
    if not path.exists():
        raise RunyardError(
            f"no market identity at {path}; run `runyard market register` first (or pass --identity)"
        )
    return MarketClient.from_identity_file(path, base_url=args.url)


def _identity_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--identity",
        default=DEFAULT_IDENTITY,
        help="file with this account's token and private key (env RUNYARD_MARKET_IDENTITY; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="market URL (env RUNYARD_MARKET_URL; default: the one stored in the identity)",
    )


def _key_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--idempotency-key", help="reuse a key to retry a request safely (default: a fresh key)"
    )


def _db_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=DEFAULT_DB,
        help="the market store: a SQLite path or a postgresql:// URL (env RUNYARD_MARKET_DB)",
    )


def _timestamp(text: str) -> int:
    """Unix seconds from an integer or an ISO 8601 date-time (UTC when no zone is given)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is neither Unix seconds nor an ISO date-time") from exc
    return int((moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp())


def register(subparsers: argparse._SubParsersAction) -> None:
    market = subparsers.add_parser("market", help="the open compute market: serve it, or trade on it")
    verbs = market.add_subparsers(dest="market_verb", metavar="ACTION", required=True)

    serve = verbs.add_parser("serve", help="run the market service (HTTP API)")
    _db_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=int, default=8470, help="port (default %(default)s)")
    serve.add_argument("--currency", default="USD", help="the market's one currency, for a new store")
    serve.add_argument("--fee-bps", type=int, default=0, help="market fee in basis points, for a new store")
    serve.add_argument(
        "--dispute-window-s", type=int, default=86400, help="seconds to acknowledge or dispute"
    )
    serve.add_argument("--accept-timeout-s", type=int, default=900, help="seconds a provider has to accept")
    serve.add_argument("--start-timeout-s", type=int, default=3600, help="grace after the expected start")
    serve.add_argument(
        "--tolerance-bps",
        type=int,
        default=500,
        help="tenant measurement vs provider record mismatch that opens a dispute",
    )
    serve.add_argument(
        "--test-clock", action="store_true", help="let operators move the clock (tests, demos)"
    )
    serve.add_argument("--sweep-interval", type=float, default=5.0, help="seconds between deadline sweeps")
    serve.add_argument("--max-body-bytes", type=int, default=64 * 1024, help="largest request body accepted")
    serve.add_argument(
        "--operator-token-file",
        type=Path,
        help="if this file does not exist, create an operator account and write its token there",
    )
    serve.set_defaults(handler=_serve)

    reg = verbs.add_parser("register", help="register a tenant or provider and save its identity file")
    reg.add_argument("name", help="account name (letters, digits, . _ -)")
    reg.add_argument(
        "--role", choices=["tenant", "provider"], required=True, help="tenant buys, provider sells"
    )
    reg.add_argument("--identity", default=DEFAULT_IDENTITY, help="where to write token and key (mode 0600)")
    reg.add_argument("--url", default=DEFAULT_URL, required=DEFAULT_URL is None, help="market URL")
    reg.set_defaults(handler=_register)

    status = verbs.add_parser("verify-status", help="this account's verification state")
    _identity_args(status)
    status.set_defaults(handler=lambda a: _print(_client(a).me()))

    request = verbs.add_parser("verify-request", help="ask to be verified (an operator decides)")
    _identity_args(request)
    request.add_argument("--evidence", default="", help="what the verifier should check")
    request.set_defaults(handler=lambda a: _print(_client(a).request_verification(a.evidence)))

    lst = verbs.add_parser("list", help="offer capacity (provider); without --kind, show listings")
    _identity_args(lst)
    lst.add_argument("--kind", help="accelerator kind, e.g. h100-80gb, a100-80gb, l40s, cpu")
    lst.add_argument("--devices-per-node", type=int, default=1, help="devices on each node")
    lst.add_argument("--nodes", type=int, default=1, help="number of nodes")
    lst.add_argument("--interconnect", default="ethernet", help="ethernet, infiniband or nvlink")
    lst.add_argument("--interconnect-gbps", type=int, default=0, help="interconnect bandwidth")
    lst.add_argument("--region", help="where the devices are, e.g. eu-west")
    lst.add_argument("--jurisdiction", help="legal jurisdiction, e.g. eu")
    lst.add_argument("--price", type=int, help="price per device-hour in minor units")
    lst.add_argument("--from", dest="available_from", type=_timestamp, help="available from (Unix s or ISO)")
    lst.add_argument(
        "--until", dest="available_until", type=_timestamp, help="available until (Unix s or ISO)"
    )
    lst.add_argument(
        "--start-class", choices=["immediate", "queued"], default="immediate", help="start class"
    )
    lst.add_argument("--max-queue-s", type=int, default=0, help="longest wait before start (queued)")
    lst.add_argument(
        "--scheduler", default="local", help="the provider's scheduler: local, slurm, kubernetes..."
    )
    lst.add_argument("--mine", action="store_true", help="when showing: only this account's listings")
    lst.set_defaults(handler=_list)

    demand = verbs.add_parser(
        "demand", help="place a demand with escrow (tenant); without options, show demands"
    )
    _identity_args(demand)
    _key_arg(demand)
    demand.add_argument(
        "--requirement",
        type=Path,
        help="YAML/JSON file: a requirement, or a job spec (its resources.requirement is used)",
    )
    demand.add_argument("--kinds", help="acceptable accelerator kinds, comma-separated")
    demand.add_argument("--devices", type=int, help="devices in total")
    demand.add_argument("--duration-s", type=int, help="seconds needed")
    demand.add_argument("--regions", help="allowed regions or jurisdictions, comma-separated")
    demand.add_argument("--latest-start", type=_timestamp, help="latest acceptable start (Unix s or ISO)")
    demand.add_argument("--start-classes", help="accepted start classes, e.g. immediate,queued")
    demand.add_argument("--min-interconnect", help="ethernet, infiniband or nvlink")
    demand.add_argument("--max-price", type=int, help="maximum price per device-hour (minor units)")
    demand.add_argument("--cancel", type=int, metavar="DEMAND", help="cancel an open demand")
    demand.add_argument(
        "--job-spec",
        type=Path,
        metavar="FILE",
        help="job spec (YAML) to run on the lease; only the lease's provider sees it",
    )
    demand.add_argument(
        "--results-to",
        metavar="PATH",
        help="where the provider delivers the results: a local directory or a URL (required with --job-spec)",
    )
    demand.add_argument(
        "--job-file",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="a data file uploaded with the job (repeatable; at most 256 KiB in all); the spec names it "
        "by NAME (default: the file's name), a relative path",
    )
    demand.add_argument(
        "--data-url",
        action="append",
        default=[],
        metavar="URL",
        help="an http(s) URL the provider fetches for the job before it starts (repeatable); the spec "
        "names it as a data source by this exact URL",
    )
    demand.set_defaults(handler=_demand)

    for name, method, help_text in (
        ("deposit", "deposit", "add funds (tenant)"),
        ("withdraw", "withdraw", "take funds out (tenant available, provider earnings)"),
    ):
        money = verbs.add_parser(name, help=help_text)
        _identity_args(money)
        _key_arg(money)
        money.add_argument("amount", type=int, help="minor units")
        money.set_defaults(
            handler=lambda a, m=method: _print(getattr(_client(a), m)(a.amount, a.idempotency_key))
        )

    lss = verbs.add_parser("leases", help="show this account's leases")
    _identity_args(lss)
    lss.add_argument("--state", help="only leases in this state")
    lss.set_defaults(handler=lambda a: _print(_client(a).leases(a.state)))

    lease = verbs.add_parser(
        "lease", help="act on one lease: show, accept, reject, start, close, terminate, cancel, settle"
    )
    _identity_args(lease)
    _key_arg(lease)
    lease.add_argument(
        "action",
        choices=["show", "accept", "reject", "start", "close", "terminate", "cancel", "settle"],
        help="what to do",
    )
    lease.add_argument("lease_id", type=int, help="the lease")
    lease.add_argument("--reason-code", default=None, help="why (reject, terminate, cancel)")
    lease.add_argument("--note", default="", help="free text for the record")
    lease.set_defaults(handler=_lease)

    use = verbs.add_parser("usage", help="usage records: report (provider), show, ack or measure (tenant)")
    _identity_args(use)
    _key_arg(use)
    use.add_argument("action", choices=["report", "show", "ack", "measure"], help="what to do")
    use.add_argument("target", type=int, help="lease id (report, show, measure) or record id (ack)")
    use.add_argument("--seq", type=int, help="sequence number (report)")
    use.add_argument("--start", type=_timestamp, help="interval start (report, measure)")
    use.add_argument("--end", type=_timestamp, help="interval end (report, measure)")
    use.add_argument("--device-seconds", type=int, help="device-seconds used in the interval")
    use.add_argument("--evidence", help="e.g. the run's metrics digest (report)")
    use.add_argument("--accepted", type=int, help="accept only this many device-seconds (ack)")
    use.set_defaults(handler=_usage)

    dispute = verbs.add_parser(
        "dispute", help="dispute a usage record (tenant) or contest a partial ack (provider)"
    )
    _identity_args(dispute)
    _key_arg(dispute)
    dispute.add_argument("record_id", type=int, help="the usage record")
    dispute.add_argument("--reason", required=True, help="why")
    dispute.add_argument(
        "--claimed", type=int, default=0, help="device-seconds the tenant believes were used"
    )
    dispute.add_argument(
        "--contest", action="store_true", help="as the provider, contest a partial acknowledgement"
    )
    dispute.set_defaults(handler=_dispute)

    stmt = verbs.add_parser("statement", help="balances, ledger entries and reconciled totals")
    _identity_args(stmt)
    stmt.set_defaults(handler=lambda a: _print(_client(a).statement()))

    admin = verbs.add_parser("admin", help="operator actions on a store")
    admin_verbs = admin.add_subparsers(dest="admin_verb", metavar="ACTION", required=True)
    verify = admin_verbs.add_parser("verify", help="approve or reject an account's verification")
    _db_arg(verify)
    verify.add_argument("account", help="account name or id")
    decision = verify.add_mutually_exclusive_group(required=True)
    decision.add_argument("--approve", action="store_true", help="verify the account")
    decision.add_argument("--reject", action="store_true", help="reject (or revoke) the verification")
    verify.add_argument("--reason", required=True, help="why (recorded with the decision)")
    verify.set_defaults(handler=_admin_verify)

    pending = admin_verbs.add_parser("pending", help="accounts waiting for verification")
    _db_arg(pending)
    pending.set_defaults(handler=_admin_pending)

    audit = admin_verbs.add_parser("audit", help="check every invariant of the ledger and the state machines")
    _db_arg(audit)
    audit.add_argument("--json", action="store_true", help="print the full result as JSON")
    audit.set_defaults(handler=_admin_audit)

    resolve = admin_verbs.add_parser("resolve", help="resolve a usage dispute")
    _db_arg(resolve)
    resolve.add_argument("dispute_id", type=int, help="the dispute")
    resolve.add_argument(
        "--outcome",
        choices=["upheld", "partial", "rejected"],
        required=True,
        help="upheld: the opener's claim; rejected: the other side's; partial: --device-seconds",
    )
    resolve.add_argument("--device-seconds", type=int, help="the accepted device-seconds (partial)")
    resolve.add_argument("--reason", required=True, help="why (recorded)")
    resolve.set_defaults(handler=_admin_resolve)

    fee = admin_verbs.add_parser("fee", help="set the market fee for new leases")
    _db_arg(fee)
    fee.add_argument("fee_bps", type=int, help="basis points (100 = 1%%)")
    fee.set_defaults(handler=_admin_fee)

    token = admin_verbs.add_parser("token", help="create an operator account and print its API token once")
    _db_arg(token)
    token.add_argument("name", help="operator account name")
    token.set_defaults(handler=_admin_token)

    sweep = admin_verbs.add_parser("sweep", help="apply due deadlines and settlements now")
    _db_arg(sweep)
    sweep.set_defaults(handler=_admin_sweep)


# -- handlers --------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from runyard.market.server import serve, write_operator_token
    from runyard.market.service import Market, Settings

    settings = Settings(
        currency=args.currency, fee_bps=args.fee_bps, dispute_window_s=args.dispute_window_s,
        accept_timeout_s=args.accept_timeout_s, start_timeout_s=args.start_timeout_s,
        tolerance_bps=args.tolerance_bps, test_clock=args.test_clock,
    )  # fmt: skip
    market = _open_store(lambda: Market.open(args.db, settings, pool_size=16), args.db)
    if args.operator_token_file and write_operator_token(market, args.operator_token_file):
        print(f"operator token written to {args.operator_token_file}", file=sys.stderr)
    print(f"runyard market on http://{args.host}:{args.port} (store {market.store.dialect})", file=sys.stderr)
    serve(market, args.host, args.port, args.sweep_interval, args.max_body_bytes)
    return 0


def _register(args: argparse.Namespace) -> int:
    from runyard.market.client import MarketClient

    path = Path(args.identity)
    if path.exists():
        raise RunyardError(f"{path} already holds an identity; pass another --identity")
    path.parent.mkdir(parents=True, exist_ok=True)
    with MarketClient(args.url) as client:
        result = client.register(args.name, args.role)
        client.save_identity(path)
    _print({k: v for k, v in result.items() if k != "token"} | {"identity": str(path)})
    return 0


def _list(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.kind:
        _print(client.listings(mine=args.mine))
        return 0
    missing = [
        f"--{n}"
        for n, v in (
            ("region", args.region),
            ("jurisdiction", args.jurisdiction),
            ("price", args.price),
            ("until", args.available_until),
        )
        if v is None
    ]
    if missing:
        raise RunyardError(f"a listing needs {', '.join(missing)}")
    _print(client.create_listing(
        accelerator_kind=args.kind, devices_per_node=args.devices_per_node, node_count=args.nodes,
        interconnect=args.interconnect, interconnect_gbps=args.interconnect_gbps, region=args.region,
        jurisdiction=args.jurisdiction, price_per_device_hour=args.price, available_from=args.available_from,
        available_until=args.available_until, start_class=args.start_class, max_queue_s=args.max_queue_s,
        scheduler_kind=args.scheduler,
    ))  # fmt: skip
    return 0


def _requirement(args: argparse.Namespace) -> dict:
    import yaml

    from runyard.market.requirement import Requirement

    data: dict = {}
    if args.requirement:
        loaded = yaml.safe_load(args.requirement.read_text()) or {}
        if not isinstance(loaded, dict):
            raise RunyardError(f"{args.requirement}: expected a mapping")
        data = (
            dict((loaded.get("resources") or {}).get("requirement") or {})
            if "resources" in loaded
            else loaded
        )
    for key, value in (
        ("accelerator_kinds", args.kinds and args.kinds.split(",")),
        ("device_count", args.devices),
        ("duration_s", args.duration_s),
        ("allowed_regions", args.regions and args.regions.split(",")),
        ("start_classes", args.start_classes and args.start_classes.split(",")),
        ("min_interconnect", args.min_interconnect),
    ):
        if value is not None:
            data[key] = value
    if args.latest_start is not None:
        data["latest_start"] = datetime.fromtimestamp(args.latest_start, UTC).isoformat()
    try:
        return Requirement.model_validate(data).model_dump(mode="json")
    except ValueError as exc:
        raise RunyardError(f"invalid requirement: {exc}") from exc


def _demand(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.cancel is not None:
        _print(client.cancel_demand(args.cancel, args.idempotency_key))
    elif args.max_price is None and not (args.requirement or args.kinds or args.job_spec):
        _print(client.demands())
    elif args.max_price is None:
        raise RunyardError("a demand needs --max-price (per device-hour, minor units)")
    else:
        _print(client.place_demand(_requirement(args), args.max_price, args.idempotency_key, job=_job(args)))
    return 0


def _job(args: argparse.Namespace) -> dict | None:
    """The demand's job from --job-spec, --results-to, --job-file and --data-url (a local path is
    made absolute)."""
    from runyard.market.jobs import MAX_SPEC_BYTES, check_data_urls, encode_files

    if args.job_spec is None and args.results_to is None:
        if args.job_file or args.data_url:
            raise RunyardError("--job-file and --data-url belong to a job: give --job-spec and --results-to")
        return None
    if args.job_spec is None or args.results_to is None:
        raise RunyardError("--job-spec and --results-to go together: a job needs both")
    try:
        size = args.job_spec.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise RunyardError(
                f"{args.job_spec}: {size} bytes; a demand's job spec is at most {MAX_SPEC_BYTES}"
            )
        spec = args.job_spec.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunyardError(f"cannot read --job-spec {args.job_spec}: {exc}") from exc
    results_to = args.results_to
    if "://" not in results_to:
        results_to = str(Path(results_to).expanduser().resolve())
    job: dict = {"spec": spec, "results_to": results_to}
    try:
        named = {}
        for item in args.job_file:
            name, sep, path = item.partition("=")
            path = Path(path if sep else name)
            named[name if sep else path.name] = path.read_bytes()
        if named:
            job["files"] = encode_files(named)
        if args.data_url:
            job["data_urls"] = check_data_urls(args.data_url)
    except (OSError, ValueError) as exc:
        raise RunyardError(f"--job-file/--data-url: {exc}") from exc
    return job


def _lease(args: argparse.Namespace) -> int:
    client = _client(args)
    key, lease_id = args.idempotency_key, args.lease_id
    actions = {
        "show": lambda: client.lease(lease_id),
        "accept": lambda: client.accept_lease(lease_id, key),
        "reject": lambda: client.reject_lease(
            lease_id, args.reason_code or "capacity_unavailable", args.note
        ),
        "start": lambda: client.start_lease(lease_id, key),
        "close": lambda: client.close_lease(lease_id, key),
        "terminate": lambda: client.terminate_lease(lease_id, args.reason_code or "other", args.note, key),
        "cancel": lambda: client.cancel_lease(lease_id, args.reason_code or "tenant_request", args.note),
        "settle": lambda: client.settle(lease_id, key),
    }
    _print(actions[args.action]())
    return 0


def _usage(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "show":
        _print(client.usage(args.target))
    elif args.action == "ack":
        _print(client.acknowledge(args.target, args.accepted, args.idempotency_key))
    else:
        needed = ["--start", "--end", "--device-seconds"] + (["--seq"] if args.action == "report" else [])
        values = {
            "--start": args.start,
            "--end": args.end,
            "--device-seconds": args.device_seconds,
            "--seq": args.seq,
        }
        missing = [n for n in needed if values[n] is None]
        if missing:
            raise RunyardError(f"usage {args.action} needs {', '.join(missing)}")
        if args.action == "report":
            _print(
                client.report_usage(
                    args.target,
                    args.seq,
                    args.start,
                    args.end,
                    args.device_seconds,
                    args.evidence,
                    args.idempotency_key,
                )
            )
        else:
            _print(
                client.submit_measurement(
                    args.target, args.start, args.end, args.device_seconds, args.idempotency_key
                )
            )
    return 0


def _dispute(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.contest:
        _print(client.contest(args.record_id, args.reason, args.idempotency_key))
    else:
        _print(client.dispute(args.record_id, args.reason, args.claimed, args.idempotency_key))
    return 0


# -- admin (direct store access) ---------------------------------------------------------------


def _operator():  # type: ignore[no-untyped-def]
    from runyard.market.service import Principal

    # The operator at the console: account id 0, named after the OS user, for the audit trail.
    return Principal(
        id=0, name=f"console:{getpass.getuser()}", role="operator", state="verified", public_key=""
    )


def _open_store(open_fn, db: str):  # type: ignore[no-untyped-def]
    """Open a market store, turning a database that cannot be reached or read into a clear error."""
    from sqlalchemy.exc import DBAPIError

    try:
        return open_fn()
    except DBAPIError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        if "://" in db:  # never echo a password from the URL
            from sqlalchemy.engine import make_url

            db = make_url(db).render_as_string(hide_password=True)
        raise RunyardError(f"cannot open the market store {db}: {reason}") from exc


def _admin_market(args: argparse.Namespace, fn):  # type: ignore[no-untyped-def]
    from runyard.market.service import Market

    if "://" not in args.db and not Path(args.db).exists():
        raise RunyardError(f"no market store at {args.db}")
    market = _open_store(lambda: Market.open(args.db, pool_size=2), args.db)
    try:
        return fn(market)
    finally:
        market.store.dispose()


def _admin_verify(args: argparse.Namespace) -> int:
    from runyard.market import identity

    _print(
        _admin_market(
            args, lambda m: identity.decide(m, _operator().actor, args.account, args.approve, args.reason)
        )
    )
    return 0


def _admin_resolve(args: argparse.Namespace) -> int:
    import uuid

    from runyard.market import usage
    from runyard.market.models import ResolveIn

    body = ResolveIn(outcome=args.outcome, device_seconds=args.device_seconds, reason=args.reason)
    _print(
        _admin_market(args, lambda m: usage.resolve(m, _operator(), args.dispute_id, body, uuid.uuid4().hex))
    )
    return 0


def _admin_audit(args: argparse.Namespace) -> int:
    from runyard.market.invariants import audit_market

    result = _admin_market(args, audit_market)
    if args.json:
        _print(result)
    elif result["ok"]:
        counts = ", ".join(f"{v} {k}" for k, v in result["counts"].items())
        print(f"audit ok: every invariant holds ({counts})")
    else:
        print(f"audit FAILED: {len(result['violations'])} violation(s)")
        for line in result["violations"]:
            print(f"  {line}")
    return 0 if result["ok"] else EXIT_FAILURE


def _admin_pending(args: argparse.Namespace) -> int:
    from runyard.market import identity

    _print(_admin_market(args, identity.pending_accounts))
    return 0


def _admin_token(args: argparse.Namespace) -> int:
    from runyard.market import identity

    _print(_admin_market(args, lambda m: identity.create_operator(m, args.name)))
    return 0


def _admin_sweep(args: argparse.Namespace) -> int:
    from runyard.market import leases

    _print(_admin_market(args, leases.sweep))
    return 0


def _admin_fee(args: argparse.Namespace) -> int:
    _print(_admin_market(args, lambda m: {"fee_bps": m.set_fee(args.fee_bps, _operator().actor)["fee_bps"]}))
    return 0
