"""The market's HTTP API (FastAPI; the OpenAPI document is at /openapi.json).

Routes are built from `operations.OPERATIONS` (the one definition of each operation) and bound to
their implementations in `HANDLERS`. Authentication is a bearer token (`Authorization: Bearer
ryk_...`), looked up by its hash; a payment rail authenticates its events with an HMAC signature
(`rails`). Authorisation is by role and ownership inside each operation: a tenant never sees
another tenant's demands, leases or statement (they answer 404, as if they did not exist), a
provider sees only its own listings and leases, and /v1/admin/* is for verified operators. Every
money-moving request needs an `Idempotency-Key` header. Errors are JSON: {"error": code, "message":
text, "detail": {...}}; a 4xx changed nothing. Bodies above `max_body_bytes` are refused with 413
before they are read in full; a body that is not strict JSON (not UTF-8, unparseable, a key twice
in one object, NaN, Infinity or a number too large for a double) is refused with 422 in the error
envelope before anything reads it (`parse_body`).

(No `from __future__ import annotations` here: FastAPI resolves the endpoints' annotations.)
"""

import inspect
import json
import logging
import math
import re
from collections.abc import Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from runyard.market import (
    availability,
    deadlines,
    disputes,
    funds,
    identity,
    invariants,
    leases,
    model_costs,
    orders,
    revocation,
    rollouts,
    settlement,
    statements,
    usage,
)
from runyard.market.console import create_console
from runyard.market.console.app import PREFIX as CONSOLE_PREFIX
from runyard.market.errors import BadRequest, MarketError, NotFound, PayloadTooLarge
from runyard.market.jobs import MAX_DEMAND_BODY_BYTES
from runyard.market.models import MAX_ID
from runyard.market.operations import OPERATIONS, Operation
from runyard.market.rails import SIGNATURE_HEADER
from runyard.market.responses import ErrorOut
from runyard.market.service import Market, Principal

log = logging.getLogger("runyard.market.api")
DEFAULT_MAX_BODY = 64 * 1024

Handler = Callable[[Market, Any, SimpleNamespace], Any]


def _market_info(market: Market, p: Any, a: SimpleNamespace) -> dict:
    config = market.read(lambda conn, now: {**Market.config(conn), "now": now})
    config.pop("id")
    return config


