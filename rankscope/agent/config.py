"""The agent's configuration: ``RANKSCOPE_*`` environment variables, validated once.

A training job must never fail because of its observability, so a bad value is not an error:
``load_config`` logs one warning per bad variable (naming it and the accepted form) and returns
None, and the agent stays off while training runs as if it were not installed.

=========================  ==================================================================
variable                   meaning (default)
=========================  ==================================================================
RANKSCOPE_ENABLE           ``1`` turns the agent on in every training rank (off)
RANKSCOPE_COLLECTOR        the collector, ``host:port``, ``[v6 address]:port`` or
                           ``unix:/path/of/its.sock`` (127.0.0.1:7777)
RANKSCOPE_RUN_ID           the run's id (torchrun's TORCHELASTIC_RUN_ID, else SLURM_JOB_ID,
                           else agreed between the ranks at start-up)
RANKSCOPE_HOST             the host name to report, a template over ``{rank}``,
                           ``{local_rank}`` and ``{node_rank}`` with integer arithmetic, e.g.
                           ``node-{rank//8}`` (the machine's host name)
RANKSCOPE_RELAY            this host's relay, ``unix:/absolute/path`` (``rankscope relay``): the rank
                           sends through it, and straight to the collector once it is gone (none)
RANKSCOPE_TOKEN            bearer token sent with every call (none)
RANKSCOPE_TLS_CA           CA bundle (PEM): talk TLS to the collector (plain text)
RANKSCOPE_SPOOL_DIR        where batches wait while the collector is unreachable
                           (``<temp dir>/rankscope-spool-<uid>``)
RANKSCOPE_SPOOL_MAX_MB     disk each process may spool before dropping oldest-first (256)
RANKSCOPE_HEARTBEAT_S      seconds between heartbeats (2)
RANKSCOPE_FLUSH_S          seconds between sends of the recorded spans, collectives and
                           scalars; a full buffer goes out at once (2)
RANKSCOPE_STALL_S          seconds without progress before a rank is "stalled" (20)
RANKSCOPE_DEBUG            ``1`` prints one line to stderr when the agent activates, and one at
                           its end: the events it took for sending, by kind, and those dropped (off)
=========================  ==================================================================

Other parts of rankscope read their own ``RANKSCOPE_*`` variables (``OTHER_PARTS``); any other
``RANKSCOPE_*`` variable is most likely a typo and gets an "unknown option" warning.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = [
    "AGENT_VARIABLES",
    "OTHER_PARTS",
    "AgentConfig",
    "TemplateError",
    "load_config",
    "parse_host_template",
    "render_host",
    "warn_once",
]

log = logging.getLogger("rankscope.agent")

AGENT_VARIABLES = (
    "RANKSCOPE_ENABLE",
    "RANKSCOPE_COLLECTOR",
    "RANKSCOPE_RELAY",
    "RANKSCOPE_RUN_ID",
    "RANKSCOPE_HOST",
    "RANKSCOPE_TOKEN",
    "RANKSCOPE_TLS_CA",
    "RANKSCOPE_SPOOL_DIR",
    "RANKSCOPE_SPOOL_MAX_MB",
    "RANKSCOPE_HEARTBEAT_S",
    "RANKSCOPE_FLUSH_S",
    "RANKSCOPE_STALL_S",
    "RANKSCOPE_DEBUG",
)

#: Variables that belong to other parts of rankscope: never reported as unknown here.
OTHER_PARTS = (
    "RANKSCOPE_INJECT",  # trainer: fault injection
    "RANKSCOPE_ROLE",  # autoload: marks collector and dashboard processes (and their children) as no rank
    "RANKSCOPE_AGENT_PID",  # autoload: set by an active agent, so its child processes stay off
    "RANKSCOPE_TLS_CERT",  # collector: its TLS certificate (--tls-cert)
    "RANKSCOPE_TLS_KEY",  # collector: its TLS private key (--tls-key)
)

DEFAULT_COLLECTOR = "127.0.0.1:7777"

T = TypeVar("T")
D = TypeVar("D")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` the first time ``key`` is seen in this process.

    The agent's failures repeat (every batch to a dead collector fails the same way); one line
    per kind of failure says everything without flooding the training log.
    """
    if key not in _warned:
        _warned.add(key)
        log.warning("rankscope agent: %s", message)


