"""The console's routes (a Starlette app that `api.create_app` mounts at /console).

Each page or form runs the API's handlers through `Console.call`: the operation's own authorisation
(an operator operation passes the API's operator check first), the handler the API binds to it, and
the operation's response model on the way out. A tenant asking for another tenant's lease gets the
API's 404, a provider on the tenant page a 403.

Signing in posts the account's API token once; the browser then holds only a random session id in an
HttpOnly, SameSite=Strict cookie (`system.web_sessions`), and every request authenticates the stored
token again, so a token the market no longer knows ends the session. Every POST carries the session's
CSRF token; forms that move money or state carry an idempotency key made when the form was rendered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from runyard.market import identity
from runyard.market.console import forms
from runyard.market.errors import Forbidden, MarketError, NotFound, Unauthenticated
from runyard.market.models import MAX_ID, RailEventIn
from runyard.market.operations import BY_NAME
from runyard.market.rails import TestRail
from runyard.market.service import Market, Principal
from runyard.system.web_pages import SECURITY_HEADERS, environment, parse_form
from runyard.system.web_sessions import COOKIE_NAME, Session, SessionStore, cookie_options, csrf_ok

PREFIX = "/console"
ROLE_PAGES = {"tenant": "/tenant", "provider": "/provider", "operator": "/operator"}


@cache
def _adapter(name: str) -> TypeAdapter:
    return TypeAdapter(BY_NAME[name].response)


class Console:
    """The market, the API's handlers and its operator check: what every page and form calls."""

    def __init__(self, market: Market, handlers: dict[str, Callable], operator_check: Callable[[Principal], Any]):
        self.market, self.handlers, self.operator_check = market, handlers, operator_check

    def call(self, principal: Principal | None, name: str, **args: Any) -> Any:
        """Operation `name` as the API runs it for `principal`, its result as the API would send it."""
        op = BY_NAME[name]
        if op.auth == "operator":
            self.operator_check(principal)
        args.setdefault("key", None)
        result = self.handlers[name](self.market, principal, SimpleNamespace(**args))
        adapter = _adapter(name)
        return adapter.dump_python(adapter.validate_python(result), mode="json", by_alias=True, exclude_unset=True)

    def test_rail(self) -> TestRail | None:
        """The test rail, where this is a test market (a test clock) that has one; else None. Funding
        through it mints money, so a real market (no test clock) never offers it, whatever its rails."""
        rail = self.market.rails.get("test")
        if not isinstance(rail, TestRail):
            return None
        return rail if self.call(None, "market_info")["test_clock"] else None

    def fund(self, principal: Principal, amount: int, key: str) -> dict:
        """A deposit through the test rail: a signed event, checked and applied by the rail webhook's own
        handler. Its event id comes from the form's idempotency key, so a resubmitted form applies once."""
        rail = self.test_rail()
        if rail is None:
            raise Forbidden("this market has no test rail (a test market's dev funding); ask an operator to credit")
        principal.require_role("tenant")
        currency = self.call(None, "market_info")["currency"]
        body, headers = rail.deposit_event(principal.id, amount, currency, event_id=f"evt_{key}")
        rail.verify(body, headers)
        return self.call(None, "rail_webhook", rail=rail.name, body=RailEventIn.model_validate_json(body))


@dataclass
class Ctx:
    """One request, signed in: what a page or action function gets."""

    console: Console
    principal: Principal
    form: dict[str, list[str]]

    def call(self, name: str, **args: Any) -> Any:
        return self.console.call(self.principal, name, **args)

    def require_role(self, role: str) -> None:
        self.principal.require_role(role)


# -- pages: each returns (template, values) ---------------------------------------------------------------


def _standing_periods(ctx: Ctx, leases: list[dict]) -> dict[int, list[dict]]:
    return {x["id"]: ctx.call("lease_periods", lease_id=x["id"]) for x in leases if x.get("form") == "standing"}


def tenant_page(ctx: Ctx) -> tuple[str, dict]:
    ctx.require_role("tenant")
    leases = ctx.call("leases", state=None)
    demands = ctx.call("demands")
    return "tenant.html", {
        "me": ctx.call("me"), "balances": ctx.call("balances"), "statement": ctx.call("statement"),
        "demands": demands, "leases": leases, "disputes": ctx.call("disputes"),
        "standing": [d for d in demands if d.get("form") == "standing"],
        "standing_leases": [x for x in leases if x.get("form") == "standing"],
        "periods": _standing_periods(ctx, leases), "test_rail": ctx.console.test_rail() is not None,
    }  # fmt: skip


