"""a demand carries its job (spec text and where results go)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("demands", schema=None) as batch_op:
        batch_op.add_column(sa.Column("job_spec", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("job_results_to", sa.String(length=1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("demands", schema=None) as batch_op:
        batch_op.drop_column("job_results_to")
        batch_op.drop_column("job_spec")
