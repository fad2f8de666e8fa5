"""revocation ends trading: a lease's provider earnings may be held for the operator's decision

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("earnings_hold", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("earnings_hold")
