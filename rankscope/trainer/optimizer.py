"""AdamW with global gradient-norm clipping, over whole parameters or, with ZeRO-1, over this rank's shards.

The global gradient norm counts every parameter once: tp-sharded parameters on every tp rank,
replicated ones on tp rank 0 only, summed over pipeline stages (and over dp shards with ZeRO-1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rankscope.trainer import comm
from rankscope.trainer.data_parallel import GradSync


class Optimizer:
    """Updates the model from the gradients ``GradSync`` left, and reports the global gradient norm."""

    def __init__(
        self,
        model: nn.Module,
        sync: GradSync,
        lr: float,
        weight_decay: float,
        tp_group: Any,
        pp_group: Any,
    ) -> None:
        self.sync = sync
        self.params = list(model.parameters())
        self.norm_groups = [tp_group, pp_group] + ([sync.dp_group] if sync.shard else [])
        tp_rank = torch.distributed.get_rank(tp_group) if comm.size(tp_group) > 1 else 0
        names = {id(p): n for n, p in model.named_parameters()}
        # (name, parameter, flat slice, tensor the optimizer updates)
        self.slots: list[tuple[str, nn.Parameter, slice, torch.Tensor]] = []
        if sync.shard:
            for p, sl, _ in sync.owned_grads():
                main = p.detach().reshape(-1)[sl].clone()
                self.slots.append((f"{names[id(p)]}[{sl.start}:{sl.stop}]", p, sl, main))
        else:
            for name, p in model.named_parameters():
                self.slots.append((name, p, slice(0, p.numel()), p))
        self._counted = [p.tp_dim is not None or tp_rank == 0 for _, p, _, _ in self.slots]  # type: ignore[attr-defined]
        decay = [t for _, p, _, t in self.slots if p.dim() >= 2]
        no_decay = [t for _, p, _, t in self.slots if p.dim() < 2]
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
            eps=1e-8,
        )

    def _grads(self) -> list[torch.Tensor]:
        if self.sync.shard:
            return [g for _, _, g in self.sync.owned_grads()]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p, _, _ in self.slots]

    def step(self, clip: float) -> float:
        """Clip to ``clip`` (0: no clipping), take one AdamW step, return the global gradient norm before clipping."""
        grads = self._grads()
        local = [g.float().pow(2).sum() for g, counted in zip(grads, self._counted) if counted]
        sq = torch.stack(local).sum() if local else torch.zeros((), device=grads[0].device)
        for group in self.norm_groups:
            comm.all_reduce(sq, group)
        norm = math.sqrt(float(sq))
        scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
        for (_, _, _, tensor), g in zip(self.slots, grads):
            tensor.grad = g.mul(scale) if scale != 1.0 else g
        self.adamw.step()
        if self.sync.shard:
            self.sync.gather_params([(p, sl, t.detach()) for _, p, sl, t in self.slots])
        return norm

    def zero_grad(self) -> None:
        """Drop every gradient of the model (ZeRO-1: also those of parameters this rank holds no slice of)."""
        for p in self.params:
            p.grad = None
        for _, _, _, t in self.slots:
            t.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's state by stable name, creating it if no step has run yet (so a load can fill it in place)."""
        out: dict[str, torch.Tensor] = {}
        for name, _, _, t in self.slots:
            state = self.adamw.state[t]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = state[key]
        return out

    def reload_from_params(self) -> None:
        """ZeRO-1: refresh the fp32 shard copies after the parameters were loaded from a checkpoint."""
        if self.sync.shard:
            with torch.no_grad():
                for _, p, sl, t in self.slots:
                    t.copy_(p.detach().reshape(-1)[sl])
