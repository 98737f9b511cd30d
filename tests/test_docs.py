"""The README and docs/ cannot drift from the code: their shell commands run.

Every shell command in README.md and docs/*.md has an entry in ``COMMANDS``: it is run as
written, run shortened (fewer steps, fewer simulated ranks: the entry says how), or marked as not
runnable on this machine with the reason. A command without an entry fails the suite, and so
does an entry whose command left the docs. Each page's commands run in order in a directory of
their own, as a reader following the page would type them: ``cmd &`` keeps running until the
page ends, a server in the foreground is started, checked and stopped. ``RUN`` stands for the
newest run the page's collector holds. The README goes first and its store (a plain DDP script
and the bundled trainer with a straggler, both with the agent on) is the data the other pages
read, through a collector started on a copy of it at the default address.

The same documents are also checked as text: flags, variables, make targets, links, the SQL
cookbook (one source: ``rankscope.dashboard.cookbook``) and the README's length.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Proc, ProcRunner

from rankscope.cli.main import COMMANDS as CLI_COMMANDS
from rankscope.cli.main import build_parser
from rankscope.testbed import hosts as testbed_hosts
from rankscope.harness.local_scenarios import SMALL_MODEL, SMALL_SHAPE

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PAGES = {p.relative_to(ROOT).as_posix(): p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
#: words that stand for a value the reader supplies, in prose such as `--run RUN`
PLACEHOLDERS = {"RUN", "NAME", "DIR", "URL", "HOST:PORT", "HOST:7777", "SPEC", "N", "R", "S", "FILE", "TOKEN", "PEM", "SECONDS", "PORT"}
DEFAULT_PORTS = (7777, 8501)


def shell_commands(text: str) -> list[str]:
    """The commands of a page's bash blocks in order: continuation lines joined, comments and extra spaces dropped."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if line:
                commands.append(line)
    return commands


def script_files(text: str) -> dict[str, str]:
    """A page's scripts: the blocks whose info string names the file they are (```bash heal.sbatch),
    which the page's commands then run; each is written into the page's directory before them."""
    return dict(re.findall(r"```(?:bash|sh|shell) ([\w.-]+)\n(.*?)```", text, re.S))


@dataclass(frozen=True)
class Run:
    """Run the command; ``shorten`` rewrites it first (pattern -> replacement), ``expect`` (a regex) must match its output."""

    how: str = "as written"
    shorten: tuple[tuple[str, str], ...] = ()
    expect: str = ""
    timeout_s: float = 240

    def command(self, text: str) -> str:
        for pattern, replacement in self.shorten:
            changed = re.sub(pattern, replacement, text)
            assert changed != text, f"{pattern!r} no longer shortens {text!r}"
            text = changed
        return text


@dataclass(frozen=True)
class Serve(Run):
    """A server in the foreground: start it, wait for ``ready`` in its output, stop it with SIGTERM, expect exit 0."""

    ready: str = "listening on"


@dataclass(frozen=True)
class NotHere:
    """Not runnable on this machine (or not in the suite); ``why`` says so."""

    why: str


STREAMLIT_SERVES = "You can now view your Streamlit app"  # printed once the server listens
NO_DOCKER = NotHere("needs a Docker engine: none runs on the development machine or in CI (docker-compose.yml is checked as data in test_deploy.py)")
SIM_SHORT = ((r"--ranks 12288 --tp 8 --pp 16 --dp 96 --steps 120", "--ranks 256 --tp 4 --pp 4 --dp 16 --steps 24"),
             (r"rank=3000", "rank=100"), (r"hang:rank=7777,step=96\"$", 'hang:rank=200,step=18" --hold 10'))  # fmt: skip
#: docs/healing.md's two drills (the test bed's and Slurm's): 24 steps of the small model, not 60 of the default one
HEAL_SHORT = ((r"--steps 60 ", f"--steps 24 {' '.join(SMALL_SHAPE)} "),)

