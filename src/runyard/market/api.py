"""The market's HTTP API (FastAPI; the OpenAPI document is at /openapi.json).

Authentication is a bearer token (`Authorization: Bearer ryk_...`), looked up by its hash.
Authorisation is by role and ownership inside each operation: a tenant never sees another tenant's
demands, leases or statement (they answer 404, as if they did not exist), a provider sees only its
own listings and leases, and /v1/admin/* is for operators. Every money-moving request needs an
`Idempotency-Key` header. Errors are JSON: {"error": code, "message": text, "detail": {...}}; a 4xx
changed nothing. Bodies above `max_body_bytes` are refused with 413 before they are read in full.

(No `from __future__ import annotations` here: FastAPI resolves the endpoints' annotations, which
name dependencies defined inside `create_app`.)
"""

import logging
from contextlib import asynccontextmanager
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from runyard.market import funds, identity, invariants, leases, orders, settlement, statements, usage
from runyard.market.errors import MarketError, PayloadTooLarge
from runyard.market.jobs import MAX_DEMAND_BODY_BYTES
from runyard.market.models import (
    AcceptIn,
    AckIn,
    AmountIn,
    ClockIn,
    ContestIn,
    DecisionIn,
    DemandIn,
    DisputeIn,
    EndIn,
    FeeIn,
    ListingIn,
    MeasurementIn,
    RegisterIn,
    ResolveIn,
    UsageIn,
    VerifyRequestIn,
)
from runyard.market.service import Market, Principal

log = logging.getLogger("runyard.market.api")
DEFAULT_MAX_BODY = 64 * 1024


class BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes (by header, or while streaming);
    `route_limits` gives some paths their own limit."""

    def __init__(self, app, limit: int, route_limits: dict[str, int] | None = None):  # type: ignore[no-untyped-def]
        self.app, self.default_limit, self.route_limits = app, limit, route_limits or {}

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.route_limits.get(scope.get("path", ""), self.default_limit)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _too_large(limit, send)
        seen = 0

        async def limited_receive():  # type: ignore[no-untyped-def]
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except PayloadTooLarge:
            await _too_large(limit, send)


async def _too_large(limit: int, send) -> None:  # type: ignore[no-untyped-def]
    response = JSONResponse(PayloadTooLarge(f"request body exceeds {limit} bytes").to_json(), status_code=413)
    await response({"type": "http"}, None, send)


def create_app(market: Market, max_body_bytes: int = DEFAULT_MAX_BODY, threads: int = 64) -> FastAPI:
    """The FastAPI application serving `market`. Endpoints are synchronous (the store is) and run
    in AnyIO's thread pool, raised to `threads` so that many clients are served at once."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    app = FastAPI(
        lifespan=lifespan,
        title="runyard market",
        version="1",
        description="Verified identities, listings, escrow-backed demands, leases, signed usage, settlement.",
    )
    # A demand may carry its job's files (runyard.market.jobs): that one route takes larger bodies.
    app.add_middleware(BodyLimit, limit=max_body_bytes,
                       route_limits={"/v1/demands": max(max_body_bytes, MAX_DEMAND_BODY_BYTES)})

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

    def who(authorization: Annotated[str | None, Header()] = None) -> Principal:
        token = None
        if authorization and authorization.lower().startswith("bearer "):
            token = authorization[7:].strip()
        return identity.authenticate(market, token)

    def operator(principal: Annotated[Principal, Depends(who)]) -> Principal:
        principal.require_role("operator")
        return principal

    Who = Annotated[Principal, Depends(who)]
    Operator = Annotated[Principal, Depends(operator)]
    Key = Annotated[str | None, Header(alias="Idempotency-Key")]

    # -- market and identity -----------------------------------------------------------------------

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/market")
    def market_info() -> dict:
        config = market.read(lambda conn, now: {**Market.config(conn), "now": now})
        config.pop("id")
        return config

    @app.post("/v1/accounts", status_code=201)
    def register(body: RegisterIn) -> dict:
        return identity.register(market, body.name, body.role, body.public_key)

    @app.get("/v1/accounts/me")
    def me(p: Who) -> dict:
        return identity.status(market, p)

    @app.post("/v1/accounts/me/verification")
    def request_verification(body: VerifyRequestIn, p: Who) -> dict:
        return identity.request_verification(market, p, body.evidence)

    # -- money -------------------------------------------------------------------------------------

    @app.post("/v1/funds/deposit")
    def deposit(body: AmountIn, p: Who, key: Key = None) -> dict:
        return funds.deposit(market, p, body.amount, key)

    @app.post("/v1/funds/withdraw")
    def withdraw(body: AmountIn, p: Who, key: Key = None) -> dict:
        return funds.withdraw(market, p, body.amount, key)

    @app.get("/v1/funds/balances")
    def balances(p: Who) -> dict:
        return funds.balances(market, p)

    @app.get("/v1/statement")
    def statement(p: Who) -> dict:
        return statements.statement(market, p)

    # -- listings and demands ----------------------------------------------------------------------

    @app.post("/v1/listings", status_code=201)
    def create_listing(body: ListingIn, p: Who, key: Key = None) -> dict:
        return orders.create_listing(market, p, body, key)

    @app.get("/v1/listings")
    def list_listings(p: Who, mine: bool = False) -> list[dict]:
        return orders.list_listings(market, p, mine)

    @app.post("/v1/listings/{listing_id}/withdraw")
    def withdraw_listing(listing_id: int, p: Who) -> dict:
        return orders.withdraw_listing(market, p, listing_id)

    @app.post("/v1/demands", status_code=201)
    def place_demand(body: DemandIn, p: Who, key: Key = None) -> dict:
        return orders.place_demand(market, p, body, key)

    @app.get("/v1/demands")
    def list_demands(p: Who) -> list[dict]:
        return orders.list_demands(market, p)

    @app.get("/v1/demands/{demand_id}")
    def get_demand(demand_id: int, p: Who) -> dict:
        return orders.get_demand(market, p, demand_id)

    @app.post("/v1/demands/{demand_id}/cancel")
    def cancel_demand(demand_id: int, p: Who, key: Key = None) -> dict:
        return orders.cancel_demand(market, p, demand_id, key)

    # -- leases ------------------------------------------------------------------------------------

    @app.get("/v1/leases")
    def list_leases(p: Who, state: str | None = None) -> list[dict]:
        return leases.list_leases(market, p, state)

    @app.get("/v1/leases/{lease_id}")
    def get_lease(lease_id: int, p: Who) -> dict:
        return leases.get_lease(market, p, lease_id)

    @app.post("/v1/leases/{lease_id}/accept")
    def accept(lease_id: int, body: AcceptIn, p: Who, key: Key = None) -> dict:
        return leases.accept(market, p, lease_id, body, key)

    @app.post("/v1/leases/{lease_id}/reject")
    def reject(lease_id: int, body: EndIn, p: Who, key: Key = None) -> dict:
        return leases.reject(market, p, lease_id, body, key)

    @app.post("/v1/leases/{lease_id}/start")
    def start(lease_id: int, p: Who, key: Key = None) -> dict:
        return leases.start(market, p, lease_id, key)

    @app.post("/v1/leases/{lease_id}/close")
    def close(lease_id: int, p: Who, key: Key = None) -> dict:
        return leases.close_window(market, p, lease_id, key)

    @app.post("/v1/leases/{lease_id}/terminate")
    def terminate(lease_id: int, body: EndIn, p: Who, key: Key = None) -> dict:
        return leases.terminate(market, p, lease_id, body, key)

    @app.post("/v1/leases/{lease_id}/cancel")
    def cancel(lease_id: int, body: EndIn, p: Who, key: Key = None) -> dict:
        return leases.cancel(market, p, lease_id, body, key)

    @app.post("/v1/leases/{lease_id}/settle")
    def settle(lease_id: int, p: Who, key: Key = None) -> dict:
        return settlement.settle(market, p, lease_id, key)

    # -- usage and disputes ------------------------------------------------------------------------

    @app.post("/v1/leases/{lease_id}/usage", status_code=201)
    def report_usage(lease_id: int, body: UsageIn, p: Who, key: Key = None) -> dict:
        return usage.report(market, p, lease_id, body, key)

    @app.get("/v1/leases/{lease_id}/usage")
    def lease_usage(lease_id: int, p: Who) -> dict:
        return usage.lease_usage(market, p, lease_id)

    @app.post("/v1/leases/{lease_id}/measurements", status_code=201)
    def measure(lease_id: int, body: MeasurementIn, p: Who, key: Key = None) -> dict:
        return usage.submit_measurement(market, p, lease_id, body, key)

    @app.post("/v1/usage/{record_id}/ack")
    def ack(record_id: int, body: AckIn, p: Who, key: Key = None) -> dict:
        return usage.acknowledge(market, p, record_id, body, key)

    @app.post("/v1/usage/{record_id}/dispute", status_code=201)
    def dispute(record_id: int, body: DisputeIn, p: Who, key: Key = None) -> dict:
        return usage.dispute(market, p, record_id, body, key)

    @app.post("/v1/usage/{record_id}/contest", status_code=201)
    def contest(record_id: int, body: ContestIn, p: Who, key: Key = None) -> dict:
        return usage.contest(market, p, record_id, body, key)

    @app.get("/v1/disputes")
    def list_disputes(p: Who) -> list[dict]:
        return usage.open_disputes(market, p)

    @app.post("/v1/disputes/{dispute_id}/withdraw")
    def withdraw_dispute(dispute_id: int, p: Who, key: Key = None) -> dict:
        return usage.withdraw_dispute(market, p, dispute_id, key)

    # -- operator ----------------------------------------------------------------------------------

    @app.get("/v1/admin/accounts/pending")
    def pending(p: Operator) -> list[dict]:
        return identity.pending_accounts(market)

    @app.post("/v1/admin/accounts/{account}/decision")
    def decide(account: str, body: DecisionIn, p: Operator) -> dict:
        return identity.decide(market, p.actor, account, body.approve, body.reason)

    @app.post("/v1/admin/disputes/{dispute_id}/resolve")
    def resolve(dispute_id: int, body: ResolveIn, p: Operator, key: Key = None) -> dict:
        return usage.resolve(market, p, dispute_id, body, key)

    @app.post("/v1/admin/fee")
    def set_fee(body: FeeIn, p: Operator) -> dict:
        config = market.set_fee(body.fee_bps, p.actor)
        return {"fee_bps": config["fee_bps"]}

    @app.post("/v1/admin/clock")
    def advance_clock(body: ClockIn, p: Operator) -> dict:
        return {"now": market.advance_clock(body.seconds, p.actor)}

    @app.post("/v1/admin/sweep")
    def sweep(p: Operator) -> dict:
        return leases.sweep(market)

    @app.get("/v1/admin/audit")
    def audit(p: Operator) -> dict:
        return invariants.audit_market(market)

    return app


def _short(value: object) -> object:
    text = repr(value)
    return (
        value if len(text) <= 200 and isinstance(value, int | str | float | bool | type(None)) else text[:200]
    )
