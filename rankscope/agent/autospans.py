"""Steps and compute spans for scripts that never call the agent's API.

- Steps: torch's global optimizer hooks. An iteration ends when an optimizer's ``step()``
  returns; with several optimizers the step is one more than the most steps any of them has
  taken, so a GAN's two optimizers do not count every iteration twice. Each step also records
  the scalar ``step_time_s``. The ``step()`` call itself is an ``optimizer`` span, less the
  closure it is given (Lightning runs forward and backward in it: they get their own spans). A script that
  updates its weights by hand (no torch optimizer exists when its second forward after a
  backward begins) gets a step per forward-backward cycle of its outermost module instead; the
  choice is made once, so steps never go backwards and every rank of the job counts alike.
- ``forward``: the outermost modules that hold parameters (the DDP or FSDP wrapper, the model
  a plain script calls). They are found by global module hooks that run only until the first
  optimizer step (or ``DISCOVERY_CALLS`` outermost calls without one), because global hooks put
  every submodule call on torch's slow path; afterwards only the roots carry hooks. A step given a
  closure, which may run the forward (Lightning's do), ends them only once a root is found.
- ``backward``: from the moment autograd computes the gradient of a root's output to the end of
  that backward pass (an engine callback queued then). It ends before DDP's own end-of-backward
  callback, which waits for the gradient all-reduces: that wait is not compute.
- ``grad_sync`` (comm) of a DDP root: that wait, from the end of the backward pass to the end of
  DDP's callback (a second engine callback, queued from the first, runs after it). Its ends also
  tell the collective tracker when the reducer's all-reduces, issued in C++, began and ended.

Precedence: the script's own API wins, per kind. The first explicit ``set_step`` turns automatic
steps off for good; the first explicit ``compute`` span turns automatic forward/backward spans
off (and removes the discovery hooks at once); the first explicit ``optimizer`` span turns the
automatic optimizer span off. The bundled trainer therefore records exactly its own spans.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.nn.modules import module as nn_module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import optimizer as optim

from rankscope.agent.collective_tracker import Collectives
from rankscope.agent.config import warn_once
from rankscope.agent.recorder import Recorder, Span
from rankscope.protos.v1 import telemetry_pb2 as pb

DISCOVERY_CALLS = 100

COMPUTE, OPTIMIZER, COMM = pb.SPAN_KIND_COMPUTE, pb.SPAN_KIND_OPTIMIZER, pb.SPAN_KIND_COMM

H = TypeVar("H", bound=Callable[..., None])


def _hook(fn: H) -> H:
    """A hook torch calls inside the script's forward, backward or step: it never raises there (and
    returns what ``fn`` does: an optimizer pre-hook may hand torch new arguments)."""

    @functools.wraps(fn)
    def safe(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            warn_once(f"autospans:{fn.__name__}", f"an automatic span hook failed ({exc!r})")
            return None

    return safe  # type: ignore[return-value]


class AutoSpans:
    """The optimizer and module hooks of one recorder; ``close`` removes them all."""

    def __init__(self, rec: Recorder, collectives: Collectives | None = None) -> None:
        self.rec = rec
        self._collectives = collectives
        self._ddp_output = False  # the root whose output the next backward starts from is a DDP module
        self._synced_from: tuple[int, int] | None = None  # (token, step) where a DDP backward pass's compute ended
        self._tls = threading.local()
        self._handles: list[Any] = []
        self._discovery: list[Any] = []
        self._roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._outermost_calls = 0
        self._steps_taken: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._optimizer_spans: dict[int, Span] = {}
        self._step_start = 0
        self._backward_open: Span | None = None
        self._backward_done = False  # a backward pass ended since the last root forward began
        self._steps_by: str | None = None  # "optimizer" or "cycles" (forward-backward), once known
        self._engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        self._handles.append(optim.register_optimizer_step_pre_hook(self._before_step))
        self._handles.append(optim.register_optimizer_step_post_hook(self._after_step))
        self._discovery.append(nn_module.register_module_forward_pre_hook(self._discover_pre))
        self._discovery.append(nn_module.register_module_forward_hook(self._discover_post, always_call=True))

    def close(self) -> None:
        self._end_discovery()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- steps and the optimizer span ------------------------------------------------------------

    @_hook
    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        closure = kwargs.get("closure") if kwargs.get("closure") is not None else args[0] if args and callable(args[0]) else None
        if closure is None or self._roots:  # a closure runs the forward: the roots may be found inside it
            self._end_discovery()
        self._first_step()
        stale = self._optimizer_spans.pop(id(opt), None)
        if stale is not None:  # its last step() raised, so the post-hook never ended it
            stale.discard()
        if OPTIMIZER in self.rec.explicit_kinds:
            return None
        span = self.rec.span("optimizer", "optimizer", None, None, {}, auto=True)
        self._optimizer_spans[id(opt)] = span
        span.__enter__()
        if closure is None:
            return None
        wrapped = _outside(span, closure)
        return (args, {**kwargs, "closure": wrapped}) if "closure" in kwargs else ((wrapped, *args[1:]), kwargs)

    @_hook
    def _after_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        span = self._optimizer_spans.pop(id(opt), None)
        if span is not None:
            span.__exit__(None, None, None)
        if self.rec.explicit_steps:
            return
        self._steps_by = self._steps_by or "optimizer"
        if self._steps_by != "optimizer":
            return
        self._steps_taken[opt] = self._steps_taken.get(opt, 0) + 1
        step = max(self._steps_taken.values()) + 1
        if step > self.rec.state.step:
            self._begin_step(step)

    def _next_cycle(self) -> None:
        """A root forward after a backward: a new step for a script without a torch optimizer."""
        if self.rec.explicit_steps:
            return
        if self._steps_by is None:
            self._steps_by = "optimizer" if _an_optimizer_exists() else "cycles"
        if self._steps_by == "cycles":
            self._begin_step(self.rec.state.step + 1)

    def _begin_step(self, step: int) -> None:
        """End the current step (its ``step_time_s``) and begin ``step``."""
        now = self.rec.clock.wall_ns()
        if self._step_start:
            self.rec.add_scalar(self.rec.state.step, self.rec.strings.id("step_time_s"), (now - self._step_start) / 1e9, now)
        self._step_start = now
        self.rec.set_step(step)

    def _first_step(self) -> None:
        if not self.rec.explicit_steps and self.rec.state.step == 0:
            self._step_start = self.rec.clock.wall_ns()
            self.rec.set_step(1)

    # --- finding the roots -----------------------------------------------------------------------

    @_hook
    def _discover_pre(self, module: torch.nn.Module, args: Any) -> None:
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        if COMPUTE in self.rec.explicit_kinds:
            self._end_discovery()
        elif depth == 0 and module not in self._roots and next(module.parameters(), None) is not None:
            self._roots.add(module)
            self._hook_root(module)
            self._root_pre(module, args)  # its own hooks start with its next call
        if depth == 0:
            self._outermost_calls += 1
            if self._outermost_calls >= DISCOVERY_CALLS:
                self._end_discovery()

    @_hook
    def _discover_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._tls.depth = max(getattr(self._tls, "depth", 1) - 1, 0)
        self._root_post(module, args, output)

    def _end_discovery(self) -> None:
        for handle in self._discovery:
            handle.remove()
        self._discovery.clear()
        self._tls.depth = 0

    def _hook_root(self, module: torch.nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._root_pre))
        self._handles.append(module.register_forward_hook(self._root_post, always_call=True))

    # --- forward and backward --------------------------------------------------------------------

    @_hook
    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        if COMPUTE in self.rec.explicit_kinds or getattr(self._tls, "forward", None) is not None:
            return
        if self._backward_done:
            self._backward_done = False
            self._next_cycle()
        self._first_step()
        span = self.rec.span("forward", "compute", None, None, {}, auto=True)
        self._tls.forward = (module, span)
        span.__enter__()

    @_hook
    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        opened = getattr(self._tls, "forward", None)
        if opened is None or opened[0] is not module:
            return
        self._tls.forward = None
        opened[1].__exit__(None, None, None)
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            self._ddp_output = isinstance(module, DistributedDataParallel)
            tensor.register_hook(self._backward_start)

    @_hook
    def _backward_start(self, grad: torch.Tensor) -> None:
        if self._backward_open is None and COMPUTE not in self.rec.explicit_kinds:
            span = self.rec.span("backward", "compute", None, None, {}, auto=True)
            self._backward_open = span
            span.__enter__()
            if self._ddp_output and self._collectives is not None:
                self._collectives.backward_began(self.rec.clock.wall_ns())
            self._engine.queue_callback(self._backward_end)

    @_hook
    def _backward_end(self) -> None:
        span, self._backward_open = self._backward_open, None
        if span is not None:
            span.__exit__(None, None, None)
            self._backward_done = True
            if self._ddp_output:
                self._synced_from = (self.rec.now(), span.step)
                self._engine.queue_callback(self._synced)  # after DDP's callback, queued during the pass

    @_hook
    def _synced(self) -> None:
        """DDP's end-of-backward callback returned: its gradient all-reduces are done."""
        began, self._synced_from = self._synced_from, None
        end = self.rec.now()
        if self._collectives is not None:  # the reducer's all-reduces end with the span: both clocks read at one instant
            self._collectives.backward_synced(self.rec.clock.wall_ns())
        if began is not None:
            self.rec.add_span(self.rec.strings.id("grad_sync"), COMM, began[1], -1, began[0], end, -1)


def _outside(span: Span, closure: Callable[..., Any]) -> Callable[..., Any]:
    """``closure``, run outside the optimizer's ``span``: a framework (Lightning) runs forward and
    backward inside ``optimizer.step(closure)``, and they are their own spans, not the optimizer's.
    The span's piece before the closure ends when it begins, the next one starts when it returns."""

    @functools.wraps(closure)
    def run(*args: Any, **kwargs: Any) -> Any:
        span.end_piece()
        try:
            return closure(*args, **kwargs)
        finally:
            span.__enter__()

    return run


def _an_optimizer_exists() -> bool:
    """Whether this process has constructed a torch optimizer: torch marks the ``step`` of each
    optimizer class it constructs as ``hooked``."""
    classes = [optim.Optimizer]
    while classes:
        cls = classes.pop()
        if getattr(getattr(cls, "step", None), "hooked", False):
            return True
        classes.extend(cls.__subclasses__())
    return False


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a module's output that autograd will differentiate, if any."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None