#: every shell command of README.md and docs/*.md -> how the suite treats it
COMMANDS: dict[str, Run | NotHere] = {
    # README.md
    "make demo": NotHere("runs until Ctrl-C; tests/test_demo.py runs the `rankscope demo` it calls (shortened) and checks the recipe"),
    "make test": NotHere("the test suite itself: this test runs inside it"),
    "rankscope collector &": Run(),
    "RANKSCOPE_ENABLE=1 RANKSCOPE_COLLECTOR=127.0.0.1:7777 torchrun --nproc-per-node 8 train.py": Run(),
    "RANKSCOPE_ENABLE=1 rankscope train --nproc 8 --tp 2 --pp 2 --dp 2 --steps 24 --inject 'straggler:rank=6,factor=1.5,from_step=6'":
        Run(expect=r"step\s+24/24"),
    "rankscope dashboard": Serve(ready=STREAMLIT_SERVES),
    "rankscope diagnose --run RUN --format json": Run(expect='"kind": "straggler"'),
    'rankscope sql "SELECT run_id, world_size, status FROM runs FINAL ORDER BY start_time DESC LIMIT 5"': Run(expect="finished"),
    'rankscope sql --param run=RUN "SELECT kind, ranks, hosts, summary FROM incidents FINAL WHERE run_id = {run:String}"':
        Run(expect="straggler"),
    # docs/benchmarks.md
    "make gpu-check": NotHere("needs a CUDA GPU: none on the development machine or in CI"),
    # docs/collector.md
    "rankscope collector": Serve(),
    "rankscope collector --listen 0.0.0.0:7777 --metrics-port 9464 --retention-days 30": Serve(ready="metrics on"),
    # docs/dashboard.md
    "rankscope dashboard --port 8502 --address 0.0.0.0": Serve(ready=STREAMLIT_SERVES, expect="Local URL: http://localhost:8502"),
    # docs/deployment.md
    "export RANKSCOPE_WRITER_PASSWORD=... RANKSCOPE_READER_PASSWORD=...": NO_DOCKER,
    "docker compose up -d --build": NO_DOCKER,
    "rankscope schema --cluster prod --retention-days 30 | clickhouse-client --host node-1 --multiquery":
        Run("no ClickHouse cluster here: the DDL goes to a file instead of clickhouse-client",
            shorten=((r"\| clickhouse-client --host node-1 --multiquery", "| tee cluster.sql"),),
            expect=r"(?s)ON CLUSTER prod.*ReplicatedReplacingMergeTree"),
    # docs/diagnosis.md
    "rankscope diagnose --run RUN": Run(expect="straggler"),
    "rankscope diagnose --run RUN --format json --hang-after 10": Run(expect='"ranks"'),
    "rankscope collector --hang-after 30 --silent-after 250 &": Run(),
    'rankscope simulate --ranks 12288 --tp 8 --pp 16 --dp 96 --steps 120 --inject "straggler:rank=3000,factor=1.3,from_step=4;hang:rank=7777,step=96"':
        Run("256 ranks, 24 steps and 10 s hung instead of 12,288 ranks, 120 steps and 120 s (benchmarks/diagnosis.py runs the full size)", shorten=SIM_SHORT, timeout_s=300),
    "rankscope scenario list": Run(expect="straggler-1.3"),
    # the suite's run of the crash scenario (tests/test_diagnosis_scenarios.py leaves it to this page)
    "rankscope scenario run crash": Run(expect=r"(?m)^PASS crash: detected crash", timeout_s=300),
    # docs/sql.md
    'rankscope sql "SHOW TABLES"': Run(expect="step_segments"),
    'rankscope sql --format csv "SELECT run_id, world_size, status FROM runs FINAL ORDER BY start_time DESC LIMIT 5"': Run(expect=",8,"),
    "rankscope sql --param run=RUN --param group='tp[0]' --param seq=42 \"SELECT rank, issue_time FROM collectives WHERE run_id = "
    '{run:String} AND group_name = {group:String} AND seq = {seq:Int64} ORDER BY issue_time"': Run(),
    # docs/testbed.md
    "rankscope testbed up --hosts 4 --ranks-per-host 2": Run(expect="node3"),
    "rankscope collector --listen unix:/tmp/rankscope.sock &": Run(),
    "rankscope testbed fault slow-cpu --host node2 --factor 3 --at-step 2 --collector unix:/tmp/rankscope.sock --for 600 &": Run(),
    "rankscope testbed run --collector unix:/tmp/rankscope.sock -- -m rankscope.trainer --tp 2 --pp 2 --dp 2 --steps 40":
        # all 40 steps, as the page: the host rule wants both its ranks slow in every step of its window but
        # one, and in 10 or 14 steps one of the two sharing node2's quota was slow first (CI of 4872a31: rank 4
        # named alone in 10; of 3d10b98: rank 5 alone in 14). A share of node2's quota (throttle-cpu, 0.35) bound
        # only at times on a loaded machine (CI of 75dacaf: rank 5 alone, from step 33 of 40): slow-cpu cuts what it used
        Run("a small model instead of the default one (2.2 s a step on 2 cores, before the throttle)",
            shorten=((r"--steps 40$", "--steps 40 " + " ".join(SMALL_MODEL)),), expect="node3: exit 0", timeout_s=400),
    "rankscope diagnose --collector unix:/tmp/rankscope.sock": Run(expect=r"straggler: host node2: ranks 4, 5"),
    "rankscope testbed down": Run(expect="is down"),
    "rankscope testbed up --hosts 3 --name rsslurm --slurm": Run(expect="Slurm partition bed"),
    "rankscope testbed slurm --testbed rsslurm -- srun --nodes=3 --label hostname": Run(expect=r"(?s)(?=.*0: node0)(?=.*1: node1).*2: node2"),
    'rankscope testbed slurm --testbed rsslurm -- scontrol update NodeName=node1 State=DRAIN Reason="rankscope: test"': Run(),
    "rankscope testbed slurm --testbed rsslurm -- sinfo --list-reasons": Run(expect=r"rankscope: test\s+root\s+\S+\s+node1"),
    "rankscope testbed down rsslurm": Run(expect="is down"),
    # docs/selfcheck.md
    "rankscope selfcheck": Run(expect="no peers to compare with"),
    "rankscope testbed up --hosts 3 --ranks-per-host 2 --name rscheck": Run(expect="node2"),
    "rankscope testbed fault throttle-cpu --testbed rscheck --host node2 --share 0.2 --for 300 &":
        Run("node2 keeps 30% of its CPU, not a fifth: it imports torch twice under the throttle (it fails, so it is measured"
            " again), and 0.3x its peers fails as 0.2x does", shorten=((r"--share 0\.2 ", "--share 0.3 "),)),
    # the suite's throttled-host self-check: only node2 fails, on matmul below half its peers' (tests/test_selfcheck.py
    # checks a frozen host on a bed of its own)
    "rankscope selfcheck --testbed rscheck": Run("exits 1: node2 fails, as the page shows", shorten=((r"rscheck$", "rscheck || test $? = 1"),),
                                                 expect=r"(?m)^node0 PASS: .*\nnode1 PASS: .*\nnode2 FAIL: matmul [\d.]+ GFLOP/s is 0\.[0-4]\d*x "),
    "rankscope testbed down rscheck": Run(expect="is down"),
    # docs/healing.md
    "rankscope testbed up --hosts 3 --ranks-per-host 2 --name rsheal": Run(expect="node2"),
    "rankscope collector --listen unix:/tmp/rankscope.sock --hang-after 10 --silent-after 8 &": Run(),
    "rankscope testbed fault kill-host --testbed rsheal --host node1 --at-step 10 --collector unix:/tmp/rankscope.sock &": Run(),
    "rankscope launch --testbed rsheal --collector unix:/tmp/rankscope.sock -- -m rankscope.trainer --tp 2 --pp 1 --dp 0 "
    "--global-batch 12 --micro-batch 2 --steps 60 --ckpt-dir ckpt --ckpt-every 2 --resume":
        # the survivors ended well, node1 was evicted. The default model: 3.5 s a step on the bed's hosts, 150 s the drill
        Run("24 steps of a small model instead of 60 of the default one (1.5 s a step, 72 s the drill)", shorten=HEAL_SHORT,
            expect=r"(?s)(?=.*node0: exit 0\n)(?=.*node2: exit 0\n).*node1: exit -9 \(evicted\)", timeout_s=420),
    'rankscope sql --collector unix:/tmp/rankscope.sock "SELECT action, hosts, reason FROM actions ORDER BY time"':
        # the lost host is named and evicted, and the job resumes from a checkpoint, not from scratch. Evicted on
        # its incident, or, when torchrun's rendezvous restarted the forked survivors without it first, as the
        # host the job went on without (the incident then finds it gone; CI at f7135ad)
        Run(expect=r'(?s)(?=.*incident +\["node1"\] +\w+: lost_host)(?=.*evict +\["node1"\] +(lost_host|attempt \d+ went on without it))'
                   r'(?=.*resumed from the checkpoint of step [1-9]\d*, \d+ steps lost).*finished'),
    "rankscope testbed down rsheal": Run(expect="is down"),
    "rankscope testbed up --hosts 4 --ranks-per-host 2 --name rsslheal --slurm": Run(expect="Slurm partition bed"),
    "rankscope testbed fault kill-host --testbed rsslheal --host node1 --at-step 10 --collector unix:/tmp/rankscope.sock &": Run(),
    "rankscope testbed slurm --testbed rsslheal -- sbatch --wait heal.sbatch": Run(expect="Submitted batch job", timeout_s=420),
    # node1 drained with the incident the driver acted on, not Slurm's own "Not responding"
    "rankscope testbed slurm --testbed rsslheal -- sinfo --list-reasons --format=\"%N %E\"": Run(expect=r"node1 rankscope: lost_host \S+: "),
    'rankscope sql --collector unix:/tmp/rankscope.sock "SELECT action, hosts, reason FROM actions WHERE run_id LIKE \'slurm-%\' ORDER BY time"':
        Run(expect=r'(?s)launched(?=.*spare +\["node3"\] +node3 joined attempt \d+ in place of node1)(?=.*evict +\["node1"\] +lost_host).*resumed.*finished'),
    "rankscope testbed down rsslheal": Run(expect="is down"),
    "rankscope scenario run testbed-freeze-rank": NotHere("tests/test_testbed_scenarios.py runs the test-bed scenarios (its RUN_ELSEWHERE says why this one is not)"),
    # docs/trainer.md
    "rankscope train --nproc 8 --tp 2 --pp 2 --dp 2 --layers 4 --hidden 64 --heads 4 --seq 64 --vocab 256 --micro-batch 2 --global-batch 16 --steps 20":
        Run("2 steps instead of 20", shorten=((r"--steps 20$", "--steps 2"),), expect=r"step\s+2/2"),
    "torchrun --nproc-per-node 8 -m rankscope.trainer --tp 2 --pp 2 --dp 2 --steps 20":
        Run("2 steps instead of 20", shorten=((r"--steps 20$", "--steps 2"),), expect=r"step\s+2/2"),
}