@dataclass(frozen=True)
class AgentConfig:
    """Validated settings of one process's agent (see the module docstring for the variables)."""

    #: gRPC target of the collector: ``host:port`` or ``[v6]:port``
    collector: str
    #: None when nothing names the run: the ranks then agree one at start-up
    run_id: str | None
    #: RANKSCOPE_HOST, validated; "" reports the machine's host name
    host_template: str
    token: str | None
    #: CA bundle for TLS; None talks plain text
    tls_ca: Path | None
    spool_dir: Path
    spool_max_bytes: int
    heartbeat_s: float
    #: seconds between two sends of the recorded rows: each send costs the collector an ingest
    #: call per kind, so fewer, larger batches keep it cheap where it shares the job's machine
    flush_s: float
    stall_s: float
    debug: bool
    #: torchrun's RANK / WORLD_SIZE / LOCAL_RANK / GROUP_RANK (NODE_RANK); None when not launched so
    rank: int | None
    world_size: int | None
    local_rank: int | None
    node_rank: int | None
    #: gRPC target of this host's relay (``rankscope relay``); None sends to the collector directly
    relay: str | None = None

    def host(self, rank: int, local_rank: int, node_rank: int) -> str:
        """The host name this rank reports: RANKSCOPE_HOST rendered, or the machine's name."""
        if not self.host_template:
            return socket.gethostname()
        return render_host(self.host_template, rank, local_rank, node_rank)


def load_config(environ: Mapping[str, str]) -> AgentConfig | None:
    """The agent's configuration from ``environ``; None when the agent is off or misconfigured.

    Every bad variable gets one warning naming it and the accepted form; an unknown
    ``RANKSCOPE_*`` variable gets an "unknown option" warning and changes nothing.
    """
    errors: list[str] = []
    read = _Reader(environ, errors)
    if not read.value("RANKSCOPE_ENABLE", _flag, False, "1 (on) or 0 (off)"):
        _report(errors)
        return None
    for name in sorted(environ):
        if name.startswith("RANKSCOPE_") and name not in AGENT_VARIABLES and name not in OTHER_PARTS:
            warn_once(f"unknown:{name}", f"unknown option {name} ignored (known: {', '.join(AGENT_VARIABLES)})")
    rank = read.value("RANK", _non_negative_int, None, "a rank number")
    local_rank = read.value("LOCAL_RANK", _non_negative_int, None, "a rank number")
    node_rank = read.value("GROUP_RANK", _non_negative_int, None, "a node number")
    if node_rank is None:
        node_rank = read.value("NODE_RANK", _non_negative_int, None, "a node number")
    config = AgentConfig(
        collector=read.value("RANKSCOPE_COLLECTOR", _address, DEFAULT_COLLECTOR, "host:port, [v6 address]:port or unix:/absolute/path"),
        relay=read.value("RANKSCOPE_RELAY", _address, None, "unix:/absolute/path (or host:port)"),
        run_id=_run_id(environ),
        host_template=read.value("RANKSCOPE_HOST", _template, "", _TEMPLATE_FORM),
        token=read.value("RANKSCOPE_TOKEN", _token, None, "printable ASCII without spaces"),
        tls_ca=read.value("RANKSCOPE_TLS_CA", _readable_file, None, "the path of a readable CA bundle (PEM)"),
        spool_dir=read.value("RANKSCOPE_SPOOL_DIR", Path, default_spool_dir(), "a directory path"),
        spool_max_bytes=read.value("RANKSCOPE_SPOOL_MAX_MB", _megabytes, 256 << 20, "a whole number of MiB >= 1"),
        heartbeat_s=read.value("RANKSCOPE_HEARTBEAT_S", _seconds, 2.0, "a positive number of seconds, e.g. 2"),
        flush_s=read.value("RANKSCOPE_FLUSH_S", _seconds, 2.0, "a positive number of seconds, e.g. 2"),
        stall_s=read.value("RANKSCOPE_STALL_S", _seconds, 20.0, "a positive number of seconds, e.g. 20"),
        debug=read.value("RANKSCOPE_DEBUG", _flag, False, "1 (on) or 0 (off)"),
        rank=rank,
        world_size=read.value("WORLD_SIZE", _positive_int, None, "a positive number of ranks"),
        local_rank=local_rank,
        node_rank=node_rank,
    )
    if config.host_template and not errors:
        try:  # valid syntax; make sure it also renders for this rank (division by zero, ...)
            config.host(rank or 0, local_rank or 0, node_rank or 0)
        except TemplateError as exc:
            errors.append(f"RANKSCOPE_HOST={config.host_template!r} is not valid ({exc}): expected {_TEMPLATE_FORM}")
    if errors:
        _report(errors)
        return None
    return config


