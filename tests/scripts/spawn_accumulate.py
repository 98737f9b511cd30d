"""DDP with gradient accumulation, launched by torch.multiprocessing.spawn (not torchrun): a sub-group
all-reduce every step, and optionally an exception on one rank. Knows nothing about rankscope.

    python spawn_accumulate.py --world 2 --port P [--steps 4] [--crash-rank R --crash-step S]
"""

import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MICROBATCHES = 2


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world)
    firsts = dist.new_group([0])  # every process creates every group, members or not
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        for micro in range(MICROBATCHES):
            x = torch.randn(8, 16)
            if micro < MICROBATCHES - 1:
                with model.no_sync():  # accumulate locally: no gradient all-reduce
                    model(x).pow(2).mean().backward()
            else:
                model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            dist.all_reduce(torch.ones(2), group=firsts)
        if rank == args.crash_rank and step == args.crash_step:
            raise RuntimeError(f"spawned rank {rank} failed at step {step}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-step", type=int, default=-1)
    args = parser.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.world)