# What each operation does, by name (the route, client method and CLI verb come from OPERATIONS).
HANDLERS: dict[str, Handler] = {
    "healthz": lambda m, p, a: {"ok": True},
    "market_info": _market_info,
    "register": lambda m, p, a: identity.register(m, a.body.name, a.body.role, a.body.public_key),
    "me": lambda m, p, a: identity.status(m, p),
    "request_verification": lambda m, p, a: identity.request_verification(m, p, a.body.evidence),
    "withdraw": lambda m, p, a: funds.withdraw(m, p, a.body, a.key),
    "add_payout_method": lambda m, p, a: funds.add_payout_method(m, p, a.body, a.key),
    "payout_methods": lambda m, p, a: funds.list_payout_methods(m, p),
    "balances": lambda m, p, a: funds.balances(m, p),
    "statement": lambda m, p, a: statements.statement(m, p),
    "model_costs": lambda m, p, a: model_costs.model_costs(m, p),
    "rail_webhook": lambda m, p, a: funds.rail_deposit(m, a.rail, a.body),
    "create_listing": lambda m, p, a: orders.create_listing(m, p, a.body, a.key),
    "listings": lambda m, p, a: orders.list_listings(m, p, a.mine),
    "withdraw_listing": lambda m, p, a: orders.withdraw_listing(m, p, a.listing_id),
    "place_demand": lambda m, p, a: orders.place_demand(m, p, a.body, a.key),
    "demands": lambda m, p, a: orders.list_demands(m, p),
    "demand": lambda m, p, a: orders.get_demand(m, p, a.demand_id),
    "cancel_demand": lambda m, p, a: orders.cancel_demand(m, p, a.demand_id, a.key),
    "leases": lambda m, p, a: leases.list_leases(m, p, a.state),
    "lease": lambda m, p, a: leases.get_lease(m, p, a.lease_id),
    "accept_lease": lambda m, p, a: leases.accept(m, p, a.lease_id, a.body, a.key),
    "reject_lease": lambda m, p, a: leases.reject(m, p, a.lease_id, a.body, a.key),
    "start_lease": lambda m, p, a: leases.start(m, p, a.lease_id, a.key),
    "close_lease": lambda m, p, a: leases.close_window(m, p, a.lease_id, a.key),
    "terminate_lease": lambda m, p, a: leases.terminate(m, p, a.lease_id, a.body, a.key),
    "cancel_lease": lambda m, p, a: leases.cancel(m, p, a.lease_id, a.body, a.key),
    "settle": lambda m, p, a: settlement.settle(m, p, a.lease_id, a.key),
    "report_usage": lambda m, p, a: usage.report(m, p, a.lease_id, a.body, a.key),
    "usage": lambda m, p, a: usage.lease_usage(m, p, a.lease_id),
    "submit_measurement": lambda m, p, a: usage.submit_measurement(m, p, a.lease_id, a.body, a.key),
    "acknowledge": lambda m, p, a: usage.acknowledge(m, p, a.record_id, a.body, a.key),
    "dispute": lambda m, p, a: disputes.dispute(m, p, a.record_id, a.body, a.key),
    "contest": lambda m, p, a: disputes.contest(m, p, a.record_id, a.body, a.key),
    "disputes": lambda m, p, a: disputes.open_disputes(m, p),
    "withdraw_dispute": lambda m, p, a: disputes.withdraw_dispute(m, p, a.dispute_id, a.key),
    "report_availability": lambda m, p, a: availability.report_availability(m, p, a.lease_id, a.body, a.key),
    "submit_probes": lambda m, p, a: availability.submit_probes(m, p, a.lease_id, a.body, a.key),
    "give_notice": lambda m, p, a: availability.give_notice(m, p, a.lease_id, a.body, a.key),
    "publish_endpoint": lambda m, p, a: availability.publish_endpoint(m, p, a.lease_id, a.body, a.key),
    "lease_periods": lambda m, p, a: availability.lease_periods(m, p, a.lease_id),
    "request_rollout": lambda m, p, a: rollouts.request_rollout(m, p, a.lease_id, a.body, a.key),
    "rollouts": lambda m, p, a: rollouts.list_rollouts(m, p, a.lease_id),
    "report_rollout": lambda m, p, a: rollouts.report_rollout(m, p, a.lease_id, a.rollout_id, a.body, a.key),
    "withdraw_rollout": lambda m, p, a: rollouts.withdraw_rollout(m, p, a.lease_id, a.rollout_id, a.key),
    "pending_accounts": lambda m, p, a: identity.pending_accounts(m),
    "decide": lambda m, p, a: identity.decide(m, p.actor, a.account, a.body.approve, a.body.reason),
    "decide_held_earnings": lambda m, p, a: revocation.decide_held(m, p, a.lease_id, a.body, a.key),
    "credit": lambda m, p, a: funds.credit(m, p, a.body, a.key),
    "resolve_dispute": lambda m, p, a: disputes.resolve(m, p, a.dispute_id, a.body, a.key),
    "set_fee": lambda m, p, a: {"fee_bps": m.set_fee(a.body.fee_bps, p.actor, principal=p)["fee_bps"]},
    "advance_clock": lambda m, p, a: {"now": m.advance_clock(a.body.seconds, p.actor, principal=p)},
    "sweep": lambda m, p, a: deadlines.sweep(m, p),
    "audit": lambda m, p, a: invariants.audit_market(m, p),
}

