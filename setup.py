"""The one build step pyproject.toml cannot say: the agent's start-up hook.

Everything else (metadata, packages: every ``rankscope*`` package under rankscope/, found by
path, so a module's path is its name) is in pyproject.toml. Wheels and editable installs alike
install ``rankscope-agent.pth`` at the root of site-packages: the one line that lets
``RANKSCOPE_ENABLE=1`` start the agent in scripts that never import rankscope
(rankscope/agent/autoload.py). It is written by the build sub-command ``build_agent_pth`` below.
"""

from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build

AGENT_PTH = "rankscope-agent.pth"
# What the .pth runs when RANKSCOPE_ENABLE=1. A failing import must not print a traceback into
# every Python process of the job, hence the try.
_AGENT_BOOT = """\
try:
    from rankscope.agent.autoload import boot
except Exception as exc:
    print("rankscope agent: off, cannot import it:", repr(exc), file=sys.stderr)
else:
    boot()
"""
# A .pth runs lines that start with "import", one line each; with RANKSCOPE_ENABLE unset this
# one costs a dictionary look-up.
AGENT_PTH_LINE = f"import os, sys; exec({_AGENT_BOOT!r}) if os.environ.get('RANKSCOPE_ENABLE') == '1' else None\n"


class build_agent_pth(Command):
    """Put rankscope-agent.pth at the root of purelib, for wheels and editable wheels alike.

    A wheel ships build_lib as the root of purelib. An editable wheel ships only its import
    hook plus what is written straight into the wheel's directory, which editable_wheel hands
    to the ``install`` command as ``install_lib`` (it also sets ``editable_mode`` on every build
    sub-command): the file goes there instead.
    """

    description = "write the agent's start-up hook (rankscope-agent.pth)"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode = False

    def initialize_options(self) -> None:
        self.build_lib: str | None = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.mkpath(root)
        Path(root, AGENT_PTH).write_text(AGENT_PTH_LINE, encoding="utf-8")

    def get_outputs(self) -> list[str]:
        return [str(Path(self.build_lib, AGENT_PTH))]

    def get_source_files(self) -> list[str]:
        return []


class build_with_agent_pth(build):
    sub_commands = [*build.sub_commands, ("build_agent_pth", None)]


setup(
    cmdclass={"build": build_with_agent_pth, "build_agent_pth": build_agent_pth},
)