def default_spool_dir() -> Path:
    """A per-user directory under the system temp dir, so users never share (or block) spools."""
    return Path(tempfile.gettempdir()) / f"rankscope-spool-{os.getuid()}"


# --- reading one variable -------------------------------------------------------------------------


class _Reader:
    """Reads variables through converters, collecting one message per bad value."""

    def __init__(self, environ: Mapping[str, str], errors: list[str]) -> None:
        self.environ = environ
        self.errors = errors

    def value(self, name: str, convert: Callable[[str], T], default: D, form: str) -> T | D:
        """``convert(value)``, or ``default`` when unset or empty, or when bad (recorded in errors)."""
        raw = self.environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            return convert(raw.strip())
        except (ValueError, TemplateError) as exc:
            reason = f" ({exc})" if str(exc) else ""
            self.errors.append(f"{name}={raw!r} is not valid{reason}: expected {form}")
            return default


def _report(errors: list[str]) -> None:
    for message in errors:
        warn_once(f"bad:{message}", f"{message}; the agent stays off")


def _flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("")
    return raw == "1"


def _integer(raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("not a whole number") from None
    if value < minimum:
        raise ValueError(f"less than {minimum}")
    return value


def _non_negative_int(raw: str) -> int:
    return _integer(raw, 0)


def _positive_int(raw: str) -> int:
    return _integer(raw, 1)


def _megabytes(raw: str) -> int:
    return _integer(raw, 1) << 20


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError("not a positive number")
    return value


_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")


def _address(raw: str) -> str:
    if raw.startswith("unix:"):
        if not raw.startswith("unix:/"):
            raise ValueError("a unix socket's path must be absolute")
        return raw
    match = _HOST_PORT.fullmatch(raw)
    if match is None:
        raise ValueError("")
    if not 1 <= int(match["port"]) <= 65535:
        raise ValueError("port out of range")
    return raw


def _template(raw: str) -> str:
    parse_host_template(raw)
    return raw


def _token(raw: str) -> str:
    if not all(33 <= ord(c) <= 126 for c in raw):
        raise ValueError("")
    return raw


def _readable_file(raw: str) -> Path:
    path = Path(raw)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ValueError("no such readable file")
    return path


def _run_id(environ: Mapping[str, str]) -> str | None:
    """RANKSCOPE_RUN_ID, else torchrun's run id, else the Slurm job id.

    torchrun without ``--rdzv-id`` sets TORCHELASTIC_RUN_ID to the literal "none": unrelated
    jobs would share it, so it does not count as an id.
    """
    for name in ("RANKSCOPE_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = environ.get(name, "").strip()
        if value and value != "none":
            return value
    return None


# --- RANKSCOPE_HOST templates ---------------------------------------------------------------------
#
# template := (text | "{{" | "}}" | "{" expr "}")*
# expr     := term (("+" | "-") term)*
# term     := unary (("*" | "//" | "%") unary)*
# unary    := "-" unary | atom
# atom     := INTEGER | NAME | "(" expr ")"
#
# Parsed by hand (never eval): a template comes from the environment of every rank.

_TEMPLATE_FORM = "text with {expr} parts over rank, local_rank, node_rank, integers, + - * // % and ( ), e.g. node-{rank//8}"
_NAMES = ("rank", "local_rank", "node_rank")
_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_]\w*)|(?P<op>//|[-+*%()]))")

# A parsed expression: int (literal), str (name), or (op, left, right) / ("neg", operand, None).
Expr = int | str | tuple


class TemplateError(ValueError):
    """A RANKSCOPE_HOST template that cannot be parsed or rendered."""


def parse_host_template(template: str) -> tuple[tuple[str, object], ...]:
    """The template as ``("text", str)`` and ``("expr", tree)`` parts, in order.

    Raises TemplateError for syntax errors, unknown names and division by a literal zero.
    """
    parts: list[tuple[str, object]] = []
    text: list[str] = []
    i = 0
    while i < len(template):
        c = template[i]
        if template.startswith("{{", i) or template.startswith("}}", i):
            text.append(c)
            i += 2
        elif c == "{":
            end = template.find("}", i)
            if end < 0:
                raise TemplateError(f"unclosed '{{' at position {i}")
            if text:
                parts.append(("text", "".join(text)))
                text = []
            parts.append(("expr", _Parser(template[i + 1 : end]).parse()))
            i = end + 1
        elif c == "}":
            raise TemplateError(f"unmatched '}}' at position {i} (write '}}}}' for a brace)")
        else:
            text.append(c)
            i += 1
    if text:
        parts.append(("text", "".join(text)))
    return tuple(parts)


def render_host(template: str, rank: int, local_rank: int, node_rank: int) -> str:
    """``template`` with each ``{expr}`` replaced by its integer value, e.g. ``node-{rank//8}``."""
    values = {"rank": rank, "local_rank": local_rank, "node_rank": node_rank}
    out = []
    for kind, value in parse_host_template(template):
        out.append(value if kind == "text" else str(_evaluate(value, values)))
    return "".join(out)


class _Parser:
    """Recursive descent over one ``{...}`` expression."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tokens: list[str] = []
        pos = 0
        while pos < len(source):
            match = _TOKEN.match(source, pos)
            if match is None or match.end() == pos:
                if source[pos:].strip() == "":
                    break
                raise TemplateError(f"unexpected {source[pos:].strip()[0]!r} in {{{source}}}")
            self.tokens.append(match.group(match.lastgroup or "int"))
            pos = match.end()
        self.pos = 0

    def parse(self) -> Expr:
        if not self.tokens:
            raise TemplateError("empty {}")
        tree = self._expr()
        if self.pos != len(self.tokens):
            raise TemplateError(f"unexpected {self.tokens[self.pos]!r} in {{{self.source}}}")
        return tree

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise TemplateError(f"{{{self.source}}} ends too early")
        self.pos += 1
        return token

    def _expr(self) -> Expr:
        tree = self._term()
        while self._peek() in ("+", "-"):
            op = self._take()
            tree = (op, tree, self._term())
        return tree

    def _term(self) -> Expr:
        tree = self._unary()
        while self._peek() in ("*", "//", "%"):
            op = self._take()
            right = self._unary()
            if op != "*" and right == 0:
                raise TemplateError(f"division by zero in {{{self.source}}}")
            tree = (op, tree, right)
        return tree

    def _unary(self) -> Expr:
        if self._peek() == "-":
            self._take()
            return ("neg", self._unary(), None)
        return self._atom()

    def _atom(self) -> Expr:
        token = self._take()
        if token == "(":
            tree = self._expr()
            if self._take() != ")":
                raise TemplateError(f"missing ')' in {{{self.source}}}")
            return tree
        if token.isdigit():
            return int(token)
        if token in _NAMES:
            return token
        if token[0].isalpha() or token[0] == "_":
            raise TemplateError(f"unknown name {token!r} (known: {', '.join(_NAMES)})")
        raise TemplateError(f"unexpected {token!r} in {{{self.source}}}")


def _evaluate(tree: Expr, values: Mapping[str, int]) -> int:
    if isinstance(tree, int):
        return tree
    if isinstance(tree, str):
        return values[tree]
    op, left, right = tree
    a = _evaluate(left, values)
    if op == "neg":
        return -a
    b = _evaluate(right, values)
    if op in ("//", "%") and b == 0:
        raise TemplateError("division by zero")
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b if op == "//" else a % b
