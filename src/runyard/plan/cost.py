"""Energy and money: device-hours priced per device-hour, and the devices' power draw times time.

Money is integer minor units of `costs.currency` (cents for USD). A price per device-hour is the spec's
(`costs.prices`) or the device table's; reserved capacity takes `costs.reserved_discount` off it. A total
is rounded up to a whole minor unit once, at the end (exact rational arithmetic until then), so a cost
is never understated by rounding.

Energy is each device's board power (the table's, taken as its draw under load) times the devices, times
the time, times the facility's PUE: kWh = W x devices x seconds / 3.6e6 x PUE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction

from runyard.errors import SpecError
from runyard.plan.devices import device
from runyard.spec.job import CostsSpec, reference_hint

TABLE_CURRENCY = "USD"  # the device table's prices


@dataclass(frozen=True)
class Cost:
    """What `devices` devices of `kind` cost for `seconds`."""

    kind: str
    devices: int
    seconds: float
    device_hours: float
    price_per_device_hour: int  # minor units, before any reserved discount
    capacity: str  # rented or reserved
    minor_units: int  # the total, rounded up
    currency: str
    energy_kwh: float

    def to_dict(self) -> dict:
        return asdict(self)


def price_per_device_hour(kind: str, costs: CostsSpec) -> int:
    """The list price of one device-hour of `kind` in minor units of costs.currency (before a discount).
    UnknownDevice for a kind not in the table; SpecError when the currency is not the table's and the
    spec gives no price for the kind."""
    if kind in costs.prices:
        return costs.prices[kind]
    table = device(kind).price_per_hour
    if costs.currency != TABLE_CURRENCY:
        where = f"costs.prices.{kind}"
        raise SpecError("costs", [(where, None, f"a price per device-hour of {kind} in {costs.currency} minor "
                                   f"units: runyard's own table is in {TABLE_CURRENCY} {reference_hint('costs.prices')}")])
    return table


def discount_factor(costs: CostsSpec) -> Fraction:
    """What is paid of the list price: 1 rented, 1 - reserved_discount reserved."""
    if costs.capacity == "reserved":
        return 1 - Fraction(str(costs.reserved_discount))
    return Fraction(1)


def money(price_per_hour: int, devices: int, seconds: float, factor: Fraction = Fraction(1)) -> int:
    """ceil(price x devices x hours x factor) in minor units, computed exactly."""
    if seconds < 0 or devices < 0 or price_per_hour < 0:
        raise ValueError("price, devices and time must not be negative")
    exact = Fraction(price_per_hour) * devices * Fraction(seconds) / 3600 * factor
    return math.ceil(exact)


def energy_kwh(kind: str, devices: int, seconds: float, pue: float = 1.0) -> float:
    """kWh drawn by `devices` devices of `kind` for `seconds` (board power), times the facility's PUE."""
    return device(kind).power_w * devices * seconds / 3.6e6 * pue


def cost_of(kind: str, devices: int, seconds: float, costs: CostsSpec) -> Cost:
    """Money and energy of `devices` x `kind` for `seconds` under the spec's costs section."""
    price = price_per_device_hour(kind, costs)
    return Cost(
        kind=kind,
        devices=devices,
        seconds=seconds,
        device_hours=devices * seconds / 3600,
        price_per_device_hour=price,
        capacity=costs.capacity,
        minor_units=money(price, devices, seconds, discount_factor(costs)),
        currency=costs.currency,
        energy_kwh=energy_kwh(kind, devices, seconds, costs.pue),
    )


def format_money(minor_units: float, currency: str) -> str:
    """`12345` USD -> `123.45 USD` (two minor-unit digits, as most currencies have)."""
    sign = "-" if minor_units < 0 else ""
    value = abs(minor_units)
    whole, cents = divmod(round(value), 100)
    return f"{sign}{whole:,}.{cents:02d} {currency}"
