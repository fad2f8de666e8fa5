"""The projected free timeline a backfill scheduler plans on: how many devices (and job slots) are
free from now on, as a step function of time.

It starts from what the jobs holding devices leave free now and gives their devices back at their
expected ends; every job the scheduler starts or reserves is taken out of it over its own interval.
A later job may start now only where the timeline still has room for it over its whole time limit,
so it never takes a device or a slot that a higher-priority job was promised.

Devices are interchangeable (one node, gang allocation of any free ones), so counts are enough: which
device a job gets is decided only for the jobs that start now.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable

INF = math.inf
_BANDS = 64  # duration bands: [2**k, 2**(k+1)) seconds, shorter ones in band 0, no limit in the last


def _band(duration: float) -> int:
    if duration == INF:
        return _BANDS
    return min(_BANDS - 1, max(0, int(duration).bit_length() - 1))


class FreeTimeline:
    """Free devices and free job slots from `now` on; segment i covers [times[i], times[i+1]).

    `slots=None` means no concurrency cap (slots are then never checked). Times are absolute
    (the same clock as `now`); an interval may end at `math.inf`.
    """

    def __init__(self, now: float, devices: int, slots: int | None, returns: Iterable[tuple[float, int]]):
        """`devices`/`slots` free at `now`; `returns`: (time, devices) a holder gives back (one slot each)."""
        self.now = now
        self.times = [now]
        self.free = [devices]
        self.slots: list[int] | None = None if slots is None else [slots]
        for at, count in sorted(returns):
            if at == INF:
                continue  # never comes back (no time limit)
            if at <= now:
                self.free[0] += count
                if self.slots is not None:
                    self.slots[0] += 1
                continue
            if at != self.times[-1]:
                self.times.append(at)
                self.free.append(self.free[-1])
                if self.slots is not None:
                    self.slots.append(self.slots[-1])
            self.free[-1] += count
            if self.slots is not None:
                self.slots[-1] += 1
        # Free room only shrinks while jobs are taken out, so an earliest start found for `devices`
        # and a duration stays a lower bound for the same devices and any duration at least as long
        # (a window that fits a longer job fits a shorter one). Searches start from the best such
        # bound: the same shape's last answer, or the latest answer for a duration in a shorter
        # power-of-two band, or the first segment with that many devices free. Cleared by `give`.
        # They spare a pass over a long queue a rescan of the whole timeline for every job.
        self._found: dict[tuple[int, float], float] = {}
        self._band_found: dict[int, list[float]] = {}  # devices -> latest start found per duration band
        self._first_room: dict[int, float] = {}

    def fits(self, start: float, end: float, devices: int) -> bool:
        """Whether `devices` devices and one slot are free over all of [start, end)."""
        times, free, slots = self.times, self.free, self.slots
        i = bisect_right(times, start) - 1
        n = len(times)
        while i < n and times[i] < end:
            if free[i] < devices or (slots is not None and slots[i] < 1):
                return False
            i += 1
        return True

    def earliest(self, devices: int, duration: float) -> float:
        """The earliest start at or after now with `devices` devices and one slot free for `duration`
        (`math.inf` if there is none: the devices never come back)."""
        times, free, slots = self.times, self.free, self.slots
        n = len(times)
        shape = (devices, duration)
        band = _band(duration)
        bands = self._band_found.setdefault(devices, [self.now] * (_BANDS + 1))
        room_from = self._first_room.get(devices, self.now)
        begin = max(self._found.get(shape, self.now), max(bands[:band], default=self.now), room_from)
        i = bisect_left(times, begin)
        # Only a scan that begins at the first-room bound sees where room for `devices` now begins.
        track_room = begin == room_from
        while i < n:
            if free[i] < devices or (slots is not None and slots[i] < 1):
                i += 1
                continue
            if track_room:
                self._first_room[devices] = times[i]
                track_room = False
            end = times[i] + duration
            j = i + 1
            while j < n and times[j] < end:
                if free[j] < devices or (slots is not None and slots[j] < 1):
                    break
                j += 1
            else:
                self._found[shape] = times[i]
                bands[band] = max(bands[band], times[i])
                return times[i]
            i = j + 1  # every start up to segment j overlaps the segment that is too full
        self._found[shape] = bands[band] = INF
        if track_room:
            self._first_room[devices] = INF
        return INF

    def take(self, start: float, end: float, devices: int) -> None:
        """Take `devices` devices and one slot over [start, end) (a start or a reservation)."""
        self._add(start, end, -devices, -1)

    def give(self, start: float, end: float, devices: int) -> None:
        """Give `devices` devices and one slot back over [start, end) (a job told to stop early)."""
        self._add(start, end, devices, 1)
        self._found.clear()  # room appeared: earlier starts are possible again
        self._band_found.clear()
        self._first_room.clear()

    def _split(self, at: float) -> int:
        """Index of the segment that starts exactly at `at` (made by splitting one if needed)."""
        times = self.times
        i = bisect_left(times, at)
        if i < len(times) and times[i] == at:
            return i
        times.insert(i, at)
        self.free.insert(i, self.free[i - 1])
        if self.slots is not None:
            self.slots.insert(i, self.slots[i - 1])
        return i

    def _add(self, start: float, end: float, devices: int, slots: int) -> None:
        start = max(start, self.now)
        if end <= start:
            return
        i = self._split(start)
        j = self._split(end) if end != INF else len(self.times)
        free = self.free
        for k in range(i, j):
            free[k] += devices
        if self.slots is not None:
            for k in range(i, j):
                self.slots[k] += slots