ERROR_TEXT = {
    401: "no valid credentials", 403: "the caller may not do this", 404: "no such thing (or not the caller's)",
    409: "conflicts with the current state (or a reused idempotency key)", 413: "request body too large",
    422: "the request is malformed (a body that is not strict UTF-8 JSON: unparseable, a key twice, NaN) "
         "or names impossible values", 503: "the store stayed busy; retry with the same key",
}  # fmt: skip


def _reject_non_finite(text: str) -> None:
    raise ValueError(f"{text} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} is too large for a number")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key[:40]!r} appears twice in one object")
        out[key] = value
    return out


def parse_body(raw: bytes) -> Any:
    """A request body as strict JSON, or BadRequest (422): UTF-8 only (no BOM, no other encoding),
    no object with a key twice, no NaN or Infinity, no number beyond a double's range. The one
    place request bodies are parsed (`BodyLimit` runs it on every non-empty body before any route
    or rail sees it); what it accepts parses to the same value in any JSON parser, so the market,
    a rail and their logs cannot read one signed body two ways. Signatures are still checked over
    `raw` itself."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_reject_non_finite, parse_float=_finite_float
        )
    except RecursionError:
        raise BadRequest("the JSON body nests too deeply") from None
    except ValueError as exc:
        raise BadRequest(f"the body is not strict JSON: {str(exc)[:200]}") from None


class BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes (by header, or while streaming;
    `route_limits` gives the paths a pattern matches whole their own limit), and bodies that are not strict JSON
    (`parse_body`), with 422 in the error envelope."""

    def __init__(self, app, limit: int, route_limits: dict[str, int] | None = None,  # type: ignore[no-untyped-def]
                 form_prefixes: tuple[str, ...] = ()):
        self.app, self.default_limit, self.route_limits = app, limit, route_limits or {}
        self.form_prefixes = form_prefixes  # HTML forms (the console): limited in size, parsed by their own app

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit = next((n for pattern, n in self.route_limits.items() if re.fullmatch(pattern, path)), self.default_limit)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _error(send, PayloadTooLarge(f"request body exceeds {limit} bytes"))
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > limit:
                return await _error(send, PayloadTooLarge(f"request body exceeds {limit} bytes"))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body and not scope.get("path", "").startswith(self.form_prefixes):
            try:
                parse_body(body)
            except BadRequest as exc:
                return await _error(send, exc)
        replayed = False

        async def replay():  # type: ignore[no-untyped-def]
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _error(send, exc: MarketError) -> None:  # type: ignore[no-untyped-def]
    response = JSONResponse(exc.to_json(), status_code=exc.status)
    await response({"type": "http"}, None, send)