#: the pages' scripts (``script_files``), written as the page shows them but for ``shorten``
SCRIPTS = {
    "heal.sbatch": Run("24 steps of a small model instead of 60 of the default one, as the test bed's drill above", shorten=HEAL_SHORT),
}
#: pages that read a recorded run through a collector at the default address (a copy of the README's store)
NEEDS_A_COLLECTOR = {"docs/diagnosis.md", "docs/sql.md", "docs/dashboard.md"}
#: pages whose commands make namespace hosts: root only
NEEDS_ROOT = {"docs/testbed.md", "docs/selfcheck.md", "docs/healing.md"}
#: pages that take no default port, no test bed and compare no speeds: they run beside the others
#: (tests/suite_lanes.py); every other page runs in the foreground lane, one at a time
BESIDE_THE_OTHERS = {"docs/trainer.md", "docs/deployment.md"}
#: a user's own training script, for the commands that run `train.py`
USER_SCRIPT = ROOT / "tests" / "scripts" / "ddp_plain.py"


def test_every_shell_command_is_run_or_marked_not_runnable() -> None:
    found = {cmd for page in PAGES.values() for cmd in shell_commands(page.read_text())}
    assert found - set(COMMANDS) == set(), "shell commands in the docs with no entry in tests/test_docs.py COMMANDS"
    assert set(COMMANDS) - found == set(), "entries in COMMANDS whose command left the docs"
    scripts = {file for page in PAGES.values() for file in script_files(page.read_text())}
    assert scripts == set(SCRIPTS), "the pages' scripts and tests/test_docs.py SCRIPTS differ"


