"""Torch-native 2-D parallelism that knows nothing about rankscope: DTensor tensor parallelism
inside FSDP2 data parallelism, on a (dp, tp) device mesh over gloo on CPU.

Its collectives come from three places the agent must all see: FSDP2's all-gathers and
reduce-scatters (torch.distributed calls), DTensor's functional collectives (C++ only, found
through the flight recorder) and DeviceMesh's set-up.
"""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--width", type=int, default=16, help="the model's width (a wider one makes a step mostly compute)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # its output is a view; we never modify it
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, 2 * args.width), torch.nn.ReLU(), torch.nn.Linear(2 * args.width, args.width))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=generator)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
