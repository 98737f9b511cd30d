"""A plain DDP training script that knows nothing about rankscope: the test bed's "user job".

The faults of the test bed are applied from outside, so nothing in here cooperates with them. An MLP
wide enough that a step is mostly compute (a throttled host shows in it). ``--closure`` runs forward
and backward inside ``optimizer.step(closure)``, as PyTorch Lightning does.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--closure", action="store_true", help="forward and backward inside optimizer.step(closure)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()] * 3
    model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x, y = torch.randn(args.batch, args.width, generator=generator), torch.randn(args.batch, 8, generator=generator)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if args.closure:
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
