"""The open market: identities, listings, demands with escrow, matching, leases, usage, settlement.

This package imports no torch (see DESIGN.md). `requirement` is the one contract shared with the
job spec.
"""
