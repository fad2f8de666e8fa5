"""The price of device time, in integer minor units: what matching escrows, what an order holds and
what a tenant's retrainer budgets. Kept apart from the store (no database layer)."""

from __future__ import annotations


def cost(price_per_device_hour: int, devices: int, seconds: int) -> int:
    """Price of `devices` for `seconds`, rounded up to a whole minor unit."""
    return -(-price_per_device_hour * devices * seconds // 3600)
