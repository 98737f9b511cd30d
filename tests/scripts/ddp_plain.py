"""A plain torch DDP training script that knows nothing about rankscope.

Run under torchrun with only ``RANKSCOPE_ENABLE=1`` (and the collector's address) set: the
agent must still record its steps, forward/backward/optimizer spans and DDP's gradient
all-reduces, and stay out of the data loader's forked worker processes. ``--by-hand`` updates
the weights without a torch optimizer, as minimal scripts do; ``--stall-rank R --stall-step S``
keeps rank R busy outside any collective for ``--stall-s`` seconds before step S (a hang's root);
``--pace-s`` makes each step last that long at least, and ``--until FILE`` ends the job at the first step
that sees FILE (a job that runs as long as a test needs, on little CPU).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--by-hand", action="store_true", help="plain SGD on the parameters, no torch optimizer")
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-step", type=int, default=-1)
    parser.add_argument("--stall-s", type=float, default=0.0)
    parser.add_argument("--pace-s", type=float, default=0.0, help="each step lasts this long at least (sleeping at its end)")
    parser.add_argument("--until", default="", help="end at the first step (all ranks agreeing) that finds this file")
    parser.add_argument("--crash-first-attempt-step", type=int, default=-1, help="rank 1 raises at this step, on torchrun's first attempt only")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = DistributedDataParallel(net)
    optimizer = None if args.by_hand else torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.MSELoss()
    generator = torch.Generator().manual_seed(dist.get_rank())
    n = 16 * args.steps
    data = TensorDataset(torch.randn(n, 32, generator=generator), torch.randn(n, 8, generator=generator))
    loader = DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context="fork")
    for step, (x, y) in enumerate(loader, start=1):
        began = time.monotonic()
        if step == args.stall_step and dist.get_rank() == args.stall_rank:
            time.sleep(args.stall_s)
        if step == args.crash_first_attempt_step and dist.get_rank() == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise RuntimeError(f"injected crash at step {step} of the first attempt")
        model.zero_grad()
        loss_fn(model(x), y).backward()
        if optimizer is not None:
            optimizer.step()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        time.sleep(max(0.0, args.pace_s - (time.monotonic() - began)))
        if args.until:
            found = torch.tensor([float(os.path.exists(args.until))])
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank ends at the same step
            if found.item():
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
