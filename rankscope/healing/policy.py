"""Which incidents make a self-healing job act, and how: the policy of ``rankscope launch``.

MegaScale's loop: diagnosis names a suspect machine, a self-check confirms it, the machine is
evicted and training restarts from the last checkpoint. A host whose processes are all gone
(``lost_host``) cannot be asked anything: it is evicted at once. The others are checked first, and
a host that passes its self-check stays (a crash of one process is torchrun's to restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

#: the incident kinds that can name a faulty host
KINDS = ("lost_host", "crash", "hang", "straggler")


class Verdict(Enum):
    """What to do about one incident."""

    IGNORE = "ignore"  # not a kind the policy acts on, or names no host it can act on
    WAIT = "wait"  # a kind it acts on, not yet (a straggler that has not lasted long enough)
    CHECK = "check"  # self-check the suspects, evict those that fail
    EVICT = "evict"  # evict the suspects without a check
    REQUEUE = "requeue"  # evict them, and too few hosts are left: the scheduler places the job anew


@dataclass(frozen=True)
class Policy:
    """What a self-healing job acts on; the defaults are MegaScale's loop."""

    #: incident kinds whose hosts are suspects (a subset of ``KINDS``)
    act_on: tuple[str, ...] = KINDS
    #: kinds whose hosts are evicted without a self-check: nothing of them is left to ask
    evict_unchecked: tuple[str, ...] = ("lost_host",)
    #: a straggler is acted on once it has stayed slow this many steps (from the step its diagnosis says it
    #: became slow, or its incident opened if that says nothing)
    straggler_steps: int = 3
    #: the fewest hosts the job may shrink to (torchrun's --nnodes MIN)
    min_hosts: int = 1
    #: below ``min_hosts``, requeue the job (its scheduler places it on healthy hosts, the fenced ones
    #: excluded, and it resumes from its checkpoint) instead of leaving the suspects in it
    requeue: bool = False
    #: self-check a drained host again this often (seconds) while the job runs; one that passes takes
    #: jobs again and waits as a spare (0: never; a person resumes it: ``rankscope node resume``)
    recheck_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.act_on) - set(KINDS))
        if unknown:
            raise ValueError(f"cannot act on {', '.join(unknown)}: the kinds that name a host are {', '.join(KINDS)}")
        if self.straggler_steps < 0 or self.min_hosts < 1 or self.recheck_s < 0:
            raise ValueError("straggler steps and the re-check period must be 0 or more, and the job needs at least one host")

    def verdict(
        self, kind: str, hosts: list[str], steps_since: int, remaining: list[str], spares: int = 0
    ) -> tuple[Verdict, list[str], str]:  # fmt: skip
        """The verdict on one incident of ``kind`` naming ``hosts``, ``steps_since`` steps after it
        opened, with ``remaining`` hosts in the job and ``spares`` waiting to join it; with the suspects
        to act on and why, in one line."""
        suspects = [h for h in hosts if h in remaining]
        if kind not in self.act_on:
            return Verdict.IGNORE, [], f"the policy does not act on {kind} incidents"
        if not suspects:
            return Verdict.IGNORE, [], f"{kind} of {', '.join(hosts) or 'no host'}: no host it names is still in the job"
        if kind == "straggler" and steps_since < self.straggler_steps:
            return Verdict.WAIT, suspects, f"a straggler is acted on after {self.straggler_steps} slow steps ({steps_since} so far)"
        short = self.short(len(remaining), len(suspects), spares)
        if short and not self.requeue:
            return Verdict.IGNORE, [], f"evicting {', '.join(suspects)} would leave fewer than {self.min_hosts} hosts"
        if kind in self.evict_unchecked:
            if short:
                return Verdict.REQUEUE, suspects, (f"{kind}: nothing of {', '.join(suspects)} is left to check, and fewer than"
                                                   f" {self.min_hosts} hosts would be left: the job is requeued without it")  # fmt: skip
            return Verdict.EVICT, suspects, f"{kind}: nothing of {', '.join(suspects)} is left to check"
        return Verdict.CHECK, suspects, f"{kind} names {', '.join(suspects)}: self-check against the other hosts"

    def short(self, remaining: int, evicted: int, spares: int) -> bool:
        """Whether evicting ``evicted`` of ``remaining`` hosts, with ``spares`` to take their places,
        would leave the job fewer than ``min_hosts``."""
        return remaining - evicted + min(spares, evicted) < self.min_hosts
