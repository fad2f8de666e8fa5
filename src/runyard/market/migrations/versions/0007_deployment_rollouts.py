"""standing leases' roll-outs: the tenant asks the provider to serve another export, or the one before

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("export", sa.Text(), nullable=True),
        sa.Column("export_sha256", sa.String(length=80), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("requested_at", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("export_digest", sa.String(length=80), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], name=op.f("fk_rollouts_lease_id_leases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
        sa.UniqueConstraint("lease_id", "seq", name="uq_rollouts_lease_seq"),
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollouts_lease_id"), ["lease_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollouts_lease_id"))
    op.drop_table("rollouts")
