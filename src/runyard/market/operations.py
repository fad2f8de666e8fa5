"""Every operation of the market's HTTP API, defined once.

An `Operation` names the route (method and path), who may call it, whether it needs an
`Idempotency-Key`, its request body and query parameters (pydantic models), its response model
and its place on the command line. From this table:

  - `api.create_app` builds the FastAPI routes (and so the OpenAPI document),
  - `client.MarketClient` gets one method per operation, named after it,
  - `runyard market ...` (cli/market_trade.py) gets one verb per operation that names `cli`, and
    `runyard market admin ...` (cli/market_admin.py) one store-side verb per operation that names
    `admin` (run in-process as the operator at the console).

The implementation of each operation (what it does to the store) is bound to its name in
`api.HANDLERS`; a test checks that every operation has exactly one. This module imports no
database code, so the client stays light.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from runyard.market import models as m
from runyard.market import responses as r
from runyard.market import serving as sv
from runyard.market import standing as st

Auth = Literal["none", "account", "operator", "rail"]


@dataclass(frozen=True)
class Query:
    """A query parameter: its type, default and what it means."""

    annotation: Any
    default: Any
    description: str


@dataclass(frozen=True)
class Operation:
    name: str  # operationId, and the client method's name
    method: str
    path: str
    summary: str
    tag: str
    response: Any
    auth: Auth = "account"
    body: type[BaseModel] | None = None
    query: dict[str, Query] = field(default_factory=dict)
    # "required": the call moves money or state and is applied once per key; "optional": may be sent.
    key: Literal["required", "optional"] | None = None
    status: int = 200
    # The CLI verb (words after `runyard market`), or None when the operation has no verb.
    cli: tuple[str, ...] | None = None
    # The operator's store-side verb (words after `runyard market admin`), for operator operations.
    admin: str | None = None
    # Defaults the client and CLI give body fields the API requires (e.g. a rejection's reason).
    client_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.path)

    @property
    def errors(self) -> tuple[int, ...]:
        """The error statuses this operation can answer (each with the error envelope). 413 and 422
        for every operation: the body limit and the strict-JSON parse run on any request that sends
        a body, before routing, whether or not the operation reads one."""
        codes = {413, 422, 503}
        if self.auth in ("account", "operator"):
            codes |= {401, 403}
        if self.auth == "rail":
            codes |= {401, 404}
        if self.path_params or self.method == "POST":
            codes |= {404, 409}
        return tuple(sorted(codes))


def _op(*args: Any, **kwargs: Any) -> Operation:
    return Operation(*args, **kwargs)


OPERATIONS: tuple[Operation, ...] = (
    # -- market and identity ----------------------------------------------------------------------
    _op("healthz", "GET", "/healthz", "Liveness check", "market", r.Health, auth="none"),
    _op("market_info", "GET", "/v1/market", "Currency, fee rate, windows, limits and the market's clock",
        "market", r.MarketInfo, auth="none", cli=("info",)),
    _op("register", "POST", "/v1/accounts", "Register a tenant or provider (the token is shown once)",
        "accounts", r.Registered, auth="none", body=m.RegisterIn, status=201, cli=("register",)),
    _op("me", "GET", "/v1/accounts/me", "The calling account and its verification state", "accounts",
        r.AccountOut, cli=("verify-status",)),
    _op("request_verification", "POST", "/v1/accounts/me/verification", "Ask to be verified",
        "accounts", r.VerificationOut, body=m.VerifyRequestIn, cli=("verify-request",)),
    # -- money -------------------------------------------------------------------------------------
    _op("withdraw", "POST", "/v1/funds/withdraw", "Pay out to a registered payout method", "funds",
        r.MoneyMoved, body=m.WithdrawIn, key="required", cli=("withdraw",)),
    _op("add_payout_method", "POST", "/v1/funds/payout-methods", "Register where withdrawals go",
        "funds", r.PayoutMethodOut, body=m.PayoutMethodIn, key="required", status=201,
        cli=("payout-method", "add")),
    _op("payout_methods", "GET", "/v1/funds/payout-methods", "The caller's payout methods", "funds",
        list[r.PayoutMethodOut], cli=("payout-method", "list")),
    _op("balances", "GET", "/v1/funds/balances", "Every ledger account the caller owns", "funds",
        r.Balances, cli=("balances",)),
    _op("statement", "GET", "/v1/statement", "Balances, ledger entries, per-lease lines, totals",
        "funds", r.Statement, cli=("statement",)),
    _op("model_costs", "GET", "/v1/model-costs",
        "Per model: what training and serving leases have cost (settled, minor units)", "funds",
        r.ModelCosts, cli=("model-costs",)),
    _op("rail_webhook", "POST", "/v1/rails/{rail}/events", "A payment rail's signed event (deposits)",
        "funds", r.RailEventOut, auth="rail", body=m.RailEventIn),
    # -- listings and demands ----------------------------------------------------------------------
    _op("create_listing", "POST", "/v1/listings", "Offer capacity (verified providers)", "listings",
        r.ListingOut, body=m.ListingIn, key="optional", status=201, cli=("list",)),
    _op("listings", "GET", "/v1/listings", "Open listings (providers: their own)", "listings",
        list[r.ListingOut], query={"mine": Query(bool, False, "only the caller's own listings")},
        cli=("listings",)),
    _op("withdraw_listing", "POST", "/v1/listings/{listing_id}/withdraw", "Take a listing off the market",
        "listings", r.ListingOut, cli=("listing", "withdraw")),
    _op("place_demand", "POST", "/v1/demands", "Place a demand with its escrow (verified tenants)",
        "demands", r.DemandOut, body=m.DemandIn, key="required", status=201, cli=("demand",)),
    _op("demands", "GET", "/v1/demands", "The caller's demands (operators: all)", "demands",
        list[r.DemandOut], cli=("demands",)),
    _op("demand", "GET", "/v1/demands/{demand_id}", "One demand", "demands", r.DemandOut,
        cli=("demand-show",)),
    _op("cancel_demand", "POST", "/v1/demands/{demand_id}/cancel", "Cancel an open demand (escrow back)",
        "demands", r.DemandOut, key="required", cli=("demand-cancel",)),
    # -- leases ------------------------------------------------------------------------------------
    _op("leases", "GET", "/v1/leases", "The caller's leases (operators: all)", "leases", list[r.LeaseOut],
        query={"state": Query(m.LeaseStateName | None, None, "only leases in this state")},
        cli=("leases",)),
    _op("lease", "GET", "/v1/leases/{lease_id}", "One lease with the terms a provider signs", "leases",
        r.LeaseWithTerms, cli=("lease", "show")),
    _op("accept_lease", "POST", "/v1/leases/{lease_id}/accept", "Accept by signing the lease terms",
        "leases", r.LeaseOut, body=m.AcceptIn, key="required", cli=("lease", "accept")),
    _op("reject_lease", "POST", "/v1/leases/{lease_id}/reject", "Decline an offered lease", "leases",
        r.LeaseOut, body=m.EndIn, key="required", cli=("lease", "reject"),
        client_defaults={"reason_code": "capacity_unavailable"}),
    _op("start_lease", "POST", "/v1/leases/{lease_id}/start", "Start an accepted lease's window",
        "leases", r.LeaseOut, key="required", cli=("lease", "start")),
    _op("close_lease", "POST", "/v1/leases/{lease_id}/close", "Mark an ended window as closed",
        "leases", r.LeaseOut, key="required", cli=("lease", "close")),
    _op("terminate_lease", "POST", "/v1/leases/{lease_id}/terminate", "End a running lease early",
        "leases", r.LeaseOut, body=m.EndIn, key="required", cli=("lease", "terminate")),
    _op("cancel_lease", "POST", "/v1/leases/{lease_id}/cancel", "Cancel a lease that has not started",
        "leases", r.LeaseOut, body=m.EndIn, key="required", cli=("lease", "cancel"),
        client_defaults={"reason_code": "tenant_request"}),
    _op("settle", "POST", "/v1/leases/{lease_id}/settle", "Bring a lease's payments up to date",
        "leases", r.SettlementOut, key="required", cli=("lease", "settle")),
    # -- usage and disputes ------------------------------------------------------------------------
    _op("report_usage", "POST", "/v1/leases/{lease_id}/usage", "Report one signed usage record",
        "usage", r.RecordOut, body=m.UsageIn, key="required", status=201, cli=("usage", "report")),
    _op("usage", "GET", "/v1/leases/{lease_id}/usage", "Records, measurements and disputes of a lease",
        "usage", r.LeaseUsage, cli=("usage", "show")),
    _op("submit_measurement", "POST", "/v1/leases/{lease_id}/measurements",
        "The tenant's signed view of an interval", "usage", r.MeasurementOut, body=m.MeasurementIn,
        key="required", status=201, cli=("usage", "measure")),
    _op("acknowledge", "POST", "/v1/usage/{record_id}/ack", "Accept a record in full or in part",
        "usage", r.RecordOut, body=m.AckIn, key="required", cli=("usage", "ack")),
    _op("dispute", "POST", "/v1/usage/{record_id}/dispute", "Dispute a record (tenant)", "usage",
        r.DisputeOut, body=m.DisputeIn, key="required", status=201, cli=("dispute", "open")),
    _op("contest", "POST", "/v1/usage/{record_id}/contest", "Contest a partial acknowledgement (provider)",
        "usage", r.DisputeOut, body=m.ContestIn, key="required", status=201, cli=("dispute", "contest")),
    _op("disputes", "GET", "/v1/disputes", "Open disputes on the caller's leases", "usage",
        list[r.DisputeOut], cli=("disputes",)),
    _op("withdraw_dispute", "POST", "/v1/disputes/{dispute_id}/withdraw", "Withdraw one's own dispute",
        "usage", r.DisputeOut, key="required", cli=("dispute", "withdraw")),
    # -- standing leases: availability, probes, notice, endpoint, periods -----------------------------
    _op("report_availability", "POST", "/v1/leases/{lease_id}/availability",
        "Report one signed availability record (standing lease)", "availability", r.RecordOut,
        body=st.AvailabilityIn, key="required", status=201, cli=("availability", "report")),
    _op("submit_probes", "POST", "/v1/leases/{lease_id}/probes", "The tenant's signed probe results of an interval",
        "availability", r.MeasurementOut, body=st.ProbesIn, key="required", status=201,
        cli=("availability", "probes")),
    _op("give_notice", "POST", "/v1/leases/{lease_id}/notice", "End a standing lease at a period's close",
        "availability", r.LeaseOut, body=st.NoticeIn, key="required", cli=("lease", "notice")),
    _op("publish_endpoint", "POST", "/v1/leases/{lease_id}/endpoint", "Say where the tenant reaches its deployment",
        "availability", r.LeaseOut, body=st.EndpointIn, key="required", cli=("lease", "endpoint")),
    _op("lease_periods", "GET", "/v1/leases/{lease_id}/periods", "A standing lease's billing periods",
        "availability", list[r.PeriodOut], cli=("lease", "periods")),
    # -- standing leases: roll-outs ----------------------------------------------------------------
    _op("request_rollout", "POST", "/v1/leases/{lease_id}/rollouts",
        "Serve another export on a running standing lease, or roll back to the one before (tenant)",
        "rollouts", r.RolloutOut, body=sv.RolloutIn, key="required", status=201, cli=("deployment", "rollout")),
    _op("rollouts", "GET", "/v1/leases/{lease_id}/rollouts", "A standing lease's roll-outs, oldest first",
        "rollouts", list[r.RolloutOut], cli=("deployment", "rollouts")),
    _op("report_rollout", "POST", "/v1/leases/{lease_id}/rollouts/{rollout_id}/outcome",
        "How a roll-out ended on the provider's machine (provider)", "rollouts", r.RolloutOut,
        body=sv.RolloutOutcomeIn, key="required"),
    _op("withdraw_rollout", "POST", "/v1/leases/{lease_id}/rollouts/{rollout_id}/withdraw",
        "Take back a roll-out the provider has not taken up (tenant)", "rollouts", r.RolloutOut, key="required",
        cli=("deployment", "withdraw")),
    # -- operator ----------------------------------------------------------------------------------
    _op("pending_accounts", "GET", "/v1/admin/accounts/pending", "Accounts waiting for verification",
        "admin", list[r.PendingAccount], auth="operator", admin="pending"),
    _op("decide", "POST", "/v1/admin/accounts/{account}/decision", "Verify, reject or revoke an account",
        "admin", r.AccountOut, auth="operator", admin="verify", body=m.DecisionIn),
    _op("decide_held_earnings", "POST", "/v1/admin/leases/{lease_id}/held-earnings",
        "Release or refund a settled lease's earnings held since its provider was revoked", "admin",
        r.HeldEarningsOut, auth="operator", admin="held", body=m.HeldDecisionIn, key="required"),
    _op("credit", "POST", "/v1/admin/credit", "Credit an account (an operator's deposit)", "admin",
        r.MoneyMoved, auth="operator", admin="credit", body=m.CreditIn, key="required"),
    _op("resolve_dispute", "POST", "/v1/admin/disputes/{dispute_id}/resolve", "Resolve a dispute",
        "admin", r.DisputeOut, auth="operator", admin="resolve", body=m.ResolveIn, key="required"),
    _op("set_fee", "POST", "/v1/admin/fee", "Set the fee for new leases", "admin", r.FeeOut,
        auth="operator", admin="fee", body=m.FeeIn),
    _op("advance_clock", "POST", "/v1/admin/clock", "Move a test market's clock forward", "admin",
        r.ClockOut, auth="operator", body=m.ClockIn),
    _op("sweep", "POST", "/v1/admin/sweep", "Apply every due deadline and settlement now", "admin",
        r.SweepOut, auth="operator", admin="sweep"),
    _op("audit", "GET", "/v1/admin/audit", "Check every invariant of the store", "admin", r.AuditOut,
        auth="operator", admin="audit"),
)  # fmt: skip

BY_NAME = {op.name: op for op in OPERATIONS}
