"""money through payment rails, per-account limits, one key per account, demands that reopen

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

LIMITS = (("deposit_limit_per_day", 10**12), ("withdrawal_limit_per_day", 10**12), ("balance_limit", 10**13))


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # Rebuilding `leases` drops and renames it while other tables point at it: check those
        # references at commit, when the new table has its name again.
        op.execute("PRAGMA defer_foreign_keys=ON")
    with op.batch_alter_table("market_config", schema=None) as batch_op:
        for name, default in LIMITS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default=str(default)))
    with op.batch_alter_table("market_config", schema=None) as batch_op:
        for name, _ in LIMITS:
            batch_op.alter_column(name, server_default=None)
    op.create_index("uq_accounts_public_key", "accounts", ["public_key"], unique=True)
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_constraint("uq_leases_demand_id", type_="unique")
        batch_op.create_index(batch_op.f("ix_leases_demand_id"), ["demand_id"], unique=False)
    op.create_table(
        "rail_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rail", sa.String(length=32), nullable=False),
        sa.Column("event_id", sa.String(length=200), nullable=False),
        sa.Column("account_id", sa.Integer(), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("transfer_id", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["account_id"], ["accounts.id"], name=op.f("fk_rail_events_account_id_accounts")
        ),
        sa.ForeignKeyConstraint(
            ["transfer_id"], ["transfers.id"], name=op.f("fk_rail_events_transfer_id_transfers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rail_events")),
        sa.UniqueConstraint("rail", "event_id", name="uq_rail_events_rail_event"),
    )
    op.create_table(
        "payout_methods",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("account_id", sa.Integer(), nullable=False),
        sa.Column("rail", sa.String(length=32), nullable=False),
        sa.Column("destination", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["account_id"], ["accounts.id"], name=op.f("fk_payout_methods_account_id_accounts")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_payout_methods")),
    )
    with op.batch_alter_table("payout_methods", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_payout_methods_account_id"), ["account_id"], unique=False)


def downgrade() -> None:
    op.drop_table("payout_methods")
    op.drop_table("rail_events")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_leases_demand_id"))
        batch_op.create_unique_constraint("uq_leases_demand_id", ["demand_id"])
    op.drop_index("uq_accounts_public_key", table_name="accounts")
    with op.batch_alter_table("market_config", schema=None) as batch_op:
        for name, _ in LIMITS:
            batch_op.drop_column(name)
