import math

import pytest

from runyard.spec.job import ScheduleSpec
from runyard.train.schedule import lr_at


def test_warmup_is_linear_and_never_zero():
    s = ScheduleSpec(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 1.0, s, 100) == pytest.approx(0.1)
    assert lr_at(4, 1.0, s, 100) == pytest.approx(0.5)
    assert lr_at(9, 1.0, s, 100) == pytest.approx(1.0)


def test_cosine_reaches_floor_at_last_step_and_half_way_is_mean():
    s = ScheduleSpec(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_at(10, 2.0, s, 101) == pytest.approx(2.0)
    assert lr_at(55, 2.0, s, 101) == pytest.approx(0.2 + 1.8 * 0.5)
    assert lr_at(100, 2.0, s, 101) == pytest.approx(0.2)
    assert lr_at(200, 2.0, s, 101) == pytest.approx(0.2)  # past the end: stays at the floor


def test_linear_and_constant():
    lin = ScheduleSpec(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert lr_at(0, 1.0, lin, 11) == pytest.approx(1.0)
    assert lr_at(5, 1.0, lin, 11) == pytest.approx(0.5)
    assert lr_at(10, 1.0, lin, 11) == pytest.approx(0.0)
    const = ScheduleSpec(warmup_steps=2, decay="constant")
    assert [lr_at(i, 1.0, const, 10) for i in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_cosine_is_monotone_after_warmup():
    s = ScheduleSpec(warmup_steps=5, decay="cosine", min_lr_ratio=0.0)
    values = [lr_at(i, 1.0, s, 50) for i in range(5, 50)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert not any(math.isnan(v) for v in values)
