"""A PyTorch Lightning training script that knows nothing about rankscope: the campaign's Lightning job.

Run under torchrun (one process per rank, gloo on CPU): Lightning finds torchrun's variables and
joins its process group, wraps the model in DDP, adds a distributed sampler, and runs each step's
forward and backward inside ``optimizer.step(closure)``. An MLP wide enough that a step is mostly
compute, as in ``ddp_job.py``, so that a starved rank shows.
"""

import argparse
import os
import warnings

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

#: the model's width and each rank's batch: a step of a few hundred ms of compute on a loaded core
WIDTH, BATCH = 768, 256


class Regression(lightning.LightningModule):
    """An MLP fitted to random targets: what matters is its compute and DDP's gradient all-reduce."""

    def __init__(self, width: int) -> None:
        super().__init__()
        layers = [torch.nn.Linear(width, width), torch.nn.ReLU()] * 3
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description="Lightning DDP on CPU, under torchrun")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (Trainer's max_steps)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    n = BATCH * args.steps * world
    data = TensorDataset(torch.randn(n, WIDTH), torch.randn(n, 8))
    trainer = lightning.Trainer(
        accelerator="cpu", devices=local, num_nodes=world // local, strategy="ddp", max_steps=args.steps, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regression(WIDTH), DataLoader(data, batch_size=BATCH))


if __name__ == "__main__":
    main()
