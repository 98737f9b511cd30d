"""Simulated hosts on one machine: a network namespace each, with its own address, host name, CPU
quota and freezer, wired to one switch.

Layout of a test bed named ``NAME`` (``rs`` and a short hex id, so that several can coexist and
leftovers can be found by prefix):

- namespace ``NAME-sw``: the switch, a Linux bridge ``br0``;
- namespace ``NAME-hI`` per host I: interface ``eth0`` (``10.200.0.{I+1}/24``), a veth whose peer
  ``hI`` is a port of ``br0``; ``lo`` up; ``/etc/netns/NAME-hI/hosts`` names every host, so host
  names resolve inside the namespaces (``ip netns exec`` mounts it over ``/etc/hosts``);
- cgroups (v1) ``cpu/MAKER/rankscope/NAME-hI`` and ``freezer/rankscope/NAME-hI``: a host's processes
  join them before entering the namespace (``ip netns exec`` remounts /sys), so its CPU can be
  throttled and all of it frozen from outside. ``MAKER`` is the cpu cgroup of the process that made
  the test bed (empty for a shell in the root group): the hosts get no more CPU weight than their
  maker has, as its own children would, so a test bed made by a low-priority job yields as that job does.

Each host gets CPU of its own: a fixed quota (``cores`` per host; by default the hosts share 70% of
the machine) on CPUs of its own where there are enough (``cpus``; else round-robin), as a virtual
machine has its vCPUs. Without it the hosts would share every core, and a
host that idles (waiting for a slow peer) would hand its CPU to the others: a fault on one host
would slow hosts that have nothing wrong with them. The quota's period is short (10 ms), so that a
host's share comes in small slices rather than in bursts that would read as slow segments.

Every address lives inside the namespaces: nothing here routes through the root namespace, whose
10.x traffic would leave the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

__all__ = [
    "Host", "Testbed", "TestbedError", "command_on", "create", "destroy", "enter_cgroups", "leftovers", "load", "pin_rank", "running",
    "set_cpu_quota",
]  # fmt: skip

PREFIX = "rs"
SUBNET = "10.200.0"
#: the switch's own address: a control host outside every training host (a job's rendezvous store
#: lives here, so that no training host's fault takes the rendezvous down with it)
CONTROL_ADDRESS = f"{SUBNET}.254"
HOST_IF = "eth0"
BRIDGE = "br0"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "freezer")
CGROUP_PARENT = "rankscope"
NETNS_ETC = Path("/etc/netns")
#: where ``rankscope testbed up`` leaves a test bed's description for the commands after it
STATE_DIR = Path("/run/rankscope-testbed")
CFS_PERIOD_US = 10_000
#: the share of the machine's cores the hosts get between them by default (the rest: collector, tests)
MACHINE_SHARE = 0.7
#: enter the host's cgroups (before ``ip netns exec`` remounts /sys), its namespace, then its host name
_ENTER = 'for g in "$1" "$2"; do echo $$ > "$g/cgroup.procs" || exit 97; done; shift 2; exec "$@"'
_NAME = 'hostname "$1" || exit 98; shift; exec "$@"'


class TestbedError(RuntimeError):
    """A test bed cannot be made or used here (not root, no namespaces, a command failed)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its index, the host name its processes see, namespace and address."""

    index: int
    name: str
    namespace: str
    address: str
    #: the CPUs its processes may run on (hosts share them round-robin when there are more hosts than CPUs)
    cpus: tuple[int, ...] = ()
    #: the cpu cgroup its own group is made in, below the cpu hierarchy's root (see the module's docstring)
    cpu_parent: str = CGROUP_PARENT

    def cgroup(self, controller: str) -> Path:
        parent = self.cpu_parent if controller == "cpu" else CGROUP_PARENT
        return CGROUP_ROOT / controller / parent / self.namespace


@dataclass(frozen=True)
class Testbed:
    """A set of hosts behind one switch; made by ``create``, removed by ``destroy``."""

    name: str
    hosts: tuple[Host, ...]
    #: the default of a job's ranks per host (``rankscope testbed up --ranks-per-host``)
    ranks_per_host: int = 1
    #: the CPUs each host may use (its cgroup's quota)
    cores: float = 1.0
    #: whether its hosts are a Slurm cluster (``rankscope.testbed.slurm``)
    slurm: bool = False

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    @property
    def directory(self) -> Path:
        """The test bed's own files (its Slurm cluster's), removed with it."""
        return STATE_DIR / self.name

    def host(self, which: int | str) -> Host:
        """A host by index or host name."""
        for h in self.hosts:
            if which in (h.index, h.name):
                return h
        raise KeyError(f"no host {which!r} in test bed {self.name} (hosts: {', '.join(h.name for h in self.hosts)})")

    def pids(self, host: Host) -> list[int]:
        """Every process in the host's namespace (its launcher, its ranks and what they started)."""
        out = _run(["ip", "netns", "pids", host.namespace], check=False).stdout
        return [int(p) for p in out.split()]

    def save(self) -> Path:
        """Write the description for later commands (``rankscope testbed run/fault/down``)."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        path = STATE_DIR / f"{self.name}.json"
        path.write_text(json.dumps(asdict(self)))
        return path


def command_on(host: Host, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` inside ``host``, as its own processes run: in its cgroups
    (so its CPU quota and freezer apply), on its CPUs, in its namespace, under its host name (a UTS
    namespace of its own). Each step execs the next: the process started is the one that runs ``argv``.
    """
    return [
        *enter_cgroups(host), "taskset", "-c", ",".join(map(str, host.cpus)), "ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c", _NAME, "name", host.name, *argv,
    ]  # fmt: skip


