"""Energy and money against arithmetic written out by hand, and the device table's errors."""

import pytest

from runyard.errors import SpecError
from runyard.plan.cost import cost_of, energy_kwh, format_money, money, price_per_device_hour
from runyard.plan.devices import DEVICES, UnknownDevice, device, kind_of_cuda_name, usable_memory
from runyard.spec.job import CostsSpec, parse_spec


def test_cost_of_rented_devices_is_price_times_device_hours():
    # 2 x h100-80gb for 1.5 h at the table's 299 cents: 299 x 2 x 1.5 = 897 cents exactly.
    c = cost_of("h100-80gb", 2, 5400, CostsSpec())
    assert (c.minor_units, c.currency, c.device_hours, c.price_per_device_hour) == (897, "USD", 3.0, 299)
    # 700 W x 2 devices x 1.5 h = 2.1 kWh.
    assert c.energy_kwh == pytest.approx(2.1)


def test_reserved_capacity_takes_the_stated_discount_and_rounds_up_once():
    costs = CostsSpec(capacity="reserved", reserved_discount=0.35)
    # 897 x 0.65 = 583.05 cents -> 584 (a cost is never understated by rounding).
    assert cost_of("h100-80gb", 2, 5400, costs).minor_units == 584
    assert cost_of("h100-80gb", 2, 5400, CostsSpec(reserved_discount=0.35)).minor_units == 897  # rented: no discount


def test_spec_prices_and_pue_override_the_table():
    costs = CostsSpec(prices={"l4": 50}, pue=1.5)
    c = cost_of("l4", 3, 7200, costs)
    assert c.minor_units == 50 * 3 * 2  # 300 cents
    assert c.energy_kwh == pytest.approx(72 * 3 * 2 / 1000 * 1.5)  # 72 W, 3 devices, 2 h, PUE 1.5


def test_money_is_exact_for_fractions_of_a_minor_unit():
    assert money(4, 1, 1) == 1  # 4 cents an hour for a second: 0.0011 cents -> 1
    assert money(100, 3, 1200) == 100  # a third of an hour on 3 devices: exactly one hour's price
    assert money(0, 8, 10**6) == 0
    with pytest.raises(ValueError):
        money(100, 1, -1)


def test_energy_of_a_cpu_core_hour():
    assert energy_kwh("cpu", 4, 3600) == pytest.approx(4 * device("cpu").power_w / 1000)


def test_unknown_device_and_a_foreign_currency_without_prices_are_errors():
    with pytest.raises(UnknownDevice, match="no accelerator kind 'h100'.*known kinds"):
        device("h100")
    with pytest.raises(SpecError) as info:
        price_per_device_hour("a100-80gb", CostsSpec(currency="EUR", prices={"h100-80gb": 280}))
    assert info.value.problems[0][0] == "costs.prices.a100-80gb" and "EUR" in info.value.problems[0][2]
    assert price_per_device_hour("h100-80gb", CostsSpec(currency="EUR", prices={"h100-80gb": 280})) == 280


def test_the_spec_refuses_unknown_kinds_negative_prices_and_bad_discounts():
    base = {"name": "x", "data": {"sources": [{"path": "x"}]}}
    for costs, field in (
        ({"prices": {"h100": 1}}, "costs.prices"),
        ({"prices": {"l4": -1}}, "costs.prices"),
        ({"reserved_discount": 1.0}, "costs.reserved_discount"),
        ({"currency": "dollars"}, "costs.currency"),
    ):
        with pytest.raises(SpecError) as info:
            parse_spec({**base, "costs": costs})
        assert info.value.problems[0][0] == field


def test_cuda_names_map_to_kinds_longest_match_first():
    assert kind_of_cuda_name("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert kind_of_cuda_name("NVIDIA H200") == "h200-141gb"
    assert kind_of_cuda_name("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert kind_of_cuda_name("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert kind_of_cuda_name("Some Future Accelerator") is None


def test_usable_memory_keeps_the_cuda_reserve_off_a_gpu():
    h100 = DEVICES["h100-80gb"]
    assert usable_memory(h100) == int(80 * 2**30 * 0.9) - 2**29
    assert usable_memory(DEVICES["cpu"]) == DEVICES["cpu"].memory_bytes


def test_format_money():
    assert format_money(123456, "USD") == "1,234.56 USD"
    assert format_money(5, "EUR") == "0.05 EUR"
