"""The diagnosis thresholds: set on the command line (``rankscope collector`` and ``diagnose``), used
by the detectors, and shown by the dashboard, which must judge a run as the collector does."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Detector thresholds; the defaults are what the scenarios are tuned and tested with."""

    #: a run whose steps stopped advancing this long while heartbeats still arrive is hung
    hang_after_s: float = 30.0
    #: ... and before its first step and in it, while no step sets a pace (each attempt's: a restart loads a checkpoint), this many times as
    #: long: start-up (process groups, the model, a checkpoint, compilation) outlasts a step, and a rank
    #: slow to start is not hung (torchtitan allows its first step 300 s, the others 100). A rank on a
    #: loaded host still importing torch after 10 s was named hung at step 0 (CI, sessions 24-25, 34)
    hang_first_step_factor: float = 3.0
    #: a rank silent for this long without saying it ended is lost
    silent_after_s: float = 15.0
    #: straggler: slower than its stage's median by at least this share ...
    straggler_excess: float = 0.10
    #: ... over this many recent steps (median of them), seen in at least ``straggler_min_steps``
    straggler_window: int = 6
    #: (clean 8-rank runs on 2 busy cores: a rank's forward 1.2x its stage's in CPU time at three steps
    #: in a row, its tensor-parallel partner too at two of them; in CI of 75dacaf, rank 6's forward
    #: 1.17-1.26x at four of six steps, costing 6% of the critical path): all of the window but one
    straggler_min_steps: int = 5
    #: ... and by at least this much time per step (tiny segments are all noise) ...
    straggler_min_excess_s: float = 0.002
    #: ... and this share of the step: a segment that costs the step less is no straggler worth a
    #: look, and a small wall-time-only segment (data loading) on a busy host is mostly the scheduler.
    #: Its cost measured on the critical paths of the latest steps, where they are known, must reach
    #: this share too: a slower rank that nobody waits for costs nothing (issue 29: "optimizer 21%
    #: slower ... costs 0% of step time" after a frozen rank resumed)
    straggler_step_share: float = 0.01
    #: where CPU time is compared, wall time too (a step's compute as a whole), slower by at least
    #: this share at every step of the window but one: a rank starved of CPU computes no slower, it
    #: waits to run. Wall time on shared cores is noisy: 8 ranks on 2 cores showed three steps in a
    #: row 1.5-1.9x their stage's median with steady CPU time
    straggler_wall_excess: float = 1.0
    #: where a rank is slower in CPU time, its groups must have waited for it at their collectives for at
    #: least this share of the time it was slower, and ``straggler_excess`` of the step (diagnosis/straggler.py:
    #: CPU time on shared cores counts the hypervisor's steal too; a rank 1.7x slower held its groups 3-5x
    #: its excess, a third of its step or more; clean ranks 0.04-0.2x its excess, 1-3% of the step)
    straggler_waited_share: float = 0.5
    #: slow link: a pair's transfer time this many times the median of comparable pairs ...
    slow_link_ratio: float = 4.0
    #: ... costing at least this share of a step (and this much time) per step. Measured: links cut
    #: to 20 Mbit/s, delayed 30 ms or 120 ms cost 23-30% of a step; scheduling noise on 8 ranks of
    #: 2 cores made a pair of 32 kB transfers 8x its peers at 5.7% (a test bed run in CI)
    slow_link_step_share: float = 0.10
    slow_link_min_s: float = 0.005
    #: loss spike: the loss this many times the median of the previous steps
    loss_spike_ratio: float = 2.0
