"""The training loop of one rank: set up the parallel state, model and optimizer, then run the steps.

Run under torchrun (``torchrun ... -m rankscope.trainer``) or through ``rankscope train``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from rankscope import agent
from rankscope.common import fault_spec
from rankscope.trainer import comm, flops, parallel_state
from rankscope.trainer.injector import Injector
from rankscope.trainer.train_config import ConfigError, TrainConfig, parse_args
from rankscope.trainer.dataset import MicroBatches, TokenSource
from rankscope.trainer.data_parallel import GradSync
from rankscope.trainer.layers import TPContext
from rankscope.trainer.model import GPTStage, ModelArgs, init_weights
from rankscope.trainer.optimizer import Optimizer
from rankscope.trainer.pipeline import Pipeline


@dataclass
class StepMetrics:
    """What every step reports; ``loss`` is known on the last pipeline stage only."""

    step: int
    loss: float | None
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    grad_norm: float
    #: this rank's micro-batches whose output was not finite (where a NaN starts shows here first)
    nonfinite_outputs: float


class Reporter:
    """Prints progress and writes ``--metrics-json``; only the first rank of the last stage does either."""

    def __init__(self, cfg: TrainConfig, active: bool, resumed_at: int) -> None:
        self.cfg = cfg
        self.active = active
        self.file: IO[str] | None = None
        if active and cfg.metrics_json is not None:
            self.file = _open_metrics(cfg.metrics_json, resumed_at)

    def report(self, m: StepMetrics) -> None:
        if not self.active:
            return
        if self.file is not None:
            record = {"step": m.step, "loss": m.loss, "step_time_s": m.step_time_s, "tokens_per_s": m.tokens_per_s, "mfu": m.mfu}
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if m.step % self.cfg.log_every == 0 or m.step == self.cfg.steps:
            mfu = f"{100 * m.mfu:.1f}%" if m.mfu is not None else "n/a"
            print(
                f"step {m.step:>5}/{self.cfg.steps} | loss {m.loss:.4f} | {m.step_time_s * 1e3:8.1f} ms "
                f"| {m.tokens_per_s:10,.0f} tok/s | mfu {mfu} | grad norm {m.grad_norm:.3f}",
                flush=True,
            )

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _open_metrics(path: Path, resumed_at: int) -> IO[str]:
    """Open the metrics file for this run: fresh, or on resume keep the lines up to the resumed step."""
    kept: list[str] = []
    if resumed_at and path.is_file():
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= resumed_at]
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("w")
    f.writelines(line + "\n" for line in kept)
    return f


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu")


def run(cfg: TrainConfig) -> None:
    """Train for ``cfg.steps`` steps on this rank (``torch.distributed`` environment from torchrun)."""
    device = _device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.timeout))
    try:
        _train(cfg, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, device: torch.device) -> None:
    layout = parallel_state.Layout(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    ps = parallel_state.initialize(layout, cfg.timeout)
    agent.init()
    agent.set_topology(cfg.tp, cfg.pp, cfg.dp, tp_rank=ps.coords.tp, pp_rank=ps.coords.pp, dp_rank=ps.coords.dp)
    agent.name_groups(ps.my_groups)

    tp = TPContext(ps.tp_group, cfg.sequence_parallel)
    args = ModelArgs(
        vocab=cfg.vocab, hidden=cfg.hidden, heads=cfg.heads, ffn=cfg.ffn_hidden, layers=cfg.layers,
        seq=cfg.seq, parallel_block=cfg.parallel_block, window=cfg.window,
    )  # fmt: skip
    model = GPTStage(args, tp, ps.coords.pp, cfg.pp)
    init_weights(model, cfg.seed, cfg.layers)
    model.to(device)
    sync = GradSync(
        list(model.parameters()), ps.dp_group, ps.tp_group, int(cfg.bucket_mb * 2**20 / 4), cfg.distributed_optimizer
    )
    optimizer = Optimizer(model, sync, cfg.lr, cfg.weight_decay, ps.tp_group, ps.pp_group)
    injector = Injector(fault_spec.parse(cfg.inject), ps.rank)
    comm.install(injector)

    checkpointer = None
    if cfg.ckpt_dir is not None:  # imported here: torch.distributed.checkpoint costs every rank 0.7 s of CPU to import
        from rankscope.trainer.checkpoint import Checkpointer

        checkpointer = Checkpointer(cfg.ckpt_dir, ps)
    resumed_at = 0
    if checkpointer is not None and cfg.resume:
        resumed_at = checkpointer.latest_step() or 0
        where = "scratch (no complete checkpoint found)"
        if resumed_at:
            saved_dp = checkpointer.load(resumed_at, model, optimizer).dp
            where = f"step {resumed_at} at dp {cfg.dp}" + (f" (was dp {saved_dp})" if saved_dp != cfg.dp else "")
        if ps.rank == 0:
            print(f"[rankscope] resuming from {where} in {cfg.ckpt_dir}", flush=True)

    data = MicroBatches(TokenSource(cfg.vocab, cfg.seq, cfg.seed, cfg.data), cfg.global_batch, cfg.micro_batch, ps.coords.dp, cfg.dp)
    pipeline = Pipeline(model, ps, data, cfg.num_microbatches, cfg.micro_batch, device, injector)
    peak = flops.peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    reporter = Reporter(cfg, ps.rank == ps.metrics_rank, resumed_at)
    if ps.rank == 0:
        print(
            f"[rankscope] training {cfg.steps} steps on {layout.world_size} {device.type} ranks "
            f"(tp {cfg.tp} x pp {cfg.pp} x dp {cfg.dp}, {cfg.num_microbatches} micro-batches of {cfg.micro_batch})",
            flush=True,
        )
    try:
        for step in range(resumed_at + 1, cfg.steps + 1):
            metrics = _step(step, cfg, ps, pipeline, sync, optimizer, injector, args, peak)
            reporter.report(metrics)
            scalars = {k: v for k, v in vars(metrics).items() if k != "step" and v is not None}
            agent.record_scalars(step, **scalars)
            if checkpointer is not None and cfg.ckpt_every and step % cfg.ckpt_every == 0:
                checkpointer.save(step, model, optimizer)
        if checkpointer is not None:
            checkpointer.wait()
    finally:
        reporter.close()


def _step(
    step: int,
    cfg: TrainConfig,
    ps: parallel_state.ParallelState,
    pipeline: Pipeline,
    sync: GradSync,
    optimizer: Optimizer,
    injector: Injector,
    args: ModelArgs,
    peak: float | None,
) -> StepMetrics:
    t0 = time.perf_counter()
    agent.set_step(step)
    injector.begin_step(step)
    optimizer.zero_grad()
    loss_sum = pipeline.run(step, sync)
    with agent.span("grad_sync", kind="comm", step=step):
        sync.finish()
    with agent.span("optimizer", kind="optimizer", step=step):
        grad_norm = optimizer.step(cfg.clip_grad)
    loss = None
    if loss_sum is not None:  # last stage: the mean over all micro-batches of all dp replicas
        loss = float(comm.all_reduce(loss_sum / cfg.num_microbatches, ps.dp_group)) / cfg.dp
    step_time = time.perf_counter() - t0
    tokens_per_s = cfg.tokens_per_step / step_time
    return StepMetrics(
        step=step,
        loss=loss,
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        mfu=flops.mfu(tokens_per_s, args, ps.layout.world_size, peak),
        grad_norm=grad_norm,
        nonfinite_outputs=float(pipeline.nonfinite),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m rankscope.trainer`` (one process per rank)."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv, prog="python -m rankscope.trainer")
    try:
        if "WORLD_SIZE" not in os.environ:
            raise ConfigError("WORLD_SIZE is unset: start the ranks with torchrun or `rankscope train`")
        run(cfg.resolved(int(os.environ["WORLD_SIZE"])))
    except ConfigError as exc:  # the same on every rank (a checkpoint this layout cannot load, too): say it once
        if os.environ.get("RANK", "0") == "0":
            print(f"rankscope trainer: error: {exc}", file=sys.stderr)
        return 2
    return 0