def provider_page(ctx: Ctx) -> tuple[str, dict]:
    ctx.require_role("provider")
    leases = ctx.call("leases", state=None)
    return "provider.html", {
        "me": ctx.call("me"), "balances": ctx.call("balances"), "statement": ctx.call("statement"),
        "listings": ctx.call("listings", mine=True), "leases": leases, "disputes": ctx.call("disputes"),
        "standing_leases": [x for x in leases if x.get("form") == "standing"],
        "periods": _standing_periods(ctx, leases), "payout_methods": ctx.call("payout_methods"),
    }  # fmt: skip


def operator_page(ctx: Ctx) -> tuple[str, dict]:
    ctx.require_role("operator")
    return "operator.html", {
        "me": ctx.call("me"), "pending": ctx.call("pending_accounts"), "disputes": ctx.call("disputes"),
        "audit": ctx.call("audit"), "info": ctx.call("market_info"),
    }  # fmt: skip


def demand_page(ctx: Ctx, demand_id: int) -> tuple[str, dict]:
    return "demand.html", {"demand": ctx.call("demand", demand_id=demand_id)}


def lease_page(ctx: Ctx, lease_id: int) -> tuple[str, dict]:
    lease = ctx.call("lease", lease_id=lease_id)
    periods = ctx.call("lease_periods", lease_id=lease_id) if lease.get("form") == "standing" else []
    return "lease.html", {"lease": lease, "usage": ctx.call("usage", lease_id=lease_id), "periods": periods}


# -- actions: each does one operation and returns (where to go next, what to tell the user) -----------------


def place_demand(ctx: Ctx) -> tuple[str, str]:
    demand = ctx.call("place_demand", body=forms.demand(ctx.form), key=forms.key(ctx.form))
    return f"/demands/{demand['id']}", f"demand {demand['id']} placed: {demand['state']}"


def cancel_demand(ctx: Ctx, demand_id: int) -> tuple[str, str]:
    demand = ctx.call("cancel_demand", demand_id=demand_id, key=forms.key(ctx.form))
    return f"/demands/{demand_id}", f"demand {demand_id} {demand['state']}"


def fund(ctx: Ctx) -> tuple[str, str]:
    moved = ctx.console.fund(ctx.principal, forms.amount(ctx.form), forms.key(ctx.form))
    return "/tenant", f"deposit of {moved['amount']:,} received through the test rail"


def decide(ctx: Ctx, account: str) -> tuple[str, str]:
    out = ctx.call("decide", account=account, body=forms.decision(ctx.form))
    return "/operator", f"account {out['name']} is {out['state']}"


def resolve(ctx: Ctx, dispute_id: int) -> tuple[str, str]:
    out = ctx.call("resolve_dispute", dispute_id=dispute_id, body=forms.resolution(ctx.form), key=forms.key(ctx.form))
    return "/operator", f"dispute {dispute_id} resolved: {out['state']}"


def credit(ctx: Ctx) -> tuple[str, str]:
    out = ctx.call("credit", body=forms.credit(ctx.form), key=forms.key(ctx.form))
    return "/operator", f"credited {out['amount']:,} (transfer {out['transfer_id']})"


# -- the app ------------------------------------------------------------------------------------------------


