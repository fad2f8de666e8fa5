"""initial market schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 10:57:58.654657
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_accounts")),
        sa.UniqueConstraint("name", name=op.f("uq_accounts_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_accounts_token_hash")),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=48), nullable=False),
        sa.Column("subject", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("account_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("params_hash", sa.String(length=64), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_idempotency_keys")),
        sa.UniqueConstraint("account_id", "key", name="uq_idempotency_keys_account_key"),
    )
    op.create_table(
        "market_config",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("currency", sa.String(length=8), nullable=False),
        sa.Column("fee_bps", sa.Integer(), nullable=False),
        sa.Column("dispute_window_s", sa.Integer(), nullable=False),
        sa.Column("accept_timeout_s", sa.Integer(), nullable=False),
        sa.Column("start_timeout_s", sa.Integer(), nullable=False),
        sa.Column("tolerance_bps", sa.Integer(), nullable=False),
        sa.Column("test_clock", sa.Boolean(), nullable=False),
        sa.Column("clock_offset_s", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_market_config")),
    )
    op.create_table(
        "transitions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("entity", sa.String(length=16), nullable=False),
        sa.Column("entity_id", sa.Integer(), nullable=False),
        sa.Column("from_state", sa.String(length=24), nullable=True),
        sa.Column("to_state", sa.String(length=24), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transitions")),
    )
    with op.batch_alter_table("transitions", schema=None) as batch_op:
        batch_op.create_index("ix_transitions_entity", ["entity", "entity_id"], unique=False)

    op.create_table(
        "ledger_accounts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("code", sa.String(length=80), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=True),
        sa.Column("no_negative", sa.Boolean(), nullable=False),
        sa.Column("debits_pending", sa.BigInteger(), nullable=False),
        sa.Column("debits_posted", sa.BigInteger(), nullable=False),
        sa.Column("credits_pending", sa.BigInteger(), nullable=False),
        sa.Column("credits_posted", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["accounts.id"], name=op.f("fk_ledger_accounts_owner_id_accounts")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_accounts")),
        sa.UniqueConstraint("code", name=op.f("uq_ledger_accounts_code")),
    )
    with op.batch_alter_table("ledger_accounts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ledger_accounts_owner_id"), ["owner_id"], unique=False)

    op.create_table(
        "listings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("provider_id", sa.Integer(), nullable=False),
        sa.Column("accelerator_kind", sa.String(length=32), nullable=False),
        sa.Column("devices_per_node", sa.Integer(), nullable=False),
        sa.Column("node_count", sa.Integer(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("reserved", sa.Integer(), nullable=False),
        sa.Column("interconnect", sa.String(length=16), nullable=False),
        sa.Column("interconnect_gbps", sa.Integer(), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("jurisdiction", sa.String(length=64), nullable=False),
        sa.Column("price_per_device_hour", sa.BigInteger(), nullable=False),
        sa.Column("available_from", sa.BigInteger(), nullable=False),
        sa.Column("available_until", sa.BigInteger(), nullable=False),
        sa.Column("start_class", sa.String(length=16), nullable=False),
        sa.Column("max_queue_s", sa.Integer(), nullable=False),
        sa.Column("scheduler_kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("leases_expired", sa.Integer(), nullable=False),
        sa.Column("leases_completed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["provider_id"], ["accounts.id"], name=op.f("fk_listings_provider_id_accounts")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_listings")),
    )
    with op.batch_alter_table("listings", schema=None) as batch_op:
        batch_op.create_index(
            "ix_listings_match", ["state", "accelerator_kind", "price_per_device_hour"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_listings_provider_id"), ["provider_id"], unique=False)

    op.create_table(
        "transfers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("debit_account_id", sa.Integer(), nullable=False),
        sa.Column("credit_account_id", sa.Integer(), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("pending_id", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=True),
        sa.Column("demand_id", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["credit_account_id"],
            ["ledger_accounts.id"],
            name=op.f("fk_transfers_credit_account_id_ledger_accounts"),
        ),
        sa.ForeignKeyConstraint(
            ["debit_account_id"],
            ["ledger_accounts.id"],
            name=op.f("fk_transfers_debit_account_id_ledger_accounts"),
        ),
        sa.ForeignKeyConstraint(
            ["pending_id"], ["transfers.id"], name=op.f("fk_transfers_pending_id_transfers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transfers")),
        sa.UniqueConstraint("pending_id", name=op.f("uq_transfers_pending_id")),
    )
    with op.batch_alter_table("transfers", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_transfers_credit_account_id"), ["credit_account_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_transfers_debit_account_id"), ["debit_account_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_transfers_lease_id"), ["lease_id"], unique=False)

    op.create_table(
        "demands",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("requirement", sa.Text(), nullable=False),
        sa.Column("kinds", sa.String(length=400), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("duration_s", sa.BigInteger(), nullable=False),
        sa.Column("max_price_per_device_hour", sa.BigInteger(), nullable=False),
        sa.Column("latest_start", sa.BigInteger(), nullable=True),
        sa.Column("escrow_account_id", sa.Integer(), nullable=True),
        sa.Column("escrow_pending_id", sa.Integer(), nullable=True),
        sa.Column("escrow_amount", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["escrow_account_id"],
            ["ledger_accounts.id"],
            name=op.f("fk_demands_escrow_account_id_ledger_accounts"),
        ),
        sa.ForeignKeyConstraint(
            ["escrow_pending_id"], ["transfers.id"], name=op.f("fk_demands_escrow_pending_id_transfers")
        ),
        sa.ForeignKeyConstraint(["tenant_id"], ["accounts.id"], name=op.f("fk_demands_tenant_id_accounts")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_demands")),
    )
    with op.batch_alter_table("demands", schema=None) as batch_op:
        batch_op.create_index("ix_demands_open", ["state", "created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_demands_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "leases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("demand_id", sa.Integer(), nullable=False),
        sa.Column("listing_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("provider_id", sa.Integer(), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("price_per_device_hour", sa.BigInteger(), nullable=False),
        sa.Column("duration_s", sa.BigInteger(), nullable=False),
        sa.Column("fee_bps", sa.Integer(), nullable=False),
        sa.Column("escrow_account_id", sa.Integer(), nullable=False),
        sa.Column("escrow_amount", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("accept_by", sa.BigInteger(), nullable=False),
        sa.Column("start_by", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=True),
        sa.Column("window_end", sa.BigInteger(), nullable=True),
        sa.Column("terms_signature", sa.String(length=100), nullable=True),
        sa.Column("end_reason", sa.String(length=64), nullable=True),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_interval_end", sa.BigInteger(), nullable=True),
        sa.Column("paid_provider", sa.BigInteger(), nullable=False),
        sa.Column("paid_fee", sa.BigInteger(), nullable=False),
        sa.Column("refunded", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["demand_id"], ["demands.id"], name=op.f("fk_leases_demand_id_demands")),
        sa.ForeignKeyConstraint(
            ["escrow_account_id"],
            ["ledger_accounts.id"],
            name=op.f("fk_leases_escrow_account_id_ledger_accounts"),
        ),
        sa.ForeignKeyConstraint(["listing_id"], ["listings.id"], name=op.f("fk_leases_listing_id_listings")),
        sa.ForeignKeyConstraint(
            ["provider_id"], ["accounts.id"], name=op.f("fk_leases_provider_id_accounts")
        ),
        sa.ForeignKeyConstraint(["tenant_id"], ["accounts.id"], name=op.f("fk_leases_tenant_id_accounts")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
        sa.UniqueConstraint("demand_id", name=op.f("uq_leases_demand_id")),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_leases_listing_id"), ["listing_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_leases_provider_id"), ["provider_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_leases_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("interval_start", sa.BigInteger(), nullable=False),
        sa.Column("interval_end", sa.BigInteger(), nullable=False),
        sa.Column("device_seconds", sa.BigInteger(), nullable=False),
        sa.Column("signature", sa.String(length=100), nullable=False),
        sa.Column("received_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], name=op.f("fk_measurements_lease_id_leases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_measurements")),
        sa.UniqueConstraint("lease_id", "interval_start", "interval_end", name="uq_measurements_interval"),
    )
    op.create_table(
        "usage_records",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("interval_start", sa.BigInteger(), nullable=False),
        sa.Column("interval_end", sa.BigInteger(), nullable=False),
        sa.Column("device_seconds", sa.BigInteger(), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=True),
        sa.Column("signature", sa.String(length=100), nullable=False),
        sa.Column("received_at", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=24), nullable=False),
        sa.Column("acked_device_seconds", sa.BigInteger(), nullable=True),
        sa.Column("acked_at", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], name=op.f("fk_usage_records_lease_id_leases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
        sa.UniqueConstraint("lease_id", "seq", name="uq_usage_records_lease_seq"),
    )
    op.create_table(
        "disputes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.Integer(), nullable=False),
        sa.Column("opened_by", sa.String(length=64), nullable=False),
        sa.Column("opener_side", sa.String(length=16), nullable=False),
        sa.Column("claimed_device_seconds", sa.BigInteger(), nullable=False),
        sa.Column("counter_device_seconds", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("resolved_device_seconds", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], name=op.f("fk_disputes_lease_id_leases")),
        sa.ForeignKeyConstraint(
            ["record_id"], ["usage_records.id"], name=op.f("fk_disputes_record_id_usage_records")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_disputes")),
        sa.UniqueConstraint("record_id", name=op.f("uq_disputes_record_id")),
    )
    with op.batch_alter_table("disputes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_disputes_lease_id"), ["lease_id"], unique=False)

    _append_only_triggers()


def downgrade() -> None:
    _drop_append_only_triggers()
    with op.batch_alter_table("disputes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_disputes_lease_id"))

    op.drop_table("disputes")
    op.drop_table("usage_records")
    op.drop_table("measurements")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_leases_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_leases_provider_id"))
        batch_op.drop_index(batch_op.f("ix_leases_listing_id"))

    op.drop_table("leases")
    with op.batch_alter_table("demands", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_demands_tenant_id"))
        batch_op.drop_index("ix_demands_open")

    op.drop_table("demands")
    with op.batch_alter_table("transfers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_transfers_lease_id"))
        batch_op.drop_index(batch_op.f("ix_transfers_debit_account_id"))
        batch_op.drop_index(batch_op.f("ix_transfers_credit_account_id"))

    op.drop_table("transfers")
    with op.batch_alter_table("listings", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_listings_provider_id"))
        batch_op.drop_index("ix_listings_match")

    op.drop_table("listings")
    with op.batch_alter_table("ledger_accounts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ledger_accounts_owner_id"))

    op.drop_table("ledger_accounts")
    with op.batch_alter_table("transitions", schema=None) as batch_op:
        batch_op.drop_index("ix_transitions_entity")

    op.drop_table("transitions")
    op.drop_table("market_config")
    op.drop_table("idempotency_keys")
    op.drop_table("audit_log")
    op.drop_table("accounts")


# Rows of these tables are history: the database itself refuses to change or delete them.
APPEND_ONLY = ("audit_log", "transitions", "transfers")


def _append_only_triggers() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(
            "CREATE OR REPLACE FUNCTION runyard_append_only() RETURNS trigger AS $$ BEGIN "
            "RAISE EXCEPTION 'table % is append-only', TG_TABLE_NAME; END; $$ LANGUAGE plpgsql"
        )
    for table in APPEND_ONLY:
        if dialect == "postgresql":
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION runyard_append_only()"
            )
        elif dialect == "sqlite":
            for event in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{event.lower()} BEFORE {event} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, 'table {table} is append-only'); END"
                )


def _drop_append_only_triggers() -> None:
    dialect = op.get_bind().dialect.name
    for table in APPEND_ONLY:
        if dialect == "postgresql":
            op.execute(f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}")
        elif dialect == "sqlite":
            for event in ("update", "delete"):
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{event}")
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS runyard_append_only()")
