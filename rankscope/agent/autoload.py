"""Activation: with ``RANKSCOPE_ENABLE=1`` the agent starts in every training rank of any Python job.

The package installs ``rankscope-agent.pth`` at the root of site-packages (see setup.py). Python
runs its one line at every interpreter start; with the variable unset that line is a dictionary
look-up and nothing else is imported. With ``RANKSCOPE_ENABLE=1`` it calls ``boot()``, which
imports nothing heavy either: it only installs a post-import hook, because whether this process
is a training rank is only known later:

- a process launched by torchrun (``RANK`` and ``WORLD_SIZE`` set) activates as soon as ``torch``
  has been imported, so heartbeats run before, during and after the rendezvous;
- any other process activates right after ``torch.distributed.init_process_group`` returns;
- a process never activates when it is marked as no rank (``forbid()``: the collector, the
  dashboard, ``rankscope train``'s launcher), when it descends from an active rank (subprocesses
  and multiprocessing workers inherit ``RANKSCOPE_AGENT_PID``), or when it was forked from one
  (data-loader workers: the at-fork handler keeps it off).

torchrun's own agent process has no RANK and never calls init_process_group, so it stays off.

Activation hands over to ``rankscope.agent.runtime.start(config)``. ``RANKSCOPE_DEBUG=1`` prints
"rankscope agent: active in rank R (pid P)" to stderr at that moment.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from rankscope import agent as api

__all__ = ["activate", "active", "boot", "forbid", "forked_rank", "when_imported"]

ROLE_VARIABLE = "RANKSCOPE_ROLE"
PARENT_VARIABLE = "RANKSCOPE_AGENT_PID"

_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.RLock()
_installed = False
_booted = False
_tried = False  # activation is decided once per process
_active = False
_forbidden: str | None = None
_forked = False


def boot() -> None:
    """Called by the .pth line when RANKSCOPE_ENABLE=1: watch for torch, decide later.

    Never raises: a broken agent must not stop the interpreter from starting.
    """
    global _booted
    try:
        with _lock:
            if os.environ.get(ROLE_VARIABLE):  # started by a process that is no rank
                _stay_off()
                return
            if _booted:
                return
            _booted = True
        when_imported("torch", _on_torch)
    except Exception as exc:  # noqa: BLE001 - start-up must go on whatever happens
        _warn("boot", f"could not install its start-up hook ({exc!r}); it stays off")


def forbid(role: str, *, children: bool = True) -> None:
    """Mark this process as no training rank: the agent never activates here.

    The collector and the dashboard call it first thing (``children=True`` also keeps the
    processes they start off, through RANKSCOPE_ROLE); ``rankscope train``'s launcher uses
    ``children=False``, because the ranks it launches must activate.
    """
    global _forbidden
    _forbidden = role
    _stay_off()
    if children:
        os.environ[ROLE_VARIABLE] = role


def active() -> bool:
    """Whether the agent was started in this process (and this is not a forked copy of it)."""
    return _active and not _forked


def activate(rank: int | None = None) -> bool:
    """Start the agent in this process if it is a training rank; idempotent, never raises.

    ``rank`` is the process's global rank when the caller knows it (after init_process_group);
    otherwise torchrun's RANK. Returns whether the agent is active afterwards.
    """
    global _active, _tried
    with _lock:
        if _tried or _forked or _forbidden or os.environ.get(ROLE_VARIABLE):
            return active()
        parent = os.environ.get(PARENT_VARIABLE)
        if parent and parent != str(os.getpid()):
            return _stay_off()  # a subprocess or multiprocessing worker of an active rank
        _tried = True
        _install()
        try:
            from rankscope.agent.config import load_config

            config = load_config(os.environ)
            if config is None:
                return _stay_off()
            os.environ[PARENT_VARIABLE] = str(os.getpid())
            if config.debug:
                shown = rank if rank is not None else config.rank
                print(f"rankscope agent: active in rank {shown} (pid {os.getpid()})", file=sys.stderr, flush=True)
            from rankscope.agent import runtime

            runtime.start(config)
            _active = True
        except Exception as exc:  # noqa: BLE001 - the agent must never break training
            _warn("start", f"could not start ({exc!r}); training continues without it")
            return _stay_off()
        return active()


def forked_rank() -> bool:
    """This process was forked to be a rank, not as a copy of one (rankscope's launcher forks the
    bundled trainer's ranks from torchrun's agent, which is no rank): decide as a new process would,
    now that torchrun's RANK is set. Returns whether the agent is active afterwards."""
    global _forked, _tried
    with _lock:
        if not _booted:  # RANKSCOPE_ENABLE was unset in the agent, and so it is here
            return False
        _forked = _tried = False
        api._may_start = os.environ.get("RANKSCOPE_ENABLE") == "1"
    return activate() if _torchrun_rank() else active()


