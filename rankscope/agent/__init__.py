"""rankscope's in-process agent: the public API training code calls.

Training code marks its critical segments and scalars through these functions whether or not
the agent is switched on. While the agent is off (the default; ``RANKSCOPE_ENABLE`` unset) every
call returns at once and records nothing, so the bundled trainer and users' scripts can call
them unconditionally on the hot path. While it is on, a span costs about a microsecond (one tuple
of integers appended to a queue; see ``recorder.py``).

Span kinds: ``compute`` (forward, backward, ...), ``comm`` (time spent in communication),
``data`` (loading a batch), ``optimizer`` and ``user``.

Scripts that call nothing here still get steps, forward/backward/optimizer spans and every
collective once ``RANKSCOPE_ENABLE=1`` is set (``autospans.py``, ``collective_patches.py``);
explicit calls take precedence over the automatic ones, kind by kind.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rankscope.agent.recorder import Recorder

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

#: the running agent's recorder (set by rankscope.agent.runtime); None while the agent is off
_recorder: Recorder | None = None
#: whether the agent may still start in this process: decorators must then resolve at call time.
#: Cleared wherever activation is decided against, so that ``span`` takes the no-op fast path.
_may_start = os.environ.get("RANKSCOPE_ENABLE") == "1"


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


class _LateSpan(_NoopSpan):
    """``span`` before the agent has started: times nothing, but as a decorator it looks the
    agent up at every call, so functions decorated at import time are timed once it runs."""

    __slots__ = ("_args",)

    def __init__(self, *args: Any) -> None:
        self._args = args

    def __call__(self, fn: F) -> F:
        return decorate(fn, *self._args)


def _attach(recorder: Recorder | None) -> None:
    """Switch the API on (a recorder) or off (None); called by the runtime."""
    global _recorder
    _recorder = recorder


def _warn(what: str, exc: BaseException) -> None:
    from rankscope.agent.config import warn_once

    warn_once(f"api:{what}", f"{what} failed ({exc!r}); training goes on")


def enabled() -> bool:
    """Whether the agent records in this process."""
    return _recorder is not None


def init() -> bool:
    """Start the agent in this process when ``RANKSCOPE_ENABLE=1``; safe to call any number of times.

    Returns whether the agent is recording afterwards.
    """
    global _may_start
    _may_start = os.environ.get("RANKSCOPE_ENABLE") == "1"
    if _recorder is None and _may_start:
        try:
            from rankscope.agent.autoload import activate

            activate()
        except Exception as exc:  # noqa: BLE001 - the agent must never break training
            _warn("init", exc)
        _may_start = enabled()  # decided either way: a refused agent does not come back
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
    rec = _recorder
    if rec is None:
        return _LateSpan(name, kind, step, microbatch, attributes) if _may_start else _NOOP_SPAN
    try:
        return rec.span(name, kind, step, microbatch, attributes)
    except Exception as exc:  # noqa: BLE001
        _warn("span", exc)
        return _NOOP_SPAN


def decorate(fn: F, name: str, kind: str, step: int | None, microbatch: int | None, attributes: dict[str, Any]) -> F:
    """``fn`` timed as ``span(name, ...)`` at every call, whatever the agent's state then."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with span(name, kind, step, microbatch, **attributes):
            return fn(*args, **kwargs)

    return timed  # type: ignore[return-value]


def set_step(step: int) -> None:
    """Mark the start of training step ``step`` (numbered from 1) on this rank."""
    rec = _recorder
    if rec is not None:
        try:
            rec.explicit_steps = True
            rec.set_step(int(step))
        except Exception as exc:  # noqa: BLE001
            _warn("set_step", exc)


def record_scalars(step: int, **values: float) -> None:
    """Record this rank's numeric scalars for ``step`` (loss, grad_norm, tokens_per_s, mfu, ...)."""
    rec = _recorder
    if rec is not None:
        try:
            now = rec.clock.wall_ns()
            for name, value in values.items():
                rec.add_scalar(int(step), rec.strings.id(name), value, now)
        except Exception as exc:  # noqa: BLE001
            _warn("record_scalars", exc)


def name_groups(groups: Mapping[str, Any]) -> None:
    """Give process groups the names the diagnosis reports, e.g. ``{"tp[0]": group, ...}``.

    Only the groups this rank belongs to need be passed; members are read from the group.
    """
    if _recorder is not None:
        try:
            from rankscope.agent import runtime

            running = runtime.current()
            if running is not None:
                running.name_groups(groups)
        except Exception as exc:  # noqa: BLE001
            _warn("name_groups", exc)


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
    if _recorder is not None:
        try:
            from rankscope.agent import runtime

            running = runtime.current()
            if running is not None:
                running.set_topology(tp, pp, dp, (tp_rank, pp_rank, dp_rank))
        except Exception as exc:  # noqa: BLE001
            _warn("set_topology", exc)
