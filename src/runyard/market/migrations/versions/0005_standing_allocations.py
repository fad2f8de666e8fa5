"""standing allocations beside blocks: listing and demand forms, standing leases billed per period,
availability records and tenant probes, deployments, and a job's environment lock

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Columns added NOT NULL to tables that may hold rows: a server default fills those, then goes.
FILLED = {
    "listings": (("memory_gib", sa.Integer(), "0"), ("form", sa.String(length=16), "block")),
    "demands": (("form", sa.String(length=16), "block"),),
    "leases": (("form", sa.String(length=16), "block"), ("credited", sa.BigInteger(), "0")),
    "usage_records": (("kind", sa.String(length=16), "usage"),),
    "measurements": (("kind", sa.String(length=16), "usage"),),
}
NULLABLE = {
    "listings": (("period_s", sa.BigInteger()), ("min_term_periods", sa.Integer()), ("notice_s", sa.BigInteger()),
                 ("availability_bps", sa.Integer()), ("credit_rule", sa.Text()), ("reserved_terms", sa.Text())),
    "demands": (("standing", sa.Text()), ("deployment", sa.Text())),
    "leases": (("period_s", sa.BigInteger()), ("term_periods", sa.Integer()), ("period_price", sa.BigInteger()),
               ("renewal_price", sa.BigInteger()), ("discount_bps", sa.Integer()), ("availability_bps", sa.Integer()),
               ("credit_rule", sa.Text()), ("notice_s", sa.BigInteger()), ("ends_at", sa.BigInteger()),
               ("notice_by", sa.String(length=64)), ("endpoint_url", sa.String(length=500))),
    "usage_records": (("available_seconds", sa.BigInteger()), ("probes", sa.BigInteger()),
                      ("probes_ok", sa.BigInteger()), ("requests", sa.BigInteger()),
                      ("latency_p50_ms", sa.BigInteger()), ("latency_p99_ms", sa.BigInteger())),
    "measurements": (("available_seconds", sa.BigInteger()), ("probes", sa.BigInteger()),
                     ("probes_ok", sa.BigInteger())),
}


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # Rebuilding `leases` and `usage_records` renames them while other tables point at them.
        op.execute("PRAGMA defer_foreign_keys=ON")
    op.create_table(
        "lease_periods",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("period_start", sa.BigInteger(), nullable=False),
        sa.Column("period_end", sa.BigInteger(), nullable=False),
        sa.Column("ended_at", sa.BigInteger(), nullable=True),
        sa.Column("price", sa.BigInteger(), nullable=False),
        sa.Column("funding", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("available_device_seconds", sa.BigInteger(), nullable=True),
        sa.Column("availability_bps", sa.Integer(), nullable=True),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("credit", sa.BigInteger(), nullable=True),
        sa.Column("paid_provider", sa.BigInteger(), nullable=False),
        sa.Column("paid_fee", sa.BigInteger(), nullable=False),
        sa.Column("refunded", sa.BigInteger(), nullable=False),
        sa.Column("settled_at", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], name=op.f("fk_lease_periods_lease_id_leases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lease_periods")),
        sa.UniqueConstraint("lease_id", "seq", name="uq_lease_periods_lease_seq"),
    )
    with op.batch_alter_table("lease_periods", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_lease_periods_lease_id"), ["lease_id"], unique=False)
    for table in FILLED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            for name, kind, default in FILLED[table]:
                batch_op.add_column(sa.Column(name, kind, nullable=False, server_default=default))
            for name, kind in NULLABLE[table]:
                batch_op.add_column(sa.Column(name, kind, nullable=True))
            if table == "usage_records":
                batch_op.add_column(sa.Column("period_id", sa.Integer(), nullable=True))
                batch_op.create_index(batch_op.f("ix_usage_records_period_id"), ["period_id"], unique=False)
                batch_op.create_foreign_key(batch_op.f("fk_usage_records_period_id_lease_periods"),
                                            "lease_periods", ["period_id"], ["id"])
        with op.batch_alter_table(table, schema=None) as batch_op:
            for name, _, _ in FILLED[table]:
                batch_op.alter_column(name, server_default=None)


def downgrade() -> None:
    for table in FILLED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            if table == "usage_records":
                batch_op.drop_constraint(batch_op.f("fk_usage_records_period_id_lease_periods"), type_="foreignkey")
                batch_op.drop_index(batch_op.f("ix_usage_records_period_id"))
                batch_op.drop_column("period_id")
            for name, _ in NULLABLE[table]:
                batch_op.drop_column(name)
            for name, _, _ in FILLED[table]:
                batch_op.drop_column(name)
    op.drop_table("lease_periods")
