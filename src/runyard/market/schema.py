"""The market's tables (SQLAlchemy Core). Alembic migrations in `migrations/` create exactly this
schema; a test compares the two.

Conventions: times are integer Unix seconds (UTC), money is integer minor units of the market's one
currency, and every row that has a state names it in a `state` column changed only by
`runyard.market.states.transition`.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _money(name: str) -> Column:
    return Column(name, BigInteger, nullable=False, default=0)


# One row: the operator's settings. `clock_offset_s` only moves when `test_clock` is on.
market_config = Table(
    "market_config",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("currency", String(8), nullable=False),
    Column("fee_bps", Integer, nullable=False),
    Column("dispute_window_s", Integer, nullable=False),
    Column("accept_timeout_s", Integer, nullable=False),
    Column("start_timeout_s", Integer, nullable=False),
    Column("tolerance_bps", Integer, nullable=False),
    Column("test_clock", Boolean, nullable=False),
    Column("clock_offset_s", BigInteger, nullable=False),
    # Per-account limits: money in per rolling day, money out per rolling day, and the most a
    # tenant's available balance may hold.
    Column("deposit_limit_per_day", BigInteger, nullable=False),
    Column("withdrawal_limit_per_day", BigInteger, nullable=False),
    Column("balance_limit", BigInteger, nullable=False),
)

# Identities: tenants, providers and operators.
accounts = Table(
    "accounts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("role", String(16), nullable=False),
    Column("public_key", String(64), nullable=False),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("state", String(16), nullable=False),
    Column("evidence", Text, nullable=False, default=""),
    Column("created_at", BigInteger, nullable=False),
    # One account per key: a shared key would let one party sign as another.
    Index("uq_accounts_public_key", "public_key", unique=True),
)

ledger_accounts = Table(
    "ledger_accounts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("code", String(80), nullable=False, unique=True),
    Column("kind", String(32), nullable=False),
    Column("owner_id", Integer, ForeignKey("accounts.id"), nullable=True, index=True),
    # Accounts that hold someone's money must never go negative; the external world may.
    Column("no_negative", Boolean, nullable=False),
    _money("debits_pending"),
    _money("debits_posted"),
    _money("credits_pending"),
    _money("credits_posted"),
)

# Immutable rows. A 'pending' transfer reserves; exactly one later 'post' or 'void' row (unique
# pending_id) resolves it. 'single' transfers post at once.
transfers = Table(
    "transfers",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("kind", String(8), nullable=False),
    Column("debit_account_id", Integer, ForeignKey("ledger_accounts.id"), nullable=False, index=True),
    Column("credit_account_id", Integer, ForeignKey("ledger_accounts.id"), nullable=False, index=True),
    Column("amount", BigInteger, nullable=False),
    Column("pending_id", Integer, ForeignKey("transfers.id"), nullable=True, unique=True),
    Column("reason", String(32), nullable=False),
    Column("lease_id", Integer, nullable=True, index=True),
    Column("demand_id", Integer, nullable=True),
    Column("actor", String(64), nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

listings = Table(
    "listings",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("provider_id", Integer, ForeignKey("accounts.id"), nullable=False, index=True),
    Column("accelerator_kind", String(32), nullable=False),
    Column("devices_per_node", Integer, nullable=False),
    Column("node_count", Integer, nullable=False),
    Column("capacity", Integer, nullable=False),
    Column("reserved", Integer, nullable=False),
    Column("interconnect", String(16), nullable=False),
    Column("interconnect_gbps", Integer, nullable=False),
    Column("region", String(64), nullable=False),
    Column("jurisdiction", String(64), nullable=False),
    Column("price_per_device_hour", BigInteger, nullable=False),
    Column("available_from", BigInteger, nullable=False),
    Column("available_until", BigInteger, nullable=False),
    Column("start_class", String(16), nullable=False),
    Column("max_queue_s", Integer, nullable=False),
    Column("scheduler_kind", String(32), nullable=False),
    Column("state", String(16), nullable=False),
    Column("leases_expired", Integer, nullable=False, default=0),
    Column("leases_completed", Integer, nullable=False, default=0),
    Column("created_at", BigInteger, nullable=False),
    # Device memory per device (GiB, 0 when unstated): part of a standing listing's shape.
    Column("memory_gib", Integer, nullable=False, default=0),
    # "block" (devices for a window) or "standing" (a shape available continuously, billed per period);
    # the standing terms (runyard.market.standing) are null for a block listing. credit_rule and
    # reserved_terms are JSON lists.
    Column("form", String(16), nullable=False, default="block"),
    Column("period_s", BigInteger, nullable=True),
    Column("min_term_periods", Integer, nullable=True),
    Column("notice_s", BigInteger, nullable=True),
    Column("availability_bps", Integer, nullable=True),
    Column("credit_rule", Text, nullable=True),
    Column("reserved_terms", Text, nullable=True),
    Index("ix_listings_match", "state", "accelerator_kind", "price_per_device_hour"),
)

demands = Table(
    "demands",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("tenant_id", Integer, ForeignKey("accounts.id"), nullable=False, index=True),
    Column("requirement", Text, nullable=False),
    # ",kind1,kind2," so that matching can filter open demands by a listing's kind in SQL.
    Column("kinds", String(400), nullable=False),
    Column("device_count", Integer, nullable=False),
    Column("duration_s", BigInteger, nullable=False),
    Column("max_price_per_device_hour", BigInteger, nullable=False),
    Column("latest_start", BigInteger, nullable=True),
    # Set in the transaction that creates the demand, once its id names the escrow account.
    Column("escrow_account_id", Integer, ForeignKey("ledger_accounts.id"), nullable=True),
    Column("escrow_pending_id", Integer, ForeignKey("transfers.id"), nullable=True),
    Column("escrow_amount", BigInteger, nullable=False),
    Column("state", String(16), nullable=False),
    Column("lease_id", Integer, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    # The job the tenant wants run (runyard.market.jobs); null for a demand that carries none.
    Column("job_spec", Text, nullable=True),
    Column("job_results_to", String(1000), nullable=True),
    # JSON {"files": {path: base64}, "data_urls": [...], "env_lock": {...}}; null when the job carries none.
    Column("job_inputs", Text, nullable=True),
    Column("form", String(16), nullable=False, default="block"),
    # A standing demand's period and term (JSON, runyard.market.standing.StandingDemandIn) and the
    # deployment it carries (JSON, runyard.market.serving); null for a block demand.
    Column("standing", Text, nullable=True),
    Column("deployment", Text, nullable=True),
    Index("ix_demands_open", "state", "created_at"),
)

leases = Table(
    "leases",
    metadata,
    Column("id", Integer, primary_key=True),
    # A demand whose lease failed before it started reopens and may get another lease.
    Column("demand_id", Integer, ForeignKey("demands.id"), nullable=False, index=True),
    Column("listing_id", Integer, ForeignKey("listings.id"), nullable=False, index=True),
    Column("tenant_id", Integer, ForeignKey("accounts.id"), nullable=False, index=True),
    Column("provider_id", Integer, ForeignKey("accounts.id"), nullable=False, index=True),
    Column("devices", Integer, nullable=False),
    Column("price_per_device_hour", BigInteger, nullable=False),
    Column("duration_s", BigInteger, nullable=False),
    Column("fee_bps", Integer, nullable=False),
    Column("escrow_account_id", Integer, ForeignKey("ledger_accounts.id"), nullable=False),
    Column("escrow_amount", BigInteger, nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("accept_by", BigInteger, nullable=False),
    Column("start_by", BigInteger, nullable=False),
    Column("started_at", BigInteger, nullable=True),
    Column("window_end", BigInteger, nullable=True),
    Column("terms_signature", String(100), nullable=True),
    Column("end_reason", String(64), nullable=True),
    Column("last_seq", BigInteger, nullable=False, default=0),
    Column("last_interval_end", BigInteger, nullable=True),
    _money("paid_provider"),
    _money("paid_fee"),
    _money("refunded"),
    # A standing lease (form "standing"): its signed terms, copied from the listing and the demand.
    # period_price is a committed period's price (after the reserved discount), renewal_price a
    # renewed period's; escrow_amount counts every period funded so far. ends_at: the period close
    # at which it ends, once either side has given notice. credited: credits paid back to the tenant.
    Column("form", String(16), nullable=False, default="block"),
    Column("period_s", BigInteger, nullable=True),
    Column("term_periods", Integer, nullable=True),
    Column("period_price", BigInteger, nullable=True),
    Column("renewal_price", BigInteger, nullable=True),
    Column("discount_bps", Integer, nullable=True),
    Column("availability_bps", Integer, nullable=True),
    Column("credit_rule", Text, nullable=True),
    Column("notice_s", BigInteger, nullable=True),
    Column("ends_at", BigInteger, nullable=True),
    Column("notice_by", String(64), nullable=True),
    Column("endpoint_url", String(500), nullable=True),
    _money("credited"),
    # Set when the provider's verification was revoked before the lease settled: "held" (its
    # settlement pays the provider's share into the lease's held account, `held:lease:<id>`, not
    # into earnings), then "released" or "refunded" by the operator's decision (revocation.py).
    Column("earnings_hold", String(16), nullable=True),
)

# The billing periods of standing leases: running -> closed -> settled (states/period.py).
lease_periods = Table(
    "lease_periods",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("lease_id", Integer, ForeignKey("leases.id"), nullable=False, index=True),
    Column("seq", Integer, nullable=False),
    Column("period_start", BigInteger, nullable=False),
    Column("period_end", BigInteger, nullable=False),
    # Set when the lease ended inside the period (terminated): it ran until then.
    Column("ended_at", BigInteger, nullable=True),
    Column("price", BigInteger, nullable=False),
    Column("funding", String(16), nullable=False),  # "prepaid" (the committed term) or "renewal"
    Column("state", String(16), nullable=False),
    Column("available_device_seconds", BigInteger, nullable=True),
    Column("availability_bps", Integer, nullable=True),
    Column("charge", BigInteger, nullable=True),
    Column("credit", BigInteger, nullable=True),
    _money("paid_provider"),
    _money("paid_fee"),
    _money("refunded"),
    Column("settled_at", BigInteger, nullable=True),
    UniqueConstraint("lease_id", "seq", name="uq_lease_periods_lease_seq"),
)

# A standing lease's roll-outs: the tenant asks the provider to serve another export (or, a
# roll-back, the one served before) on the same lease and endpoint: requested -> switched | failed,
# or withdrawn by the tenant while still requested (states/rollout.py). `export` is the new export's
# files and URLs (JSON, as a deployment carries them; null for a roll-back); `export_digest` the
# digest of the runyard export the provider reports serving after the switch.
rollouts = Table(
    "rollouts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("lease_id", Integer, ForeignKey("leases.id"), nullable=False, index=True),
    Column("seq", Integer, nullable=False),
    Column("kind", String(16), nullable=False),  # "rollout" or "rollback"
    Column("export", Text, nullable=True),
    Column("export_sha256", String(80), nullable=True),
    Column("state", String(16), nullable=False),
    Column("requested_at", BigInteger, nullable=False),
    Column("finished_at", BigInteger, nullable=True),
    Column("export_digest", String(80), nullable=True),
    Column("detail", Text, nullable=True),
    UniqueConstraint("lease_id", "seq", name="uq_rollouts_lease_seq"),
)

usage_records = Table(
    "usage_records",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("lease_id", Integer, ForeignKey("leases.id"), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("interval_start", BigInteger, nullable=False),
    Column("interval_end", BigInteger, nullable=False),
    Column("device_seconds", BigInteger, nullable=False),
    Column("evidence", Text, nullable=True),
    Column("signature", String(100), nullable=False),
    Column("received_at", BigInteger, nullable=False),
    Column("state", String(24), nullable=False),
    Column("acked_device_seconds", BigInteger, nullable=True),
    Column("acked_at", BigInteger, nullable=True),
    # "usage" (device-seconds used, block leases) or "availability" (standing leases: device_seconds is
    # available seconds x devices, with the probe counts and request figures as evidence).
    Column("kind", String(16), nullable=False, default="usage"),
    Column("period_id", Integer, ForeignKey("lease_periods.id"), nullable=True, index=True),
    Column("available_seconds", BigInteger, nullable=True),
    Column("probes", BigInteger, nullable=True),
    Column("probes_ok", BigInteger, nullable=True),
    Column("requests", BigInteger, nullable=True),
    Column("latency_p50_ms", BigInteger, nullable=True),
    Column("latency_p99_ms", BigInteger, nullable=True),
    UniqueConstraint("lease_id", "seq", name="uq_usage_records_lease_seq"),
)

# The tenant's own signed view of an interval; a mismatch beyond tolerance opens a dispute.
measurements = Table(
    "measurements",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("lease_id", Integer, ForeignKey("leases.id"), nullable=False),
    Column("interval_start", BigInteger, nullable=False),
    Column("interval_end", BigInteger, nullable=False),
    Column("device_seconds", BigInteger, nullable=False),
    Column("signature", String(100), nullable=False),
    Column("received_at", BigInteger, nullable=False),
    # "usage", or "probes": a standing lease's tenant probe results (device_seconds = available x devices).
    Column("kind", String(16), nullable=False, default="usage"),
    Column("available_seconds", BigInteger, nullable=True),
    Column("probes", BigInteger, nullable=True),
    Column("probes_ok", BigInteger, nullable=True),
    UniqueConstraint("lease_id", "interval_start", "interval_end", name="uq_measurements_interval"),
)

disputes = Table(
    "disputes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("lease_id", Integer, ForeignKey("leases.id"), nullable=False, index=True),
    Column("record_id", Integer, ForeignKey("usage_records.id"), nullable=False, unique=True),
    Column("opened_by", String(64), nullable=False),
    Column("opener_side", String(16), nullable=False),
    Column("claimed_device_seconds", BigInteger, nullable=False),
    Column("counter_device_seconds", BigInteger, nullable=False),
    Column("reason", Text, nullable=False),
    Column("state", String(16), nullable=False),
    Column("resolved_device_seconds", BigInteger, nullable=True),
    Column("created_at", BigInteger, nullable=False),
)

# Every state change of every machine: who, when, why.
transitions = Table(
    "transitions",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("entity", String(16), nullable=False),
    Column("entity_id", Integer, nullable=False),
    Column("from_state", String(24), nullable=True),
    Column("to_state", String(24), nullable=False),
    Column("actor", String(64), nullable=False),
    Column("reason", Text, nullable=False),
    Column("at", BigInteger, nullable=False),
    Index("ix_transitions_entity", "entity", "entity_id"),
)

# Append-only (database triggers refuse UPDATE and DELETE).
audit_log = Table(
    "audit_log",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("at", BigInteger, nullable=False),
    Column("actor", String(64), nullable=False),
    Column("action", String(48), nullable=False),
    Column("subject", String(64), nullable=False),
    Column("detail", Text, nullable=False),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account_id", Integer, nullable=False),
    Column("key", String(200), nullable=False),
    Column("params_hash", String(64), nullable=False),
    Column("response", Text, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    UniqueConstraint("account_id", "key", name="uq_idempotency_keys_account_key"),
)

# Events received from payment rails: each (rail, event id) is applied once.
rail_events = Table(
    "rail_events",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("rail", String(32), nullable=False),
    Column("event_id", String(200), nullable=False),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("transfer_id", Integer, ForeignKey("transfers.id"), nullable=False),
    Column("received_at", BigInteger, nullable=False),
    UniqueConstraint("rail", "event_id", name="uq_rail_events_rail_event"),
)

# Where an account's withdrawals are paid: a destination on a configured rail.
payout_methods = Table(
    "payout_methods",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False, index=True),
    Column("rail", String(32), nullable=False),
    Column("destination", String(200), nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

APPEND_ONLY_TABLES = ("audit_log", "transitions", "transfers")