class Page:
    """One page's commands run in order in ``workdir``, as a reader would type them."""

    def __init__(self, name: str, runner: ProcRunner, workdir: Path):
        self.name, self.runner, self.workdir = name, runner, workdir
        self.env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(workdir)}
        self.background: list[Proc] = []
        shutil.copy(USER_SCRIPT, workdir / "train.py")  # the reader's own training script
        for file, script in script_files(PAGES[name].read_text()).items():
            for pattern, replacement in SCRIPTS[file].shorten:
                script = re.sub(pattern, replacement, script, flags=re.M)
            (workdir / file).write_text(script)
        self.outputs: dict[str, str] = {}

    def run_all(self, *, stop: bool = True) -> None:
        """Every command in order; then what runs in the background is stopped, unless ``stop`` is False."""
        for i, text in enumerate(shell_commands(PAGES[self.name].read_text())):
            treatment = COMMANDS[text]
            if isinstance(treatment, NotHere):
                continue
            command = treatment.command(text)
            if "RUN" in command.split() or "run=RUN" in command:
                command = re.sub(r"\bRUN\b", self.newest_run(), command)
            self.outputs[text] = self.one(command, treatment, name=f"{i:02d}")
        if stop:
            self.stop_background()

    def one(self, command: str, treatment: Run, name: str) -> str:
        background = command.endswith("&")
        if command.startswith("rankscope collector"):
            self.stop_background()  # a page that starts its collector replaces the one the reader had running
        proc = self.runner.start(["bash", "-c", command.rstrip("& ")], env=self.env, cwd=self.workdir, name=name)
        if background:
            self.background.append(proc)
            if "rankscope collector" in command:
                proc.wait_for("listening on", timeout=90)
            return ""
        if isinstance(treatment, Serve):
            proc.wait_for(treatment.ready, timeout=90)
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, f"{command}: did not stop cleanly on SIGTERM\n{proc.output()}"
        else:
            assert proc.wait(timeout=treatment.timeout_s) == 0, f"{command} failed\n{proc.output()}"
        out = proc.stdout + proc.stderr
        assert re.search(treatment.expect, out), f"{command}: {treatment.expect!r} not in its output\n{proc.output()}"
        return out

    def newest_run(self) -> str:
        done = self.runner.start(
            [str(VENV_BIN / "rankscope"), "sql", "--format", "json", "SELECT run_id FROM runs FINAL ORDER BY start_time DESC LIMIT 1"],
            env=self.env, cwd=self.workdir, name="newest-run")  # fmt: skip
        assert done.wait(timeout=60) == 0, done.output()
        return json.loads(done.stdout)[0]["run_id"]

    def stop_background(self) -> None:
        """SIGTERM what the page left running (a reader's Ctrl-C); a collector must write everything and exit 0."""
        for proc in self.background:
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, f"{proc.name} did not stop cleanly\n{proc.output()}"
        self.background.clear()


