"""A Slurm cluster on a test bed's hosts: the scheduler that large training jobs run under, real, on
one machine.

munged and slurmctld run on the control host (the switch's namespace, ``control`` at
``CONTROL_ADDRESS``), one slurmd on each host inside the host's cgroups, CPUs, network namespace
and host name, so the job steps Slurm starts there are the host's own processes: its CPU quota
and freezer apply to them, and a fault from outside reaches them as it reaches a node's. Each
slurmd also gets the host's ``/etc/hosts`` (a mount namespace of its own): its job steps resolve
the other hosts by name, as ``ip netns exec`` would give them. Slurm's client commands (``sinfo``,
``srun``, ``sbatch``, ``scontrol``) reach slurmctld from the control host (``Slurm.command``).

Everything (configuration, munge key, state, spool, logs) lives in the test bed's own directory,
which ``hosts.destroy`` removes with the processes. Debian's ``slurm-wlm`` (22.05) and ``munge``;
``make slurm`` installs them (root). Measured facts: ../shared/NOTES.md, "Slurm across namespace hosts".
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rankscope.healing.slurm_fleet import SlurmError, SlurmNodes
from rankscope.testbed.hosts import CONTROL_ADDRESS, NETNS_ETC, Host, Testbed, TestbedError, enter_cgroups

__all__ = ["PARTITION", "Slurm", "missing", "start"]

#: what a test bed's nodes are scheduled as
PARTITION = "bed"
#: the daemons and commands a Slurm test bed needs, and the Debian package of each
PROGRAMS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "srun": "slurm-wlm", "sinfo": "slurm-wlm"}
#: seconds before slurmctld calls a silent slurmd's node DOWN (Slurm's default is 300): longer than the
#: diagnosis takes to name a lost host, as on a real cluster, so that the healing driver acts first (a node
#: that goes DOWN leaves its ``--no-kill`` job's allocation, and the job would be requeued a node short)
SLURMD_TIMEOUT_S = 60
#: seconds a job step's credential lives (Slurm's default is 120); a requeued job waits this long (and a
#: second) before it may start again
CRED_EXPIRE_S = 20
#: seconds between the scheduler's passes over pending jobs (Slurm's defaults: 60 for the main loop, 30 for
#: backfill): a requeued job, eligible again once its credential expired, waited up to a pass more to start
SCHED_INTERVAL_S = 2
START_TIMEOUT_S = 30.0
#: the host's /etc/hosts over the machine's, then the host name, then the daemon (``unshare --mount``
#: keeps the mount to the daemon and its job steps)
_NODE = 'mount --bind "$1" /etc/hosts || exit 96; hostname "$2" || exit 98; shift 2; exec "$@"'


@dataclass(frozen=True)
class Slurm:
    """The Slurm cluster of test bed ``bed``: where its files are and how to reach it."""

    bed: Testbed

    @property
    def directory(self) -> Path:
        return self.bed.directory / "slurm"

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` (a Slurm command) on the control host, where slurmctld is reached."""
        return ["nsenter", f"--net=/run/netns/{self.bed.switch}", "env", f"SLURM_CONF={self.conf}", *argv]

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command on the control host; its output as text."""
        done = subprocess.run(self.command(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s)
        if check and done.returncode != 0:
            raise TestbedError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
        return done

    def nodes(self) -> dict[str, tuple[str, str]]:
        """Each node's state as Slurm says it (``idle``, ``allocated``, ``drained``, ``down*``, ...) and the reason given."""
        try:
            return SlurmNodes(self.command).states()
        except SlurmError as e:
            raise TestbedError(str(e)) from None

    def wait_idle(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every node has registered and is idle (a node's slurmd may take a moment to register)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = self.nodes()
            except (TestbedError, subprocess.TimeoutExpired) as e:
                states, why = {}, str(e)
            else:
                why = ", ".join(f"{n} {s}" for n, (s, _) in states.items() if s != "idle")
            if states and not why:
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"the Slurm nodes are not idle after {timeout_s:g} s: {why or 'no node'}; logs in {self.directory}")
            time.sleep(0.2)


def missing() -> list[str]:
    """The Debian packages a Slurm test bed needs that this machine lacks (``make slurm`` installs them)."""
    return sorted({package for program, package in PROGRAMS.items() if shutil.which(program) is None})


def start(bed: Testbed) -> Slurm:
    """Make ``bed``'s hosts a Slurm cluster (partition ``PARTITION``, every host a node) and wait until
    every node is idle. The daemons go with the test bed (``hosts.destroy``)."""
    if lacking := missing():
        raise TestbedError(f"a Slurm test bed needs {' and '.join(lacking)} (`make slurm` installs them as root: apt-get install {' '.join(lacking)})")
    slurm = Slurm(bed)
    directory = slurm.directory
    for sub in ("state", "log"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    munge = _start_munge(bed, directory / "munge")
    slurm.conf.write_text(_config(bed, directory, munge))
    control = ["nsenter", f"--net=/run/netns/{bed.switch}", "unshare", "--uts", "sh", "-c", 'hostname control && exec "$@"', "control"]
    _daemon([*control, "slurmctld", "-f", str(slurm.conf)], directory / "log" / "slurmctld.out")
    for host in bed.hosts:
        _daemon(_on_node(host, ["slurmd", "-f", str(slurm.conf), "-N", host.name]), directory / "log" / f"slurmd-{host.name}.out")
    slurm.wait_idle()
    return slurm


def _start_munge(bed: Testbed, directory: Path) -> Path:
    """munged with a key of this test bed's own, on the control host; its socket."""
    user = pwd.getpwnam("munge")
    directory.mkdir(exist_ok=True)
    directory.chmod(0o755)  # munged: clients need to reach the socket; only munge may write here
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for path in (directory, key):
        os.chown(path, user.pw_uid, user.pw_gid)
    socket = directory / "munge.socket"
    _daemon(
        ["nsenter", f"--net=/run/netns/{bed.switch}", "runuser", "-u", "munge", "--", "munged", f"--key-file={key}", f"--socket={socket}",
         f"--pid-file={directory / 'munged.pid'}", f"--log-file={directory / 'munged.log'}", f"--seed-file={directory / 'munged.seed'}"],
        directory.parent / "log" / "munged.out",
    )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while not socket.exists():
        if time.monotonic() > deadline:
            raise TestbedError(f"munged did not start in {START_TIMEOUT_S:g} s: {directory.parent / 'log' / 'munged.out'}")
        time.sleep(0.05)
    return socket


def _on_node(host: Host, argv: Sequence[str]) -> list[str]:
    """``argv`` as a daemon of ``host``: in its cgroups and on its CPUs, in its network namespace
    (``nsenter``: ``ip netns exec`` remounts /sys, and slurmd then finds no cgroup file system), with
    its /etc/hosts and host name."""
    return [
        *enter_cgroups(host), "taskset", "-c", ",".join(map(str, host.cpus)), "nsenter", f"--net=/run/netns/{host.namespace}",
        "unshare", "--uts", "--mount", "sh", "-c", _NODE, "node", str(NETNS_ETC / host.namespace / "hosts"), host.name, *argv,
    ]  # fmt: skip


def _daemon(argv: Sequence[str], log: Path) -> None:
    """Start a daemon that forks into the background; its first words go to ``log``."""
    with open(log, "ab") as out:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=START_TIMEOUT_S)
    if done.returncode != 0:
        raise TestbedError(f"{argv[argv.index('--') + 1] if '--' in argv else Path(argv[-1]).name} did not start (exit {done.returncode}): "
                           f"{log.read_text(errors='replace').strip()[-500:]}")  # fmt: skip


def _config(bed: Testbed, directory: Path, munge: Path) -> str:
    """slurm.conf: every host a node of one partition; whole nodes per job (one torchrun agent a node)."""
    cpus = len(os.sched_getaffinity(0))
    nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN\n" for h in bed.hosts)
    return f"""\
# rankscope test bed {bed.name}: written by rankscope.testbed.slurm
ClusterName={bed.name}
SlurmctldHost=control({CONTROL_ADDRESS})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge},cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={directory / 'state'}
SlurmdSpoolDir={directory / 'state'}/spool-%n
SlurmctldPidFile={directory / 'state'}/slurmctld.pid
SlurmdPidFile={directory / 'state'}/slurmd-%n.pid
SlurmctldLogFile={directory / 'log'}/slurmctld.log
SlurmdLogFile={directory / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout=5
KillWait=5
SchedulerParameters=sched_interval={SCHED_INTERVAL_S},bf_interval={SCHED_INTERVAL_S}
{nodes}PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