def enter_cgroups(host: Host) -> list[str]:
    """The start of a command line that runs the rest in ``host``'s cgroups (its CPU quota and freezer)."""
    return ["sh", "-c", _ENTER, "enter", str(host.cgroup("cpu")), str(host.cgroup("freezer"))]


def create(hosts: int, *, ranks_per_host: int = 1, cores: float | None = None, name: str | None = None) -> Testbed:
    """Make a test bed of ``hosts`` hosts (``node0``, ``node1``, ...) with ``cores`` CPUs each; removes
    what it made if a step fails. A name that is taken (a test bed that is up, or what a killed
    one left) is refused and its test bed left alone."""
    if not 1 <= hosts <= 250:
        raise TestbedError(f"a test bed has 1 to 250 hosts, not {hosts}")
    cores = cores if cores is not None else default_cores(hosts, ranks_per_host)
    if cores <= 0:
        raise TestbedError(f"a host needs a positive number of cores, not {cores:g}")
    _check_can()
    name = name or f"{PREFIX}{secrets.token_hex(2)}"
    if not re.fullmatch(f"{PREFIX}[a-z0-9]{{1,12}}", name):
        raise TestbedError(f"a test bed's name is {PREFIX!r} and 1 to 12 small letters or digits (rsheal, rs1), not {name!r}: "
                           "what it makes is found again by that prefix")  # fmt: skip
    if found := leftovers(name):
        raise TestbedError(f"test bed {name!r} exists already ({', '.join(found[:2])}{', ...' if len(found) > 2 else ''}): "
                           f"`rankscope testbed down {name}` removes it, or name another")  # fmt: skip
    machine = sorted(os.sched_getaffinity(0))
    per_host = max(1, len(machine) // hosts)
    cpus = [tuple(machine[(i * per_host + k) % len(machine)] for k in range(per_host)) for i in range(hosts)]
    cpu_parent = "/".join([*_own_cgroup("cpu").parts[1:], CGROUP_PARENT])
    bed = Testbed(name, tuple(Host(i, f"node{i}", f"{name}-h{i}", f"{SUBNET}.{i + 1}", cpus[i], cpu_parent) for i in range(hosts)),
                  ranks_per_host, cores)  # fmt: skip
    try:
        _ip("netns", "add", bed.switch)
        _ip("-n", bed.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", bed.switch, "link", "set", BRIDGE, "up")
        _ip("-n", bed.switch, "addr", "add", f"{CONTROL_ADDRESS}/24", "dev", BRIDGE)
        _ip("-n", bed.switch, "link", "set", "lo", "up")  # the control host reaches its own address
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in bed.hosts) + f"{CONTROL_ADDRESS} control\n"
        for h in bed.hosts:
            _ip("netns", "add", h.namespace)
            _ip("-n", h.namespace, "link", "add", HOST_IF, "type", "veth", "peer", "name", f"h{h.index}", "netns", bed.switch)
            _ip("-n", bed.switch, "link", "set", f"h{h.index}", "master", BRIDGE, "up")
            _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", HOST_IF)
            _ip("-n", h.namespace, "link", "set", HOST_IF, "up")
            _ip("-n", h.namespace, "link", "set", "lo", "up")
            etc = NETNS_ETC / h.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(h.name + "\n")
            for controller in CONTROLLERS:
                h.cgroup(controller).mkdir(parents=True, exist_ok=True)
            set_cpu_quota(h, cores)
    except BaseException:
        destroy(name)
        raise
    return bed


def default_cores(hosts: int, ranks_per_host: int) -> float:
    """``MACHINE_SHARE`` of this machine's cores split between the hosts, at most a core per rank."""
    return round(min(ranks_per_host, MACHINE_SHARE * (os.cpu_count() or 1) / hosts), 2)


def set_cpu_quota(host: Host, cores: float) -> None:
    """Let the host's processes use at most ``cores`` CPUs between them, split evenly between the
    ranks pinned to it. cgroup v1 refuses a child's quota above its parent's, so a shrinking host's
    ranks shrink first and a growing host grows first."""
    parent = host.cgroup("cpu")
    ranks = sorted(p for p in parent.glob("rank*") if p.is_dir())
    steps = [(g, cores / len(ranks)) for g in ranks]
    steps = [*steps, (parent, cores)] if cores < _cores(parent) else [(parent, cores), *steps]
    for group, quota in steps:
        _quota(group, quota)


def pin_rank(host: Host, local_rank: int, pid: int, ranks_per_host: int) -> None:
    """Give one rank its share of the host's CPU to itself, as a GPU is a rank's own.

    Without it the ranks of a host share its quota, and a rank that waits on the network hands its
    CPU to the other: a slow link would make the host's other ranks compute faster than their peers.
    """
    group = host.cgroup("cpu") / f"rank{local_rank}"
    group.mkdir(exist_ok=True)
    _quota(group, _cores(host.cgroup("cpu")) / ranks_per_host)
    (group / "cgroup.procs").write_text(str(pid))


def _cores(group: Path) -> float:
    quota = int((group / "cpu.cfs_quota_us").read_text())
    return float("inf") if quota < 0 else quota / int((group / "cpu.cfs_period_us").read_text())


def _quota(group: Path, cores: float) -> None:
    (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * CFS_PERIOD_US))))