def _default_ports_free() -> None:
    for port in DEFAULT_PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is taken on this machine: the docs' commands use the default addresses")


@dataclass
class Readme:
    """The README followed top to bottom, and what its collector raised live about the fault drill's run."""

    page: Page
    runs: list[str]  # every run the collector holds, newest first
    live: list[dict]  # the drill's incidents once the collector's final passes over the ended run are done


@pytest.fixture(scope="module")
def readme(tmp_path_factory: pytest.TempPathFactory) -> Readme:
    """The README followed top to bottom; its store is the recorded data of the other pages."""
    from conftest import incidents

    from rankscope.collector.client import Client
    from rankscope.collector.diagnosis.engine import CONCLUDE_AFTER_S, DIAGNOSE_EVERY_S

    _default_ports_free()
    workdir = tmp_path_factory.mktemp("readme")
    runner = ProcRunner(workdir)
    page = Page("README.md", runner, workdir)
    try:
        page.run_all(stop=False)
        address = f"127.0.0.1:{DEFAULT_PORTS[0]}"  # the README's collector, with its default flags
        with Client(address) as client:
            runs = [r["run_id"] for r in client.query("SELECT run_id FROM runs FINAL ORDER BY start_time DESC").to_pylist()]
            ended = client.query("SELECT toUnixTimestamp64Nano(max(time)) AS ns FROM heartbeats WHERE run_id = {run:String}",
                                 {"run": runs[0]}).to_pylist()[0]["ns"]  # fmt: skip
        # A late second incident would come in the final passes over the ended run: wait them out.
        settled_at = ended / 1e9 + CONCLUDE_AFTER_S + 2 * DIAGNOSE_EVERY_S
        live = incidents(address, runs[0], lambda found, client: time.time() > settled_at, max(0.0, settled_at - time.time()) + 30)
        page.stop_background()
    finally:
        runner.cleanup()
    return Readme(page, runs, live)


