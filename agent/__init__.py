"""rankscope's in-process agent: the public API training code calls.

Training code marks its critical segments and scalars through these functions whether or not
the agent is switched on. While the agent is off (the default; ``RANKSCOPE_ENABLE`` unset) every
call returns at once and records nothing, so the bundled trainer and users' scripts can call
them unconditionally on the hot path.

Span kinds: ``compute`` (forward, backward, ...), ``comm`` (time spent in communication),
``data`` (loading a batch), ``optimizer`` and ``user``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = [
    "KINDS",
    "enabled",
    "init",
    "name_groups",
    "record_scalars",
    "set_step",
    "set_topology",
    "span",
]

KINDS = ("compute", "comm", "data", "optimizer", "user")

F = TypeVar("F", bound=Callable[..., Any])


class _NoopSpan:
    """What ``span`` returns while the agent is off: a context manager and decorator that does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, fn: F) -> F:
        return fn


_NOOP_SPAN = _NoopSpan()


def enabled() -> bool:
    """Whether the agent records in this process."""
    return False


def init() -> bool:
    """Start the agent in this process when ``RANKSCOPE_ENABLE=1``; safe to call any number of times.

    Returns whether the agent is recording afterwards.
    """
    return enabled()


def span(
    name: str,
    kind: str = "compute",
    step: int | None = None,
    microbatch: int | None = None,
    **attributes: Any,
) -> Any:
    """Time a code segment: ``with span("forward", step=3, microbatch=0): ...`` or ``@span("load")``.

    ``step`` defaults to the step last given to ``set_step``. A segment that contains a
    collective is split around it, so compute time never includes waiting for other ranks.
    """
    return _NOOP_SPAN


def set_step(step: int) -> None:
    """Mark the start of training step ``step`` (numbered from 1) on this rank."""


def record_scalars(step: int, **values: float) -> None:
    """Record this rank's numeric scalars for ``step`` (loss, grad_norm, tokens_per_s, mfu, ...)."""


def name_groups(groups: Mapping[str, Any]) -> None:
    """Give process groups the names the diagnosis reports, e.g. ``{"tp[0]": group, ...}``.

    Only the groups this rank belongs to need be passed; members are read from the group.
    """


def set_topology(
    tp: int,
    pp: int,
    dp: int,
    *,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    dp_rank: int | None = None,
) -> None:
    """Declare the job's 3D-parallel sizes and this rank's coordinates.

    Coordinates left out follow Megatron's order: rank = tp_rank + dp_rank*tp + pp_rank*tp*dp.
    """

