"""A Hugging Face Accelerate training script that knows nothing about rankscope: the campaign's Accelerate job.

Run under torchrun (one process per rank, CPU): ``Accelerator`` finds torchrun's variables, joins
its gloo process group, wraps the model in DDP and shards the data loader; ``accelerator.backward``
replaces ``loss.backward``. An MLP wide enough that a step is mostly compute, as in ``ddp_job.py``.
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()] * 3
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    n = args.batch * args.steps * accelerator.num_processes
    loader = DataLoader(TensorDataset(torch.randn(n, args.width), torch.randn(n, 8)), batch_size=args.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    accelerator.end_training()


if __name__ == "__main__":
    main()