def create_console(
    market: Market, handlers: dict[str, Callable], operator_check: Callable[[Principal], Any], prefix: str = PREFIX
) -> Starlette:
    """The console for `market`, to mount at `prefix`: `handlers` and `operator_check` are the API's own."""
    console = Console(market, handlers, operator_check)
    sessions = SessionStore()
    templates = environment("runyard.market.console")

    def html(request: Request, template: str, values: dict, session: Session | None, status: int = 200) -> Response:
        principal = values.get("principal")
        body = templates.get_template(template).render(
            prefix=prefix, csrf=session.csrf if session else "", principal=principal,
            notice=_pop_notice(session), **{k: v for k, v in values.items() if k != "principal"},
        )  # fmt: skip
        response = HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)
        if session is not None:
            response.set_cookie(value=session.id, **cookie_options(prefix, request.url.scheme == "https"))
        return response

    def redirect(request: Request, to: str, session: Session | None = None) -> Response:
        response = RedirectResponse(prefix + to, status_code=303, headers=SECURITY_HEADERS)
        if session is not None:
            response.set_cookie(value=session.id, **cookie_options(prefix, request.url.scheme == "https"))
        return response

    def error(request: Request, exc: MarketError, session: Session | None, principal: Principal | None = None):
        values = {"status": exc.status, "code": exc.code, "message": exc.message, "principal": principal}
        return html(request, "error.html", values, session, status=exc.status)

    async def signed_in(request: Request) -> tuple[Session | None, Principal | None]:
        session = sessions.get(request.cookies.get(COOKIE_NAME))
        if session is None or session.secret is None:
            return session, None
        try:
            return session, await run_in_threadpool(identity.authenticate, market, session.secret)
        except Unauthenticated:
            sessions.end(session.id)  # the token is no longer the market's: this session is over
            return None, None

    def page(fn: Callable[..., tuple[str, dict]]) -> Callable:
        async def endpoint(request: Request) -> Response:
            session, principal = await signed_in(request)
            if principal is None:
                return redirect(request, "/sign-in")
            try:
                _check_ids(request.path_params)
                template, values = await run_in_threadpool(
                    fn, Ctx(console, principal, {}), **request.path_params
                )
            except MarketError as exc:
                return error(request, exc, session, principal)
            return html(request, template, {**values, "principal": principal}, session)

        return endpoint

    def action(fn: Callable[..., tuple[str, str]]) -> Callable:
        async def endpoint(request: Request) -> Response:
            session, principal = await signed_in(request)
            try:
                form = parse_form(await request.body())
            except ValueError:
                return error(request, MarketError("the form is not UTF-8"), session, principal)
            if not csrf_ok(session, forms.first(form, "csrf")):
                return error(request, Forbidden("the form's CSRF token is missing or stale; reload the page"),
                             session, principal)  # fmt: skip
            if principal is None:
                return error(request, Unauthenticated("sign in first"), session)
            try:
                _check_ids(request.path_params)
                to, notice = await run_in_threadpool(fn, Ctx(console, principal, form), **request.path_params)
            except ValidationError as exc:
                return error(request, forms.invalid(exc), session, principal)
            except MarketError as exc:
                return error(request, exc, session, principal)
            session.notice = notice
            return redirect(request, to)

        return endpoint

    async def home(request: Request) -> Response:
        session, principal = await signed_in(request)
        if principal is None:
            return redirect(request, "/sign-in")
        return redirect(request, ROLE_PAGES.get(principal.role, "/sign-in"))

    async def sign_in_form(request: Request) -> Response:
        session = sessions.anonymous(request.cookies.get(COOKIE_NAME))
        return html(request, "sign_in.html", {}, session)

    async def sign_in(request: Request) -> Response:
        session = sessions.get(request.cookies.get(COOKIE_NAME))
        try:
            form = parse_form(await request.body())
        except ValueError:
            form = {}
        if not csrf_ok(session, forms.first(form, "csrf")):
            return error(request, Forbidden("the sign-in form's CSRF token is missing or stale; reload the page"),
                         session or sessions.anonymous(None))  # fmt: skip
        token = (forms.first(form, "token") or "").strip()
        try:
            principal = await run_in_threadpool(identity.authenticate, market, token)
        except Unauthenticated as exc:
            return error(request, exc, session)
        fresh = sessions.sign_in(session.id if session else None, token)
        return redirect(request, ROLE_PAGES.get(principal.role, "/sign-in"), fresh)

    async def sign_out(request: Request) -> Response:
        session = sessions.get(request.cookies.get(COOKIE_NAME))
        form = parse_form(await request.body())
        if not csrf_ok(session, forms.first(form, "csrf")):
            return error(request, Forbidden("the form's CSRF token is missing or stale; reload the page"), session)
        sessions.end(session.id if session else None)
        response = redirect(request, "/sign-in")
        response.delete_cookie(COOKIE_NAME, path=prefix)
        return response

    routes = [
        Route("/", home, methods=["GET"]),
        Route("/sign-in", sign_in_form, methods=["GET"]),
        Route("/sign-in", sign_in, methods=["POST"]),
        Route("/sign-out", sign_out, methods=["POST"]),
        Route("/tenant", page(tenant_page), methods=["GET"]),
        Route("/provider", page(provider_page), methods=["GET"]),
        Route("/operator", page(operator_page), methods=["GET"]),
        Route("/demands/{demand_id:int}", page(demand_page), methods=["GET"]),
        Route("/leases/{lease_id:int}", page(lease_page), methods=["GET"]),
        Route("/demands", action(place_demand), methods=["POST"]),
        Route("/demands/{demand_id:int}/cancel", action(cancel_demand), methods=["POST"]),
        Route("/fund", action(fund), methods=["POST"]),
        Route("/operator/accounts/{account}/decision", action(decide), methods=["POST"]),
        Route("/operator/disputes/{dispute_id:int}/resolve", action(resolve), methods=["POST"]),
        Route("/operator/credit", action(credit), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _check_ids(params: dict) -> None:
    """An id beyond what the store holds names nothing (the API's path parameters stop at MAX_ID too)."""
    for name, value in params.items():
        if isinstance(value, int) and not 1 <= value <= MAX_ID:
            raise NotFound(f"no {name.removesuffix('_id')} {value}")


def _pop_notice(session: Session | None) -> str | None:
    if session is None:
        return None
    notice, session.notice = session.notice, None
    return notice