@pytest.mark.slow
@pytest.mark.foreground  # and the default ports, as every page that takes them
@pytest.mark.timeout(900)
def test_the_readme_runs_as_written_and_finds_the_straggler(readme: Readme) -> None:
    """The README's commands as written, its fault drill (`rankscope train ... --inject straggler:rank=6`) untuned,
    against a collector with its default flags: one straggler incident naming rank 6 and this machine, live and after."""
    host = socket.gethostname()  # the host each rank reports: this machine
    live = [(i["kind"], sorted(i["ranks"]), sorted(i["hosts"])) for i in readme.live]
    assert live == [("straggler", [6], [host])], readme.live
    drill = next(out for command, out in readme.page.outputs.items() if command.startswith("RANKSCOPE_ENABLE=1 rankscope train"))
    assert re.search(r"step\s+24/24 \| loss \d", drill), drill[-3000:]  # it trained to its last step, untuned
    diagnosed = json.loads(readme.page.outputs["rankscope diagnose --run RUN --format json"])
    found = [(i["kind"], i["ranks"], i["hosts"]) for i in diagnosed]
    assert [k for k, _, _ in found] == ["straggler"] and found[0][1] == [6], found
    assert found[0][2] == [host], found
    # two runs, each named by its torchrun (the README sets no run id): the user's DDP script and the drill
    assert len(readme.runs) == 2 and len(set(readme.runs)) == 2, readme.runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in BESIDE_THE_OTHERS else [pytest.mark.foreground])
                                  for n in PAGES if n != "README.md" and any(
    isinstance(COMMANDS.get(c), Run) for c in shell_commands(PAGES[n].read_text()))])  # fmt: skip
def test_the_page_runs_as_written(name: str, request: pytest.FixtureRequest, proc_runner: ProcRunner, tmp_path: Path) -> None:
    if name not in BESIDE_THE_OTHERS:  # those take no default port: a foreground page may hold them meanwhile
        _default_ports_free()
    if name in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip(f"{name} makes namespace hosts: needs root")
    page = Page(name, proc_runner, tmp_path)
    if name in NEEDS_A_COLLECTOR:
        readme: Page = request.getfixturevalue("readme").page
        shutil.copytree(readme.workdir / "rankscope-data", tmp_path / "rankscope-data", symlinks=True)  # chDB links metadata/ to store/
        page.one("rankscope collector &", Run(), name="collector")
    named = {m for c in shell_commands(PAGES[name].read_text()) for m in re.findall(r"testbed up .*--name (\w+)", c)}
    for bed in named & set(testbed_hosts.running()):  # what a killed earlier run of this page left: its `testbed up` refuses the name
        testbed_hosts.destroy(bed)
    try:
        page.run_all()
    finally:  # a page that failed before its `rankscope testbed down` (its own test beds only: other tests run beside it)
        made = {m for out in page.outputs.values() for m in re.findall(r"^test bed (\w+) is up", out, re.M)}
        for bed in made & set(testbed_hosts.running()):
            testbed_hosts.destroy(bed)


# --- the documents as text -------------------------------------------------------------------------


def _all_text() -> str:
    return "\n".join(p.read_text() for p in PAGES.values())


def rankscope_commands() -> list[list[str]]:
    """Every ``rankscope ...`` invocation of the shell blocks, as argv (without "rankscope")."""
    found = []
    for page in PAGES.values():
        scripts = [line for script in script_files(page.read_text()).values() for line in script.splitlines() if not line.startswith("#")]
        for line in [*shell_commands(page.read_text()), *scripts]:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.wordchars += "{}[]/:=,.*-"
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token and set(token) <= set("|&;()<>"):  # the end of one command of the line
                    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
                        words.pop(0)
                    if words and words[0] == "rankscope":
                        found.append(words[1:])
                    words = []
                else:
                    words.append(token)
    return found


