"""Planning: stage gates and promotion, and sizing (FLOPs, memory, time, cost, requirement)."""
