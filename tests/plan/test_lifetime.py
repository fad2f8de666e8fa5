"""Training against a lifetime of inference: the crossover day by hand, serving sized for the peak, the
decoder's roofline against its arithmetic, and bad traffic."""

import math

import pytest

from runyard.model.registry import Sizing
from runyard.plan.cost import cost_of
from runyard.plan.devices import DEVICES, UTILISATION, usable_memory
from runyard.plan.lifetime import (
    Capacity,
    Traffic,
    crossover_day,
    decoder_capacity,
    lifetime_of,
    plot_lifetime,
    serving_for,
)
from runyard.spec.job import CostsSpec


def test_crossover_day_by_hand():
    assert crossover_day(1000, 300) == 4  # day 3 ends at 900, day 4 at 1200 > 1000
    assert crossover_day(900, 300) == 4  # equal at day 3 is not overtaking
    assert crossover_day(0, 1) == 1
    assert crossover_day(5000, 0) is None  # serving that costs nothing never overtakes
    with pytest.raises(ValueError):
        crossover_day(-1, 10)


def test_a_small_case_end_to_end_by_hand():
    # 50,000 requests a day of 4 rows, peak twice the mean: 50,000 x 4 / 86,400 x 2 = 4.63 rows/s at peak.
    # One CPU core answers 2 rows/s, so 3 cores (ceil 2.31); at 10 cents a core-hour a day costs
    # 3 x 24 x 10 = 720 cents. Training: 4 x a100-80gb for 2.5 h at 150 cents = 1,500 cents.
    costs = CostsSpec(prices={"cpu": 10, "a100-80gb": 150})
    traffic = Traffic(50_000, 4, "row", peak_to_mean=2.0, horizon_days=30)
    training = cost_of("a100-80gb", 4, 2.5 * 3600, costs)
    assert training.minor_units == 1500
    life = lifetime_of("tabular_classification", training, [Capacity("cpu", 1, 2.0, "by hand")], traffic, costs)
    assert (life.serving.devices, life.serving.cost_per_day.minor_units) == (3, 720)
    assert life.crossover_day == 3  # 1,500 // 720 + 1: day 2 ends at 1,440, day 3 at 2,160
    assert [(r["day"], r["inference"]) for r in life.table] == [(1, 720), (7, 5040), (30, 21600)]
    assert life.cost_per_million_requests == math.ceil(720 * 1_000_000 / 50_000)  # 14,400 cents
    text = "\n".join(life.lines())
    assert "overtakes training on day 3" in text and "| 30 | 216.00 USD | 15.00 USD |" in text


def test_the_cheapest_serving_kind_wins_for_every_family():
    costs = CostsSpec(prices={"cpu": 1, "t4": 35})
    # 1,000,000 images a day at peak 2x: 23.1 images/s. A core does 1/s -> 24 cores (24 c/h); a T4 100/s -> 1
    # (35 c/h).
    traffic = Traffic(1_000_000, 1, "row")
    caps = [Capacity("cpu", 1, 1.0, "x"), Capacity("t4", 1, 100.0, "x")]
    training = cost_of("t4", 1, 3600, costs)
    image = lifetime_of("image_classification", training, caps, traffic, costs)
    assert (image.serving.capacity.kind, image.serving.devices) == ("cpu", 24)  # no core cap: cost decides
    tabular = lifetime_of("tabular_classification", training, caps, traffic, costs)
    assert tabular.serving.capacity.kind == "cpu" and tabular.serving.devices == 24 and tabular.check == ""
    # Ten times the traffic: 231 cores (231 c/h) against 3 T4s (105 c/h): the T4s.
    busy = lifetime_of("tabular_classification", training, caps, Traffic(10_000_000, 1, "row"), costs)
    assert (busy.serving.capacity.kind, busy.serving.devices) == ("t4", 3)
    assert "the table says CPU for a tabular model" in busy.check


def test_no_traffic_provisions_nothing():
    serving = serving_for(Capacity("cpu", 1, 5.0, "x"), Traffic(0, 1, "row"), CostsSpec())
    assert serving.devices == 0 and serving.cost_per_day.minor_units == 0


def test_decoder_roofline_against_its_arithmetic():
    # A 1B-parameter decoder with 512 KiB of KV per token, 1,024 tokens a request, on an h100-80gb.
    size = Sizing(parameters=10**9, non_embedding_parameters=9 * 10**8, flops_per_unit=6e9, unit="token",
                  activation_bytes=0, cache_bytes_per_unit=512 * 1024)
    d = DEVICES["h100-80gb"]
    cap = decoder_capacity(d, size, 1024)
    weights, per_seq = 2e9, 512 * 1024 * 1024
    batch = min(256, int((usable_memory(d) - weights) // per_seq))
    assert batch == int((int(80 * 2**30 * 0.9) - 2**29 - weights) // per_seq) < 256
    memory_s = (weights + batch * per_seq / 2) / (3350e9 * UTILISATION["decode_bandwidth"])
    compute_s = batch * 2e9 / (989e12 * UTILISATION["decode_compute"])
    assert cap.units_per_s == pytest.approx(batch / max(memory_s, compute_s), rel=1e-9)
    assert cap.devices_per_replica == 1 and "memory bandwidth-bound" in cap.how


def test_bad_traffic_is_refused():
    with pytest.raises(ValueError, match="requests per day"):
        Traffic(-5, 1, "row")
    with pytest.raises(ValueError, match="tokens per request"):
        Traffic(10, 0, "token")
    with pytest.raises(ValueError, match="peak_to_mean"):
        Traffic(10, 1, "row", peak_to_mean=0.5)


def test_the_plot_is_a_png(tmp_path):
    costs = CostsSpec()
    life = lifetime_of("tabular_regression", cost_of("cpu", 4, 3600, costs), [Capacity("cpu", 1, 10.0, "x")],
                       Traffic(1000, 1, "row"), costs)
    path = plot_lifetime(life, tmp_path / "lifetime.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
