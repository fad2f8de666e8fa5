"""The free timeline the backfill scheduler plans on, against a grid of whole time units: after any
sequence of starts, reservations and early returns, `earliest` and `fits` answer what a scan
of every unit says (its search shortcuts must never skip a start that fits)."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from runyard.control.timeline import FreeTimeline
from tests.tiers import examples

UNITS = 600  # beyond every event (at most 16 reservations of 33 units after 30): from there on, nothing changes


def _grid(devices, slots, returns):
    free = [devices] * UNITS
    jobs = [slots] * UNITS if slots is not None else None
    for at, count in returns:
        if at is None:
            continue
        for t in range(at, UNITS):
            free[t] += count
            if jobs is not None:
                jobs[t] += 1
    return free, jobs


def _room(free, jobs, t, need):
    return free[t] >= need and (jobs is None or jobs[t] >= 1)


def _grid_earliest(free, jobs, need, length):
    for t in range(UNITS - 40):
        end = UNITS if length is None else t + length
        if all(_room(free, jobs, u, need) for u in range(t, end)):
            return t
    return math.inf


def _grid_add(free, jobs, start, length, devices):
    for t in range(start, UNITS if length is None else start + length):
        free[t] += devices
        if jobs is not None:
            jobs[t] += 1 if devices > 0 else -1


ops = st.lists(st.tuples(st.sampled_from(["reserve", "reserve", "start", "give"]), st.integers(1, 4),
                         st.sampled_from([None, 1, 2, 3, 5, 7, 9, 17, 33])), min_size=1, max_size=16)


@settings(max_examples=examples(400, fast=60), deadline=None)
@given(devices=st.integers(0, 4), cap=st.sampled_from([None, 1, 3]),
       returns=st.lists(st.tuples(st.sampled_from([None, 0, 1, 4, 9, 30]), st.integers(1, 3)), max_size=4),
       steps=ops)
def test_the_timeline_answers_what_a_scan_of_every_unit_says(devices, cap, returns, steps):
    timeline = FreeTimeline(0.0, devices, cap, [(math.inf if at is None else float(at), n) for at, n in returns])
    free, jobs = _grid(devices, cap, returns)
    given_back = []
    for op, need, length in steps:
        duration = math.inf if length is None else float(length)
        expected = _grid_earliest(free, jobs, need, length)
        assert timeline.earliest(need, duration) == expected, (op, need, length)
        end = UNITS if length is None else length
        fits_now = all(_room(free, jobs, t, need) for t in range(0, end))
        assert timeline.fits(0.0, duration, need) == fits_now
        if op == "start" and fits_now:
            timeline.take(0.0, duration, need)
            _grid_add(free, jobs, 0, length, -need)
            given_back.append((need, length))
        elif op == "reserve" and expected != math.inf:
            timeline.take(expected, expected + duration, need)
            _grid_add(free, jobs, expected, length, -need)
        elif op == "give" and given_back:  # a started job told to stop: its room comes back now
            back, back_length = given_back.pop()
            timeline.give(0.0, math.inf if back_length is None else float(back_length), back)
            _grid_add(free, jobs, 0, back_length, back)