@pytest.mark.parametrize("argv", rankscope_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_rankscope_command_parses(argv: list[str]) -> None:
    """Each command parses with rankscope's own parser (the trainer's for train), in the fast suite too."""
    assert argv and argv[0] in CLI_COMMANDS, f"no such command: rankscope {' '.join(argv)}"
    if argv[0] == "train":
        from rankscope.trainer.train_config import build_parser as trainer_parser

        trainer_parser().parse_args(argv[1:])
        return
    build_parser().parse_args(argv)


def test_every_flag_in_prose_belongs_to_its_command() -> None:
    """Inline examples such as `rankscope diagnose --run RUN --format json`: each flag exists on that command."""
    from rankscope.trainer.train_config import build_parser as trainer_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices  # noqa: SLF001
    problems = []
    for command, rest in re.findall(r"`rankscope ([a-z]+)((?: [^`]*)?)`", _all_text()):
        if command not in CLI_COMMANDS:
            problems.append(f"rankscope {command}: no such command")
            continue
        parser = trainer_parser() if command == "train" else subparsers[command]
        known = {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001
        for word in rest.split():  # a subcommand's flags too (`rankscope testbed fault slow-cpu --factor F`)
            nested = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
            if nested and word in nested[0]:
                parser = nested[0][word]
                known |= {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001
        problems += [f"rankscope {command} {flag}" for flag in re.findall(r"(--[a-z][a-z-]*)", rest) if flag not in known]
    assert not problems, f"the docs name flags the commands lack: {problems}"


def test_every_environment_variable_is_read_by_the_code() -> None:
    named = set(re.findall(r"\b(RANKSCOPE_[A-Z0-9_]+)", _all_text()))
    code = "\n".join(p.read_text() for p in ROOT.rglob("*.py") if ".venv" not in p.parts)
    code += (ROOT / "docker-compose.yml").read_text() + (ROOT / "Makefile").read_text()
    assert sorted(v for v in named if v not in code) == [], "the docs name variables nothing reads"


def test_every_agent_variable_is_documented_in_the_agent_page() -> None:
    from rankscope.agent.config import AGENT_VARIABLES

    agent_page = (ROOT / "docs" / "agent.md").read_text()
    assert sorted(v for v in AGENT_VARIABLES if f"`{v}`" not in agent_page) == []


def test_every_make_target_named_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    text = _all_text()
    named = set(re.findall(r"`make ([a-z][a-z-]*)", text)) | set(re.findall(r"^\s*make ([a-z][a-z-]*)", text, re.M))
    assert named and named <= targets, f"the docs name make targets the Makefile lacks: {named - targets}"


def test_every_relative_link_resolves() -> None:
    broken = []
    for name, page in PAGES.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{name}: {target}")
    assert broken == []


def test_the_readme_is_a_short_front_door_with_a_picture() -> None:
    readme = PAGES["README.md"].read_text()
    assert len(readme.splitlines()) <= 250
    picture = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert picture, "the README shows no picture"
    assert (ROOT / picture.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for page in PAGES:
        assert page == "README.md" or f"({page})" in readme, f"the README does not link {page}"


def test_every_python_block_compiles() -> None:
    blocks = re.findall(r"```python\n(.*?)```", _all_text(), re.S)
    for block in blocks:
        compile(block, "<docs>", "exec")


def test_the_sql_cookbook_has_one_source() -> None:
    """docs/sql.md prints the dashboard's cookbook, and no page carries a query of its own."""
    from rankscope.dashboard import cookbook

    sql_page = (ROOT / "docs" / "sql.md").read_text()
    begin, end = (sql_page.index(marker) for marker in cookbook.MARKERS)
    assert sql_page[begin : end + len(cookbook.MARKERS[1])] + "\n" == cookbook.markdown(), (
        "docs/sql.md's cookbook differs from rankscope.dashboard.cookbook: "
        "paste the output of `python -m rankscope.dashboard.cookbook` between its markers")
    queries = {e.sql.strip() for e in cookbook.EXAMPLES}
    strays = [q for q in re.findall(r"```sql\n(.*?)```", _all_text(), re.S) if q.strip() not in queries]
    assert strays == []