def load(name: str | None = None) -> Testbed:
    """A test bed ``rankscope testbed up`` made (the only one when ``name`` is None)."""
    saved = sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []
    if name is not None:
        saved = [p for p in saved if p.stem == name]
    if len(saved) != 1:
        known = ", ".join(p.stem for p in sorted(STATE_DIR.glob("*.json"))) if STATE_DIR.is_dir() else ""
        if name:
            raise TestbedError(f"no test bed {name!r} (up: {known or 'none'})")
        raise TestbedError(f"several test beds are up ({known}): name one" if known else "no test bed is up (rankscope testbed up makes one)")
    data = json.loads(saved[0].read_text())
    return Testbed(data["name"], tuple(Host(**{**h, "cpus": tuple(h["cpus"])}) for h in data["hosts"]), data["ranks_per_host"], data["cores"],
                   data.get("slurm", False))  # fmt: skip


def running() -> list[str]:
    """The names of the test beds whose namespaces exist."""
    return sorted({ns.rsplit("-", 1)[0] for ns in _namespaces()})


def destroy(name: str) -> None:
    """Kill every process of test bed ``name`` and remove its namespaces, links, cgroups and files.

    Works on a half-made or half-removed test bed, and from another process than the one that made it.
    """
    namespaces = [ns for ns in _namespaces() if ns.rsplit("-", 1)[0] == name]
    groups = [g for c in CONTROLLERS for g in _cgroups(c) if g.name.rsplit("-", 1)[0] == name]
    for group in groups:
        if group.parent.parent.name == "freezer":
            _write(group / "freezer.state", "THAWED")  # a frozen process does not die of SIGKILL until thawed
    victims = {int(p) for ns in namespaces for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()}
    victims |= {pid for g in groups for sub in [g, *g.glob("rank*")] for pid in _members(sub)}
    _kill_and_reap(victims)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    for group in groups:
        _rmdir(group)
        with contextlib.suppress(OSError):  # the test beds' parent group goes with the last of them
            group.parent.rmdir()
    (STATE_DIR / f"{name}.json").unlink(missing_ok=True)
    shutil.rmtree(STATE_DIR / name, ignore_errors=True)


