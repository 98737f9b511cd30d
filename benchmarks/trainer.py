"""Trainer throughput: tokens/s and step time of the default 8-rank CPU job; MFU of a ~1B GPT on one GPU.

    python benchmarks/trainer.py [--steps N] [--warmup N]

Each configuration is a real ``rankscope train`` run; the first ``--warmup`` steps are left out
of the statistics. The GPU row runs only where CUDA is available.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

GPU_1B = ["--tp", "1", "--pp", "1", "--dp", "1", "--layers", "20", "--hidden", "2048", "--heads", "16",
          "--seq", "2048", "--vocab", "50304", "--micro-batch", "4", "--global-batch", "16"]  # fmt: skip


def run(name: str, flags: list[str], steps: int) -> list[dict]:
    """Train ``steps`` steps through the real launcher and return the metrics lines."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "rankscope.cli.main", "train", *flags, "--steps", str(steps),
               "--metrics-json", str(metrics), "--log-every", str(steps)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            sys.exit(f"{name}: training failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def row(name: str, lines: list[dict], warmup: int) -> str:
    kept = lines[warmup:]
    times = sorted(line["step_time_s"] for line in kept)
    tok = statistics.median(line["tokens_per_s"] for line in kept)
    mfus = [line["mfu"] for line in kept if line["mfu"] is not None]
    mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    return f"| {name} | {len(kept)} | {1e3 * statistics.median(times):.1f} | {1e3 * p90:.1f} | {tok:,.0f} | {mfu} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print("| configuration | steps measured | median step ms | p90 step ms | tokens/s | MFU |")
    print("|---|---|---|---|---|---|")
    cpu = run("cpu", [], args.steps)
    print(row("default job: 8 CPU ranks, TP2xPP2xDP2, gloo", cpu, args.warmup), flush=True)
    if torch.cuda.is_available():
        gpu = run("gpu", GPU_1B, args.steps)
        name = f"GPT ~1.2B, seq 2048, bf16, 1x {torch.cuda.get_device_name()}"
        print(row(name, gpu, args.warmup), flush=True)
    else:
        print("| GPT ~1.2B on one GPU | - | - | - | - | no GPU here |")


if __name__ == "__main__":
    main()