def _stay_off() -> bool:
    """Activation is decided against: the public API drops its wait for a late start, so that
    ``span`` hands out its no-op object instead of checking for the agent at every call."""
    api._may_start = False
    return False


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported (now, if it already is).

    Callbacks run at the end of the module's import, on the importing thread: they should
    patch attributes and return, and must not wait for threads that import the same module.
    Used for torch.distributed's collectives and init_process_group.
    """
    with _lock:
        _install()
        module = sys.modules.get(name)
        if module is None or _initializing(module):
            _hooks.setdefault(name, []).append(callback)
            return
    _run(callback, module)


def _install() -> None:
    """The import hook and the at-fork handler, once per process."""
    global _installed
    if not _installed:
        _installed = True
        sys.meta_path.insert(0, _PostImportFinder())
        os.register_at_fork(after_in_child=_after_fork_in_child)


# --- what happens when torch arrives ----------------------------------------------------------------


def _on_torch(torch: ModuleType) -> None:
    distributed = getattr(torch, "distributed", None)
    if distributed is not None and hasattr(distributed, "init_process_group"):
        _patch_init_process_group(distributed)
    if _torchrun_rank():
        activate()


def _torchrun_rank() -> bool:
    """Whether torchrun launched this process as a rank: it starts the agent at once, before the rendezvous."""
    return bool(os.environ.get("RANK") and os.environ.get("WORLD_SIZE"))


def _patch_init_process_group(distributed: ModuleType) -> None:
    """Make init_process_group start the agent right after the default group exists."""
    from torch.distributed import distributed_c10d  # type: ignore[import-not-found]

    original = distributed_c10d.init_process_group
    if getattr(original, "__rankscope_wrapped__", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            rank = distributed.get_rank()
        except Exception:  # noqa: BLE001 - the group exists; its rank is only for the debug line
            rank = None
        activate(rank)
        return result

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    init_process_group.__rankscope_wrapped__ = True  # type: ignore[attr-defined]
    distributed_c10d.init_process_group = init_process_group
    distributed.init_process_group = init_process_group


def _after_fork_in_child() -> None:
    """A forked child (data-loader worker) is a copy of a rank, not a rank: it stays quiet."""
    global _forked, _lock
    _forked = True
    _stay_off()
    _lock = threading.RLock()  # another thread of the parent may have held it at the fork


# --- post-import hooks ---------------------------------------------------------------------------


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _run(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001 - a failing hook must not break the user's import
        _warn(f"hook:{module.__name__}", f"hook on {module.__name__} failed ({exc!r}); part of the agent is off")


class _PostImportFinder(MetaPathFinder):
    """Finds nothing itself: wraps the loader of watched modules so that hooks run after them."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in _hooks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname  # the other finders below must not find us again
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _HookedLoader(spec.loader)
                    return spec
            return None
        finally:
            self._busy.name = None


class _HookedLoader(Loader):
    """Runs the real loader, puts it back on the module, then the module's hooks."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with _lock:
            callbacks = _hooks.pop(module.__name__, [])
        for callback in callbacks:
            _run(callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _warn(key: str, message: str) -> None:
    # config's warn_once, imported late: boot() runs at every interpreter start.
    from rankscope.agent.config import warn_once

    warn_once(key, message)
