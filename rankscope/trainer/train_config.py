"""The trainer's configuration: one dataclass, one help text per field, validated before any process starts.

The command line is generated from the fields, so ``rankscope train`` and
``torchrun -m rankscope.trainer`` accept exactly the same flags and cannot drift from this file.
``rank_argv`` writes a validated configuration back as the command line the launcher hands the
ranks: full spellings only, launcher-only fields (``launcher_only`` in a field's metadata) left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.common.cmdline import Parser
from rankscope.common import fault_spec


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


#: metadata key of a field that only ``rankscope train`` reads: it is not handed to the ranks
LAUNCHER_ONLY = "launcher_only"


def _opt(default: object, help: str, *, launcher_only: bool = False, **extra: object) -> object:
    return field(default=default, metadata={"help": help, LAUNCHER_ONLY: launcher_only, **extra})


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs. Defaults give an 8-rank TP2xPP2xDP2 CPU job."""

    nproc: int | None = _opt(None, "processes to launch on this machine (default: tp*pp*dp; needed with --dp 0); launcher only", launcher_only=True)
    tp: int = _opt(2, "tensor-parallel size: attention heads, MLP and vocabulary split across this many ranks")
    pp: int = _opt(2, "pipeline-parallel size: layers split into this many stages, run with the 1F1B schedule")
    dp: int = _opt(2, "data-parallel size: replicas whose gradients are averaged (0: WORLD_SIZE // (tp*pp), for elastic jobs)")
    layers: int = _opt(4, "transformer blocks (divisible by --pp)")
    hidden: int = _opt(256, "model width (divisible by --heads)")
    heads: int = _opt(8, "attention heads (divisible by --tp)")
    ffn: int | None = _opt(None, "MLP width (default 4*hidden; divisible by --tp)")
    seq: int = _opt(128, "sequence length in tokens")
    vocab: int = _opt(2048, "vocabulary size (divisible by --tp)")
    micro_batch: int = _opt(4, "sequences per micro-batch")
    global_batch: int = _opt(32, "sequences per step over all data-parallel replicas")
    steps: int = _opt(20, "total steps of the run (also when resuming); steps are numbered from 1")
    lr: float = _opt(1e-3, "AdamW learning rate (constant)")
    weight_decay: float = _opt(0.1, "AdamW weight decay, applied to matrices only")
    clip_grad: float = _opt(1.0, "clip the global gradient norm to this value (0 disables)")
    seed: int = _opt(1234, "seed for weights and synthetic data")
    sequence_parallel: bool = _opt(False, "shard norms and dropout-free regions along the sequence across tp ranks")
    distributed_optimizer: bool = _opt(False, "ZeRO-1: reduce-scatter gradients, shard optimizer state over dp, all-gather parameters")
    parallel_block: bool = _opt(False, "MegaScale's parallel block: attention and MLP from one normalised input, summed")
    window: int | None = _opt(None, "sliding-window attention: each token sees at most this many tokens (itself included)")
    bucket_mb: float = _opt(4.0, "data-parallel gradient bucket size in MiB (buckets reduce while backward runs)")
    timeout: float = _opt(300.0, "process-group timeout in seconds, so a hung run ends by itself")
    data: Path | None = _opt(None, "token file (uint16, nanoGPT-style .bin) instead of the synthetic stream", type=Path)
    ckpt_dir: Path | None = _opt(None, "directory for torch.distributed.checkpoint checkpoints", type=Path)
    ckpt_every: int = _opt(0, "save a checkpoint every N steps (0: never)")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in --ckpt-dir")
    inject: str = _opt("", "faults to inject, e.g. 'straggler:rank=5,factor=1.5,from_step=5' (also env RANKSCOPE_INJECT)")
    metrics_json: Path | None = _opt(None, "write one JSON line per step (written by the first rank of the last stage)", type=Path)
    log_every: int = _opt(1, "print a progress line every N steps")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ffn_hidden(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def validate(self) -> TrainConfig:
        """Refuse sizes that do not divide and options that contradict each other; returns self.

        With ``--dp 0`` the checks that need dp (batch split, ranks named by faults, --nproc) wait
        for ``resolved``: an elastic job learns its size only when torchrun starts the ranks.
        """
        problems: list[str] = []
        if self.dp < 0:
            problems.append(f"--dp must be 0 (auto: WORLD_SIZE // (tp*pp)) or more (got {self.dp})")
        for name in ("tp", "pp", "layers", "hidden", "heads", "seq", "vocab", "micro_batch", "global_batch", "steps"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if problems:
            raise ConfigError("; ".join(problems))
        if self.dp and self.nproc is not None and self.nproc != self.world_size:
            problems.append(f"--nproc {self.nproc} does not equal tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size}")
        if self.heads % self.tp:
            problems.append(f"--heads {self.heads} is not divisible by --tp {self.tp}")
        if self.hidden % self.heads:
            problems.append(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.layers % self.pp:
            problems.append(f"--layers {self.layers} is not divisible by --pp {self.pp}")
        if self.vocab % self.tp:
            problems.append(f"--vocab {self.vocab} is not divisible by --tp {self.tp}")
        if self.ffn_hidden % self.tp:
            problems.append(f"--ffn {self.ffn_hidden} is not divisible by --tp {self.tp}")
        if self.dp and self.global_batch % (self.micro_batch * self.dp):
            problems.append(
                f"--global-batch {self.global_batch} is not divisible by --micro-batch {self.micro_batch} "
                f"x --dp {self.dp} = {self.micro_batch * self.dp}"
            )
        if self.sequence_parallel and self.seq % self.tp:
            problems.append(f"--sequence-parallel needs --seq {self.seq} divisible by --tp {self.tp}")
        if self.window is not None and self.window < 1:
            problems.append(f"--window must be at least 1 (got {self.window})")
        if self.ckpt_every < 0:
            problems.append(f"--ckpt-every must be 0 or more (got {self.ckpt_every})")
        if (self.ckpt_every or self.resume) and self.ckpt_dir is None:
            problems.append("--ckpt-every and --resume need --ckpt-dir")
        if self.timeout <= 0:
            problems.append(f"--timeout must be positive (got {self.timeout})")
        if self.bucket_mb <= 0:
            problems.append(f"--bucket-mb must be positive (got {self.bucket_mb})")
        if self.log_every < 1:
            problems.append(f"--log-every must be at least 1 (got {self.log_every})")
        if self.data is not None and not self.data.is_file():
            problems.append(f"--data {self.data}: no such file")
        try:
            for fault in fault_spec.parse(self.inject):
                if self.dp:
                    fault.check_ranks(self.world_size, self.steps)
        except fault_spec.FaultSpecError as exc:
            problems.append(str(exc))
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def resolved(self, world_size: int) -> TrainConfig:
        """This configuration for a job of ``world_size`` ranks, validated, with ``--dp 0`` replaced by the dp they give.

        Each rank calls it with torchrun's WORLD_SIZE, so a job that torchrun's elastic agent
        restarts on fewer hosts re-plans its data parallelism while tp x pp stays.
        """
        model = self.tp * self.pp
        if self.dp:
            if world_size != self.world_size:
                raise ConfigError(
                    f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} ranks are needed but the job has "
                    f"{world_size}; launch {self.world_size} or use --dp 0"
                )
            return self.validate()
        if world_size < 1 or world_size % model:
            raise ConfigError(
                f"the job's {world_size} ranks are not a multiple of tp*pp = {self.tp}*{self.pp} = {model}, "
                "so --dp 0 cannot choose a data-parallel size"
            )
        dp = world_size // model
        try:
            return dataclasses.replace(self, dp=dp).validate()
        except ConfigError as exc:
            raise ConfigError(f"with --dp 0 the job's {world_size} ranks give dp {dp}: {exc}") from None

    def check_elastic(self, min_dp: int, max_dp: int) -> TrainConfig:
        """Refuse, before launching, a job that could not run or resume at some dp in ``min_dp..max_dp``; returns self.

        For a launcher whose job may lose or gain hosts: finding out at a restart is too late.
        """
        if not 1 <= min_dp <= max_dp:
            raise ConfigError(f"the dp range {min_dp}..{max_dp} must be non-empty and start at 1 or more")
        if self.dp and not min_dp == max_dp == self.dp:
            raise ConfigError(f"--dp {self.dp} is fixed but the job may run at dp {min_dp}..{max_dp}; use --dp 0")
        if self.distributed_optimizer and min_dp != max_dp:
            raise ConfigError(
                f"--distributed-optimizer cannot run at dp {min_dp}..{max_dp}: its optimizer shards are keyed by dp rank "
                "and a checkpoint cannot be re-sharded to another dp"
            )
        bad = [dp for dp in range(min_dp, max_dp + 1) if self.global_batch % (self.micro_batch * dp)]
        if bad:
            raise ConfigError(
                f"--global-batch {self.global_batch} does not split into micro-batches of {self.micro_batch} "
                f"at dp {', '.join(map(str, bad))}"
            )
        return self


def flag(f: dataclasses.Field[object]) -> str:
    """The command-line flag of a ``TrainConfig`` field: ``--micro-batch`` for ``micro_batch``."""
    return "--" + f.name.replace("_", "-")


def rank_argv(cfg: TrainConfig) -> list[str]:
    """The ranks' command line for ``cfg``: each value that differs from its default as ``--flag=value``.

    The launcher rebuilds it instead of forwarding what the user typed: torchrun's parser reads
    every ``--x`` token after ``-m module`` too and refuses one that abbreviates its own options
    (``--nproc`` could be ``--nproc-per-node``), so only full trainer spellings may reach it, and
    launcher-only fields, which the ranks do not need, stay out. ``--flag=value`` keeps a value
    that starts with ``-`` a value. ``parse_args(rank_argv(cfg))`` gives ``cfg`` back, launcher-only
    fields at their defaults.
    """
    argv: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.metadata.get(LAUNCHER_ONLY) or value == f.default:
            continue
        argv.append(flag(f) if isinstance(value, bool) else f"{flag(f)}={value}")  # a bool flag is store_true
    return argv


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help, and the fault grammar's table kept as written."""


def build_parser(prog: str = "rankscope train") -> argparse.ArgumentParser:
    """The command line, one flag per ``TrainConfig`` field (``--micro-batch`` for ``micro_batch``)."""
    parser = Parser(
        prog=prog,
        description="Megatron-style GPT training with tensor, pipeline and data parallelism.",
        epilog=fault_spec.GRAMMAR,
        formatter_class=_HelpFormatter,
    )
    for f in dataclasses.fields(TrainConfig):
        help_text = str(f.metadata["help"])
        if f.type in ("bool", bool):
            parser.add_argument(flag(f), action="store_true", help=help_text)
            continue
        base = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], None)
        parser.add_argument(flag(f), type=f.metadata.get("type", base), default=f.default, help=help_text)
    return parser


def parse_args(argv: list[str], prog: str = "rankscope train") -> TrainConfig:
    """Parse and validate a command line; ``RANKSCOPE_INJECT`` is used when --inject is absent.

    Exits with status 2 and one ``PROG: error: ...`` line on a bad flag, a value of the wrong type
    or a configuration that cannot run (the fault grammar is in ``--help``).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    values = vars(args)
    values["inject"] = values["inject"] or os.environ.get("RANKSCOPE_INJECT", "")
    try:
        return TrainConfig(**values).validate()
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