def create_app(market: Market, max_body_bytes: int = DEFAULT_MAX_BODY, threads: int = 64) -> FastAPI:
    """The FastAPI application serving `market`. Endpoints are synchronous (the store is) and run
    in AnyIO's thread pool, raised to `threads` so that many clients are served at once."""
    missing = {op.name for op in OPERATIONS} ^ set(HANDLERS)
    assert not missing, f"operations and handlers disagree: {sorted(missing)}"

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    app = FastAPI(
        lifespan=lifespan,
        title="runyard market",
        version="1",
        description=(
            "Verified identities, listings, escrow-backed demands, leases, signed usage, settlement. "
            "The protocol (signed payloads, canonical JSON, idempotency, errors, state machines) is "
            "described in docs/market-protocol.md."
        ),
    )
    # A demand may carry its job's files (runyard.market.jobs): that one route takes larger bodies.
    app.add_middleware(BodyLimit, limit=max_body_bytes,
                       route_limits={pattern: max(max_body_bytes, MAX_DEMAND_BODY_BYTES)
                                     for pattern in (r"/v1/demands", r"/v1/leases/\d+/rollouts")},
                       form_prefixes=(CONSOLE_PREFIX + "/",))

    @app.exception_handler(MarketError)
    async def _market_error(_: Request, exc: MarketError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"where": ".".join(str(p) for p in e["loc"]), "problem": e["msg"], "got": _short(e.get("input"))}
            for e in exc.errors()
        ]
        message = "; ".join(f"{p['where']}: {p['problem']}" for p in problems)
        return JSONResponse(
            {"error": "invalid_request", "message": message, "detail": {"problems": problems}}, 422
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"error": "internal", "message": "internal error; nothing was applied"}, 500)

    bearer = HTTPBearer(auto_error=False, description="the API token `register` returned (ryk_...)")
    rail_signature = APIKeyHeader(
        name=SIGNATURE_HEADER, auto_error=False, description="t=<unix seconds>,v1=<hex HMAC-SHA256>"
    )

    def who(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        return identity.authenticate(market, credentials.credentials if credentials else None)

    def operator(principal: Annotated[Principal, Depends(who)]) -> Principal:
        principal.require_role("operator")
        # An early, clear refusal; operations that change state check again inside their transaction.
        market.read(lambda conn, now: principal.require_verified("act as operator", conn, lock=False))
        return principal

    async def rail_checked(
        rail: Annotated[str, Path(min_length=1, max_length=32)],
        request: Request,
        _: Annotated[str | None, Depends(rail_signature)],
    ) -> str:
        adapter = market.rails.get(rail)
        if adapter is None:
            raise NotFound(f"no payment rail {rail!r} here")
        adapter.verify(await request.body(), request.headers)
        return rail

    dependencies = {"account": who, "operator": operator, "rail": rail_checked}
    for op in OPERATIONS:
        _add_route(app, market, op, HANDLERS[op.name], dependencies)
    # The web console: the same handlers, the same operator check (docs/console.md).
    app.mount(CONSOLE_PREFIX, create_console(market, HANDLERS, operator, CONSOLE_PREFIX))
    return app


def _add_route(app: FastAPI, market: Market, op: Operation, handler: Handler, dependencies: dict) -> None:
    kw = inspect.Parameter.KEYWORD_ONLY
    params = []
    for name in op.path_params:
        if name.endswith("_id"):
            annotation: Any = Annotated[int, Path(ge=1, le=MAX_ID)]
        else:
            annotation = Annotated[str, Path(min_length=1, max_length=100)]
        params.append(inspect.Parameter(name, kw, annotation=annotation))
    for name, q in op.query.items():
        annotation = Annotated[q.annotation, Query(description=q.description)]
        params.append(inspect.Parameter(name, kw, annotation=annotation, default=q.default))
    if op.body is not None:
        params.append(inspect.Parameter("body", kw, annotation=Annotated[op.body, Body()]))
    if op.auth != "none":
        depends = Depends(dependencies[op.auth])
        params.append(inspect.Parameter("auth", kw, annotation=Annotated[Any, depends]))
    if op.key is not None:
        header = Header(
            alias="Idempotency-Key", min_length=1, max_length=200,
            description="any unique string; a retry with the same key and body returns the first answer",
        )  # fmt: skip
        if op.key == "required":
            params.append(inspect.Parameter("idempotency_key", kw, annotation=Annotated[str, header]))
        else:
            params.append(
                inspect.Parameter(
                    "idempotency_key", kw, annotation=Annotated[str | None, header], default=None
                )
            )

    def endpoint(**values: Any) -> Any:
        auth = values.pop("auth", None)
        principal = auth if isinstance(auth, Principal) else None
        key = values.pop("idempotency_key", None)
        return handler(market, principal, SimpleNamespace(key=key, **values))

    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = op.name
    app.add_api_route(
        op.path, endpoint, methods=[op.method], status_code=op.status, operation_id=op.name,
        summary=op.summary, tags=[op.tag], response_model=op.response, response_model_exclude_unset=True,
        responses={code: {"model": ErrorOut, "description": ERROR_TEXT[code]} for code in op.errors},
    )  # fmt: skip


def _short(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    text = repr(value)
    return (
        value if len(text) <= 200 and isinstance(value, int | str | float | bool | type(None)) else text[:200]
    )