def leftovers(name: str) -> list[str]:
    """What test bed ``name`` left behind: namespaces, /etc/netns entries, cgroups, state (empty once destroyed)."""
    found = [f"netns {ns}" for ns in _namespaces() if ns.startswith(f"{name}-")]
    found += [f"{NETNS_ETC / p.name}" for p in NETNS_ETC.glob(f"{name}-*")] if NETNS_ETC.is_dir() else []
    found += [str(g) for c in CONTROLLERS for g in _cgroups(c) if g.name.startswith(f"{name}-")]
    found += [str(p) for p in [STATE_DIR / f"{name}.json", STATE_DIR / name] if p.exists()]
    return found


# --- plumbing ------------------------------------------------------------------------------------


def _check_can() -> None:
    if os.geteuid() != 0:
        raise TestbedError("a test bed needs root (network namespaces, veths, cgroups)")
    if shutil.which("ip") is None:
        raise TestbedError("a test bed needs iproute2's `ip` command")
    missing = [c for c in CONTROLLERS if not (CGROUP_ROOT / c).is_dir()]
    if missing:
        raise TestbedError(f"a test bed needs the cgroup v1 controllers {', '.join(missing)} under {CGROUP_ROOT}")


def _namespaces() -> Iterator[str]:
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(PREFIX) and "-" in ns:
            yield ns


def _cgroups(controller: str) -> list[Path]:
    """Every test bed's host groups of ``controller``, whatever group their makers ran in."""
    top = CGROUP_ROOT / controller
    return sorted(p for p in top.glob(f"**/{CGROUP_PARENT}/{PREFIX}*-*") if p.is_dir()) if top.is_dir() else []


def _own_cgroup(controller: str) -> PurePosixPath:
    """This process's group in ``controller``'s hierarchy (``/`` for the root group), from /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return PurePosixPath(path)
    return PurePosixPath("/")


def _members(group: Path) -> set[int]:
    try:
        return {int(p) for p in (group / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def _kill_and_reap(pids: set[int], timeout_s: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rmdir(group: Path, timeout_s: float = 5.0) -> None:
    """A cgroup goes once its last process has gone (a killed process leaves it a moment later),
    after its children (the ranks' own)."""
    for child in [p for p in group.iterdir() if p.is_dir()] if group.is_dir() else []:
        _rmdir(child, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if check and done.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done
