"""The offset between this rank's clock and the collector's, estimated from acknowledgements.

Every rank stamps its events with its own wall clock; the collector adds each batch's
``clock_offset_ns`` so that timelines from different hosts line up. Each acknowledgement gives
one NTP-style sample: t0 (request sent, our clock), t1 (received) and t2 (replied, collector
clock), t3 (reply arrived, our clock). Network and queueing delays are rarely symmetric, and the
error of a sample is bounded by half its round trip, so the estimate is the sample with the
lowest round trip among the recent ones (a sliding window follows clock drift).
"""

from __future__ import annotations

from collections import deque

__all__ = ["ClockEstimator"]


class ClockEstimator:
    """Collector clock minus rank clock, from the lowest-round-trip sample of the last ``window``."""

    def __init__(self, window: int = 32) -> None:
        self._samples: deque[tuple[int, int]] = deque(maxlen=window)  # (round trip, offset)
        self._best: tuple[int, int] | None = None

    def add(self, t0: int, t1: int, t2: int, t3: int) -> None:
        """One exchange: t0/t3 on this rank's clock, t1/t2 on the collector's (nanoseconds)."""
        if not (t1 and t2) or t3 < t0 or t2 < t1:
            return  # the collector did not stamp it, or a clock jumped: no information
        round_trip = (t3 - t0) - (t2 - t1)
        offset = ((t1 - t0) + (t2 - t3)) // 2
        self._samples.append((round_trip, offset))
        self._best = min(self._samples, key=lambda s: s[0])

    @property
    def offset_ns(self) -> int:
        """The current estimate; 0 before the first sample."""
        return self._best[1] if self._best is not None else 0
