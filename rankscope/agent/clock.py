"""The offset between this rank's clock and the collector's, estimated from acknowledgements.

Every rank stamps its events with its own wall clock; the collector adds each batch's
``clock_offset_ns`` so that timelines from different hosts line up. Each acknowledgement gives
one NTP-style exchange: t0 (request sent, our clock), t1 (received) and t2 (replied, collector
clock), t3 (reply arrived, our clock). Whatever the delays on the way there and back, the true
offset lies within half the round trip of the exchange's midpoint estimate, so every exchange
bounds it, and the recent ones together bound it tighter (their intersection).

Within those bounds the estimate is the value nearest 0: hosts run synchronised clocks, and a
correction larger than the evidence demands does harm. A collector short of CPU answers late, and
the delay lands on one leg of the exchange: the midpoint alone was then off by tens of
milliseconds, different on every rank, which is more than the arrival skew and the transfer
times the diagnosis reads (ranks on one machine showed slow links that were not there). When the
bounds of the window contradict each other, a clock has moved (a step, drift): the newest
exchange starts a new window.
"""

from __future__ import annotations

from collections import deque

__all__ = ["ClockEstimator"]


class ClockEstimator:
    """Collector clock minus rank clock: the value nearest 0 that each of the last ``window`` exchanges allows."""

    def __init__(self, window: int = 32) -> None:
        self._bounds: deque[tuple[int, int]] = deque(maxlen=window)  # (lowest, highest) offset, per exchange
        self._estimate = 0

    def add(self, t0: int, t1: int, t2: int, t3: int) -> None:
        """One exchange: t0/t3 on this rank's clock, t1/t2 on the collector's (nanoseconds)."""
        if not (t1 and t2) or t3 < t0 or t2 < t1:
            return  # the collector did not stamp it, or a clock jumped: no information
        round_trip = (t3 - t0) - (t2 - t1)
        if round_trip < 0:
            return  # the collector took longer than the whole exchange: a clock jumped
        midpoint = ((t1 - t0) + (t2 - t3)) // 2
        half = (round_trip + 1) // 2
        self._bounds.append((midpoint - half, midpoint + half))
        lowest = max(b[0] for b in self._bounds)
        highest = min(b[1] for b in self._bounds)
        if lowest > highest:  # contradicting bounds: a clock moved; start again from this exchange
            lowest, highest = self._bounds[-1]
            self._bounds.clear()
            self._bounds.append((lowest, highest))
        self._estimate = min(max(0, lowest), highest)

    @property
    def offset_ns(self) -> int:
        """The current estimate; 0 before the first exchange."""
        return self._estimate
